"""The precision modes by name: what each autocasts to and whether it scales the loss (no torch here).

:mod:`autotune.training.precision` applies them (autocast, the GradScaler); the device's backend says which run
well where (:mod:`autotune.device`).
"""

from __future__ import annotations

import dataclasses

__all__ = ["Precision", "PRECISIONS", "PRECISION_NAMES", "HALF", "INIT_LOSS_SCALE", "GROWTH_INTERVAL"]

INIT_LOSS_SCALE = 2.0**16  # fp16's GradScaler starts here (the practitioner's guide): halve on inf/NaN, grow when quiet
GROWTH_INTERVAL = 2000  # fp16: clean steps before the scale doubles (GradScaler's default, stated for the exports)


@dataclasses.dataclass(frozen=True)
class Precision:
    """A precision mode: its name, the torch dtype autocast runs in (by name; None for fp32), and the GradScaler."""

    name: str
    autocast_dtype: str | None  # "float16", "bfloat16": an attribute of torch
    uses_scaler: bool


PRECISIONS = {
    "fp32": Precision("fp32", None, uses_scaler=False),
    "fp16": Precision("fp16", "float16", uses_scaler=True),
    "bf16": Precision("bf16", "bfloat16", uses_scaler=False),
}
PRECISION_NAMES = tuple(PRECISIONS)  # "fp32", "fp16", "bf16": the order tables and searches list them in
HALF = tuple(name for name, p in PRECISIONS.items() if p.autocast_dtype)  # the modes that autocast: fp16, bf16
