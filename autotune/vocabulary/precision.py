"""The precision modes by name: what each computes in, and how (no torch here).

Three modes autocast an fp32 model (``fp16`` with a GradScaler, ``bf16`` without one); ``bf16-fsdp`` is FSDP2's own
mixed precision, ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` as torchtitan trains: each
rank keeps its fp32 shards (and the optimizer's fp32 state), gathers the parameters in bf16 and computes in bf16
without autocast, and reduces the gradients in fp32. It is the wrapper's, so it trains under ``--parallel fsdp`` only.

``bf16-true`` holds the model itself in bf16: its floating parameters and buffers, so its gradients and the optimizer's
state too, with no autocast and no GradScaler (Lightning's ``precision="bf16-true"``, torchtune's full fine-tuning).
It halves the training state; its cost is that an update smaller than half a unit in the last place of its weight
(2**-9 to 2**-8 of the weight's magnitude) rounds away (:data:`ROUNDING_NOTE`). ``fp16-true`` is not offered
(:data:`NOT_OFFERED`): without a loss scale its first AdamW step divides by zero.

:mod:`autotune.training.precision` applies them (autocast, the GradScaler, the FSDP2 policy); the device's backend
says which run well where (:mod:`autotune.device`).
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["PrecisionName", "Precision", "PRECISIONS", "PRECISION_NAMES", "HALF", "SIXTEEN_BIT", "FSDP_ONLY", "TRUE", "INIT_LOSS_SCALE",
           "GROWTH_INTERVAL", "NOT_OFFERED", "ROUNDING_NOTE", "STOCHASTIC_ROUNDING", "rounding_notice", "runs_where"]

INIT_LOSS_SCALE = 2.0**16  # fp16's GradScaler starts here (the practitioner's guide): halve on inf/NaN, grow when quiet
GROWTH_INTERVAL = 2000  # fp16: clean steps before the scale doubles (GradScaler's default, stated for the exports)


class PrecisionName(str, enum.Enum):
    """A precision mode's name, as flags, the JSON and the store spell it (a ``str``: equal to the word it is)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    BF16_FSDP = "bf16-fsdp"
    BF16_TRUE = "bf16-true"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Precision:
    """A precision mode: its name, the torch dtype autocast runs in (by name; None for fp32), the GradScaler, for
    a mode of FSDP2's the dtypes its ``MixedPrecisionPolicy`` gathers parameters in and reduces gradients in, and for
    a "true" mode the dtype the model's weights (so its gradients and the optimizer's state) are held in."""

    name: str
    autocast_dtype: str | None  # "float16", "bfloat16": an attribute of torch
    uses_scaler: bool
    param_dtype: str | None = None  # FSDP2 gathers (and computes with) the parameters in this dtype; None: no policy
    reduce_dtype: str | None = None  # FSDP2 reduces the gradients in this dtype
    weight_dtype: str | None = None  # the model's floating parameters and buffers are cast to it; None: fp32

    @property
    def compute_dtype(self) -> str | None:
        """The 16-bit dtype the forward and backward passes run in (autocast's, FSDP2's or the weights'), None for
        fp32."""
        return self.autocast_dtype or self.param_dtype or self.weight_dtype

    @property
    def true(self) -> bool:
        """Whether the model itself is held in the 16-bit dtype (weights, gradients, optimizer state): ``bf16-true``."""
        return self.weight_dtype is not None

    @property
    def state_bytes_per_element(self) -> int:
        """Bytes of a floating weight (and of its gradient) in this mode: 2 for a true mode, else fp32's 4."""
        return 2 if self.true else 4

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


_N = PrecisionName
PRECISIONS = {  # keyed by the words (a PrecisionName member finds its entry: it is equal to its word)
    _N.FP32.value: Precision(_N.FP32.value, None, uses_scaler=False),
    _N.FP16.value: Precision(_N.FP16.value, "float16", uses_scaler=True),
    _N.BF16.value: Precision(_N.BF16.value, "bfloat16", uses_scaler=False),
    _N.BF16_FSDP.value: Precision(_N.BF16_FSDP.value, None, uses_scaler=False, param_dtype="bfloat16",
                                  reduce_dtype="float32"),
    _N.BF16_TRUE.value: Precision(_N.BF16_TRUE.value, None, uses_scaler=False, weight_dtype="bfloat16"),
}
PRECISION_NAMES = tuple(PRECISIONS)  # "fp32", "fp16", "bf16", "bf16-fsdp", "bf16-true": the order tables list them in
HALF = tuple(name for name, p in PRECISIONS.items() if p.autocast_dtype)  # the modes that autocast: fp16, bf16
SIXTEEN_BIT = tuple(name for name, p in PRECISIONS.items() if p.compute_dtype)  # fp16, bf16, bf16-fsdp, bf16-true
FSDP_ONLY = tuple(name for name, p in PRECISIONS.items() if p.fsdp_only)  # bf16-fsdp
TRUE = tuple(name for name, p in PRECISIONS.items() if p.true)  # bf16-true

# Names a user may reach for that are refused, with why (parse_precisions says it in one line)
NOT_OFFERED = {
    "fp16-true": "fp16-true (weights, gradients and optimizer state in fp16) is not offered: a GradScaler cannot "
                 "unscale fp16 gradients, and without a loss scale AdamW's second moment (a thousandth of the "
                 "squared gradient) underflows to zero while its eps of 1e-8 rounds to 0 in fp16, so the first step "
                 "divides by zero (after one step at lr 1e-4, 642,855 of TinyGPT's 642,944 weights were inf or NaN: "
                 "results/true_precision-cpu.md). "
                 "Search bf16-true where the device has bf16, or fp16 (autocast, fp32 master weights) with an "
                 "optimizer of less state (--optimizer bitsandbytes.optim:AdamW8bit)",
}

# What a true mode costs, said wherever it is searched (the report's notices) and measured by the probe
ROUNDING_NOTE = ("{name} holds the weights in {dtype}, 8 significant bits: an update smaller than half a unit in the "
                 "last place of its weight (2**-9 to 2**-8 of the weight's magnitude: 0.002 to 0.004 on a weight of "
                 "1.0) rounds back to the weight and is lost, where fp32 master weights would keep it; the probe "
                 "counts the updates lost ({lost}). Stochastic rounding keeps them on average: {remedy}")
# An optimizer that rounds bf16 weights stochastically (torchao 0.18: torchao.optim._AdamW, AdamW8bit, AdamW4bit and
# AdamWFp8 take bf16_stochastic_round; _AdamW keeps AdamW's state in the parameters' dtype)
STOCHASTIC_ROUNDING = ("--optimizer torchao.optim:_AdamW --optimizer-kwargs '{\"bf16_stochastic_round\": true}' "
                       "(or torchao.optim:AdamW8bit with it, for 8-bit state too)")


def rounding_notice(name: str, *, torchao: bool) -> str:
    """:data:`ROUNDING_NOTE` for the true mode ``name``, naming torchao's stochastic rounding (installed here or not:
    ``torchao``)."""
    remedy = STOCHASTIC_ROUNDING + (", torchao installed here" if torchao else ", after pip install torchao")
    return ROUNDING_NOTE.format(name=name, dtype=PRECISIONS[name].weight_dtype, lost="its lost_updates", remedy=remedy)


def runs_where(autocast_modes: list[str]) -> list[str]:
    """``autocast_modes`` (those a device runs: ``fp32`` and the autocast modes) and the other modes whose dtype one
    of them computes in: ``bf16-fsdp`` and ``bf16-true`` run where ``bf16`` does."""
    dtypes = {PRECISIONS[name].compute_dtype for name in autocast_modes}
    others = (name for name, p in PRECISIONS.items() if not p.autocast_dtype and p.compute_dtype in dtypes - {None})
    return [*autocast_modes, *others]
