"""Memory meters behind one small interface, chosen once per device by its backend (:func:`autotune.device.make_meter`).

The interface (:class:`Meter`, :class:`Measuring`, :class:`MemoryReading`) imports without torch,
so that code which only reads measurements loads without it; the meters load torch on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.meters.base import Measuring, MemoryReading, Meter

if TYPE_CHECKING:
    from autotune.meters.allocator import AllocatorMeter
    from autotune.meters.cuda import CudaMeter
    from autotune.meters.tensor import TensorMeter

__all__ = ["Meter", "MemoryReading", "Measuring", "TensorMeter", "CudaMeter", "AllocatorMeter"]


def __getattr__(name: str) -> Any:  # PEP 562: the meters import torch, and CUDA's nothing CUDA-specific on CPU
    if name == "TensorMeter":
        from autotune.meters.tensor import TensorMeter

        return TensorMeter
    if name == "AllocatorMeter":
        from autotune.meters.allocator import AllocatorMeter

        return AllocatorMeter
    if name == "CudaMeter":
        from autotune.meters.cuda import CudaMeter

        return CudaMeter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
