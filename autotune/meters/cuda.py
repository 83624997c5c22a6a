"""CUDA memory: the caching allocator's peaks from ``torch.cuda`` plus device memory from NVML.

``max_memory_allocated`` counts live tensors, ``max_memory_reserved`` what the caching allocator
took from the driver (the figure a budget is enforced on), and NVML's device-used adds the CUDA
context, library workspaces and every other process on the card. All three are reported.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from autotune._log import notice_once
from autotune.meters.base import MemoryReading, Measuring, Meter

__all__ = ["CudaMeter", "nvml_handle"]

_NVML_SAMPLE_S = 0.005  # NVML's memory query costs ~10 us; 5 ms catches all but the briefest peaks


def nvml_handle(device: torch.device) -> Any | None:
    """Return the NVML handle of a CUDA device, or ``None`` (said once) when NVML is unavailable."""
    try:
        import pynvml
    except ImportError:
        notice_once("NVML figures are off: install nvidia-ml-py (`pip install nvidia-ml-py`) to get them")
        return None
    try:
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid is not None:
            # CUDA_VISIBLE_DEVICES renumbers devices; the UUID names the same card in both APIs.
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            except pynvml.NVMLError:
                pass
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:  # NVMLError, a missing libnvidia-ml.so, a driver mismatch
        notice_once(f"NVML figures are off: NVML could not be read ({exc})")
        return None


class _NvmlSampler:
    """Poll NVML device-used memory on a background thread and keep the maximum."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._stop = threading.Event()
        self.peak_bytes = self._read()
        self._thread = threading.Thread(target=self._run, name="autotune-nvml", daemon=True)

    def _read(self) -> int:
        import pynvml

        return int(pynvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def _run(self) -> None:
        while not self._stop.wait(_NVML_SAMPLE_S):
            self.peak_bytes = max(self.peak_bytes, self._read())

    def __enter__(self) -> "_NvmlSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._read())


class _CudaMeasuring(Measuring):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.region_reserved = self.region_allocated = 0  # the largest peaks before a reset_peak()

    def reset_peak(self) -> None:
        self.region_reserved = max(self.region_reserved, torch.cuda.max_memory_reserved(self.device))
        self.region_allocated = max(self.region_allocated, torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)


class CudaMeter(Meter):
    """Peak CUDA memory of a region; a budget below the card is enforced by the allocator.

    The budget uses ``torch.cuda.set_per_process_memory_fraction``, so the caching allocator
    raises ``torch.OutOfMemoryError`` as reserved memory would cross it. :meth:`close` gives the
    whole card back.
    """

    def __init__(self, device: str | torch.device = "cuda", *, budget_bytes: int | None = None) -> None:
        super().__init__(budget_bytes=budget_bytes)
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.total_bytes = torch.cuda.get_device_properties(self.device).total_memory
        self._handle = nvml_handle(self.device)
        self._fraction_set = False
        if budget_bytes is not None and budget_bytes < self.total_bytes:
            torch.cuda.set_per_process_memory_fraction(budget_bytes / self.total_bytes, self.device)
            self._fraction_set = True

    @contextlib.contextmanager
    def measure(self, *, deadline: float | None = None) -> Iterator[Measuring]:
        """Measure the block's CUDA peaks. ``deadline`` is not enforced per op on CUDA."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        handle = _CudaMeasuring(self.device)
        sampler = _NvmlSampler(self._handle) if self._handle is not None else None
        try:
            with sampler if sampler is not None else contextlib.nullcontext():
                yield handle
                torch.cuda.synchronize(self.device)
        finally:
            reserved = max(torch.cuda.max_memory_reserved(self.device), handle.region_reserved)
            handle.reading = MemoryReading(
                peak_bytes=reserved,
                peak_allocated_bytes=max(torch.cuda.max_memory_allocated(self.device), handle.region_allocated),
                peak_reserved_bytes=reserved,
                peak_nvml_bytes=sampler.peak_bytes if sampler is not None else None,
                source="cuda",
            )

    def close(self) -> None:
        if self._fraction_set:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self._fraction_set = False
