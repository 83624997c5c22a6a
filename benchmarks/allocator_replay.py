"""The caching allocator's model replayed against real GPU records: ``torch.cuda.memory._dump_snapshot()`` files.

    python benchmarks/allocator_replay.py FILE... --json OUT [--md OUT.md] [--sources SOURCES.json]
                                          [--numbers-only DIR]

Each FILE is a memory snapshot (a pickle, read with an unpickler that refuses every class) or a numbers-only record
of one (``.json`` or ``.json.gz``, as ``tests/data/allocator_traces/`` holds). Each is replayed from the state its
recording began in, event by event, through ``autotune/meters/caching_allocator.py``
(:mod:`autotune.meters.allocator_record` says how), and held against the record: each segment allocated and freed
with its size, the reserved bytes after every event, and the peak.

OUT is a JSON list, one object per file: ``file``; ``source`` (the repository, commit and path it was found at:
a record's own, else the entry of ``--sources`` whose git blob hash is the file's); ``recorded`` and ``replayed``,
each with ``segment_allocs``, ``segment_frees`` (expandable segments: maps and unmaps) and ``peak_reserved_bytes``
(over the recording; several devices: the largest device's); ``first_difference`` (the first event where they
differ, or null); and the detail (events, streams, the starting state, ``empty_cache()`` calls, failed allocations,
allocations the model placed at the recorded address, per device). ``--md`` writes a table of it;
``--numbers-only DIR`` writes each file's numbers-only record (no stack frames) to ``DIR/<name>.json.gz``.

A file that cannot be read, is not a snapshot, or whose pickle names a class: one line on stderr, exit 2, and
nothing written. A snapshot the model cannot make sense of is no bad input: its ``first_difference`` says where and
why the replay stopped.

``results/allocator_replay-cpu.json`` replays the snapshots ``benchmarks/allocator_replay_sources.json`` names (by
repository, commit, path and git blob hash), each fetched as ``<owner>/<repo>/<commit[:8]>/<path>``; from there:

    python $CHECKOUT/benchmarks/allocator_replay.py <those files> --json $CHECKOUT/results/allocator_replay-cpu.json \\
        --md $CHECKOUT/results/allocator_replay-cpu.md --sources $CHECKOUT/benchmarks/allocator_replay_sources.json

(about 5 s on 2 cores). ``tests/data/allocator_traces/`` holds ten of them as numbers-only records.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's autotune, not an installed one

from autotune.errors import UsageError  # noqa: E402
from autotune.meters.allocator_record import replay_record  # noqa: E402
from autotune.meters.memory_snapshot import load_record  # noqa: E402

MiB = 1 << 20


def git_blob(path: str) -> str:
    """The git blob hash of a file: how a file found in a repository is named whatever it is called here."""
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def load_sources(path: str | None) -> dict[str, dict]:
    """``--sources``: a JSON list of ``{"repository", "commit", "path", "blob"}``, by blob hash."""
    if not path:
        return {}
    try:
        with open(path) as f:
            entries = json.load(f)
        return {e["blob"]: {k: e[k] for k in ("repository", "commit", "path")} for e in entries}
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"--sources {path}: not a list of repository, commit, path and blob ({exc})") from None


def replay_files(files: list[str], sources: dict[str, dict]) -> tuple[list[dict], list[dict]]:
    """Read every file first (so that a bad one stops the run before anything is written), then replay each;
    return the results and the records."""
    records = []
    for path in files:
        record = load_record(path)
        if record.get("source") is None and sources:
            record["source"] = sources.get(git_blob(path))
        records.append(record)
    results = []
    for path, record in zip(files, records):
        replayed = replay_record(record)
        results.append({"file": path, "source": record.get("source"), **replayed})
        rec, rep, diff = replayed["recorded"], replayed["replayed"], replayed["first_difference"]
        print(f"{path}: {replayed['events']} events, {replayed['streams']} stream(s); segments "
              f"{rec['segment_allocs']}/{rec['segment_frees']} recorded, {rep['segment_allocs']}/"
              f"{rep['segment_frees']} replayed; peak {rec['peak_reserved_bytes']} / {rep['peak_reserved_bytes']} B; "
              + ("the same at every event" if diff is None else f"first differs at event {diff['event']}"), flush=True)
    return results, records


def _where(result: dict) -> str:
    source = result.get("source")
    if not source:
        return f"`{result['file']}`"
    return f"{source['repository']} `{source['path']}` ({source['commit'][:8]})"


def _start(result: dict) -> str:
    devices = result["devices"]
    segments = sum(d["start"]["segments"] for d in devices)
    reserved = sum(d["start"]["reserved_bytes"] for d in devices)
    return "empty" if not segments else f"{segments} segment{'s' * (segments != 1)}, {reserved / MiB:,.0f} MiB"


def _difference(diff: dict | None) -> str:
    if diff is None:
        return "none"
    return f"event {diff['event']}" + (f" (the replay stopped: {diff['stopped']})" if "stopped" in diff else "")


def markdown(results: list[dict], command: str) -> str:
    """The results as a table, one row per file."""
    same = [r for r in results if r["first_difference"] is None]
    lines = [
        "# The caching allocator's model against GPU records", "",
        f"Command: `{command}`.", "",
        "Each file is a memory snapshot a GPU recorded (`torch.cuda.memory._dump_snapshot()`), found in a public "
        "repository. It is replayed from the state its recording began in (rebuilt from the snapshot's segments and "
        "its trace), event by event, through `autotune/meters/caching_allocator.py`, which takes from the record only "
        "what the driver answered: where a new segment lies, which allocations it refused. Segments + / -: "
        "cudaMalloc'd and freed (expandable segments: ranges mapped and unmapped); peaks: the reserved bytes' over the "
        "recording, in MiB (several devices: the largest device's); **placed**: allocations the model made at the "
        "address the GPU's allocator chose.", "",
        f"**{len(same)} of {len(results)} records replay with the same segments and reserved bytes at every event**"
        f" ({sum(r['events'] for r in same):,} events).", "",
        "| record | events | streams | start | `empty_cache` / failed allocs | recorded segments + / - "
        "| replayed segments + / - | recorded peak | replayed peak | placed | first difference |",
        "|---|--:|--:|---|--:|--:|--:|--:|--:|--:|---|"]
    idle = [r for r in results if not any(d["allocs"] for d in r["devices"])]
    for r in (r for r in results if r not in idle):
        devices, rec, rep, diff = r["devices"], r["recorded"], r["replayed"], r["first_difference"]
        allocs = sum(d["allocs"] for d in devices)
        placed = sum(d["allocs_at_recorded_address"] for d in devices)
        lines.append(
            f"| {_where(r)} | {r['events']:,} | {r['streams']} | {_start(r)} | "
            f"{sum(d['empty_cache_calls'] for d in devices)} / {sum(d['failed_allocations'] for d in devices)} | "
            f"{rec['segment_allocs']} / {rec['segment_frees']} | {rep['segment_allocs']} / {rep['segment_frees']} | "
            f"{rec['peak_reserved_bytes'] / MiB:,.0f} | {rep['peak_reserved_bytes'] / MiB:,.0f} | "
            f"{placed:,} of {allocs:,} | {_difference(diff)} |")
    expandable = [r for r in results if r["settings"]["expandable_segments"]]
    if idle:
        lines += ["", f"Not in the table: {len(idle)} snapshot(s) whose trace allocates nothing (empty, or a lone "
                  f"free), the same replayed as recorded: " + ", ".join(_where(r) for r in idle) + "."]
    lines += ["", f"Records with several streams: {sum(r['streams'] > 1 for r in results)}; with expandable segments: "
              f"{len(expandable)}; several devices: {sum(len(r['devices']) > 1 for r in results)}. Settings the model "
              "does not follow: " + (", ".join(sorted({s for r in results for s in r['unmodelled_settings']}))
                                     or "none set") + "."]
    return "\n".join(lines) + "\n"


def _shown(path: str) -> str:
    """``path`` as the command is shown: from the repository's root where it lies inside."""
    relative = os.path.relpath(os.path.abspath(path), ROOT)
    return path if relative.startswith("..") else relative


def _write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = path + ".partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", metavar="FILE", help="memory snapshots, or numbers-only records of them")
    parser.add_argument("--json", metavar="OUT", help="write the results here (a JSON list, one object per file)")
    parser.add_argument("--md", metavar="OUT", help="write a table of the results here")
    parser.add_argument("--sources", metavar="JSON", help="where the files were found, matched by git blob hash")
    parser.add_argument("--numbers-only", metavar="DIR", help="write each file's numbers-only record here")
    args = parser.parse_args(argv)
    try:
        results, records = replay_files(args.files, load_sources(args.sources))
    except UsageError as exc:
        print(f"allocator_replay: {exc}", file=sys.stderr)
        return 2
    files = " ".join(args.files) if len(args.files) <= 3 else f"<{len(args.files)} files>"
    options = [f"--{k.replace('_', '-')} {_shown(v)}" for k, v in vars(args).items() if k != "files" and v]
    command = " ".join(["python benchmarks/allocator_replay.py", files, *options])
    if args.json:
        _write(args.json, json.dumps(results, indent=1) + "\n")
    if args.md:
        _write(args.md, markdown(results, command))
    for path, record in zip(args.files, records) if args.numbers_only else ():
        os.makedirs(args.numbers_only, exist_ok=True)
        data = gzip.compress(json.dumps(record, separators=(",", ":")).encode(), mtime=0)  # the same bytes each time
        with open(os.path.join(args.numbers_only, os.path.basename(path).split(".")[0] + ".json.gz"), "wb") as f:
            f.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
