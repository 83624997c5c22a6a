"""Parallel workers on one study while CPU-bound processes compete for the cores.

    python benchmarks/workers_under_load.py [--runs 10] [--workers 2,3] [--strategies grid,auto]
                                            [--hogs 3] [--storage sqlite] [--out results]

For each strategy and worker count, starts that many workers at once, each of which runs
``python -m autotune``'s ``main`` on a fresh study ``--runs`` times in a row (one process per worker
for all runs: a run costs its trials, not an interpreter's start), beside ``--hogs`` processes that
spin on the CPU. Each run is checked as a user would: every worker's exit code is 0, no
configuration is measured twice as the same kind of trial (memory, timing, a near tie's second
timing), the workers' reports agree, and the trials that measured nothing (claims lost, abandoned)
are counted. Prints a table of those counts; ``--out`` writes it as
``workers_under_load-cpu.{json,md}``. ``tests/test_workers_under_load.py`` runs the same cases.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = '{"n_layer": 2, "block_size": 16, "n_embd": 16, "n_head": 2, "vocab_size": 32}'
# 16 configurations of short trials; under 320,000 bytes segments 0 fits batch 4 and segments 2 batch 8.
SEARCH = ["--model", "autotune.examples:TinyGPT", "--model-kwargs", TINY, "--device", "cpu", "--budget", "320000",
          "--precisions", "fp32,bf16", "--segments", "0,2", "--batch-sizes", "1..8", "--warmup-steps", "1",
          "--measure-steps", "2", "--isolation", "none", "--no-probe", "--quiet"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1")


@contextlib.contextmanager
def cpu_hogs(n: int) -> Iterator[list[subprocess.Popen]]:
    """``n`` processes that spin on the CPU until the block ends."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def storage_url(kind: str, folder: str, postgres: str | None = None) -> str:
    return {"sqlite": f"sqlite:///{folder}/load.db", "journal": f"journal://{folder}/load.log"}.get(kind) or postgres


def start_workers(n: int, *, strategy: str, runs: int, storage: str, prefix: str, folder: str,
                  track: list | None = None) -> list[subprocess.Popen]:
    """Start ``n`` worker processes, each running the search on studies ``PREFIX-0`` .. ``PREFIX-(runs-1)``."""
    procs = []
    for w in range(n):
        argv = [*SEARCH, "--strategy", strategy, "--storage", storage]
        command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(
            {"argv": argv, "prefix": prefix, "runs": runs, "out": os.path.join(folder, f"w{w}")})]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        procs.append(proc)
        if track is not None:
            track.append(proc)
    return procs


def check_run(storage: str, study: str, reports: list[dict]) -> dict:
    """What one run left in the store and what its workers reported: duplicates, idle trials, agreement."""
    import optuna

    import autotune.search.store

    trials = optuna.load_study(study_name=study, storage=autotune.search.store.make_storage(storage)).get_trials(deepcopy=False)
    measured = [t for t in trials if "measurement" in t.user_attrs]
    differences = _differences(reports)
    kinds = [(tuple(sorted(t.params.items())), t.user_attrs["figures"], t.user_attrs["measurement"]["timings"])
             for t in measured]
    return {
        "trials": len(trials),
        "measured": len(measured),
        "duplicates": len(kinds) - len(set(kinds)),
        "idle": sum(1 for t in trials if "measurement" not in t.user_attrs),  # claims lost, abandoned
        "running": sum(1 for t in trials if t.state == optuna.trial.TrialState.RUNNING),
        "differences": differences,
        "agree": not differences,
    }


def _differences(reports: list[dict]) -> list[str]:
    """Where the workers' reports differ from the first one's: a trial's fields, or the recommendation (none: they agree,
    trials being one per configuration in the space's order)."""
    def key(t: dict) -> tuple:
        return t["precision"], t["segments"], t["batch_size"]

    first = {key(t): t for t in reports[0]["trials"]}
    said = []
    for w, report in enumerate(reports[1:], 1):
        trials = {key(t): t for t in report["trials"]}
        for k in sorted(first.keys() | trials.keys(), key=str):
            a, b = first.get(k), trials.get(k)
            if a != b:
                fields = sorted(f for f in (a or {}).keys() | (b or {}).keys() if (a or {}).get(f) != (b or {}).get(f))
                said.append(f"worker {w}: {k}: {fields if a and b else 'only in one report'}")
        if report["recommendation"] != reports[0]["recommendation"]:
            said.append(f"worker {w}: recommendation")
    return said


def run_case(*, strategy: str, workers: int, runs: int, storage_kind: str, folder: str, postgres: str | None = None,
             track: list | None = None, timeout_s: float = 900) -> tuple[list[dict], list[str]]:
    """Run one case (``runs`` studies, ``workers`` workers each); return one check per run, and what workers
    wrote on stderr."""
    storage = storage_url(storage_kind, folder, postgres)
    prefix = f"load-{strategy}-{workers}-{os.getpid()}-{time.time_ns()}"  # a server keeps its studies between runs
    procs = start_workers(workers, strategy=strategy, runs=runs, storage=storage, prefix=prefix, folder=folder,
                          track=track)
    codes, errors = [], []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout_s)
        lines = out.strip().splitlines()
        codes.append(json.loads(lines[-1]) if proc.returncode == 0 and lines else [proc.returncode] * runs)
        errors.append(err)
    checks = []
    for i in range(runs):
        study = f"{prefix}-{i}"
        reports = []
        for w in range(workers):
            path = os.path.join(folder, f"w{w}-{study}.json")
            if os.path.exists(path):
                with open(path) as f:
                    reports.append(json.load(f))
        check = check_run(storage, study, reports) if len(reports) == workers else {"agree": False}
        checks.append({"run": i, "codes": [c[i] for c in codes], **check})
    return checks, [e for e in errors if e.strip()]


def _worker(spec: dict) -> None:
    """One worker: the CLI's main on each study in turn; prints the runs' exit codes as JSON (its errors on stderr)."""
    from autotune.__main__ import main

    codes = [main([*spec["argv"], "--study", f"{spec['prefix']}-{i}", "--out", f"{spec['out']}-{spec['prefix']}-{i}.json"])
             for i in range(spec["runs"])]
    print(json.dumps(codes))


def table(rows: list[dict]) -> str:
    lines = ["| strategy | workers | runs | workers' exit codes not 0 | duplicates | runs that disagree | "
             "trials measured (median) | idle trials per run: median | max |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        checks = r["checks"]
        idle = sorted(c.get("idle", 0) for c in checks)
        measured = sorted(c.get("measured", 0) for c in checks)
        lines.append(f"| {r['strategy']} | {r['workers']} | {len(checks)} | "
                     f"{sum(code != 0 for c in checks for code in c['codes'])} | "
                     f"{sum(c.get('duplicates', 0) for c in checks)} | {sum(not c['agree'] for c in checks)} | "
                     f"{measured[len(measured) // 2]} | {idle[len(idle) // 2]} | {idle[-1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--workers", default="2,3")
    parser.add_argument("--strategies", default="grid,auto")
    parser.add_argument("--hogs", type=int, default=3, help="CPU-bound processes beside the workers")
    parser.add_argument("--storage", default="sqlite", choices=["sqlite", "journal", "postgres"])
    parser.add_argument("--postgres-url", default=os.environ.get("AUTOTUNE_TEST_POSTGRES_URL"))
    parser.add_argument("--out", help="a folder for workers_under_load-cpu.{json,md}")
    args = parser.parse_args()
    if args.worker:
        return _worker(json.loads(args.worker))
    rows = []
    started = time.monotonic()
    with cpu_hogs(args.hogs):
        for strategy in args.strategies.split(","):
            for workers in map(int, args.workers.split(",")):
                with tempfile.TemporaryDirectory() as folder:
                    checks, errors = run_case(strategy=strategy, workers=workers, runs=args.runs,
                                              storage_kind=args.storage, folder=folder, postgres=args.postgres_url)
                rows.append({"strategy": strategy, "workers": workers, "checks": checks, "stderr": errors})
                for e in errors:
                    print(e, file=sys.stderr)
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = (f"{table(rows)}\n\n`python benchmarks/workers_under_load.py --runs {args.runs} --workers {args.workers} "
            f"--strategies {args.strategies} --hogs {args.hogs} --storage {args.storage}`: "
            f"{time.monotonic() - started:.0f} s on {os.cpu_count()} cores.\n")
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "workers_under_load-cpu.json"), "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "workers_under_load-cpu.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
