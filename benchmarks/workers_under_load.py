"""Parallel workers on one study while CPU-bound processes compete for the cores.

    python benchmarks/workers_under_load.py [--runs 10] [--workers 2,3] [--strategies grid,auto]
                                            [--hogs 3] [--storage sqlite] [--out results]

For each strategy and worker count, starts that many workers at once, each of which runs
``python -m autotune``'s ``main`` on a fresh study ``--runs`` times in a row (one process per worker
for all runs: a run costs its trials, not an interpreter's start), beside ``--hogs`` processes that
spin on the CPU (a worker takes its cases on its stdin, ``Workers``: the test keeps three workers
for all its cases, so that a case costs its studies, not the workers' start). Each run is checked
as a user would: every worker's exit code is 0, no configuration is measured twice as the same kind
of trial (memory, timing, a near tie's second timing), the workers' reports agree, and the trials
that measured nothing (claims lost, abandoned) are counted. Prints a table of those counts; ``--out``
writes it as ``workers_under_load-cpu.{json,md}``. ``tests/search/test_workers_under_load.py`` runs the
same cases.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
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
          "--measure-steps", "2", "--isolation", "none", "--no-probe", "--no-eval-limits", "--quiet"]


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


class Workers:
    """``n`` worker processes, started on the first case and kept for the next ones (``close`` ends them).

    A worker reads a case from its stdin, one JSON line: ``main`` on studies ``PREFIX-0`` .. ``PREFIX-(runs-1)``,
    one after another, what they print in the case's files (``OUT.stdout``, ``OUT.stderr``), and answers with one
    line on its stdout, the studies' exit codes. A case cut short (a time-out, an exception) ends every worker: the
    next case starts fresh ones, never a worker still busy with the last case."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []

    def _start(self) -> None:
        self.procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
                      for _ in range(self.n)]

    def run(self, workers: int, *, argv: list[str], runs: int, prefix: str, folder: str,
            timeout_s: float) -> tuple[list[list[int]], list[str]]:
        """Run one case on the first ``workers`` workers; return each one's exit codes and what it wrote on stderr."""
        if not self.procs or any(p.poll() is not None for p in self.procs):
            self.close()
            self._start()
        outs = [os.path.join(folder, f"w{w}") for w in range(workers)]
        try:
            for proc, out in zip(self.procs, outs):
                proc.stdin.write(json.dumps({"argv": argv, "prefix": prefix, "runs": runs, "out": out}) + "\n")
                proc.stdin.flush()
            deadline = time.monotonic() + timeout_s
            answers = [self._answer(proc, runs, deadline) for proc in self.procs[:workers]]
        except BaseException:
            self.close(kill=True)
            raise
        errors = []
        for (codes, said), out in zip(answers, outs):
            if os.path.exists(f"{out}.stderr"):
                with open(f"{out}.stderr") as f:
                    said = f.read() + said
            errors.append(said)
        return [codes for codes, _ in answers], errors

    @staticmethod
    def _answer(proc: subprocess.Popen, runs: int, deadline: float) -> tuple[list[int], str]:
        """A worker's exit codes for the case, and what it wrote on stderr outside the case (where it died)."""
        while select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            line = proc.stdout.readline()
            if not line:  # the worker died: its stderr says why
                proc.wait()
                return [proc.returncode] * runs, proc.stderr.read()
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER):]), ""
        raise TimeoutError(f"a worker did not finish its studies in time (pid {proc.pid})")

    def close(self, *, kill: bool = False) -> None:
        for proc in self.procs:
            if not kill:
                proc.stdin.close()  # the worker's loop ends
            try:
                proc.wait(timeout=0 if kill else 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                pipe.close()
        self.procs = []


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


_OWN_CLOCKS = {"setup_s", "steps_s", "wall_s"}  # a trial's seconds, which a trial each worker runs itself has its own


def _differences(reports: list[dict]) -> list[str]:
    """Where the workers' reports differ from the first one's: a trial's fields, or the recommendation (none: they agree,
    trials being one per configuration in the space's order). The report's own trials, at sizes outside the space (the
    recommended limit's confirmation after the search), each worker runs itself: their figures must agree, their
    clocks are each run's."""
    def key(t: dict) -> tuple:
        return t["precision"], t["segments"], t["batch_size"]

    sizes = set(reports[0]["search"]["space"]["batch_sizes"])
    first = {key(t): t for t in reports[0]["trials"]}
    said = []
    for w, report in enumerate(reports[1:], 1):
        trials = {key(t): t for t in report["trials"]}
        for k in sorted(first.keys() | trials.keys(), key=str):
            a, b = first.get(k), trials.get(k)
            clocks = _OWN_CLOCKS if k[2] not in sizes else set()
            fields = sorted(f for f in (a or {}).keys() | (b or {}).keys()
                            if (a or {}).get(f) != (b or {}).get(f) and f not in clocks)
            if fields or (a is None) != (b is None):
                said.append(f"worker {w}: {k}: {fields if a and b else 'only in one report'}")
        if report["recommendation"] != reports[0]["recommendation"]:
            said.append(f"worker {w}: recommendation")
    return said


def run_case(*, strategy: str, workers: int, runs: int, storage_kind: str, folder: str, postgres: str | None = None,
             timeout_s: float = 900, pool: Workers | None = None) -> tuple[list[dict], list[str]]:
    """Run one case (``runs`` studies, ``workers`` workers each): on the first workers of ``pool``, or on workers
    started for it; return one check per run, and what workers wrote on stderr."""
    storage = storage_url(storage_kind, folder, postgres)
    prefix = f"load-{strategy}-{workers}-{os.getpid()}-{time.time_ns()}"  # a server keeps its studies between runs
    argv = [*SEARCH, "--strategy", strategy, "--storage", storage]
    own = pool is None
    pool = Workers(workers) if own else pool
    try:
        codes, errors = pool.run(workers, argv=argv, runs=runs, prefix=prefix, folder=folder, timeout_s=timeout_s)
    finally:
        if own:
            pool.close()
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


ANSWER = "codes: "  # a worker's answer to a case, on its stdout; what the case prints goes to the case's files


def _worker() -> None:
    """One worker: case after case from stdin, the CLI's main on each of the case's studies in turn; answers with
    the studies' exit codes (what main prints goes to the case's files, its errors to OUT.stderr)."""
    from autotune.__main__ import main

    pipes = os.dup(1), os.dup(2)  # to the parent: the answers, and what is said outside a case
    for line in sys.stdin:
        spec = json.loads(line)
        with open(f"{spec['out']}.stdout", "w") as out, open(f"{spec['out']}.stderr", "w") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            try:
                codes = [main([*spec["argv"], "--study", f"{spec['prefix']}-{i}",
                               "--out", f"{spec['out']}-{spec['prefix']}-{i}.json"]) for i in range(spec["runs"])]
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(pipes[0], 1)
                os.dup2(pipes[1], 2)
        print(ANSWER + json.dumps(codes), flush=True)


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
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--workers", default="2,3")
    parser.add_argument("--strategies", default="grid,auto")
    parser.add_argument("--hogs", type=int, default=3, help="CPU-bound processes beside the workers")
    parser.add_argument("--storage", default="sqlite", choices=["sqlite", "journal", "postgres"])
    parser.add_argument("--postgres-url", default=os.environ.get("AUTOTUNE_TEST_POSTGRES_URL"))
    parser.add_argument("--out", help="a folder for workers_under_load-cpu.{json,md}")
    args = parser.parse_args()
    if args.worker:
        return _worker()
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
