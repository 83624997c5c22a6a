"""Published memory figures, reproduced by a dry run on this CPU: one row per figure a project published.

    python benchmarks/published.py                   # every row; writes results/published-cpu.{json,md}
    python benchmarks/published.py --check           # each row's arguments parsed by autotune's parser; nothing run
    python benchmarks/published.py --only ID[,ID]    # those rows (the files then hold only them)
    python benchmarks/published.py --only ID --merge # those rows again, every other row's result kept from the files
    python benchmarks/published.py --rows FILE       # rows from a JSON list instead (the fields of :class:`Row`)

A row is data (:data:`ROWS`): where the figure was published, the configuration measured, which statistic it is
(:data:`STATISTICS`: what torch or NVML reported, and the report field a dry run predicts it in), the figure as
printed with its unit, and either the autotune arguments that express the configuration or why none can. Each
expressible row runs ``python -m autotune ARGS --dry-run`` in a process that sees no GPU, reads the statistic from
the report's trial and writes ``predicted / published - 1`` as its error. Every row's arguments are parsed by
autotune's own parser before anything runs: a row naming an option that does not exist is one line and exit 2.

The rows are in ``benchmarks/published_rows.py``, the models they name in ``benchmarks/published_models.py`` and
``benchmarks/litgpt_models.py``. About 10 minutes on 2 cores (the Llama 3 8B and Llama 2 7B rows take most of it:
their processes stay under 1 GiB).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from autotune.cli.parser import build_parser, options_from  # noqa: E402 - after the repository root is importable
from autotune.errors import AutotuneError  # noqa: E402
from autotune.units import format_bytes  # noqa: E402
from autotune.vocabulary import Status  # noqa: E402

from benchmarks.published_rows import ROWS, STATISTICS, UNITS, Row, Statistic  # noqa: E402,F401 - the table's

COMMAND = "python benchmarks/published.py"


class RowError(Exception):
    """A row that cannot be run as written: one line, exit 2."""


CLI_ADDS = ("--dry-run", "--out", "--quiet")  # what this script adds to each row's arguments


# -- checking and running ---------------------------------------------------------------------------------------------


def check(rows: tuple[Row, ...]) -> None:
    """Raise :class:`RowError` for the first row that cannot run as written: an unknown statistic or unit, neither
    arguments nor a reason, or arguments autotune's parser refuses (an option that does not exist, a bad value)."""
    seen = set()
    for row in rows:
        if row.id in seen:
            raise RowError(f"row {row.id}: a second row has this id")
        seen.add(row.id)
        if row.statistic not in STATISTICS:
            raise RowError(f"row {row.id}: statistic {row.statistic!r} is not one of {', '.join(STATISTICS)}")
        if row.unit not in UNITS:
            raise RowError(f"row {row.id}: unit {row.unit!r} is not one of {', '.join(UNITS)}")
        if (row.published is None) != row.ran_out or (row.ran_out and row.args is None):
            raise RowError(f"row {row.id}: a figure, or ran_out (the source's OOM) with the arguments that predict it")
        if (row.args is None) == (row.why_not is None):
            raise RowError(f"row {row.id}: give either the arguments that express it or why none can, not "
                           f"{'both' if row.args is not None else 'neither'}")
        if row.args is not None:
            _parse(row)


def _parse(row: Row) -> None:
    """Parse the row's arguments as ``python -m autotune`` would, with the flags this script adds, into its options."""
    added = [a for a in row.args if a.split("=")[0] in CLI_ADDS]
    if added:
        raise RowError(f"row {row.id}: {added[0]} is added by {COMMAND}: leave it out of the row")
    parser = build_parser()

    def refuse(message: str) -> None:
        raise RowError(f"row {row.id}: autotune refuses its arguments: {message}")

    parser.error = refuse  # one line, ours, instead of argparse's usage and exit
    try:
        options_from(parser.parse_args([*row.args, "--dry-run", "--quiet", "--out", "x.json"]))
    except AutotuneError as exc:  # a value the options refuse (a precision, a size, a combination)
        refuse(str(exc))


def predict(row: Row, folder: str) -> dict[str, Any]:
    """Run the row's dry run in a process that sees no GPU; return the report's trial and the wall seconds."""
    out = os.path.join(folder, f"{row.id}.json")
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "autotune", *row.args, "--dry-run", "--quiet", "--out", out],
                          cwd=ROOT, env=env, text=True, capture_output=True)
    said = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode == 2:
        raise RowError(f"row {row.id}: {said[-1] if said else 'autotune exited 2'}")
    if done.returncode not in (0, 3) or not os.path.exists(out):
        raise RuntimeError(f"row {row.id}: autotune exited {done.returncode}: {said[-1] if said else ''}")
    with open(out) as f:
        trials = json.load(f)["trials"]
    return {"trial": trials[0], "seconds": round(time.monotonic() - started, 1)}


def result(row: Row, predicted: dict[str, Any] | None) -> dict[str, Any]:
    """Return the row as the JSON keeps it: the issue's keys first, then what the table and a reader need."""
    statistic = STATISTICS[row.statistic]
    trial = predicted["trial"] if predicted else None
    value = trial.get(statistic.field) if trial else None
    if value is not None and statistic.kind == "per_s":
        value = round(value * row.per_sample, 2)
    published = row.published if statistic.kind == "per_s" else row.published_bytes  # a throughput is not rounded
    return {"source": row.source, "config": row.config, "statistic": row.statistic,
            f"published_{statistic.kind}": published, f"predicted_{statistic.kind}": value,
            "error": None if value is None or published is None else round(value / published - 1, 4),
            "command": row.command, "id": row.id, "where": row.where,
            "published": "OOM" if row.ran_out else f"{row.published:g} {row.unit}", "unit": row.unit,
            "statistic_says": statistic.says, "expressed": row.args is not None, "why_not": row.why_not,
            "note": row.note, "published_status": Status.OOM if row.ran_out else Status.OK,
            "status": trial["status"] if trial else None,  # the prediction's: ok, or oom past the budget
            "predicted_s": predicted["seconds"] if predicted else None}


# -- the files --------------------------------------------------------------------------------------------------------


def _percent(error: float | None) -> str:
    return "-" if error is None else f"{error * 100:+.1f}%"


def _figure(value: int | None, unit: str) -> str:
    """Write bytes in the unit the source printed (MiB whole, GiB to a hundredth), then exactly."""
    if value is None:
        return "-"
    return f"{value / UNITS[unit]:,.{0 if unit == 'MiB' else 2}f} {unit} ({value:,} B)"


def _predicted(r: dict[str, Any]) -> str:
    """The predicted column: the figure, or the prediction's out of memory where it ran past the budget."""
    if not r["expressed"]:
        return "not expressed"
    if STATISTICS[r["statistic"]].kind == "per_s":
        return "-" if r["predicted_per_s"] is None else f"{r['predicted_per_s']:,.1f} {r['unit']}"
    figure = _figure(r["predicted_bytes"], r["unit"])
    return f"OOM (needs {figure})" if r["status"] == Status.OOM else figure


def _outcomes(rows: list[dict[str, Any]]) -> str:
    """``, and the N that ran out of memory are predicted to (M of them)`` for the rows published as OOM."""
    oom = [r for r in rows if r.get("published_status") == Status.OOM and r["expressed"]]
    if not oom:
        return ""
    agree = sum(r["status"] == Status.OOM for r in oom)
    return f"; of the {len(oom)} that ran out of memory, {agree} {'is' if agree == 1 else 'are'} predicted to"


def markdown(data: dict[str, Any]) -> str:
    """Return the Markdown file, generated from the JSON's rows."""
    rows = data["rows"]
    expressed = [r for r in rows if r["expressed"]]
    said = []
    for kind, what in (("bytes", "memory"), ("per_s", "throughput")):
        errors = [abs(r["error"]) for r in expressed if r["error"] is not None and f"predicted_{kind}" in r]
        if errors:
            said.append(f"the {len(errors)} {what} rows each within {max(errors) * 100:.1f}% of the published figure")
    lines = [f"# Published memory and throughput figures, predicted by a dry run ({data['environment']['machine']}, "
             f"torch {data['environment']['torch']})", "",
             f"Command: `{data['command']}`. Each row a project published; the ones autotune's options express are "
             "predicted by `python -m autotune ... --dry-run` in a process that sees no GPU: predictions, not "
             f"measurements. {len(rows)} rows, {len(expressed)} expressed" + (f": {'; '.join(said)}" if said else "")
             + _outcomes(rows) + ".", "",
             "| row | source | statistic | published | predicted | error |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        url = r["source"].split(" ")[0]
        error = _percent(r["error"]) if r.get("published_status") != Status.OOM or not r["expressed"] else (
            "agrees" if r["status"] == Status.OOM else "disagrees")
        lines.append(f"| {r['id']} | [{r['where']}]({url}) | {r['statistic']} | {r['published']} | {_predicted(r)} | "
                     f"{error} |")
    lines += ["", "Statistics: " + "; ".join(f"**{name}**, {s.says}" for name, s in STATISTICS.items()
                                             if any(r["statistic"] == name for r in rows)) + ".", ""]
    for source in dict.fromkeys(r["source"] for r in rows):
        lines += [f"**{source}**", ""]
        for r in (r for r in rows if r["source"] == source):
            said = (f"`{r['command']}` ({r['predicted_s']} s){'; ' + r['note'] if r['note'] else ''}" if r["expressed"]
                    else f"not expressed: {r['why_not']}")
            lines.append(f"- {r['id']} ({r['where']}): {r['config']}. {said}.")
        lines.append("")
    return "\n".join(lines)


def _rows_from(path: str) -> tuple[Row, ...]:
    """Read rows from a JSON list of objects with :class:`Row`'s fields."""
    names = {f.name for f in dataclasses.fields(Row)}
    try:
        with open(path) as f:
            items = json.load(f)
    except (OSError, ValueError) as exc:
        raise RowError(f"--rows {path}: {exc}") from None
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise RowError(f"--rows {path}: not a JSON list of rows (objects with the fields {', '.join(sorted(names))})")
    rows = []
    for item in items:
        unknown = sorted(set(item) - names)
        if unknown:
            raise RowError(f"row {item.get('id', '?')}: unknown field {unknown[0]} (a row has "
                           f"{', '.join(sorted(names))})")
        try:
            rows.append(Row(**{**item, "args": None if item.get("args") is None else tuple(item["args"])}))
        except TypeError as exc:
            raise RowError(f"row {item.get('id', '?')}: {exc}") from None
    return tuple(rows)


def _kept(rows: tuple[Row, ...], wanted: set[str], out_dir: str) -> dict[str, dict[str, Any]]:
    """``--merge``: the results of the rows not in ``wanted``, read from the file in ``out_dir``, by id; a row the file
    lacks is one line (run it with ``--only``)."""
    path = os.path.join(out_dir, "published-cpu.json")
    try:
        with open(path) as f:
            kept = {r["id"]: r for r in json.load(f)["rows"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RowError(f"--merge: cannot read the rows of {path}: {exc}") from None
    absent = [r.id for r in rows if r.id not in wanted and r.id not in kept]
    if absent:
        raise RowError(f"--merge: {path} has no row {absent[0]}: add it to --only")
    return {r.id: kept[r.id] for r in rows if r.id not in wanted}


def run(rows: tuple[Row, ...], out_dir: str, reports: str | None,
        kept: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Predict every expressible row (identical arguments once) but those ``kept`` (their results as the file had
    them), write the JSON and the Markdown; return the data."""
    import torch

    done: dict[tuple[str, ...], dict[str, Any]] = {}
    kept = kept or {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = reports or scratch
        os.makedirs(folder, exist_ok=True)
        results = []
        for row in rows:
            if row.id in kept:  # in this version's keys (a file written before a key was added lacks it)
                results.append({**result(row, None), **kept[row.id]})
                continue
            if row.args is not None and row.args not in done:
                done[row.args] = predict(row, folder)
            results.append(result(row, done.get(row.args) if row.args is not None else None))
            print(json.dumps({k: v for k, v in results[-1].items() if k in ("id", "error") or k.startswith("p")
                              and k.endswith(("_bytes", "_per_s"))}), flush=True)
    data = {"command": COMMAND, "environment": {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
                                                "torch": torch.__version__}, "rows": results}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "published-cpu.json"), "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    with open(os.path.join(out_dir, "published-cpu.md"), "w") as f:
        f.write(markdown(data))
    return data


def main(argv: list[str] | None = None) -> int:
    """Check the rows, then predict them and write the files; a bad row is one line and exit 2."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "results"), help="where published-cpu.{json,md} go")
    parser.add_argument("--rows", help="a JSON list of rows to run instead of the table's")
    parser.add_argument("--only", help="comma-separated row ids")
    parser.add_argument("--check", action="store_true", help="parse every row's arguments; run nothing")
    parser.add_argument("--merge", action="store_true", help="with --only: keep every other row's result from the "
                        "files in --out, and write them all")
    parser.add_argument("--reports", help="keep each row's dry-run report in this folder")
    args = parser.parse_args(argv)
    try:
        rows = _rows_from(args.rows) if args.rows else ROWS
        kept = None
        if args.merge and not args.only:
            raise RowError("--merge keeps the rows --only does not name: give --only")
        if args.only:
            wanted = args.only.split(",")
            missing = [i for i in wanted if i not in {r.id for r in rows}]
            if missing:
                raise RowError(f"--only: no row {missing[0]}")
            kept = _kept(rows, set(wanted), args.out) if args.merge else None
            rows = rows if args.merge else tuple(r for r in rows if r.id in wanted)
        check(tuple(r for r in rows if kept is None or r.id not in kept))
        if not args.check:
            run(rows, args.out, args.reports, kept)
    except RowError as exc:
        print(f"published.py: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a dry run that failed for another reason than its input
        print(f"published.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
