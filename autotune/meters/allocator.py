"""A CPU allocator meter: the peak of bytes the CPU allocator held in a region, read from the allocator's own events.

The tensor meter sees the outputs of dispatched ops. Code that ``torch.compile`` generates for the CPU (inductor's
C++ kernels) allocates its buffers with ``empty_strided_cpu``, below the dispatcher, where that meter cannot see them;
and under a dispatch mode dynamo does not run compiled code at all (torch 2.13 skips the frame), so the tensor meter
measures the eager step instead. Every block that c10's CPU allocator hands out, though, is reported to the profiler
while it profiles memory: this meter runs its region under the profiler (Kineto, the CPU activity,
``profile_memory=True``) and sums those events afterwards. The profiler is held to a record scope that nothing outside
the mobile runtime uses (``RecordScope.LITE_INTERPRETER``), so it records no operator: only the allocator's events.

What the profiler reports (torch 2.13, CPU build), and what the meter does about it:

1. An event's ``total_allocated`` is c10's process-wide count of bytes allocated while memory was profiled (in this
   region or an earlier one) and not yet freed, so it is not the region's. Memory allocated before the region (a
   model built outside it) is in none of the events. The meter sums ``alloc_size`` from zero at the region's start;
   tensors that exist before the region count when passed to ``handle.track(tensors)`` (unique storages, the
   device's only), as with the tensor meter.
2. A free is reported only for a block allocated while memory was profiled, in any region; a block allocated before
   any profiling is freed silently (c10 logs "Memory block of unknown size was allocated before the profiling
   started" for the first such free and every 1000th after it). So a free counts only for a block the region allocated, found
   by its address; a tracked storage is uncounted by a weak-reference finaliser that notes the time of its free
   (``time.time_ns()``, the clock the profiler's times are converted to: an allocation's event fell between
   ``time_ns()`` read before and after it in 2,000 of 2,000 tries).
3. Cost: each allocation and free takes a lock and queues an event, so a step inside the region takes 1.00-1.01
   times its unmetered time on TinyGPT and 1.03-1.06 times on the small ResNet (650 allocations in 3 ms), against
   1.7-1.9 and 3.5-3.8 inside the tensor meter. The events are read when the profiler stops, at the region's end
   and at each ``reset_peak()``/``peak_bytes()``: about 7 ms per thousand, outside any step a trainer times. Small,
   but not nothing: :attr:`AllocatorMeter.slows_steps` is True, and trials time their steps outside the region.
4. Kineto prints ``USDT: ... profiler_start``/``profiler_stop`` to stderr on each start and stop unless its log level
   is 6 when it initialises, at a process's first profiler start: the meter sets ``KINETO_LOG_LEVEL=6`` around that
   start only (a value already in the environment is kept) and takes it out again. c10's warning in (2) goes by
   ``TORCH_CPP_LOG_LEVEL``, read when torch loads: set it to ``ERROR`` in the environment to silence it.

Limits. The allocator cannot be refused from Python: the budget is judged after the fact, when the events are read,
and a region that went past it raises :class:`~autotune.meters.oom.BudgetExceededError` then (its reading's
``source`` is ``"allocator"``, which tells the budget was judged so). Only the thread that entered the region is seen
(memory profiling is thread-local: a kernel's own threads and other Python threads allocate unseen), and only what
c10's allocator hands out (what a library takes from malloc itself, such as MKL's buffers, is not). The profiler
belongs to one user at a time: a region refuses to start under a running profiler, and a profiler started inside the
region makes the meter fail. ``deadline`` cannot stop a step (nothing runs between ops): trials check their own
deadline between steps.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from typing import Iterable, Iterator

import torch
from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler, _profiler_enabled
from torch._C._profiler import (ProfilerActivity, ProfilerConfig, ProfilerState, RecordScope, _ExperimentalConfig,
                                _ExtraFields_Allocation)
from torch.autograd import profiler as _autograd_profiler  # its _is_profiler_enabled: torch.profiler's own flag

from autotune.errors import UsageError, is_oom
from autotune.meters.base import Measuring, MemoryReading, Meter
from autotune.meters.oom import BudgetExceededError
from autotune.meters.tensor import plain_tensors

__all__ = ["AllocatorMeter"]

SOURCE = "allocator"  # MemoryReading.source: peaks summed from the allocator's events, the budget judged after the fact
_ACTIVITIES = {ProfilerActivity.CPU}
_SCOPES = {RecordScope.LITE_INTERPRETER}  # the mobile interpreter's: no operator is recorded, allocations still are
_QUIET_KINETO = "6"  # above USDT (5), Kineto's highest level: nothing printed
_kineto_started = False  # Kineto reads its log level once, at the process's first profiler start

# The kinds of event: the allocator's, and the meter's notes on tracked storages
_ALLOC, _FREE, _TRACK, _UNTRACK = range(4)


def _config() -> ProfilerConfig:
    """Kineto with memory profiling: no shapes, stacks, flops or modules."""
    return ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig(), "")


def _start() -> None:
    """Start profiling this thread's allocations; quietly the first time in a process (see the module's (4))."""
    global _kineto_started
    if _profiler_enabled():
        raise UsageError("a profiler is already running: the allocator meter reads the allocator's events through the "
                         "profiler and needs it to itself; stop the profiler first, or measure with the tensor meter")
    quiet = not _kineto_started and "KINETO_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["KINETO_LOG_LEVEL"] = _QUIET_KINETO
    try:
        _prepare_profiler(_config(), _ACTIVITIES)
    finally:
        if quiet:
            del os.environ["KINETO_LOG_LEVEL"]
    _kineto_started = True
    _enable_profiler(_config(), _ACTIVITIES, _SCOPES)


def _stop() -> object:
    """Stop the meter's profiler and return its result; fail when another profiler took its place in the region."""
    if not _profiler_enabled() or _autograd_profiler._is_profiler_enabled:  # stopped, or replaced by the user's
        raise UsageError("a profiler was started inside an allocator meter's region, which took the profiler from "
                         "the meter: profile outside the region, or measure with the tensor meter")
    return _disable_profiler()


def _allocations(result: object, device_type: str) -> list[tuple[int, int, int, int]]:
    """The allocator's events on ``device_type`` in a profiler's result, in the order they happened, as
    ``(time_ns, kind, address, nbytes)``."""
    events = []
    stack = list(reversed(result.experimental_event_tree()))  # depth first, in order: the events' own order
    while stack:  # about a microsecond an event: each attribute read builds a Python object, so each is read once
        node = stack.pop()
        f = node.extra_fields
        if type(f) is not _ExtraFields_Allocation:  # an operator's, were any recorded: allocations are its children
            stack.extend(reversed(node.children))
            continue
        nbytes = f.alloc_size
        if nbytes and f.device.type == device_type:
            events.append((node.start_time_ns, _ALLOC if nbytes > 0 else _FREE, f.ptr, abs(nbytes)))
    return events


class _Ledger:
    """The region's running count of bytes, in time order: the blocks the allocator gave it and tracked storages."""

    def __init__(self, device_type: str, budget_bytes: int | None) -> None:
        self.device_type = device_type
        self.budget_bytes = budget_bytes
        self.live_bytes = 0
        self.peak_bytes = 0  # since the region began
        self.part_peak_bytes = 0  # since the last reset_peak()
        self.crossing: tuple[int, int, int] | None = None  # (held, needed, asked): the first allocation past the budget
        self._blocks: dict[int, int] = {}  # address -> bytes of the blocks the region allocated and has not freed
        self._tracked: dict[int, int] = {}  # key -> bytes of the tracked storages counted now
        self._address: dict[int, int] = {}  # key -> address of a tracked storage, until its note is read
        self._alive: dict[int, int] = {}  # address -> key of the tracked storages alive now
        self._finalisers: list[weakref.finalize] = []
        self._notes: list[tuple[int, int, int, int]] = []  # (time_ns, kind, key, nbytes) of tracking, not read yet
        self._keys = 0

    def track(self, tensors: Iterable[object]) -> None:
        """Count the unique storages of ``tensors`` on the device from now until they are freed."""
        for t in plain_tensors(tensors):
            if t.device.type != self.device_type or t.is_sparse or t.is_meta:
                continue
            storage = t.untyped_storage()
            address, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or address in self._alive:
                continue
            self._keys += 1
            self._alive[address] = self._keys
            self._address[self._keys] = address
            self._finalisers.append(weakref.finalize(storage, self._freed, self._keys, address, nbytes))
            self._notes.append((time.time_ns(), _TRACK, self._keys, nbytes))

    def _freed(self, key: int, address: int, nbytes: int) -> None:
        if self._alive.get(address) == key:
            del self._alive[address]
        self._notes.append((time.time_ns(), _UNTRACK, key, nbytes))

    def read(self, events: list[tuple[int, int, int, int]]) -> tuple[int, int, int] | None:
        """Count the allocator's ``events`` since the last read, with the tracking noted meanwhile, in time order;
        return the first allocation among them past the budget, as ``(held, needed, asked)`` (``None``: none)."""
        notes, self._notes = self._notes, []
        first = None
        for _, kind, ident, nbytes in sorted(events + notes, key=lambda e: e[0]):  # stable: equal times keep order
            held = self.live_bytes
            self._count(kind, ident, nbytes)
            if self.live_bytes > held:
                self.part_peak_bytes = max(self.part_peak_bytes, self.live_bytes)
                if first is None and self.budget_bytes is not None and self.live_bytes > self.budget_bytes:
                    first = (held, self.live_bytes, self.live_bytes - held)
        self.peak_bytes = max(self.peak_bytes, self.part_peak_bytes)
        self.crossing = self.crossing or first
        return first

    def _count(self, kind: int, ident: int, nbytes: int) -> None:
        """Count one event; ``ident`` is a block's address for the allocator's events, a tracking key for the notes."""
        if kind == _ALLOC:
            self._blocks[ident] = nbytes
            self.live_bytes += nbytes
        elif kind == _FREE:
            self.live_bytes -= self._blocks.pop(ident, 0)  # a block allocated before the region was never counted
        elif kind == _TRACK:
            if self._address.pop(ident) not in self._blocks:  # a storage the region allocated is counted already
                self._tracked[ident] = nbytes
                self.live_bytes += nbytes
        else:
            self.live_bytes -= self._tracked.pop(ident, 0)

    def release(self) -> None:
        """Stop following tracked storages that outlive the region, so that their finalisers drop this ledger."""
        for finaliser in self._finalisers:
            finaliser.detach()
        self._finalisers = []


class AllocatorMeter(Meter):
    """Peak bytes the CPU allocator held for a region, summed from its events; ``budget_bytes`` judged after the fact.

    Sees what no dispatch mode sees (code that ``torch.compile`` generated, kernels' scratch buffers); tensors that
    exist before the region count when passed to ``handle.track(tensors)``. Exceeding the budget raises
    :class:`~autotune.meters.oom.BudgetExceededError` when the events are read: at the region's end, or at
    ``handle.reset_peak()``/``handle.peak_bytes()`` inside it. See the module's docstring for what it cannot see.
    """

    slows_steps = True

    def __init__(self, device: str | torch.device = "cpu", *, budget_bytes: int | None = None) -> None:
        super().__init__(budget_bytes=budget_bytes)
        self.device_type = torch.device(device).type
        if self.device_type != "cpu":
            raise UsageError(f"the allocator meter reads the CPU allocator; on {self.device_type!r} use the "
                             "device's own meter (autotune.device.make_meter)")

    @contextlib.contextmanager
    def measure(self, *, deadline: float | None = None) -> Iterator["_AllocatorMeasuring"]:
        """Count the CPU allocator's events in the block; ``deadline`` cannot stop a step and is ignored."""
        handle = _AllocatorMeasuring(_Ledger(self.device_type, self.budget_bytes))
        _start()
        try:
            yield handle
        except BaseException as exc:
            handle._finish(exc)
            raise
        handle._finish(None)


class _AllocatorMeasuring(Measuring):
    def __init__(self, ledger: _Ledger) -> None:
        self._ledger = ledger
        self._profiling = True  # the meter's profiler runs

    def track(self, tensors: Iterable[object]) -> None:
        """Count tensors that were created before the region, such as a model's parameters."""
        self._ledger.track(tensors)

    def reset_peak(self) -> None:
        """Read the events so far (past the budget, raise) and start new peaks from the bytes held now."""
        self._read()
        self._ledger.part_peak_bytes = self._ledger.live_bytes

    def peak_bytes(self) -> int:
        """Read the events so far (past the budget, raise); return the peak since the region began or reset_peak()."""
        self._read()
        return self._ledger.part_peak_bytes

    @property
    def live_bytes(self) -> int:
        """Read the events so far (past the budget, raise); return the bytes held now."""
        self._read()
        return self._ledger.live_bytes

    def _read(self) -> None:
        """Stop the profiler, start it again at once (what the thread frees between the two goes unseen: nothing of
        the caller's runs there) and count the events; raise the budget's error if they went past it."""
        self._profiling = False
        result = _stop()
        _start()
        self._profiling = True
        first = self._ledger.read(_allocations(result, self._ledger.device_type))
        if first is not None:
            raise BudgetExceededError(first[2], first[1], self._ledger.budget_bytes)

    def _finish(self, raised: BaseException | None) -> None:
        """Stop the profiler, count the last events and fill the reading. After a block that did not raise, raise the
        budget's error if the last events went past it, or the error that kept them from being read; after a block
        that raised, its error is the region's (a real allocator may have refused memory before it: see the reading)."""
        ledger, first = self._ledger, None
        try:
            if self._profiling:
                self._profiling = False
                first = ledger.read(_allocations(_stop(), ledger.device_type))
        except UsageError:
            if raised is None:
                raise
        finally:
            over = first is not None and raised is None
            self.reading = _reading(ledger, over or (raised is not None and is_oom(raised)))
            ledger.release()
        if over:
            raise BudgetExceededError(first[2], first[1], ledger.budget_bytes)


def _reading(ledger: _Ledger, oom: bool) -> MemoryReading:
    """The region's reading; ``oom``: the region ends in an out-of-memory error (the budget's, or the allocator's)."""
    held = needed = None
    if oom and ledger.crossing is not None:  # the allocation a real allocator with this budget would have refused
        held, needed = ledger.crossing[0], ledger.crossing[1]
    elif oom:  # an out-of-memory error the budget did not raise: its size is unknown here
        held = ledger.live_bytes
    return MemoryReading(
        peak_bytes=ledger.peak_bytes,
        peak_allocated_bytes=ledger.peak_bytes,
        source=SOURCE,
        oom_held_bytes=held,
        oom_needed_bytes=needed,
    )
