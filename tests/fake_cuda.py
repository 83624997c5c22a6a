"""Fakes of ``torch.cuda`` and ``pynvml`` for testing CUDA code on machines without a GPU.

``FakeCuda(...).install(monkeypatch)`` replaces the ``torch.cuda`` functions the meters call with
a small model of the caching allocator on one device: ``allocate``/``free`` move the allocated
and reserved counters and their peaks, a memory fraction is enforced the way torch enforces it
(cached blocks are released first, then an out-of-memory error in torch's words is raised), and
``break_sticky()`` makes every call raise, as after an illegal memory access.

``FakeNvml(gpus).install(monkeypatch)`` puts a ``pynvml`` module in ``sys.modules`` that knows the
given GPUs and their MIG devices, with NVML's numbering (which ignores CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import torch

__all__ = ["GiB", "MiB", "FakeCuda", "FakeGpu", "FakeNvml", "FakeStreams", "format_size", "oom_message", "STICKY_MESSAGE"]

GiB = 1 << 30
MiB = 1 << 20
STICKY_MESSAGE = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
    "below might be incorrect."
)


def format_size(nbytes: int) -> str:
    """Format ``nbytes`` as c10's ``format_size`` does in torch's out-of-memory messages."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= MiB:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= GiB:
        return f"{nbytes / MiB:.2f} MiB"
    return f"{nbytes / GiB:.2f} GiB"


def oom_message(tried_bytes: int, *, total_bytes: int, free_bytes: int, allocated_bytes: int,
                reserved_bytes: int, device_index: int = 0) -> str:
    """Return the message of torch 2.x's CUDA caching allocator when an allocation fails."""
    return (
        f"CUDA out of memory. Tried to allocate {format_size(tried_bytes)}. GPU {device_index} has a total "
        f"capacity of {format_size(total_bytes)} of which {format_size(free_bytes)} is free. Of the allocated "
        f"memory {format_size(allocated_bytes)} is allocated by PyTorch, and "
        f"{format_size(reserved_bytes - allocated_bytes)} is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
        "fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


class FakeUuid:
    """Print like torch's ``_CUuuid``: 8-4-4-4-12 lower-case hex, without NVML's GPU-/MIG- prefix."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __str__(self) -> str:
        return self._text


@dataclasses.dataclass
class FakeCuda:
    """The caching allocator of CUDA devices ``0 .. len(uuids) - 1``; every device shares one set of counters."""

    total_bytes: int = 24 * GiB
    uuids: tuple[str, ...] = ("58be26a5-7d12-4c3e-9f0a-1b2c3d4e5f60",)  # per CUDA ordinal, as torch prints them
    current: int = 0
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    fraction: float | None = None  # None: never set in this process (torch then reports 1.0)
    sticky: bool = False  # every call raises, as after an illegal memory access
    fraction_calls: list[float] = dataclasses.field(default_factory=list)

    # -- what a test does on the "device" ------------------------------------------------------------

    def allocate(self, nbytes: int) -> None:
        """Allocate ``nbytes``, from the cache when it can; past the fraction, raise torch's OOM error."""
        self._check()
        allowed = int(self.total_bytes * (1.0 if self.fraction is None else self.fraction))
        shortfall = max(0, self.allocated_bytes + nbytes - self.reserved_bytes)
        if self.reserved_bytes + shortfall > allowed:
            # Like torch: give the unused cache back to the driver, then try once more.
            self.reserved_bytes = self.allocated_bytes
            shortfall = nbytes
            if self.reserved_bytes + shortfall > allowed:
                raise torch.OutOfMemoryError(oom_message(
                    nbytes, total_bytes=self.total_bytes, free_bytes=self.total_bytes - self.reserved_bytes,
                    allocated_bytes=self.allocated_bytes, reserved_bytes=self.reserved_bytes))
        self.reserved_bytes += shortfall
        self.allocated_bytes += nbytes
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    def free(self, nbytes: int) -> None:
        """Free ``nbytes``; the caching allocator keeps them reserved."""
        self._check()
        self.allocated_bytes -= nbytes

    def break_sticky(self) -> None:
        """Make every later call raise, as the CUDA context does after an illegal memory access."""
        self.sticky = True

    def _check(self) -> None:
        if self.sticky:
            raise torch.AcceleratorError(STICKY_MESSAGE)  # a new error per call, as torch raises

    # -- the torch.cuda functions --------------------------------------------------------------------

    def install(self, monkeypatch: Any) -> "FakeCuda":
        """Replace the ``torch.cuda`` functions the meters call with this fake's, for one test."""
        for name in ("is_available", "device_count", "current_device", "get_device_properties", "synchronize",
                     "empty_cache", "reset_peak_memory_stats", "memory_allocated", "memory_reserved",
                     "max_memory_allocated", "max_memory_reserved", "set_per_process_memory_fraction",
                     "get_per_process_memory_fraction"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        return self

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.uuids)

    def current_device(self) -> int:
        self._check()
        return self.current

    def get_device_properties(self, device: Any = None) -> types.SimpleNamespace:
        self._check()
        index = _index(device, self.current)
        return types.SimpleNamespace(name="Fake GPU", total_memory=self.total_bytes, uuid=FakeUuid(self.uuids[index]))

    def synchronize(self, device: Any = None) -> None:
        self._check()

    def empty_cache(self) -> None:
        self._check()
        self.reserved_bytes = self.allocated_bytes

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._check()
        self.peak_allocated_bytes, self.peak_reserved_bytes = self.allocated_bytes, self.reserved_bytes

    def memory_allocated(self, device: Any = None) -> int:
        self._check()
        return self.allocated_bytes

    def memory_reserved(self, device: Any = None) -> int:
        self._check()
        return self.reserved_bytes

    def max_memory_allocated(self, device: Any = None) -> int:
        self._check()
        return self.peak_allocated_bytes

    def max_memory_reserved(self, device: Any = None) -> int:
        self._check()
        return self.peak_reserved_bytes

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        self._check()
        self.fraction = fraction
        self.fraction_calls.append(fraction)

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        self._check()
        return 1.0 if self.fraction is None else self.fraction


def _index(device: Any, current: int) -> int:
    if device is None:
        return current
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return current if device.index is None else device.index


# -- NVML ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class FakeGpu:
    """One NVML device: a whole GPU, or (inside a GPU's ``mig``) a MIG device."""

    uuid: str  # as NVML prints it: "GPU-..." or "MIG-..."
    used_bytes: int
    total_bytes: int = 24 * GiB
    mig: dict[int, "FakeGpu"] = dataclasses.field(default_factory=dict)  # MIG slot index -> MIG device
    mig_enabled: bool = False
    mig_capable: bool = False  # an A100/H100 reports its MIG mode even when MIG is off; older GPUs cannot
    max_mig_devices: int = 7

    @property
    def is_mig(self) -> bool:
        return self.uuid.startswith("MIG-")


class NVMLError(Exception):
    """``pynvml.NVMLError``: ``value`` is NVML's return code."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6


class FakeNvml:
    """A ``pynvml`` that knows ``gpus`` (in NVML index order); handles are the :class:`FakeGpu` objects."""

    def __init__(self, gpus: list[FakeGpu], *, lookup_by_uuid: str = "all") -> None:
        self.gpus = gpus
        # "all": GPU and MIG UUIDs (R470 and later); "gpu": drivers that do not accept "MIG-<uuid>";
        # "none": nvmlDeviceGetHandleByUUID fails (NVML_ERROR_NOT_FOUND) whatever it is given.
        self.lookup_by_uuid = lookup_by_uuid
        self.calls: list[str] = []

    def install(self, monkeypatch: Any) -> types.ModuleType:
        """Put this fake in ``sys.modules["pynvml"]`` for one test; return the module."""
        module = types.ModuleType("pynvml")
        module.NVMLError = NVMLError
        module.NVML_ERROR_INVALID_ARGUMENT = NVML_ERROR_INVALID_ARGUMENT
        module.NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
        module.NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
        module.NVML_DEVICE_MIG_DISABLE, module.NVML_DEVICE_MIG_ENABLE = 0, 1
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(module, name, self._recorded(name, getattr(self, name)))
        monkeypatch.setitem(sys.modules, "pynvml", module)
        return module

    def _recorded(self, name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append(name)
            return fn(*args)

        return call

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        for gpu in self.gpus if self.lookup_by_uuid != "none" else ():
            if gpu.uuid == uuid:
                return gpu
            for mig in gpu.mig.values():
                if mig.uuid == uuid and self.lookup_by_uuid == "all":
                    return mig
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        return handle.uuid

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> types.SimpleNamespace:
        return types.SimpleNamespace(total=handle.total_bytes, used=handle.used_bytes,
                                     free=handle.total_bytes - handle.used_bytes)

    def nvmlDeviceIsMigDeviceHandle(self, handle: FakeGpu) -> int:
        return int(handle.is_mig)

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> list[int]:
        if handle.is_mig or not (handle.mig_capable or handle.mig_enabled):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return [int(handle.mig_enabled), int(handle.mig_enabled)]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeGpu) -> int:
        if handle.is_mig:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return handle.max_mig_devices if handle.mig_enabled else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeGpu, index: int) -> FakeGpu:
        if not handle.mig_enabled or index >= handle.max_mig_devices:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if index not in handle.mig:
            raise NVMLError(NVML_ERROR_NOT_FOUND)  # an empty slot: MIG devices need not be numbered densely
        return handle.mig[index]


class FakeStreams:
    """CUDA's streams and events, pinned host buffers and ``record_stream``, as a log of calls, for code whose
    tensors are on the CPU but which takes its CUDA path (``as_cuda()``: every tensor says ``is_cuda``).

    ``log`` holds, in call order: ``("wait_stream", waiting, waited)``, ``("enter", stream)``, ``("exit", stream)``,
    ``("record_event", stream, event, inside)`` (``inside``: within ``torch.cuda.stream(stream)``),
    ``("wait_event", stream, event)``, ``("record_stream", tensor_id, stream)`` and ``("pinned", bytes)``.
    Streams are names: ``"compute"`` (the current stream) and ``"side1"``, ``"side2"``, ... (made).
    """

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._made = 0
        self._current: list[str] = ["compute"]

    def install(self, monkeypatch: Any) -> "FakeStreams":
        fake = self

        class Stream(str):
            def __new__(cls, device: Any = None, name: str | None = None) -> "Stream":
                if name is None:  # a stream the code makes
                    fake._made += 1
                    name = f"side{fake._made}"
                return super().__new__(cls, name)

            def wait_stream(self, other: str) -> None:
                fake.log.append(("wait_stream", str(self), str(other)))

            def record_event(self) -> object:
                event = object()
                fake.log.append(("record_event", str(self), event, fake._current[-1] == str(self)))
                return event

            def wait_event(self, event: object) -> None:
                fake.log.append(("wait_event", str(self), event))

        class _On:
            def __init__(self, stream: str) -> None:
                self.stream = str(stream)

            def __enter__(self) -> None:
                fake._current.append(self.stream)
                fake.log.append(("enter", self.stream))

            def __exit__(self, *exc: Any) -> None:
                fake._current.pop()
                fake.log.append(("exit", self.stream))

        empty_like = torch.empty_like

        def pinned_empty_like(tensor: torch.Tensor, *args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
            out = empty_like(tensor, *args, **kwargs)
            if pin_memory:
                fake.log.append(("pinned", out.numel() * out.element_size()))
            return out

        def record_stream(tensor: torch.Tensor, stream: str) -> None:
            fake.log.append(("record_stream", id(tensor), str(stream)))

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(name="compute"))
        monkeypatch.setattr(torch.cuda, "stream", _On)
        monkeypatch.setattr(torch, "empty_like", pinned_empty_like)
        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
        return self

    def as_cuda(self, monkeypatch: Any) -> None:
        """From now on every tensor answers ``is_cuda`` with True (undo with ``monkeypatch.undo()``)."""
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda tensor: True))

    def calls(self, name: str) -> list[tuple]:
        return [entry for entry in self.log if entry[0] == name]
