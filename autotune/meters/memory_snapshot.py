"""A CUDA memory snapshot read safely, as numbers: the segments at its end and the trace of allocator events before.

``torch.cuda.memory._dump_snapshot()`` pickles plain dicts, lists, strings and numbers: the segments the caching
allocator held when it was taken, each with its blocks, and per device the trace of ``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``, ``segment_free`` (``segment_map``, ``segment_unmap`` for expandable
segments) and ``oom`` events recorded since ``_record_memory_history()``. A pickle can run any code it names, so
:func:`load_record` unpickles with an unpickler that refuses every class: a snapshot names none. A file someone
hands us is data.

:func:`numbers_only` keeps what a replay needs and nothing of the stack frames (which name others' files): the
record, a JSON-able dict, is what ``tests/data/allocator_traces/`` holds, and :func:`load_record` reads it back
(plain or gzipped JSON) as it reads a pickle. Torch-free.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import zlib
from typing import Any

from autotune.errors import UsageError

__all__ = ["load_record", "numbers_only", "BLOCK_STATES", "FORMAT"]

FORMAT = "autotune.memory_record/1"  # the numbers-only form's name, in its "format" key
# A block's state in a snapshot: handed out; freed but waiting for another stream's work (record_stream); free.
# A replay counts every state but the last as handed out.
BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")
_SEGMENT_KEYS = ("device", "address", "total_size", "stream", "segment_type", "is_expandable")
_EVENT_KEYS = ("action", "addr", "size", "stream")


class _Refused(Exception):
    """A pickle named a class: ``module.name``."""


class _PlainUnpickler(pickle.Unpickler):
    """Unpickle plain containers and numbers only: every class a pickle names is refused, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")


def load_record(path: str) -> dict:
    """Read a snapshot pickle, or a numbers-only record (JSON, gzipped or not), as a numbers-only record.

    Raises :class:`~autotune.errors.UsageError` (one line) for a file that cannot be read, that is not a snapshot,
    or whose pickle names a class: it is then not unpickled any further."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise UsageError(f"{path}: not a memory snapshot (a broken gzip file: {exc})") from None
    if data.lstrip()[:1] == b"{":
        try:
            record = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise UsageError(f"{path}: not a memory snapshot (JSON that does not parse: {exc})") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise UsageError(f"{path}: not a memory snapshot (JSON, but not a record with format {FORMAT!r})")
        return _checked(record, path)
    try:
        snapshot = _PlainUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise UsageError(f"{path}: the pickle names {exc}; a memory snapshot names no class, so it is not "
                         "unpickled") from None
    except Exception as exc:  # noqa: BLE001 - whatever a malformed pickle raises, the file is not a snapshot
        raise UsageError(f"{path}: not a memory snapshot (not a pickle: {type(exc).__name__}: {exc})") from None
    return numbers_only(snapshot, path=path)


def numbers_only(snapshot: Any, *, path: str = "snapshot", source: dict | None = None) -> dict:
    """Return a snapshot's numbers: segments with their blocks, per device the events (columns ``action``,
    ``addr``, ``size``, ``stream``), and ``allocator_settings``; no stack frames. ``source`` (where the snapshot
    came from) is kept as given. Raises :class:`~autotune.errors.UsageError` where ``snapshot`` is not one."""
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments"), list):
        raise UsageError(f"{path}: not a memory snapshot (torch.cuda.memory._snapshot() is a dict with 'segments' "
                         f"and 'device_traces'; this is a {type(snapshot).__name__}"
                         f"{' without segments' if isinstance(snapshot, dict) else ''})")
    try:
        segments = [_segment(s) for s in snapshot["segments"]]
        traces = [{key: [_event_field(e, key) for e in trace] for key in _EVENT_KEYS}
                  for trace in snapshot.get("device_traces") or []]
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise UsageError(f"{path}: not a memory snapshot (a segment or event without its numbers: "
                         f"{type(exc).__name__}: {exc})") from None
    settings = snapshot.get("allocator_settings")
    record = {"format": FORMAT, "source": source,
              "allocator_settings": _plain(settings) if isinstance(settings, dict) else None,
              "segments": segments, "device_traces": traces}
    return _checked(record, path)


def _segment(segment: dict) -> dict:
    """A segment's numbers, its blocks as ``[size, requested_size, state]`` from its address on."""
    out = {key: segment.get(key) for key in _SEGMENT_KEYS}
    out["device"] = int(out["device"] or 0)
    out["stream"] = int(out["stream"] or 0)
    out["is_expandable"] = bool(out["is_expandable"])
    address = out["address"] = int(segment["address"])
    out["total_size"] = int(segment["total_size"])
    if out["segment_type"] not in ("small", "large"):  # where an old torch did not say: only small ones are 2 MiB
        out["segment_type"] = "small" if out["total_size"] == 2 << 20 and not out["is_expandable"] else "large"
    blocks = []
    for block in segment["blocks"]:
        if "address" in block and int(block["address"]) != address:
            raise ValueError(f"blocks of the segment at {segment['address']:#x} do not follow each other")
        blocks.append([int(block["size"]), int(block.get("requested_size", block["size"])), str(block["state"])])
        address += int(block["size"])
    out["blocks"] = blocks
    return out


def _event_field(event: dict, key: str) -> Any:
    """One number (the action: its name) of a trace event; ``stream`` is 0 where an old torch did not record it,
    ``addr`` where the event has none (``oom`` records the device's free bytes instead)."""
    if key == "action":
        return str(event["action"])
    return int(event.get(key) or 0) if key in ("stream", "addr") else int(event[key])


def _plain(value: Any) -> Any:
    """``value`` with what JSON holds: tuples as lists, keys as strings."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def _checked(record: dict, path: str) -> dict:
    """``record`` where its shape is a record's: segments, traces of equal columns, known block states."""
    traces, segments = record.get("device_traces"), record.get("segments")
    try:
        problem = _problem(segments, traces)
    except (TypeError, KeyError, IndexError, AttributeError) as exc:
        problem = f"a segment or trace without its numbers: {type(exc).__name__}: {exc}"
    if problem:
        raise UsageError(f"{path}: not a memory snapshot ({problem})")
    return record


def _problem(segments: Any, traces: Any) -> str | None:
    """What makes these not a record's segments and traces, or ``None``."""
    problem = None
    if not isinstance(segments, list) or not isinstance(traces, list):
        problem = "no segments or no device traces"
    elif any(not isinstance(t, dict) or len({len(t.get(k) or ()) for k in _EVENT_KEYS}) != 1 for t in traces):
        problem = "a device trace whose columns differ in length"
    elif any(not isinstance(b[2], str) for s in segments for b in s["blocks"]):
        problem = "a block without a state"
    elif any(s["segment_type"] not in ("small", "large") or s["total_size"] != sum(b[0] for b in s["blocks"])
             for s in segments):
        problem = "a segment whose blocks do not add up to it, or that is neither small nor large"
    return problem
