"""CUDA's autocast policies by name (aten/src/ATen/autocast_mode.cpp), as a plan for CUDA applies them on the CPU
(:mod:`autotune.execution.cuda_rules`, one small kernel per policy). No torch here.
"""

from __future__ import annotations

import enum

__all__ = ["AutocastPolicy"]


class AutocastPolicy(str, enum.Enum):
    """What CUDA's autocast does to an op's floating inputs."""

    LOWER = "lower"  # cast to the autocast dtype (AT_FORALL_LOWER_PRECISION_FP)
    FP32 = "fp32"  # cast to float32 (AT_FORALL_FP32)
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # run in float32 through the op's own dtype argument, unless given
    FP32_APPEND_DTYPE = "fp32_append_dtype"  # redispatched to the overload that takes a dtype, float32
    PROMOTE = "promote"  # cast to the widest dtype among the inputs
    BANNED = "banned"  # refused (binary_cross_entropy)

    def __str__(self) -> str:
        return self.value
