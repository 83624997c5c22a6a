"""The precision modes by name: what each computes in, and how (no torch here).

Three modes autocast an fp32 model (``fp16`` with a GradScaler, ``bf16`` without one); ``bf16-fsdp`` is FSDP2's own
mixed precision, ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` as torchtitan trains: each
rank keeps its fp32 shards (and the optimizer's fp32 state), gathers the parameters in bf16 and computes in bf16
without autocast, and reduces the gradients in fp32. It is the wrapper's, so it trains under ``--parallel fsdp`` only.

:mod:`autotune.training.precision` applies them (autocast, the GradScaler, the FSDP2 policy); the device's backend
says which run well where (:mod:`autotune.device`).
"""

from __future__ import annotations

import dataclasses

__all__ = ["Precision", "PRECISIONS", "PRECISION_NAMES", "HALF", "SIXTEEN_BIT", "FSDP_ONLY", "INIT_LOSS_SCALE",
           "GROWTH_INTERVAL", "runs_where"]

INIT_LOSS_SCALE = 2.0**16  # fp16's GradScaler starts here (the practitioner's guide): halve on inf/NaN, grow when quiet
GROWTH_INTERVAL = 2000  # fp16: clean steps before the scale doubles (GradScaler's default, stated for the exports)


@dataclasses.dataclass(frozen=True)
class Precision:
    """A precision mode: its name, the torch dtype autocast runs in (by name; None for fp32), the GradScaler, and for
    a mode of FSDP2's the dtypes its ``MixedPrecisionPolicy`` gathers parameters in and reduces gradients in."""

    name: str
    autocast_dtype: str | None  # "float16", "bfloat16": an attribute of torch
    uses_scaler: bool
    param_dtype: str | None = None  # FSDP2 gathers (and computes with) the parameters in this dtype; None: no policy
    reduce_dtype: str | None = None  # FSDP2 reduces the gradients in this dtype

    @property
    def compute_dtype(self) -> str | None:
        """The 16-bit dtype the forward and backward passes run in (autocast's or FSDP2's), None for fp32."""
        return self.autocast_dtype or self.param_dtype

    @property
    def fsdp_only(self) -> bool:
        """Whether the mode is FSDP2's policy: it trains under ``--parallel fsdp`` and nowhere else."""
        return self.param_dtype is not None

    @property
    def policy(self) -> str | None:
        """FSDP2's policy in words (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``), else None."""
        if not self.fsdp_only:
            return None
        return f"MixedPrecisionPolicy(param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype})"


PRECISIONS = {
    "fp32": Precision("fp32", None, uses_scaler=False),
    "fp16": Precision("fp16", "float16", uses_scaler=True),
    "bf16": Precision("bf16", "bfloat16", uses_scaler=False),
    "bf16-fsdp": Precision("bf16-fsdp", None, uses_scaler=False, param_dtype="bfloat16", reduce_dtype="float32"),
}
PRECISION_NAMES = tuple(PRECISIONS)  # "fp32", "fp16", "bf16", "bf16-fsdp": the order tables and searches list them in
HALF = tuple(name for name, p in PRECISIONS.items() if p.autocast_dtype)  # the modes that autocast: fp16, bf16
SIXTEEN_BIT = tuple(name for name, p in PRECISIONS.items() if p.compute_dtype)  # fp16, bf16, bf16-fsdp
FSDP_ONLY = tuple(name for name, p in PRECISIONS.items() if p.fsdp_only)  # bf16-fsdp


def runs_where(autocast_modes: list[str]) -> list[str]:
    """``autocast_modes`` (those a device runs: ``fp32`` and the autocast modes) and FSDP2's modes whose dtype one of
    them computes in: ``bf16-fsdp`` runs where ``bf16`` does."""
    dtypes = {PRECISIONS[name].compute_dtype for name in autocast_modes}
    return [*autocast_modes, *(name for name in FSDP_ONLY if PRECISIONS[name].compute_dtype in dtypes)]
