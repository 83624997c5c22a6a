"""A tensor-storage tracker: peak live bytes of tensors on one device, with a hard budget.

Every ATen call inside :meth:`TensorMeter.measure` passes through a ``TorchDispatchMode``. Each
output tensor's storage is counted once (views share their base's storage) and uncounted by a
weak-reference finaliser when the storage is freed, so the live total follows parameters,
gradients, optimizer state, activations and recomputed activations as they come and go.
Allocations inside a kernel (workspaces) and allocator caching are invisible to it, and every op
pays a Python call, which is why trials time their steps outside this meter.

Asked to (``TensorMeter(trace=True)``), the meter also keeps the region's allocation trace: one event
``(+nbytes, key)`` as each storage is counted and ``(-nbytes, key)`` as it is uncounted (freed, resized,
moved off the device), in order, each counted storage under a key of its own. A storage made while another
stream than the region's first is current (``torch.cuda.stream``, or ``torch.cpu.stream``, which code
written for any device calls as it would CUDA's: FSDP2 gathers and reduces on streams of its own) is counted
as ``(+nbytes, key, stream)``, the streams numbered from 1 in the order they are met. Replayed by a model of an
allocator (:mod:`autotune.meters.caching_allocator`), it says what that allocator would have reserved: a block
is cached for the stream that allocated it.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Iterable, Iterator

import torch
from torch.utils._python_dispatch import (TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode, _push_mode,
                                         is_traceable_wrapper_subclass)
from torch._subclasses.fake_tensor import FakeTensor  # private, and in every torch autotune supports
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from autotune.errors import TrialTimeoutError, is_oom
from autotune.meters.base import Measuring, MemoryReading, Meter
from autotune.meters.oom import BudgetExceededError

__all__ = ["TensorMeter", "leave_device", "enter_device", "kept_on_host", "passing_peak", "meter_aside", "plain_tensors"]


class _Tracker(TorchDispatchMode):
    def __init__(self, device_type: str, budget_bytes: int | None, deadline: float | None, *,
                 trace: bool = False) -> None:
        super().__init__()
        self.device_type = device_type
        self.budget_bytes = budget_bytes
        self.deadline = deadline
        self.live_bytes = 0
        self.peak_bytes = 0  # of what was allowed
        self.refused_bytes = 0  # the largest total an allocation asked for and was refused
        self.refused_held_bytes = 0  # what was live when that allocation was refused
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> (nbytes, finaliser)
        # storages an emulation keeps on the host, never counted; made on first use (most trials have none, and every
        # op's outputs would pay the lookup)
        self._host: WeakIdKeyDictionary | None = None
        self.trace: list[tuple[int, ...]] | None = [] if trace else None  # (+/-nbytes, key[, stream]), in order
        self._keys = 0  # keys handed to traced storages so far
        self._streams: dict[object, int] = {_stream_identity(device_type): 0}  # the region's first stream is 0

    def track(self, tensors: Iterable[object]) -> None:
        """Count the storages of ``tensors`` (non-tensors are ignored); raise past the budget.

        Past the budget the new storages are not counted, as a real allocator that refused them
        would not: an out-of-memory handler can go on allocating what still fits, and every later
        allocation is held to the budget again.
        """
        added = []
        mark = len(self.trace) if self.trace is not None else 0
        for t in plain_tensors(tensors):
            if t.device.type != self.device_type or t.is_sparse or t.is_meta:
                continue
            storage = t.untyped_storage()
            if self._host is not None and storage in self._host:
                continue
            nbytes = storage.nbytes()
            known = self._storages.get(storage)
            if known is not None:
                if known[0] == nbytes:
                    continue
                self._unfollow(known[1])  # resized in place: recount at its new size
                self.live_bytes -= known[0]
            self._storages[storage] = (nbytes, self._follow(storage, nbytes))
            self.live_bytes += nbytes
            added.append(storage)
        if added and self.budget_bytes is not None and self.live_bytes > self.budget_bytes:
            tried = self.live_bytes
            refused = set()
            for storage in added:
                size, finaliser = self._storages.pop(storage)
                refused.add(_key_of(finaliser.detach()))
                self.live_bytes -= size
            if self.trace is not None:  # what the budget refused was never allocated
                self.trace[mark:] = [event for event in self.trace[mark:] if event[1] not in refused]
            self._refuse(nbytes, tried)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _refuse(self, asked: int, tried: int) -> None:
        """Raise the budget's out-of-memory error for an allocation of ``asked`` bytes that would make ``tried`` live
        (nothing of it counted), remembering the largest refusal for the region's reading."""
        if tried > self.refused_bytes:
            self.refused_bytes, self.refused_held_bytes = tried, self.live_bytes
        raise BudgetExceededError(asked, tried, self.budget_bytes)

    def passing(self, nbytes: int) -> None:
        """Count ``nbytes`` allocated and freed at once: a peak, held to the budget (see :func:`passing_peak`)."""
        tried = self.live_bytes + nbytes
        if self.budget_bytes is not None and tried > self.budget_bytes:
            self._refuse(nbytes, tried)
        self.peak_bytes = max(self.peak_bytes, tried)
        if self.trace is not None:
            self._keys += 1
            self.trace += [(nbytes, self._keys), (-nbytes, self._keys)]

    def _follow(self, storage: torch.UntypedStorage, nbytes: int) -> weakref.finalize:
        """The finaliser that uncounts ``storage`` when it is freed; traced, its allocation's event too."""
        if self.trace is None:
            return weakref.finalize(storage, self._free, nbytes)
        self._keys += 1
        stream = self._streams.setdefault(_stream_identity(self.device_type), len(self._streams))
        self.trace.append((nbytes, self._keys) if stream == 0 else (nbytes, self._keys, stream))
        return weakref.finalize(storage, self._free, nbytes, self._keys)

    def _unfollow(self, finaliser: weakref.finalize) -> None:
        """Stop following a storage's count (the caller uncounts it); traced, its free's event."""
        args = finaliser.detach()
        if self.trace is not None and args is not None:
            self.trace.append((-args[2][0], _key_of(args)))

    def _free(self, nbytes: int, key: int | None = None) -> None:
        self.live_bytes -= nbytes
        if key is not None and self.trace is not None:
            self.trace.append((-nbytes, key))

    def resize(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Resize a counted storage in place and count it at its new size (FSDP frees each gathered block's
        parameters with ``resize_(0)`` and gathers into them again); past the budget, refuse as an allocator would."""
        known = self._storages.get(storage)
        if known is None:  # not this device's, or not counted (what an emulation made the host's)
            _RESIZE(storage, nbytes)
            return
        tried = self.live_bytes - known[0] + nbytes
        if nbytes > known[0] and self.budget_bytes is not None and tried > self.budget_bytes:
            self._refuse(nbytes - known[0], tried)
        _RESIZE(storage, nbytes)
        self._unfollow(known[1])
        self._storages[storage] = (nbytes, self._follow(storage, nbytes))
        self.live_bytes = tried
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def untrack(self, tensors: Iterable[object]) -> int:
        """Stop counting the storages of ``tensors`` (they left the device); return the bytes let go."""
        freed = 0
        for t in plain_tensors(tensors):
            if t.device.type == self.device_type and not t.is_meta:
                known = self._storages.pop(t.untyped_storage(), None)
                if known is not None:
                    self._unfollow(known[1])
                    self.live_bytes -= known[0]
                    freed += known[0]
        return freed

    def keep_on_host(self, tensors: Iterable[object]) -> None:
        """Never count the storages of ``tensors`` (nor of their views): the host's (see :func:`kept_on_host`)."""
        tensors = list(plain_tensors(tensors))
        self.untrack(tensors)
        if self._host is None:
            self._host = WeakIdKeyDictionary()
        for t in tensors:
            self._host[t.untyped_storage()] = True

    def release(self) -> None:
        """Stop following storages that outlive the region, so the finalisers drop this tracker."""
        for _, finaliser in list(self._storages.values()):
            finaliser.detach()
        self._storages = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TrialTimeoutError("the trial ran past its time limit (--trial-timeout)")
        out = func(*args, **(kwargs or {}))
        self.track(tree_leaves(out))
        return out


def _stream_identity(device_type: str) -> object:
    """What tells the current stream of ``device_type`` apart from the others (``None`` where it has no streams)."""
    module = torch.cpu if device_type == "cpu" else torch.cuda if device_type == "cuda" else None
    if module is None or (module is torch.cuda and not torch.cuda.is_available()):
        return None
    stream = module.current_stream()
    return (stream.device_index, stream.stream_id) if hasattr(stream, "stream_id") else id(stream)


def _key_of(detached: tuple | None) -> int | None:
    """The trace key among what ``weakref.finalize.detach()`` returned (``None``: untraced, or already run)."""
    return detached[2][1] if detached is not None and len(detached[2]) > 1 else None


_RESIZE = torch.UntypedStorage.resize_  # the method itself; while a meter measures, the class answers with _resize


def _resize(storage: torch.UntypedStorage, nbytes: int) -> torch.UntypedStorage:
    """``UntypedStorage.resize_`` while a tensor meter measures: the meter counts the storage at its new size."""
    tracker = _active()
    if tracker is None:
        _RESIZE(storage, nbytes)
    else:
        tracker.resize(storage, int(nbytes))
    return storage


@contextlib.contextmanager
def _resizes_seen() -> Iterator[None]:
    """Storages resized in place are recounted (an op's output shows a new size; ``resize_`` on a storage is no op)."""
    if torch.UntypedStorage.__dict__.get("resize_") is _resize:  # a meter inside a meter: the outer one installed it
        yield
        return
    torch.UntypedStorage.resize_ = _resize
    try:
        yield
    finally:
        del torch.UntypedStorage.resize_


_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)  # a fake tensor (a dry run's) has a storage of its own, no data


def plain_tensors(tensors: Iterable[object]) -> Iterator[torch.Tensor]:
    """The plain tensors among ``tensors``, and those inside wrapper subclasses (a DTensor's local shard: the op that
    made it ran inside DTensor's own dispatch, below this meter's, so its storage is seen here or nowhere). Read
    without dispatching anything (``to_local()`` would be an op the meter sees)."""
    for t in tensors:
        if type(t) in _PLAIN:
            yield t
        elif isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t):
            yield from plain_tensors(getattr(t, name) for name in t.__tensor_flatten__()[0])


def _active() -> _Tracker | None:
    """The innermost tensor meter measuring here, if any."""
    return next((m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, _Tracker)), None)


def leave_device(tensors: Iterable[object]) -> int:
    """For an emulation of host memory on one memory (the CPU's): the active tensor meter stops counting ``tensors``
    as the device's, as if they had been moved to the host; return the bytes it let go (0 without a meter)."""
    tracker = _active()
    return 0 if tracker is None else tracker.untrack(tensors)


def enter_device(tensors: Iterable[object]) -> None:
    """The inverse of :func:`leave_device`: the active tensor meter counts ``tensors`` as the device's (made where it
    did not look, as an emulation's host was); nothing without a meter."""
    tracker = _active()
    if tracker is not None:
        tracker.track(tensors)


def kept_on_host(tensors: Iterable[object]) -> None:
    """For an emulation of host memory on one memory (the CPU's): the active tensor meter never counts the storages of
    ``tensors`` as the device's, nor of views of them made later (FSDP2 views each fake shard it keeps on the host
    again as it starts; a real shard it recognises and does not view); nothing without a meter."""
    tracker = _active()
    if tracker is not None:
        tracker.keep_on_host(tensors)


def passing_peak(nbytes: int) -> None:
    """The active tensor meter counts ``nbytes`` allocated and freed at once (what an emulation's device held
    briefly where the meter did not look): a peak, held to the budget."""
    tracker = _active()
    if tracker is not None and nbytes > 0:
        tracker.passing(nbytes)


@contextlib.contextmanager
def meter_aside() -> Iterator[None]:
    """For an emulation of host memory on one memory (the CPU's): what is made in the block is the host's, counted by
    no tensor meter measuring here; every other mode (a dry run's fake tensors) stays in force."""
    stack = _get_current_dispatch_mode_stack()
    if not any(isinstance(mode, _Tracker) for mode in stack):
        yield
        return
    popped = [_pop_mode() for _ in stack]  # innermost first
    kept = [mode for mode in reversed(popped) if not isinstance(mode, _Tracker)]
    for mode in kept:
        _push_mode(mode)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for mode in reversed(popped):
            _push_mode(mode)


class TensorMeter(Meter):
    """Peak live tensor bytes on one device (any device type), enforcing ``budget_bytes``.

    Tensors that exist before the region (a model built outside it) are counted when passed to
    :meth:`Measuring.track`; tensors created inside the region are counted automatically.

    ``trace=True`` keeps each region's allocation trace (see the module's docstring): on the handle
    (``handle.trace``) and, for code that makes the meter but not the region, as :attr:`last_trace`.
    Without it nothing is recorded and counting costs what it did.
    """

    slows_steps = True
    predicted_exactly = True  # a prediction is this meter's count under fake tensors (results/dry_run-cpu.md)
    sees_compiled = False  # under a dispatch mode dynamo does not compile: a compiled step would run eager

    def __init__(self, device: str | torch.device = "cpu", *, budget_bytes: int | None = None,
                 trace: bool = False) -> None:
        super().__init__(budget_bytes=budget_bytes)
        self.device_type = torch.device(device).type
        self.tracing = trace
        self.last_trace: tuple[tuple[int, ...], ...] | None = None  # the latest region's, with trace=True

    @contextlib.contextmanager
    def measure(self, *, deadline: float | None = None) -> Iterator["_TensorMeasuring"]:
        """Track tensors created in the block; ``deadline`` (``time.monotonic()``) stops it."""
        tracker = _Tracker(self.device_type, self.budget_bytes, deadline, trace=self.tracing)
        handle = _TensorMeasuring(tracker)
        raised: BaseException | None = None
        try:
            with tracker, _resizes_seen():
                yield handle
        except BaseException as exc:
            raised = exc
            raise
        finally:
            handle.reading = _reading(tracker, handle, raised)
            tracker.release()
            self.last_trace = handle.trace


def _reading(tracker: _Tracker, handle: "_TensorMeasuring", raised: BaseException | None) -> MemoryReading:
    """Return the region's reading; ``raised`` is what the block raised, if anything."""
    # A region that ran out of memory reports the total it asked for: a lower bound on its need.
    peak = max(tracker.peak_bytes, handle.region_peak, tracker.refused_bytes)
    held = needed = None
    if raised is not None and is_oom(raised):
        if tracker.refused_bytes:  # the largest refusal: the one peak_bytes reports
            held, needed = tracker.refused_held_bytes, tracker.refused_bytes
        else:  # an out-of-memory error the budget did not raise: its size is unknown here
            held = tracker.live_bytes
    return MemoryReading(
        peak_bytes=peak,
        peak_allocated_bytes=peak,
        source="tensor",
        oom_held_bytes=held,
        oom_needed_bytes=needed,
    )


class _TensorMeasuring(Measuring):
    def __init__(self, tracker: _Tracker) -> None:
        self._tracker = tracker
        self.region_peak = 0  # the largest peak before a reset_peak()

    def track(self, tensors: Iterable[object]) -> None:
        """Count tensors that were created before the region, such as a model's parameters."""
        self._tracker.track(tensors)

    def reset_peak(self) -> None:
        self.region_peak = max(self.region_peak, self._tracker.peak_bytes)
        self._tracker.peak_bytes = self._tracker.live_bytes

    def peak_bytes(self) -> int:
        return self._tracker.peak_bytes

    @property
    def live_bytes(self) -> int:
        """Tracked bytes alive right now."""
        return self._tracker.live_bytes

    @property
    def trace(self) -> tuple[tuple[int, ...], ...] | None:
        """The allocation trace so far: ``(+nbytes, key)`` as a storage is counted (``(+nbytes, key, stream)`` on
        another stream than the region's first), ``(-nbytes, key)`` as it is uncounted, in order (``None`` unless the
        meter was made with ``trace=True``). Storages still alive when the region ended have no free event."""
        return None if self._tracker.trace is None else tuple(self._tracker.trace)
