"""Memory meters behind one small interface, chosen once per device by :func:`make_meter`.

The interface (:class:`Meter`, :class:`Measuring`, :class:`MemoryReading`) imports without torch,
so that code which only reads measurements loads without it; the meters load torch on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.meters.base import Measuring, MemoryReading, Meter

if TYPE_CHECKING:
    import torch

    from autotune.meters.cuda import CudaMeter
    from autotune.meters.tensor import TensorMeter

__all__ = ["Meter", "MemoryReading", "Measuring", "TensorMeter", "CudaMeter", "make_meter"]


def make_meter(device: str | torch.device, *, budget_bytes: int | None = None) -> Meter:
    """Return the meter for ``device``: :class:`CudaMeter` on CUDA, :class:`TensorMeter` elsewhere.

    Making a meter changes no process-wide setting: the budget is enforced inside ``measure()``.
    """
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        from autotune.meters.cuda import CudaMeter

        return CudaMeter(device, budget_bytes=budget_bytes)
    from autotune.meters.tensor import TensorMeter

    return TensorMeter(device, budget_bytes=budget_bytes)


def __getattr__(name: str) -> Any:  # PEP 562: the meters import torch, and CUDA's nothing CUDA-specific on CPU
    if name == "TensorMeter":
        from autotune.meters.tensor import TensorMeter

        return TensorMeter
    if name == "CudaMeter":
        from autotune.meters.cuda import CudaMeter

        return CudaMeter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
