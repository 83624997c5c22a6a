"""The device backend: every place autotune behaves differently on CUDA and elsewhere, in one class.

:func:`backend_for` picks :class:`CudaBackend` or :class:`Backend` (the CPU, and any other device
through the tensor meter) once, at the boundary; the stages ask it, never ``device.type``:
synchronise before reading a clock, release memory after a trial, total memory, the default
isolation, the precisions the device runs, the meter (whose ``measure()`` applies the budget for
its region and puts the setting back) and a description for the report. Cleanup that runs while
another error propagates never raises over it: after a sticky CUDA error every CUDA call fails,
and the error worth reporting is the first one.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import platform
import time
from typing import Any, Callable, Iterable

import torch

from autotune._log import logger, notice_once
from autotune.errors import UsageError, first_line
from autotune.meters import Meter
from autotune.vocabulary import HALF, PRECISIONS, Isolation, PrecisionName

__all__ = ["Backend", "CudaBackend", "backend_for", "make_meter", "resolve_device", "ram_bytes", "available_ram_bytes",
           "slowdown_vs_fp32", "SLOW_FACTOR", "autocast_type", "on_host", "host_memory_apart", "rank_device",
           "device_ids", "collective_backend", "batch_multiple", "predictable", "PlannedCudaBackend",
           "follows_cuda", "measurable_here"]

SLOW_FACTOR = 8.0  # a mode whose matmuls run this many times slower than fp32 leaves the defaults


def resolve_device(device: str | torch.device | None, *, planned: bool = False) -> torch.device:
    """Return ``device`` as a ``torch.device`` (default: CUDA when available, else the CPU). ``planned``: for a dry
    run, where CUDA is planned for, not used: it need not be here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"--device {device!r} is not a device: use cpu, cuda or cuda:N ({exc})") from None
    if device.type == "cuda" and planned and not torch.cuda.is_available():
        return torch.device("cuda", device.index or 0)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: this torch sees no CUDA GPU (install a CUDA build of torch, or use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif device.type != "cpu":
        notice_once(f"device type {device.type!r}: memory is measured with the tensor meter")
    return device


@functools.lru_cache(maxsize=None)
def slowdown_vs_fp32(name: str, device_type: str, n: int = 384) -> float:
    """Return how many times slower an ``n`` x ``n`` matmul runs in ``name`` than in fp32 (median of 5).

    For devices whose ops run synchronously (the CPU): CUDA keeps every mode it supports.
    """
    dtype = getattr(torch, PRECISIONS[name].autocast_dtype or "float32")

    def median_s(dt: torch.dtype) -> float:
        a = torch.randn(n, n, device=device_type).to(dt)
        b = torch.randn(n, n, device=device_type).to(dt)
        times = []
        for _ in range(6):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return sorted(times[1:])[2]  # the first call warms up kernels and caches

    return median_s(dtype) / median_s(torch.float32)


def ram_bytes() -> int | None:
    """Return the machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def available_ram_bytes() -> int | None:
    """The memory the machine could give a process now (Linux's MemAvailable), or None where the OS does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def autocast_type(device: torch.device) -> str:
    """The device type ``torch.autocast`` and the GradScaler take for ``device`` (``"cuda"``, ``"cpu"``)."""
    return device.type


def on_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in host memory (the CPU's)."""
    return tensor.device.type == "cpu"


def host_memory_apart(device: torch.device) -> bool:
    """Whether ``device``'s memory is not the host's (CUDA): offloading to the host frees device memory there, copies
    cross PCIe, and pinned host memory speeds them up. On the CPU the two are one memory and offload is emulated."""
    return device.type == "cuda"


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device a torchrun rank trains on: its local GPU on CUDA (``--device cuda`` means each rank's own)."""
    if device.type != "cuda":
        return device
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def device_ids(device: torch.device) -> list[int] | None:
    """DistributedDataParallel's ``device_ids`` for a model on ``device``: its GPU, or None elsewhere."""
    return [device.index] if device.type == "cuda" else None


def collective_backend(device: torch.device) -> str:
    """The torch.distributed backend of a job on ``device``: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


def batch_multiple(asked: int | None, device: torch.device) -> int:
    """The step exact limits are found in: ``--batch-multiple``, else 8 on CUDA (tensor cores like multiples of 8)
    and 1 elsewhere."""
    return asked if asked is not None else (8 if device.type == "cuda" else 1)


def follows_cuda(device: torch.device) -> bool:
    """Whether work for ``device`` follows CUDA's rules (its autocast lists, its caching allocator), whether or not
    this machine has a GPU: a dry run for it predicts with them (:mod:`autotune.execution.cuda_rules`)."""
    return device.type == "cuda"


def measurable_here(device: torch.device) -> bool:
    """Whether a trial for ``device`` can be measured by this process's tensor meter on the CPU instead of predicted
    (a dry run for the CPU can; one for CUDA cannot)."""
    return device.type == "cpu"


def predictable(device: torch.device) -> bool:
    """Whether a dry run predicts for ``device``: the CPU's rules, and CUDA's (:mod:`autotune.execution.cuda_rules`),
    also on a machine without a GPU."""
    return device.type in ("cpu", "cuda")


class Backend:
    """The CPU (and any non-CUDA device): tensor meter, no synchronisation, trials in this process."""

    default_isolation = Isolation.NONE  # a trial cannot poison the process: no worker start-up to pay
    held_by_scan = True  # held_bytes walks Python's objects (what gc.freeze hides it no longer sees), not an allocator

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def here(self) -> torch.device:
        """Where this process's tensors of the device live: the device, except where it is only planned for."""
        return self.device

    @property
    def kind(self) -> str:
        """What the study's identity names: workers on devices of one kind share a study."""
        return self.device.type

    def total_bytes(self) -> int | None:
        """Return the device's memory in bytes (the machine's RAM for the CPU), or None if unknown."""
        return ram_bytes()

    def synchronize(self) -> None:
        """Wait for queued work to finish (a no-op where ops run synchronously)."""

    def timed(self, fn: Callable[[], Any]) -> float:
        """Run ``fn`` to completion on the device; return its seconds."""
        self.synchronize()
        start = time.perf_counter()
        fn()
        self.synchronize()
        return time.perf_counter() - start

    def release(self) -> None:
        """Free what a finished trial left: reference cycles first (a model's weights may sit in one)."""
        gc.collect()

    def held_bytes(self, kept: Iterable[torch.Tensor] = ()) -> int:
        """The bytes this process holds on the device now, after :meth:`release`, not counting ``kept``.

        What a warm worker compares with the bytes it held before its first trial
        (:mod:`autotune.execution.spawn`). Without an allocator's count (the CPU, any device the
        tensor meter measures), the storages of every tensor Python can reach on this device, each
        counted once: a tensor only C++ holds (none of autotune's, nor a module's) is not seen.
        """
        skip = {_storage_key(t) for t in kept}
        held: dict[tuple[int, int], int] = {}
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor) and obj.device == self.device:  # type(): no __class__ lookups
                key = _storage_key(obj)
                if key is not None and key not in skip:
                    held[key] = obj.untyped_storage().nbytes()
        return sum(held.values())

    @property
    def meter_class(self) -> type[Meter]:
        """The meter this device is measured with (the tensor meter: any device, budget-enforcing)."""
        from autotune.meters import TensorMeter

        return TensorMeter

    @property
    def meter_name(self) -> str:
        return self.meter_class.__name__

    def meter(self, budget_bytes: int | None = None, *, compiled: bool = False) -> Meter:
        """Return the meter for this device; ``budget_bytes`` is enforced inside its ``measure()`` regions.

        ``compiled``: for a compiled trial, whose generated kernels allocate where no dispatch mode sees them. On
        the CPU that is the allocator's own events (:class:`~autotune.meters.allocator.AllocatorMeter`), which
        judge the budget when the region ends, not as it runs; CUDA's meter sees every allocation either way.
        """
        if compiled and not self.meter_class.sees_compiled:
            if self.device.type != "cpu":
                raise UsageError(f"compiled trials are measured on the CPU and CUDA, not on {self.device.type}: "
                                 f"search eager only (--compile none)")
            from autotune.meters import AllocatorMeter

            return AllocatorMeter(self.device, budget_bytes=budget_bytes)
        return self.meter_class(self.device, budget_bytes=budget_bytes)

    def budget(self, budget_bytes: int | None) -> contextlib.AbstractContextManager:
        """Hold the device to ``budget_bytes`` inside the block, and put the setting back after.

        On the CPU nothing process-wide is set: the tensor meter enforces its budget in its own
        ``measure()`` region.
        """
        return contextlib.nullcontext()

    def supported_precisions(self) -> list[str]:
        """Return the precision modes the device can train in at all (autocast runs a matmul)."""
        names = [PrecisionName.FP32.value]
        for name in HALF:
            try:
                with torch.autocast(self.device.type, dtype=getattr(torch, PRECISIONS[name].autocast_dtype)):
                    torch.ones(2, 2, device=self.device) @ torch.ones(2, 2, device=self.device)
            except Exception:  # noqa: BLE001 - any failure means the mode is not available here
                continue
            names.append(name)
        return names

    def default_precisions(self) -> list[str]:
        """Return the supported modes that are not pathologically slow here.

        A mode whose matmuls run more than ``SLOW_FACTOR`` times slower than fp32 (fp16 on CPUs
        without native half arithmetic) is left out, with a notice; asking for it explicitly still
        runs it, cut at ``--trial-timeout``.
        """
        kept = []
        for name in self.supported_precisions():
            factor = 1.0 if name == PrecisionName.FP32 else slowdown_vs_fp32(name, self.device.type)
            if factor > SLOW_FACTOR:
                notice_once(f"{name} matmuls run {factor:.0f}x slower than fp32 on this {self.device.type}: left out of "
                            f"the default precisions (add it with --precisions to measure it anyway)")
                continue
            kept.append(name)
        return kept

    def environment(self) -> dict[str, Any]:
        """Describe the machine the trials run on, for the report."""
        import optuna

        from autotune._version import __version__

        return {"autotune_version": __version__, "torch_version": torch.__version__, "optuna_version": optuna.__version__,
                "python_version": platform.python_version(), "platform": platform.platform(),
                "device": str(self.device), "device_type": self.device.type, **self.describe()}

    def describe(self) -> dict[str, Any]:
        """The device's part of the report's ``environment``."""
        return {"device_name": _cpu_name(), "total_memory_bytes": ram_bytes(), "cpu_count": os.cpu_count(),
                "torch_threads": torch.get_num_threads()}


class CudaBackend(Backend):
    """A CUDA GPU: caching-allocator and NVML meter, asynchronous kernels, one worker process per trial."""

    default_isolation = Isolation.PROCESS  # a sticky CUDA error or a fragmented cache stays in the worker
    held_by_scan = False  # the allocator counts every block, frozen objects' too

    def __init__(self, device: torch.device) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)

    @property
    def kind(self) -> str:
        return torch.cuda.get_device_name(self.device)

    @property
    def meter_class(self) -> type[Meter]:
        from autotune.meters.cuda import CudaMeter

        return CudaMeter

    def total_bytes(self) -> int | None:
        return torch.cuda.get_device_properties(self.device).total_memory

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)  # kernels run asynchronously: time them to completion

    def release(self) -> None:
        """Collect reference cycles, then hand the allocator's cache back; never raise over a sticky error.

        After an illegal memory access every CUDA call fails: the trial has already recorded that
        error, and a second one from the cleanup would hide it.
        """
        gc.collect()  # before empty_cache: a model in a reference cycle still holds its blocks
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - see the docstring
            logger.info("releasing CUDA memory failed (%s: %s): the device is unusable", type(exc).__name__,
                        first_line(exc))

    def held_bytes(self, kept: Iterable[torch.Tensor] = ()) -> int:
        """The caching allocator's allocated bytes now (``kept`` lives on the CPU), with cuBLAS's workspaces handed
        back first: a trial that follows makes them again inside its own peak, as a fresh process would."""
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def budget(self, budget_bytes: int | None) -> contextlib.AbstractContextManager:
        """``torch.cuda.set_per_process_memory_fraction`` inside the block, the previous fraction after (the meter's)."""
        from autotune.meters.cuda import memory_budget

        return memory_budget(self.device, budget_bytes)

    def supported_precisions(self) -> list[str]:
        """fp32 and fp16 on every GPU; bf16 where the hardware has it (compute capability 8.0+, or ROCm).

        ``torch.cuda.is_bf16_supported()`` counts emulated bf16 (Volta, Turing) by default, and asks
        the current device rather than this one: both would offer a mode that runs slowly or fails
        in cuDNN's convolutions.
        """
        names = [PrecisionName.FP32.value, PrecisionName.FP16.value]
        if torch.version.hip or torch.cuda.get_device_capability(self.device)[0] >= 8:
            names.append(PrecisionName.BF16.value)
        return names

    def default_precisions(self) -> list[str]:
        return self.supported_precisions()  # on a GPU every supported mode is worth measuring

    def describe(self) -> dict[str, Any]:
        props = torch.cuda.get_device_properties(self.device)
        return {"device_name": props.name, "total_memory_bytes": props.total_memory, "cuda_version": torch.version.cuda,
                "compute_capability": f"{props.major}.{props.minor}"}


def _storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """Which storage ``tensor`` views (its device and address), or None for one without a storage of its own."""
    try:
        storage = tensor.untyped_storage()
        return storage.device.index or 0, storage.data_ptr()
    except Exception:  # noqa: BLE001 - sparse, meta, functional and subclass tensors without a plain storage
        return None


class PlannedCudaBackend(Backend):
    """A CUDA GPU planned for on a machine without one, or another than this machine's (``--device cuda --dry-run``,
    ``--cuda-capability``): nothing runs on it, so it has no memory size of its own (``--budget`` says the card's);
    bf16 is offered from compute capability 8.0 (assumed where none is given)."""

    def __init__(self, device: torch.device, capability: tuple[int, int] | None = None) -> None:
        super().__init__(device)
        self.capability = capability  # --cuda-capability; None: assumed (the CUDA rules' ASSUMED_CAPABILITY)

    @property
    def here(self) -> torch.device:
        return torch.device("cpu")  # a prediction's fake tensors: the CPU's, with CUDA's rules

    def total_bytes(self) -> int | None:
        return None

    def supported_precisions(self) -> list[str]:
        bf16 = self.capability is None or self.capability >= (8, 0)
        return [PrecisionName.FP32.value, PrecisionName.FP16.value] + ([PrecisionName.BF16.value] if bf16 else [])

    def default_precisions(self) -> list[str]:
        return self.supported_precisions()

    def describe(self) -> dict[str, Any]:
        name = "CUDA GPU" if self.capability is None else "CUDA GPU of compute capability {}.{}".format(*self.capability)
        where = "with CUDA's rules on this machine's CPU" if torch.cuda.is_available() else "on a machine without one"
        return {"device_name": f"{name} (planned {where})", "total_memory_bytes": None, "planned_on": _cpu_name()}


def backend_for(device: str | torch.device, *, planned: bool = False,
                capability: tuple[int, int] | None = None) -> Backend:
    """Return the backend of ``device``: :class:`CudaBackend` on CUDA (``planned``, for a dry run, where this machine
    has none or another GPU is described by its ``capability``: :class:`PlannedCudaBackend`), :class:`Backend`
    elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return Backend(device)
    if planned and (capability is not None or not torch.cuda.is_available()):
        return PlannedCudaBackend(device, capability)
    return CudaBackend(device)


def make_meter(device: str | torch.device, *, budget_bytes: int | None = None) -> Meter:
    """Return the meter ``device``'s backend measures with: :class:`~autotune.meters.CudaMeter` on CUDA, the
    :class:`~autotune.meters.TensorMeter` elsewhere. Making a meter changes no process-wide setting: the budget
    is enforced inside ``measure()``."""
    return backend_for(device).meter(budget_bytes)
