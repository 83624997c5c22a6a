"""CUDA memory: the caching allocator's peaks from ``torch.cuda`` plus device memory from NVML.

``max_memory_allocated`` counts live tensors, ``max_memory_reserved`` what the caching allocator
took from the driver (the figure a budget is enforced on), and NVML's device-used adds the CUDA
context, library workspaces and every other process on the device. All three are reported.

The NVML device is the one whose UUID is the CUDA device's, never one picked by index: NVML
numbers devices ignoring ``CUDA_VISIBLE_DEVICES``, and under MIG the CUDA device is a MIG
instance whose memory is not the whole card's.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Any, Callable, Iterator

import torch

from autotune._log import notice_once
from autotune.errors import is_oom
from autotune.meters.base import Measuring, MemoryReading, Meter

__all__ = ["CudaMeter", "memory_budget", "nvml_handle", "oom_request_bytes"]

_NVML_SAMPLE_S = 0.005  # NVML's memory query costs ~10 us; 5 ms catches all but the briefest peaks

# c10's format_size, which torch's out-of-memory messages use: "512 bytes", "1.50 KiB", "20.00 MiB", "2.00 GiB".
_TRIED = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) (bytes|KiB|MiB|GiB|TiB)\b")
_UNIT_BYTES = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def oom_request_bytes(exc: BaseException) -> int | None:
    """Return the size of the allocation an out-of-memory error says failed, or ``None`` when it says none.

    torch's caching allocator writes "Tried to allocate 2.00 GiB" with two decimals, so the
    figure is within half a hundredth of its unit of the true size (5 MiB at GiB sizes). It is
    the segment the allocator asked the driver for: by it, reserved memory would have grown.
    """
    match = _TRIED.search(str(exc))
    if match is None:
        return None
    return round(float(match.group(1)) * _UNIT_BYTES[match.group(2)])


# -- NVML --------------------------------------------------------------------------------------------------


def nvml_handle(device: torch.device) -> Any | None:
    """Return the NVML handle of a CUDA device, or ``None`` (said once) when it cannot be found for sure."""
    try:
        import pynvml
    except ImportError:
        notice_once("NVML figures are off: install nvidia-ml-py (`pip install nvidia-ml-py`) to get them")
        return None
    try:
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid is None:  # the UUID is the only name CUDA and NVML share; an index may name another device
            notice_once("NVML figures are off: this torch does not report CUDA device UUIDs")
            return None
        handle = _find_by_uuid(pynvml, _bare_uuid(str(uuid)))
        if handle is not None and _mig_enabled(pynvml, handle):
            # CUDA runs only on MIG instances of a card in MIG mode: this is the parent card's UUID
            # (an older CUDA runtime), and the card's figure would be every instance's.
            notice_once(f"NVML figures are off: cuda:{index} is a MIG instance of {uuid} and CUDA does not say which")
            return None
    except Exception as exc:  # NVMLError, a missing libnvidia-ml.so, a driver mismatch
        notice_once(f"NVML figures are off: NVML could not be read ({exc})")
        return None
    if handle is None:
        notice_once(f"NVML figures are off: no NVML device or MIG device has the UUID of cuda:{index} ({uuid})")
    return handle


def _bare_uuid(uuid: str) -> str:
    """Return ``uuid`` without NVML's GPU-/MIG- prefix, lower-case: torch prints it bare."""
    uuid = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if uuid.startswith(prefix):
            return uuid[len(prefix):]
    return uuid


def _find_by_uuid(pynvml: Any, bare: str) -> Any | None:
    """Return the NVML device or MIG device whose UUID is ``bare`` (no prefix), or ``None``."""
    # Direct lookups first; drivers before R470 refuse MIG UUIDs, so enumerating follows.
    for prefix in ("GPU-", "MIG-"):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(prefix + bare)
        except pynvml.NVMLError:
            pass
    for index in range(pynvml.nvmlDeviceGetCount()):
        try:
            gpu = pynvml.nvmlDeviceGetHandleByIndex(index)
            if _uuid_of(pynvml, gpu) == bare:
                return gpu
            for mig in _mig_devices(pynvml, gpu):
                if _uuid_of(pynvml, mig) == bare:
                    return mig
        except pynvml.NVMLError:  # a device this process may not query: it is not the one we run on
            continue
    return None


def _uuid_of(pynvml: Any, handle: Any) -> str:
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    return _bare_uuid(uuid.decode() if isinstance(uuid, bytes) else uuid)


def _mig_devices(pynvml: Any, gpu: Any) -> Iterator[Any]:
    """Yield the MIG devices of ``gpu`` (none when it has no MIG mode); their slots need not be dense."""
    try:
        slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)
    except pynvml.NVMLError:
        return
    for slot in range(slots):
        try:
            yield pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)
        except pynvml.NVMLError:  # an empty slot
            continue


def _mig_enabled(pynvml: Any, handle: Any) -> bool:
    """Return True when ``handle`` is a whole card with MIG mode on."""
    try:
        if pynvml.nvmlDeviceIsMigDeviceHandle(handle):
            return False
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:  # no MIG on this card
        return False
    return current == getattr(pynvml, "NVML_DEVICE_MIG_ENABLE", 1)


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
            try:
                self.peak_bytes = max(self.peak_bytes, self._read())
            except Exception:  # the last read, in __exit__, raises it where the caller sees it
                return

    def __enter__(self) -> "_NvmlSampler":
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, _stat(self._read, fallback=0, failing=exc_type is not None))


# -- the meter ---------------------------------------------------------------------------------------------


def _stat(read: Callable[[], int], *, fallback: int, failing: bool) -> int:
    """Return ``read()``; while the region is failing, ``fallback`` when that raises too.

    After an illegal memory access every CUDA call raises: the block's error says what went
    wrong, and an error from reading the stats in the meter's cleanup must not replace it.
    """
    if not failing:
        return read()
    try:
        return read()
    except Exception:
        return fallback


class _CudaMeasuring(Measuring):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        # The largest peaks read in the region so far (before a reset_peak() too): the reading
        # never reports less, and falls back to them when a sticky CUDA error stops reading.
        self.region_reserved = self.region_allocated = 0

    def reset_peak(self) -> None:
        self.peak_bytes()
        self.peak_reserved_bytes()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        peak = torch.cuda.max_memory_allocated(self.device)
        self.region_allocated = max(self.region_allocated, peak)
        return peak

    def peak_reserved_bytes(self) -> int:
        peak = torch.cuda.max_memory_reserved(self.device)
        self.region_reserved = max(self.region_reserved, peak)
        return peak


@contextlib.contextmanager
def memory_budget(device: torch.device, budget_bytes: int | None, *, total_bytes: int | None = None) -> Iterator[None]:
    """Hold the caching allocator to ``budget_bytes`` inside the block; put the previous fraction back after.

    ``torch.cuda.set_per_process_memory_fraction`` makes the allocator raise ``torch.OutOfMemoryError``
    as reserved memory would cross the budget. A budget at or above the device's memory sets nothing.
    """
    total_bytes = total_bytes or torch.cuda.get_device_properties(device).total_memory
    if budget_bytes is None or budget_bytes >= total_bytes:
        yield
        return
    # An older torch cannot say the fraction in force; 1.0, the whole card, is torch's default.
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    previous = float(get(device)) if get is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(budget_bytes / total_bytes, device)
    failing = True
    try:
        yield
        failing = False
    finally:
        try:
            torch.cuda.set_per_process_memory_fraction(previous, device)
        except Exception:
            if not failing:
                raise
            # A sticky CUDA error fails every call: the block's error is the one to report.


class CudaMeter(Meter):
    """Peak CUDA memory of a region; a budget below the card is enforced by the allocator.

    Inside :meth:`measure` the budget is a ``torch.cuda.set_per_process_memory_fraction``, so the
    caching allocator raises ``torch.OutOfMemoryError`` as reserved memory would cross it; the
    fraction that was in force before is put back when the region ends. Making a meter sets
    nothing.
    """

    def __init__(self, device: str | torch.device = "cuda", *, budget_bytes: int | None = None) -> None:
        super().__init__(budget_bytes=budget_bytes)
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.total_bytes = torch.cuda.get_device_properties(self.device).total_memory
        self._handle = nvml_handle(self.device)

    @contextlib.contextmanager
    def measure(self, *, deadline: float | None = None) -> Iterator[Measuring]:
        """Measure the block's CUDA peaks under the budget. ``deadline`` is not enforced per op on CUDA.

        When the block raised and a sticky CUDA error makes the stats unreadable, the reading
        has the largest peaks read during the region (by ``reset_peak``/``peak_bytes``), else 0,
        and the caller sees the block's error.
        """
        with self._budget():
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            handle = _CudaMeasuring(self.device)
            sampler = _NvmlSampler(self._handle) if self._handle is not None else None
            raised: BaseException | None = None
            try:
                with sampler if sampler is not None else contextlib.nullcontext():
                    yield handle
                    torch.cuda.synchronize(self.device)
            except BaseException as exc:
                raised = exc
                raise
            finally:
                handle.reading = self._reading(handle, sampler, raised)

    def _budget(self) -> contextlib.AbstractContextManager:
        return memory_budget(self.device, self.budget_bytes, total_bytes=self.total_bytes)

    def _reading(self, handle: _CudaMeasuring, sampler: _NvmlSampler | None,
                 raised: BaseException | None) -> MemoryReading:
        """Return the region's reading; ``raised`` is what the block raised, if anything."""
        failing = raised is not None
        held, needed = self._oom_figures(raised) if failing and is_oom(raised) else (None, None)
        reserved = max(_stat(handle.peak_reserved_bytes, fallback=0, failing=failing), handle.region_reserved)
        allocated = max(_stat(handle.peak_bytes, fallback=0, failing=failing), handle.region_allocated)
        return MemoryReading(
            peak_bytes=max(reserved, needed if needed is not None else held or 0),
            peak_allocated_bytes=allocated,
            peak_reserved_bytes=reserved,
            peak_nvml_bytes=sampler.peak_bytes if sampler is not None else None,
            source="cuda",
            oom_held_bytes=held,
            oom_needed_bytes=needed,
        )

    def _oom_figures(self, raised: BaseException) -> tuple[int | None, int | None]:
        """Return what was held when the allocation failed, and that plus the failed request."""
        try:
            # torch gave its cache back to the driver before giving up, so reserved now is what it
            # held then (less anything freed while the error unwound the block: a lower bound still).
            held = torch.cuda.memory_reserved(self.device)
        except Exception:  # a sticky CUDA error besides: keep the block's error, lose the figure
            return None, None
        request = oom_request_bytes(raised)
        return held, held + request if request is not None else None
