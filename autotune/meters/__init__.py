"""Memory meters behind one small interface, chosen once per device by :func:`make_meter`."""

from __future__ import annotations

import torch

from autotune.meters.base import MemoryReading, Measuring, Meter
from autotune.meters.tensor import TensorMeter

__all__ = ["Meter", "MemoryReading", "Measuring", "TensorMeter", "CudaMeter", "make_meter"]


def make_meter(device: str | torch.device, *, budget_bytes: int | None = None) -> Meter:
    """Return the meter for ``device``: :class:`CudaMeter` on CUDA, :class:`TensorMeter` elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        from autotune.meters.cuda import CudaMeter

        return CudaMeter(device, budget_bytes=budget_bytes)
    return TensorMeter(device, budget_bytes=budget_bytes)


def __getattr__(name: str):  # CudaMeter imports lazily: nothing CUDA-specific loads on CPU runs
    if name == "CudaMeter":
        from autotune.meters.cuda import CudaMeter

        return CudaMeter
    raise AttributeError(name)
