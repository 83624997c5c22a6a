"""The state a memory snapshot's recording began in, rebuilt from the snapshot's end and its trace.

A recording rarely begins on an empty allocator: ``_record_memory_history()`` is called once the model is on the
GPU, or the trace kept only its last events (``max_entries``). What the allocator held then follows from what it
holds at the end and what the trace did in between:

- **Segments**: the final ones less those the trace allocated, plus those it freed, walked back from the end; for
  expandable segments the pages mapped at the end less those the trace mapped, plus those it unmapped, each mapped
  range given the pool and stream of the nearest segment or event whose pool and stream are known.
- **Handed-out blocks**: those the trace frees without having allocated them (as large as their rounded request;
  the replay widens one handed out whole), and those handed out at the end that the trace never allocated (their
  sizes are the snapshot's). Everything else in a segment was free: free neighbours are always merged.

Torch-free.
"""

from __future__ import annotations

import bisect
import dataclasses

from autotune.meters.caching_allocator import LARGE_BUFFER_BYTES, SMALL_BUFFER_BYTES, SMALL_SIZE_BYTES, round_size

__all__ = ["Start", "rebuild_start"]

_UNIT = SMALL_BUFFER_BYTES  # every expandable page, small (2 MiB) or large (20 MiB), is whole 2 MiB units


@dataclasses.dataclass(frozen=True)
class Start:
    """One device's allocator when the recording began; addresses and sizes in bytes."""

    segments: list[tuple[int, int, int, bool]]  # cudaMalloc'd segments: (address, bytes, stream, small pool)
    mapped: list[tuple[int, int, int, bool]]  # expandable segments' mapped ranges: (address, bytes, stream, small)
    bases: dict[tuple[bool, int], int]  # expandable: (small pool, stream) -> the lowest address its pages were seen at
    blocks: dict[int, tuple[int, int]]  # handed out: address -> (bytes, bytes requested)

    reserved_bytes = property(lambda self: sum(s[1] for s in self.segments) + sum(m[1] for m in self.mapped))


def rebuild_start(record: dict, device: int, *, splits_all: bool = False) -> Start:
    """Return the state ``device``'s allocator was in when the record's trace began. ``splits_all``: the allocator
    split every block where 512 bytes were left (``expandable_segments`` on), so no block was handed out whole."""
    traces = record["device_traces"]
    trace = traces[device] if device < len(traces) else {"action": [], "addr": [], "size": [], "stream": []}
    final = [s for s in record["segments"] if s["device"] == device]
    segments = {s["address"]: (s["total_size"], s["stream"], s["segment_type"] == "small")
                for s in final if not s["is_expandable"]}
    pages = {page for s in final if s["is_expandable"] for page in _units(s["address"], s["total_size"])}
    events = list(zip(trace["action"], trace["addr"], trace["size"], trace["stream"]))
    for action, address, size, stream in reversed(events):
        if action == "segment_alloc":
            segments.pop(address, None)
        elif action == "segment_free":
            segments[address] = (size, stream, size == SMALL_BUFFER_BYTES)  # only the small pool's are 2 MiB
        elif action == "segment_map":
            pages.difference_update(_units(address, size))
        elif action == "segment_unmap":
            pages.update(_units(address, size))
    known = sorted([(s["address"], s["stream"], s["segment_type"] == "small") for s in final if s["is_expandable"]]
                   + [(a, st, s == SMALL_BUFFER_BYTES or s % LARGE_BUFFER_BYTES != 0)
                      for action, a, s, st in events if action in ("segment_map", "segment_unmap")])
    mapped = [(address, size, *_nearest(known, address)) for address, size in _runs(pages)]
    bases: dict[tuple[bool, int], int] = {}
    for address, stream, small in known + [(m[0], m[2], m[3]) for m in mapped]:
        bases[small, stream] = min(address, bases.get((small, stream), address))
    start = sorted((a, *rest) for a, rest in segments.items())
    held = _held(final, events)
    blocks = {a: (size, requested) for a, (size, requested, _) in held.items()} if splits_all else _widened(
        held, start, events)
    return Start(segments=start, mapped=mapped, bases=bases, blocks=blocks)


def _held(final: list[dict], events: list[tuple[str, int, int, int]]) -> dict[int, tuple[int, int, int | None]]:
    """The blocks handed out when the trace began: address -> (bytes, bytes requested, the event that frees it:
    ``None`` for a block still handed out at the end, whose bytes are the snapshot's)."""
    live: set[int] = set()  # handed out by the trace, not yet freed
    held: dict[int, tuple[int, int]] = {}
    for k, (action, address, size, _) in enumerate(events):
        if action == "alloc":
            live.add(address)
        elif action in ("free_requested", "free_completed"):
            if address not in live:
                held.setdefault(address, (round_size(size), size, k))  # the event names the request, not the block
            elif action == "free_completed":
                live.discard(address)
    for segment in final:
        address = segment["address"]
        for size, requested, state in segment["blocks"]:
            if state != "inactive" and address not in live:
                held[address] = (size, requested, None)
            address += size
    return held


def _widened(held: dict[int, tuple[int, int, int | None]], segments: list[tuple[int, int, int, bool]],
             events: list[tuple[str, int, int, int]]) -> dict[int, tuple[int, int]]:
    """``held`` as address -> (bytes, bytes requested), a large block that was handed out whole as large as it was.

    A block of the large pool of cudaMalloc'd segments is not split where less than 1 MiB would be left
    (``should_split``), so a block freed during the trace may be up to 1 MiB larger than its rounded request. An
    allocation is always made at a free block's start, and no block of that pool is 1 MiB or smaller: so an
    allocation within 1 MiB past the rounded end, in the same segment while the block is held, begins where the
    block ends."""
    bases = [s[0] for s in segments]
    windows = {}  # the rounded end -> the block's address, the event that frees it, its segment's end
    for address, (size, _, freed) in held.items():
        segment = segments[bisect.bisect_right(bases, address) - 1] if bases and bases[0] <= address else None
        if freed is not None and size > SMALL_SIZE_BYTES and segment and not segment[3]:
            windows[address + size] = (address, freed, segment[0] + segment[1])
    ends = sorted(windows)
    sizes = {address: (size, requested) for address, (size, requested, _) in held.items()}
    for k, (action, address, _, _) in enumerate(events):
        i = bisect.bisect_left(ends, address) - 1  # the nearest rounded end below the allocation
        if action == "alloc" and i >= 0 and address - ends[i] <= SMALL_SIZE_BYTES:
            block, freed, segment_end = windows[ends[i]]
            if k < freed and address < segment_end:
                sizes[block] = (address - block, sizes[block][1])
    return sizes


def _units(address: int, size: int) -> range:
    return range(address, address + size, _UNIT)


def _runs(pages: set[int]) -> list[tuple[int, int]]:
    """The mapped ranges ``(address, bytes)`` that a set of 2 MiB units makes."""
    runs: list[list[int]] = []
    for page in sorted(pages):
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1][1] += _UNIT
        else:
            runs.append([page, _UNIT])
    return [(a, s) for a, s in runs]


def _nearest(known: list[tuple[int, int, bool]], address: int) -> tuple[int, bool]:
    """The (stream, small pool) of the known segment or event nearest ``address``."""
    _, stream, small = min(known, key=lambda k: abs(k[0] - address))
    return stream, small
