"""Failure behaviour: isolated trials, resume after SIGKILL, Ctrl-C, parallel workers, memory under load."""

import gc
import json
import os
import signal
import subprocess
import sys
import time
import weakref

import optuna
import pytest
import sqlalchemy.exc
import torch

import autotune
import autotune.search.store
from autotune.execution import spawn as isolation
from autotune.meters import TensorMeter
from autotune.records import Config, TrialSettings
from autotune.execution.trial import TrialWork, run_trial
from autotune.training.workload import Workload

from tests import procs
from tests.paths import ROOT

# Run alone (marker serial): the tests whose searches are caught mid-way by a signal; CI runs them in a pytest call of
# their own, after the rest runs on two processes (.ci/run). The rest share the machine: the isolated trials' tests
# as tests/execution/test_isolation.py's workers do (killed, hung, timed out), and the two workers on one study assert nothing
# a load changes (tests/search/test_workers_under_load.py checks the same beside three CPU hogs; beside one, auto measured 6
# of the 16 configurations in each of 3 runs, as alone).
serial = pytest.mark.serial

TINY = '{"n_layer": 2, "block_size": 16, "n_embd": 16, "n_head": 2, "vocab_size": 32}'


def _default_sigint() -> None:
    # A background job of a non-interactive shell ignores SIGINT and its children inherit that: then Python
    # installs no KeyboardInterrupt handler and a Ctrl-C test could not pass. The children start with the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def cli(processes):
    """Start ``python -m autotune ARGS`` in a process group of its own; the group (the CLI's isolated workers too) is
    killed when the test ends, however it ends."""
    def start(*args, **popen):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1")
        popen.setdefault("start_new_session", True)
        processes.append(subprocess.Popen([sys.executable, "-m", "autotune", *args], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_default_sigint, **popen))
        return processes[-1]
    return start


def measured_trials(storage, study):
    trials = optuna.load_study(study_name=study, storage=autotune.search.store.make_storage(storage)).get_trials(deepcopy=False)
    return [t for t in trials if "measurement" in t.user_attrs]


# What reading a SQLite store may meet while the search that writes it starts: its tables being made, or the file
# locked by the writer (sqlite3's messages). Any other error is the store's own and ends the wait with it.
_BUSY = ("database is locked", "no such table", "already exists", "UNIQUE constraint failed")


def wait_for_trials(storage, study, n, timeout=120):
    """Wait until ``n`` trials of ``study`` in the SQLite ``storage`` hold a measurement. Until the search has made
    the file and the study, and while it holds the file locked, wait on; a store that fails otherwise (not a
    database, a folder that does not exist) raises its own error at once."""
    path = storage[len("sqlite:///"):] if storage.startswith("sqlite:///") else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path is None or os.path.exists(path):  # not made yet: reading would make it, racing the search
            try:
                if len(measured_trials(storage, study)) >= n:
                    return
            except KeyError:  # optuna.load_study: no study of that name yet
                pass
            except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.IntegrityError) as exc:
                if not any(busy in str(exc) for busy in _BUSY):
                    raise
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} trials finished in {timeout} s")


def test_waiting_for_trials_fails_at_once_on_a_broken_store_and_waits_on_a_missing_study(tmp_path):
    broken = tmp_path / "broken.db"
    broken.write_bytes(b"not a database " * 512)
    with pytest.raises(sqlalchemy.exc.DatabaseError, match="file is not a database"):  # its own error, not the wait's
        wait_for_trials(f"sqlite:///{broken}", "s", 1, timeout=60)
    with pytest.raises(sqlalchemy.exc.OperationalError, match="unable to open database file"):
        wait_for_trials(f"sqlite:///{tmp_path}", "s", 1, timeout=60)  # a folder, not a file
    empty = f"sqlite:///{tmp_path}/empty.db"
    optuna.create_study(study_name="other", storage=empty)
    with pytest.raises(AssertionError, match="fewer than 1 trials finished in 0.5 s"):
        wait_for_trials(empty, "s", 1, timeout=0.5)  # no such study yet: waited on until the time-out
    with pytest.raises(AssertionError, match="fewer than 1 trials finished in 0.5 s"):
        wait_for_trials(f"sqlite:///{tmp_path}/not-yet.db", "s", 1, timeout=0.5)
    assert not (tmp_path / "not-yet.db").exists()  # the wait made no file the search would race to make


# A slow enough search to be caught mid-way: 16 trials of ~0.3 s each; under the budget of 320,000 bytes
# fp32 and bf16 without checkpointing run out of memory at batch 8, with 2 segments they fit.
SEARCH = ["--model", "autotune.examples:TinyGPT", "--model-kwargs", TINY, "--device", "cpu", "--budget", "320000",
          "--precisions", "fp32,bf16", "--segments", "0,2", "--batch-sizes", "1..8", "--warmup-steps", "2",
          "--measure-steps", "40", "--settle-steps", "0", "--isolation", "none", "--no-eval-limits", "--strategy", "grid"]


def test_isolated_trial_killed_by_sigkill_is_recorded_and_the_search_finishes(tmp_path):
    report = autotune.tune("tests.models:SelfKill", device="cpu", budget="8MiB", precisions="fp32", segments="0",
                           batch_sizes="2,4,8", measure_steps=2, isolation="process", strategy="grid",
                           storage=f"sqlite:///{tmp_path}/k.db", study="k")
    status = {m.batch_size: m for m in report.trials}
    assert status[4].status == "crashed" and "SIGKILL" in status[4].error
    assert status[2].status == "ok" and status[8].status == "ok"
    assert report.search["isolation"] == "process"
    # The fastest trial that fits is recommended (pareto.recommend); which of 2 and 8 that is, is a timing on a
    # loaded machine. What holds: a measured trial, never the crashed one.
    fastest = max((status[2], status[8]), key=lambda m: (m.samples_per_s, -m.peak_bytes))
    assert report.recommendation == fastest and report.recommendation.batch_size != 4


def test_a_warm_worker_killed_between_two_trials_of_a_search_costs_no_trial(tmp_path):
    # After each trial the search's warm worker waits for the next; killing it there must not record a crash:
    # the next trial runs in a new worker, and the search measures what the same search in this process measures.
    import multiprocessing

    killed = []
    before = set(multiprocessing.active_children())  # none but the search's, in a process that ran other tests too

    def kill_the_waiting_worker(measurement, reused):
        if len(killed) < 3:
            for child in set(multiprocessing.active_children()) - before:
                os.kill(child.pid, signal.SIGKILL)
                killed.append(child.pid)

    space = dict(model_kwargs=TINY, device="cpu", budget=320_000, precisions="fp32", segments="0,2", batch_sizes="1..8",
                 measure_steps=2, strategy="grid", probe=False)
    warm = autotune.tune("autotune.examples:TinyGPT", isolation="process", storage=f"sqlite:///{tmp_path}/w.db",
                         on_trial=kill_the_waiting_worker, **space)
    here = autotune.tune("autotune.examples:TinyGPT", isolation="none", storage=f"sqlite:///{tmp_path}/h.db", **space)
    assert len(killed) == 3
    assert [(m.config, m.status, m.peak_bytes) for m in warm.trials] == [(m.config, m.status, m.peak_bytes)
                                                                        for m in here.trials]
    assert "crashed" not in {m.status for m in warm.trials}
    assert warm.search["workers_started"] == 1 + 3  # the plan checks' worker served the first trial


def _group(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that are still running (zombies do not count)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry))
    return found


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@serial
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process groups from /proc")
def test_a_search_killed_with_sigkill_leaves_no_worker_training(tmp_path, cli):
    # SIGKILL cannot be handled: the search cannot kill its worker, so the worker must notice and exit on its own
    storage = f"sqlite:///{tmp_path}/k.db"
    slow = [a if a != "40" else "1000000" for a in SEARCH]  # one trial far longer than the test
    proc = cli(*[a if a != "none" else "process" for a in slow], "--storage", storage, "--study", "k",
               "--trial-timeout", "600", "--quiet")  # quiet: a worker writing to a closed pipe would die of that
    deadline = time.monotonic() + 180
    busiest = 0.0
    while time.monotonic() < deadline:  # a worker that has used 6 s of CPU has imported torch and is training
        busiest = max((_cpu_seconds(p) for p in _group(proc.pid) if p != proc.pid), default=0.0)
        if busiest > 6:
            break
        time.sleep(0.5)
    assert busiest > 6, "no worker is training"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)  # not communicate(): a worker left running holds the pipes open
    deadline = time.monotonic() + 30
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _group(proc.pid) == []


def test_isolated_trial_that_hangs_is_killed_at_the_time_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(isolation, "STARTUP_GRACE_S", 5.0)
    w = Workload.from_specs("tests.models:Hangs")
    start = time.monotonic()
    m = isolation.Spawned("cpu").run(w, TrialWork(Config("fp32", "0", 2), TrialSettings(measure_steps=2, timeout_s=5.0), None))
    assert m.status == "timeout" and "killed" in m.error
    assert time.monotonic() - start < 60


def test_isolated_trial_measures_like_an_in_process_one():
    w = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=TINY)
    settings = TrialSettings(measure_steps=2)
    here = run_trial(w, Config("bf16", "2", 4), device="cpu", meter=TensorMeter(budget_bytes=2**30), settings=settings)
    there = isolation.Spawned("cpu").run(w, TrialWork(Config("bf16", "2", 4), settings, 2**30))
    assert there.status == "ok" and there.peak_bytes == here.peak_bytes and there.loss_first == here.loss_first


def test_an_isolated_trial_logs_its_steps_with_verbose(capfd):
    # --verbose sets the autotune logger to DEBUG; a worker process must log its steps as this one would
    import logging

    from autotune._log import logger

    w = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=TINY)
    before = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        m = isolation.Spawned("cpu").run(w, TrialWork(Config("fp32", "0", 2), TrialSettings(measure_steps=2), 2**30))
    finally:
        logger.setLevel(before)
    err = capfd.readouterr().err
    assert m.status == "ok"
    assert err.count("fp32 segments=0 batch=2 timed step") == 2 and "warm-up (metered) step 1" in err


@serial
def test_search_killed_with_sigkill_resumes_without_measuring_twice(tmp_path, cli):
    storage, out = f"sqlite:///{tmp_path}/r.db", tmp_path / "r.json"
    # A search that is never killed, for its answer: on a store of its own, beside the one killed and resumed
    reference = cli(*SEARCH, "--storage", f"sqlite:///{tmp_path}/ref.db", "--study", "ref", "--out", str(tmp_path / "ref.json"))
    proc = cli(*SEARCH, "--storage", storage, "--study", "r", "--out", str(out))
    wait_for_trials(storage, "r", 3)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    before = {t.number: t.user_attrs["measurement"] for t in measured_trials(storage, "r")}
    assert 3 <= len(before) < 16
    again = cli(*SEARCH, "--storage", storage, "--study", "r", "--out", str(out))
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err
    data = json.loads(out.read_text())
    assert data["search"]["n_trials"] == 16 and data["search"]["n_reused"] >= len(before)
    trials = measured_trials(storage, "r")
    params = [tuple(sorted(t.params.items())) for t in trials]
    assert len(params) == len(set(params)) == 16  # every configuration measured exactly once
    reported = {(t["precision"], t["segments"], t["batch_size"]): {k: v for k, v in t.items() if k != "feasible"}
                for t in data["trials"]}
    for m in before.values():  # reused as measured before the kill, not measured again
        assert reported[(m["precision"], m["segments"], m["batch_size"])] == m
    # The same answer as a search that was never killed: memory is deterministic, so the limits
    # must agree exactly; which configuration is fastest is a timing measurement.
    _, err = reference.communicate(timeout=600)
    assert reference.returncode == 0, err
    ref = json.loads((tmp_path / "ref.json").read_text())
    assert data["limits"] == ref["limits"]
    assert {(r["precision"], r["segments"]): r["max_batch_size"] for r in ref["limits"]} == {
        ("fp32", "0"): 4, ("fp32", "2"): 8, ("bf16", "0"): 4, ("bf16", "2"): 8}
    assert data["recommendation"]["feasible"] and data["recommendation"]["peak_bytes"] <= 0.9 * data["budget_bytes"]


@serial
def test_ctrl_c_writes_a_partial_report_and_exits_130(tmp_path, cli):
    storage, out = f"sqlite:///{tmp_path}/i.db", tmp_path / "i.json"
    proc = cli(*SEARCH, "--storage", storage, "--study", "i", "--out", str(out))
    wait_for_trials(storage, "i", 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)  # closes the pipes too
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    data = json.loads(out.read_text())
    assert data["search"]["partial"] is True and 2 <= data["search"]["n_trials"] < 16
    study = optuna.load_study(study_name="i", storage=storage)
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    resumed = autotune.tune("autotune.examples:TinyGPT", model_kwargs=TINY, device="cpu", budget=320000,
                            precisions="fp32,bf16", segments="0,2", batch_sizes="1..8", measure_steps=40, settle_steps=0,
                            storage=storage, study="i", isolation="none", strategy="grid")
    assert resumed.search["n_reused"] == data["search"]["n_trials"] and not resumed.search["partial"]


@serial
@pytest.mark.parametrize("isolation", ["none", "process"])
def test_sigterm_is_handled_as_ctrl_c_and_exits_143(tmp_path, cli, isolation):
    # torchrun, SLURM, Kubernetes and systemd stop a job with SIGTERM and a grace period.
    storage, out = f"sqlite:///{tmp_path}/t.db", tmp_path / "t.json"
    search = [a if a != "none" else isolation for a in SEARCH]
    proc = cli(*search, "--storage", storage, "--study", "t", "--out", str(out), start_new_session=True)
    wait_for_trials(storage, "t", 2, timeout=300)
    os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as systemd and torchrun do: isolated workers too
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    data = json.loads(out.read_text())
    assert data["search"]["partial"] is True and 2 <= data["search"]["n_trials"] < 16
    assert all(m["status"] != "crashed" for m in data["trials"])  # a worker's SIGTERM is not a crash of the trial
    study = optuna.load_study(study_name="t", storage=storage)
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]


POSTGRES_URL = os.environ.get("AUTOTUNE_TEST_POSTGRES_URL")


def two_workers(cli, search, storage, study, tmp_path):
    """Run two CLI workers of ``search`` on one study at once; return their processes and reports."""
    outs = [tmp_path / f"w{i}.json" for i in range(2)]
    procs = [cli(*search, "--storage", storage, "--study", study, "--out", str(o), "--quiet") for o in outs]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    return procs, [json.loads(o.read_text()) for o in outs]


@pytest.mark.parametrize("kind", [
    "sqlite",
    "journal",
    pytest.param("postgres", marks=pytest.mark.skipif(
        not POSTGRES_URL, reason="set AUTOTUNE_TEST_POSTGRES_URL (`.ci/postgres.sh` starts a server and prints it)")),
])
def test_two_workers_share_one_study_without_overlap(tmp_path, cli, kind):
    storage = {"sqlite": f"sqlite:///{tmp_path}/p.db", "journal": f"journal:///{tmp_path}/p.log", "postgres": POSTGRES_URL}[kind]
    study = f"p-{os.getpid()}-{time.time_ns()}"  # a server keeps its studies between runs
    procs, reports = two_workers(cli, SEARCH, storage, study, tmp_path)
    trials = measured_trials(storage, study)
    params = [tuple(sorted(t.params.items())) for t in trials]
    assert len(params) == len(set(params)) == 16  # disjoint, and together the whole space
    assert [r["search"]["n_run"] for r in reports] == [sum(1 for t in trials if t.user_attrs["worker"].endswith(f":{p.pid}"))
                                                       for p in procs]
    # Together they ran the space once. How it splits is a race (a worker may finish before the other has imported
    # torch on a loaded machine); that neither runs what the other claimed is what the lines above check.
    assert sum(r["search"]["n_run"] for r in reports) == 16
    assert reports[0]["trials"] == reports[1]["trials"]
    assert reports[0]["recommendation"] == reports[1]["recommendation"]


def test_two_workers_with_the_auto_strategy_split_its_trials_and_agree(tmp_path, cli):
    # auto decides from the store alone: a second worker must not repeat a trial the first runs,
    # and both must find the grid's limits (here: segments 0 fits batch 4, segments 2 batch 8).
    storage, study = f"sqlite:///{tmp_path}/a.db", "a"
    _, reports = two_workers(cli, SEARCH[:-1] + ["auto"], storage, study, tmp_path)
    trials = measured_trials(storage, study)
    # A configuration can have a memory trial, the timing that completes it and a near tie's second timing:
    # never two trials of one kind.
    kinds = [(tuple(sorted(t.params.items())), t.user_attrs["figures"], t.user_attrs["measurement"]["timings"])
             for t in trials]
    assert len(kinds) == len(set(kinds))
    assert len({k[0] for k in kinds}) < 16
    assert reports[0]["trials"] == reports[1]["trials"]
    assert reports[0]["recommendation"] == reports[1]["recommendation"]
    limits = {(r["precision"], r["segments"]): (r["max_batch_size"], r["bracketed"]) for r in reports[0]["limits"]}
    assert limits == {("fp32", "0"): (4, True), ("bf16", "0"): (4, True), ("fp32", "2"): (8, True), ("bf16", "2"): (8, True)}


def _tensor_count():
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_soak_of_40_trials_alternating_oom_and_success_keeps_memory_flat():
    # benchmarks/soak.py runs 100 and reports the figures; 40 keep CI's time (a leak of one tensor fails either).
    # Both precisions, two trials each in turn: autocast's caches and the bf16 OOM path are released too.
    w = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=TINY)
    meter = TensorMeter(budget_bytes=3 * 2**20)  # batch 128 peaks at 4.2 MiB in fp32 and 3.6 MiB in bf16
    settings = TrialSettings(warmup_steps=2, measure_steps=1)

    def config(i):
        return Config("bf16" if i // 2 % 2 else "fp32", "0", 128 if i % 2 else 2)

    for i in range(4):  # warm up allocator, imports and caches: each precision's success and OOM
        run_trial(w, config(i), device="cpu", meter=meter, settings=settings)
    tensors, finalisers, rss = _tensor_count(), len(weakref.finalize._registry), _rss_bytes()
    for i in range(40):
        m = run_trial(w, config(i), device="cpu", meter=meter, settings=settings)
        assert m.status == ("oom" if i % 2 else "ok"), (config(i), m.error)
    assert _tensor_count() == tensors
    assert len(weakref.finalize._registry) == finalisers
    assert _rss_bytes() - rss < 32 * 2**20  # the allocator may keep some pages; a leak of 40 trials would not fit


# The tests that stop a run with Ctrl-C's signal, or raise one in the test process: each must pass however the suite
# was started: in a terminal, as a background job of a shell (which starts it with SIGINT ignored), or under a runner
# that ignores SIGINT or SIGHUP (nohup, some CI agents). Each starts its children, or sets its own handler, as a
# foreground process would have them (_default_sigint; tests/cli/test_cli.py and tests/search/test_store.py set the handler).
# SIGTERM's tests (test_sigterm_..., 20 s more) do not depend on SIGINT's disposition and are left out. Named so that
# none of the -k expressions here or in the docs' check (-k "signal or interrupt or SIG") selects this test itself.
# The tests that stop a search with Ctrl-C (whose disposition a runner may have set to ignored): the SIGTERM tests
# here do not depend on it, and run once, in the suite itself.
_STOPPING_TESTS = ["tests/cli/test_cli.py", "tests/search/test_store.py", "tests/execution/test_reliability.py", "-k", "signal or ctrl_c",
                   "--deselect", "tests/execution/test_reliability.py::test_sigterm_is_handled_as_ctrl_c_and_exits_143"]


def _ignore_ctrl_c_and_hangups() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


@serial
def test_the_stopping_tests_pass_under_a_runner_that_ignores_int_and_hup():
    # pytest in a child that starts with SIGINT and SIGHUP ignored, as `bash -c 'trap "" INT HUP; pytest ...'` or a
    # background job would start it; its own plugins (the cache, the benchmark plugin) off, so it writes nothing here
    command = [sys.executable, "-m", "pytest", *_STOPPING_TESTS, "-q", "-p", "no:cacheprovider", "-p", "no:benchmark",
               "-p", "no:xdist"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = procs.run(command, cwd=ROOT, env=env, timeout=280, preexec_fn=_ignore_ctrl_c_and_hangups)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and "skipped" not in done.stdout and "deselected" in done.stdout, tail
