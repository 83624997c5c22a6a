"""The attention kernels ``scaled_dot_product_attention`` chooses among on CUDA, by name (``torch.nn.attention``'s
``SDPBackend``): what a prediction for CUDA assumed each call ran, in the report's ``search.cuda.attention``."""

from __future__ import annotations

import enum

__all__ = ["Attention"]


class Attention(str, enum.Enum):
    """An SDPA kernel, by what it keeps for the backward pass."""

    FLASH = "flash"  # FlashAttention 2: the output and a float32 log-sum-exp per query, O(T) a head
    EFFICIENT = "efficient"  # memory-efficient (xFormers/CUTLASS): the same, a mask as a bias tensor beside it
    CUDNN = "cudnn"  # cuDNN's fused attention
    MATH = "math"  # the composite: the T x T scores and their softmax kept, in float32 for half-precision inputs

    def __str__(self) -> str:
        return self.value
