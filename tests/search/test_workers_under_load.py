"""Parallel workers while CPU-bound processes compete for the cores: no crash, no duplicate, no spinning.

The module starts three workers once, beside the hogs, and keeps them for every case (a case costs its studies, not
three interpreters' start and imports): each case's two or three workers run the CLI's ``main`` on RUNS fresh
studies in a row (benchmarks/workers_under_load.py, which prints the same checks as a table, ten studies a case).
Before the claim protocol was one write (issue 23), three auto workers under this load crashed
(``UpdateFinishedTrialError``) in 2 studies of 10, measured a configuration twice in 4, disagreed in
3, and left a median of 27 trials that measured nothing per study (46 at most): one study of auto with three
workers catches that in every run (the trials that measured nothing alone: 27 against the 4 a worker may leave), and
the suite runs two (a journal file, PostgreSQL).
"""

import os
import sys

import pytest

from tests.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from workers_under_load import Workers, cpu_hogs, run_case  # noqa: E402

# Run alone (marker serial): its workers compete with CPU hogs on purpose; CI runs these tests in a pytest call
# of their own, after the rest runs on two processes (.ci/run).
pytestmark = pytest.mark.serial

# Studies per case: one in the suite (each case races two or three workers over a whole study, beside the hogs; a
# second study a case cost CI about 30 s of its 10 minutes); AUTOTUNE_LOAD_RUNS=10 is the benchmark's table
RUNS = int(os.environ.get("AUTOTUNE_LOAD_RUNS", "1"))
HOGS = 3  # with two cores: each worker gets well under half a core, and is preempted mid-claim
# Trials that measured nothing, per worker and study: claims lost at the same moment or closed as stale. Ten studies a
# pair in results/workers_under_load-cpu.json: at most 2 and 3 with two workers, 6 and 7 with three (before: 46).
IDLE_PER_WORKER = 4
POSTGRES_URL = os.environ.get("AUTOTUNE_TEST_POSTGRES_URL")


@pytest.fixture(scope="module")
def load():
    with cpu_hogs(HOGS):
        yield


@pytest.fixture(scope="module")
def pool(load):
    """The cases' workers, started under the load by the first case; a case that fails midway ends them all, and the
    next case starts its own (benchmarks/workers_under_load.py's Workers)."""
    pool = Workers(3)
    try:
        yield pool
    finally:
        pool.close(kill=True)


# Both strategies, two and three workers, the three kinds of storage (the benchmark runs every pair on SQLite).
@pytest.mark.parametrize("strategy, workers, storage", [
    ("grid", 3, "sqlite"), ("auto", 2, "sqlite"), ("auto", 3, "journal"),
    pytest.param("auto", 3, "postgres", marks=pytest.mark.skipif(
        not POSTGRES_URL, reason="set AUTOTUNE_TEST_POSTGRES_URL (`.ci/postgres.sh` starts a server and prints it)")),
])
def test_workers_under_load_never_crash_duplicate_or_spin(tmp_path, pool, strategy, workers, storage):
    checks, errors = run_case(strategy=strategy, workers=workers, runs=RUNS, storage_kind=storage,
                              folder=str(tmp_path), postgres=POSTGRES_URL, pool=pool)
    for check in checks:
        assert check["codes"] == [0] * workers, (check, errors)
        assert check["running"] == 0 and check["duplicates"] == 0, check
        assert check["agree"], check  # every worker's report holds every measurement and the same recommendation
        assert check["idle"] <= IDLE_PER_WORKER * workers, check
    assert not any("Traceback" in e or "error" in e for e in errors), errors
