"""The caching allocator's model held against a GPU's record: a memory snapshot's trace replayed event by event.

A record (:mod:`autotune.meters.memory_snapshot`) holds the segments at a snapshot's end and, per device, the
allocator's events before it. :func:`replay_record`, device by device:

1. **Starts where the recording started** (:func:`~autotune.meters.record_start.rebuild_start`).
2. **Replays every event** through :class:`~autotune.meters.caching_allocator.CachingAllocator`, on the snapshot's
   ``allocator_settings``: ``alloc`` is ``malloc`` on its stream, ``free_completed`` is ``free`` (from then on torch
   reuses the block, on its stream; ``free_requested`` only asks); a run of ``segment_free`` (``segment_unmap``)
   events that no failed allocation caused is ``empty_cache()``.
3. **Takes the driver's answers from the record**, for they are the driver's and not the allocator's: a new segment
   lies where the record's did (until the model's segments first differ from the record's), and where the record
   shows an allocation that failed (segments given back right before it got one: the retry; or an ``oom``) the
   driver refuses the model's first request for it (for an ``oom``, every request).
4. **Compares** each ``segment_alloc`` and ``segment_free`` (``segment_map``, ``segment_unmap``) with its size, the
   reserved bytes after every event, and the peak; and, as a witness of the model's choices, counts the allocations
   it placed at the recorded address.

Torch-free.
"""

from __future__ import annotations

import bisect
import dataclasses
from autotune.meters.caching_allocator import (_VA_PAGES, SMALL_BUFFER_BYTES, SMALL_SIZE_BYTES, AllocatorOutOfMemory,
                                               AllocatorSettings, CachingAllocator, MiB, _Block, round_size)
from autotune.meters.record_start import Start, rebuild_start

__all__ = ["replay_record", "record_settings", "RecordSettings"]

_UP, _DOWN = ("segment_alloc", "segment_map"), ("segment_free", "segment_unmap")
_SYNTHETIC_BASE = 1 << 60  # where the model's own segments go once it stops following the record: above any GPU's


@dataclasses.dataclass(frozen=True)
class RecordSettings:
    """The allocator settings a record was made under, and the names of those it sets that the model does not follow
    (``unmodelled``)."""

    settings: AllocatorSettings
    unmodelled: list[str]


def record_settings(record: dict) -> RecordSettings:
    """The allocator settings a record was made under (its ``allocator_settings``, else what its segments show) and
    the names of those it sets that the model does not follow."""
    given = record.get("allocator_settings") or {}
    conf = dict(item.strip().split(":", 1) for item in str(given.get("PYTORCH_CUDA_ALLOC_CONF") or "").split(",")
                if ":" in item)
    expandable = (bool(given.get("expandable_segments")) or any(s["is_expandable"] for s in record["segments"])
                  or any("segment_map" in t["action"] for t in record["device_traces"]))
    cut = given.get("max_split_size", -1)
    options: dict = {"expandable_segments": expandable,
                               "max_split_bytes": None if not isinstance(cut, int) or not 0 <= cut < 1 << 62 else cut}
    for key, option in (("max_non_split_rounding_mb", "max_non_split_rounding_bytes"),
                        ("large_segment_size_mb", "large_segment_bytes")):
        if key in conf:
            options[option] = int(float(conf[key]) * MiB)
    divisions = given.get("roundup_power2_divisions")
    unmodelled = [name for name, value in (
        ("roundup_power2_divisions", any(divisions.values()) if isinstance(divisions, dict) else divisions),
        ("garbage_collection_threshold", given.get("garbage_collection_threshold"))) if value]
    return RecordSettings(AllocatorSettings(**options), unmodelled)


class _Replayer(CachingAllocator):
    """The model from a record's starting state, answered as the record's driver answered; it notes its segment
    events as (action, address, bytes, reserved bytes after)."""

    def __init__(self, settings: AllocatorSettings, start: Start) -> None:
        super().__init__(settings)
        self.events: list[tuple[str, int, int, int]] = []
        self.answers: list[tuple[int, int]] = []  # the record's new segments (bytes, address) for the step replayed
        self.refusals = 0  # the driver refuses this many more requests
        self._next_address = _SYNTHETIC_BASE
        self._held = sorted(start.blocks)
        self.inconsistent: str | None = None  # why the starting state is not one allocator's, where it is not
        for address, size, stream, small in start.segments:
            self._lay(address, address + size, [(address, size)], small, stream, None, start.blocks)
        for small, stream in sorted({(m[3], m[2]) for m in start.mapped}):
            page = SMALL_BUFFER_BYTES if small else settings.large_segment_bytes
            base = start.bases[small, stream]
            runs = [(m[0], m[1]) for m in start.mapped if (m[3], m[2]) == (small, stream)]
            self._lay(base, base + page * _VA_PAGES, runs, small, stream, (base, page), start.blocks)
        self.peak_reserved, self.peak_segments = self.reserved, self.segments

    def _address(self, nbytes: int, small: bool, stream: int, *, expandable: bool) -> int:
        if expandable and self.answers:  # a new address space is mapped from its start on: where the record mapped
            return self.answers[0][1]
        if not expandable and self.answers and self.answers[0][0] == nbytes:
            return self.answers.pop(0)[1]
        return super()._address(nbytes, small, stream, expandable=expandable)

    def serves(self, nbytes: int, stream: int) -> bool:
        """Whether a cached block would serve a request of ``nbytes`` on ``stream`` (``get_free_block``); the cache
        is left as it was."""
        size = round_size(nbytes)
        block = self._cached_block(size, size <= SMALL_SIZE_BYTES, stream)
        if block is not None:
            self._pools[block.small].add(block)
        return block is not None

    def _refused(self, nbytes: int) -> bool:
        if self.refusals > 0:
            self.refusals -= 1
            return True
        return False

    def _traced(self, action: str, address: int, nbytes: int, stream: int) -> None:
        self.events.append((action, address, nbytes, self.reserved))

    def _lay(self, begin: int, end: int, mapped: list[tuple[int, int]], small: bool, stream: int,
             segment: tuple[int, int] | None, held: dict[int, tuple[int, int]]) -> None:
        """Lay the segment ``[begin, end)`` out as blocks: those handed out (``held``: address -> bytes, request)
        within its ``mapped`` ranges, a free block in each gap between them, unmapped pages between the ranges."""
        addresses, whole = self._held, segment is None and not small and not self.settings.expandable_segments
        pieces: list[tuple[int, int, bool, bool]] = []  # from, to, mapped, handed out
        at = begin
        for lo, size in sorted(mapped):
            pieces.append((at, lo, False, False))
            at, hi = lo, lo + size
            inside = addresses[bisect.bisect_left(addresses, lo):bisect.bisect_left(addresses, hi)]
            for address, after in zip(inside, inside[1:] + [hi]):
                block_size = held[address][0]
                if whole and 0 < after - address - block_size <= SMALL_SIZE_BYTES:
                    block_size = after - address  # handed out whole: no free block of 1 MiB or less in this pool
                pieces += [(at, address, True, False), (address, address + block_size, True, True)]
                at = address + block_size
            pieces.append((at, hi, True, False))
            at = hi
        pieces.append((at, end, False, False))
        previous = None
        for lo, hi, is_mapped, handed in pieces:
            if hi < lo:
                self.inconsistent = self.inconsistent or f"blocks at the start overlap at {hi:#x}"
            elif hi > lo:
                previous = self._piece(previous, _Block(lo, hi - lo, small, segment, is_mapped, stream),
                                       held[lo][1] if handed else None)
        self.segments += 1

    def _piece(self, previous: _Block | None, block: _Block, requested: int | None) -> _Block:
        """Put ``block`` after ``previous`` in its segment: handed out (``requested`` bytes), free, or unmapped."""
        block.prev = previous
        if previous is not None:
            previous.next = block
        if not block.mapped:
            self._unmapped[block.small][block.address] = block
            return block
        self.reserved += block.size
        if requested is None:
            self._pools[block.small].add(block)
        else:
            block.allocated, block.requested = True, requested
            self._live[block.address] = block
            self.allocated, self.requested = self.allocated + block.size, self.requested + requested
        return block


@dataclasses.dataclass
class _Tally:
    """One side's count: segments allocated (mapped) and freed (unmapped); reserved bytes now and at the peak."""

    reserved: int
    peak: int
    allocs: int = 0
    frees: int = 0

    def note(self, action: str, reserved: int) -> None:
        self.allocs, self.frees = self.allocs + (action in _UP), self.frees + (action in _DOWN)
        self.reserved, self.peak = reserved, max(self.peak, reserved)

    def summary(self) -> dict:
        return {"segment_allocs": self.allocs, "segment_frees": self.frees, "peak_reserved_bytes": self.peak}


class _DeviceReplay:
    """One device's trace replayed through the model from the state it began in, and held against the record."""

    def __init__(self, record: dict, device: int, settings: AllocatorSettings) -> None:
        traces = record["device_traces"]
        trace = traces[device] if device < len(traces) else {"action": [], "addr": [], "size": [], "stream": []}
        self.device, self.actions, self.addrs = device, trace["action"], trace["addr"]
        self.sizes, self.streams = trace["size"], trace["stream"]
        self.start = rebuild_start(record, device, splits_all=settings.expandable_segments)
        self.model = _Replayer(settings, self.start)
        self.recorded = _Tally(self.model.reserved, self.model.reserved)
        self.replayed = _Tally(self.model.reserved, self.model.reserved)
        self.first_difference: dict | None = None
        self.follows = True  # whether the model's segments are still the record's, address for address
        self.empty_caches = self.failed = self.allocs = self.placed = 0
        self.lost: set[int] = set()  # allocations the model could not make (where the GPU could): freed by no one

    def run(self) -> dict:
        """Replay every event; return what the record and the replay say. Where the record stops making sense to
        the model (a block freed that it does not hold), the replay stops there: the first difference says why."""
        if self.model.inconsistent:
            return self._stop(0, self.model.inconsistent)
        actions, n, i = self.actions, len(self.actions), 0
        while i < n:
            try:
                i = self._run_step(i)
            except (KeyError, ValueError) as exc:
                return self._stop(i, f"{type(exc).__name__}: {exc}")
        return self._result()

    def _run_step(self, i: int) -> int:
        """Replay the segment events from event ``i`` on and the event after them; return the next event's index."""
        actions, n = self.actions, len(self.actions)
        j = i
        while j < n and actions[j] in _UP + _DOWN:
            j += 1
        lead = next((k for k in range(i, j) if actions[k] not in _DOWN), j)  # segments given back come first
        downs, ups = range(i, lead), range(lead, j)
        oom = j < n and actions[j] == "oom"
        refusals = 1 << 30 if oom else 1  # an oom: the driver refuses every request; a retry: the first
        if downs and j < n and (ups and actions[j] == "alloc" or oom) and not self.model.serves(
                self.sizes[j], self.streams[j]):
            self.failed += 1  # an allocation failed, gave the cache back and (unless oom) got a segment
            self._step(j, range(i, j), refusals)
        else:  # a cached block would have served it: what was given back went first, in empty_cache()
            if downs:
                self.empty_caches += 1
                self._step(None, downs, 0)
            if j < n:
                self.failed += oom
                self._step(j, ups, refusals if oom else 0)
            elif ups:
                self._step(None, ups, 0)
        return j + 1

    def _stop(self, k: int, why: str) -> dict:
        """Stop replaying at event ``k`` for ``why``; the record's own figures are counted to its end."""
        self.first_difference = self.first_difference or {
            "device": self.device, "event": k, "action": self.actions[k] if k < len(self.actions) else None,
            "stopped": why}
        for action, nbytes in zip(self.actions[k:], self.sizes[k:]):
            if action in _UP + _DOWN:
                self.recorded.note(action, self.recorded.reserved + (nbytes if action in _UP else -nbytes))
        return self._result()

    def _step(self, k: int | None, recorded: range, refusals: int) -> None:
        """Replay event ``k`` (``None``: ``empty_cache()``) and hold what the model did against the record's segment
        events ``recorded`` before it; the driver refuses ``refusals`` requests first."""
        self.model.events.clear()
        action = self.actions[k] if k is not None else None
        if action is None:
            self.model.release_cached()
        elif action in ("alloc", "oom"):
            self._allocate(k, [u for u in recorded if self.actions[u] in _UP], refusals)
        elif action == "free_completed" and self.addrs[k] not in self.lost:
            self.model.free(self.addrs[k])
        self._compare(recorded, k)

    def _allocate(self, k: int, up: list[int], refusals: int) -> None:
        """Replay the allocation (or ``oom``) at event ``k``: the driver gives the segments of events ``up`` and
        refuses ``refusals`` requests first."""
        model, oom = self.model, False
        model.answers = [(self.sizes[u], self.addrs[u]) for u in up] if self.follows else []
        model.refusals = refusals
        key = self.addrs[k] if self.actions[k] == "alloc" else -1 - k  # an oom's addr is the device's free bytes
        try:
            model.malloc(key, self.sizes[k], stream=self.streams[k])
        except AllocatorOutOfMemory:
            oom = True
        model.answers, model.refusals = [], 0
        if oom != (self.actions[k] == "oom"):  # ran out where the GPU did not, or the other way round
            self._differs(k, None, None, ran_out=oom)
        if oom and self.actions[k] == "alloc":
            self.lost.add(key)
        if not oom and self.actions[k] == "alloc":
            self.allocs += 1
            self.placed += model._live[key].address == key

    def _compare(self, recorded: range, at: int | None) -> None:
        """Hold the model's segment events of one step against the record's (events ``recorded``), then the
        reserved bytes after the step's own event ``at``."""
        events = self.model.events
        for m in range(max(len(recorded), len(events))):
            k = recorded[m] if m < len(recorded) else at if at is not None else recorded[-1]
            ours = events[m] if m < len(events) else None
            theirs = (self.actions[k], self.sizes[k]) if m < len(recorded) else None
            if theirs is not None:
                up = theirs[0] in _UP
                self.recorded.note(theirs[0], self.recorded.reserved + (theirs[1] if up else -theirs[1]))
            if ours is not None:
                self.replayed.note(ours[0], ours[3])
                self.follows = self.follows and theirs == (ours[0], ours[2]) and ours[1] == self.addrs[k]
            self._check(k, theirs, ours and (ours[0], ours[2]))
        if at is not None:
            self._check(at, None, None)

    def _check(self, k: int, theirs: tuple | None, ours: tuple | None) -> None:
        """Note event ``k`` as the first difference where the segment events or the reserved bytes after it differ
        (after a step's own event, ``theirs`` and ``ours`` ``None``: the model's reserved bytes then)."""
        reserved = self.model.reserved if theirs is None and ours is None else self.replayed.reserved
        if theirs != ours or self.recorded.reserved != reserved:
            self._differs(k, theirs, ours)

    def _differs(self, k: int, theirs: tuple | None, ours: tuple | None, *, ran_out: bool | None = None) -> None:
        """Note event ``k`` as the first difference (``ran_out``: whether the model ran out of memory there, where
        the record says the other)."""
        if self.first_difference is None:
            sides = [{"segment_event": list(event) if event else None, "reserved_bytes": reserved}
                     for event, reserved in ((theirs, self.recorded.reserved), (ours, self.model.reserved))]
            if ran_out is not None:
                sides[0]["out_of_memory"], sides[1]["out_of_memory"] = not ran_out, ran_out
            self.first_difference = {"device": self.device, "event": k, "action": self.actions[k],
                                     "recorded": sides[0], "replayed": sides[1]}

    def _result(self) -> dict:
        streams = sorted(set(self.streams) | {s[2] for s in self.start.segments + self.start.mapped})
        self.replayed.peak = max(self.replayed.peak, self.model.peak_reserved)
        return {"device": self.device, "events": len(self.actions), "streams": len(streams),
                "start": {"segments": len(self.start.segments) + len(self.start.mapped),
                          "reserved_bytes": self.start.reserved_bytes, "blocks_held": len(self.start.blocks)},
                "empty_cache_calls": self.empty_caches, "failed_allocations": self.failed,
                "allocs": self.allocs, "allocs_at_recorded_address": self.placed,
                "recorded": self.recorded.summary(), "replayed": self.replayed.summary(),
                "first_difference": self.first_difference}


def replay_record(record: dict) -> dict:
    """Replay a record (:func:`~autotune.meters.memory_snapshot.load_record`) device by device; return what the
    record and the replay say: ``recorded`` and ``replayed`` (``segment_allocs``, ``segment_frees``, summed over
    devices; ``peak_reserved_bytes``, the largest device's), ``first_difference`` (the first event where they
    differ, or ``None``; with ``stopped``, why the replay stopped there: a record no allocator could have made)
    and each device's detail."""
    made_under = record_settings(record)
    settings, unmodelled = made_under.settings, made_under.unmodelled
    devices = sorted({s["device"] for s in record["segments"]}
                     | {d for d, trace in enumerate(record["device_traces"]) if trace["action"]})
    results = [_DeviceReplay(record, device, settings).run() for device in devices]
    both = {side: {"segment_allocs": sum(r[side]["segment_allocs"] for r in results),
                   "segment_frees": sum(r[side]["segment_frees"] for r in results),
                   "peak_reserved_bytes": max([r[side]["peak_reserved_bytes"] for r in results], default=0)}
            for side in ("recorded", "replayed")}
    return {**both, "first_difference": next((r["first_difference"] for r in results if r["first_difference"]), None),
            "events": sum(r["events"] for r in results), "streams": max([r["streams"] for r in results], default=0),
            "settings": dataclasses.asdict(settings), "unmodelled_settings": unmodelled, "devices": results}
