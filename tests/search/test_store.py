"""The trial store: study names and URLs, opening a study, and how trials go in, come out and are reused."""

import dataclasses
import hashlib
import json
import os

import optuna
import pytest
from optuna.trial import TrialState

from autotune.errors import UsageError
from autotune.records import Config, GuardRails, Measurement
from autotune.search.space import SearchSpace
from autotune.search.store import (
    state_of,
    FINISHED,
    STATE,
    abandon,
    config_of,
    default_storage,
    default_study_name,
    distributions,
    fingerprint,
    make_storage,
    open_study,
    quiet_optuna,
    record,
    reusable,
    start_trial,
    store_plan_checks,
    stored_plan_checks,
)

SPACE = SearchSpace(("fp32", "bf16"), ("0", 2, "all"), (1, 2, 4), blocks=4)


def sqlite(tmp_path, name="trials"):
    return f"sqlite:///{tmp_path / name}.db"


def ok(config, peak=1000, sps=10.0):
    return Measurement(config, "ok", peak_bytes=peak, samples_per_s=sps, step_s=config.batch_size / sps)


def attrs(m, settings_key="s", budget=None, timeout=None):
    return {"measurement": m.to_dict(), "settings_key": settings_key, "budget_bytes": budget, "timeout_s": timeout,
            "status": m.status}


# --- fingerprint ---------------------------------------------------------------------------------


def test_fingerprint_is_stable_across_processes_and_versions():
    # Stored studies are found again by this key: it must not depend on the process (no hash()) or key order.
    expected = hashlib.sha256(json.dumps({"a": 1, "b": [1, 2]}, sort_keys=True).encode()).hexdigest()[:16]
    assert fingerprint(a=1, b=[1, 2]) == expected == fingerprint(b=[1, 2], a=1)
    assert fingerprint(model="m", device="cpu") == "4667b2c1bdda45f6"  # pinned: a change would orphan every study


def test_fingerprint_ignores_key_order_at_every_depth():
    assert fingerprint(x={"p": 1, "q": {"r": 2, "s": 3}}) == fingerprint(x={"q": {"s": 3, "r": 2}, "p": 1})


def test_fingerprint_tells_different_parts_apart():
    keys = {fingerprint(), fingerprint(a=1), fingerprint(a=2), fingerprint(a="1"), fingerprint(b=1), fingerprint(a=[1, 2]),
            fingerprint(a=[2, 1])}
    assert len(keys) == 7 and all(len(k) == 16 for k in keys)


def test_fingerprint_reads_values_json_cannot_through_str():
    guard = GuardRails(1.0, ("LayerNorm",))
    assert fingerprint(guard=guard) == fingerprint(guard=GuardRails(1.0, ("LayerNorm",)))
    assert fingerprint(guard=guard) != fingerprint(guard=GuardRails(2.0, ("LayerNorm",)))


# --- names and storages --------------------------------------------------------------------------


@pytest.mark.parametrize("model, device, options, name", [
    ("autotune.examples:TinyGPT", "cpu", None, "TinyGPT-cpu"),
    ("tests.models:Outer.Inner", "cuda", None, "Outer.Inner-cuda"),
    ("my model/v2", "cpu", None, "my-model-v2-cpu"),
    ("pkg:a b//c", "cpu", None, "a-b-c-cpu"),
    ("<lambda>", "cpu", None, "-lambda--cpu"),
    ("../../etc/passwd", "cpu", None, "..-..-etc-passwd-cpu"),  # no path separators left
    ("pkg:Model", "mps", "0123456789abcdef", "Model-01234567-mps"),
])
def test_default_study_name_is_safe_as_a_file_name(model, device, options, name):
    got = default_study_name(model, device, options)
    assert got == name and "/" not in got and os.sep not in got


def test_default_storage_creates_the_folder(tmp_path):
    folder = tmp_path / "deep" / "results"
    url = default_storage("TinyGPT-cpu", str(folder))
    assert folder.is_dir() and url == f"sqlite:///{folder}/TinyGPT-cpu.db"
    assert default_storage("TinyGPT-cpu", str(folder)) == url  # an existing folder is fine
    open_study("TinyGPT-cpu", url, workload_key="k")
    assert (folder / "TinyGPT-cpu.db").is_file()


def test_make_storage_passes_database_urls_through(tmp_path):
    assert make_storage(sqlite(tmp_path)) == sqlite(tmp_path)
    assert make_storage("postgresql://u@h/db") == "postgresql://u@h/db"


def test_make_storage_opens_a_journal_file(tmp_path):
    path = tmp_path / "trials.log"
    storage = make_storage(f"journal://{path}")
    assert isinstance(storage, optuna.storages.JournalStorage)
    study = open_study("j", f"journal://{path}", workload_key="k", space=SPACE)
    study.add_trial(optuna.trial.create_trial(params={"precision": "fp32", "segments": "0", "batch_size": 1,
                                                      "compile": "none"}, distributions=distributions(SPACE), values=[1.0, 2.0]))
    again = open_study("j", f"journal://{path}", workload_key="k", space=SPACE)
    assert path.is_file() and len(again.trials) == 1 and again.user_attrs["workload_key"] == "k"


def test_a_journal_in_a_missing_folder_or_without_a_path_is_bad_input(tmp_path):
    missing = tmp_path / "no" / "such" / "dir" / "t.log"
    with pytest.raises(UsageError, match="does not exist") as info:
        make_storage(f"journal://{missing}")
    assert str(tmp_path / "no" / "such" / "dir") in str(info.value)
    with pytest.raises(UsageError, match="journal:///path/to/file.log"):
        make_storage("journal://")
    with pytest.raises(UsageError, match="does not exist"):  # open_study says the same, at once
        open_study("s", f"journal://{missing}", workload_key="k")
    assert not (tmp_path / "no").exists()


# --- open_study ----------------------------------------------------------------------------------


def test_a_new_study_keeps_its_workload_and_space(tmp_path):
    study = open_study("s", sqlite(tmp_path), workload_key="wk", space=SPACE)
    assert study.directions == [optuna.study.StudyDirection.MAXIMIZE, optuna.study.StudyDirection.MINIMIZE]
    loaded = optuna.load_study(study_name="s", storage=sqlite(tmp_path))
    assert loaded.user_attrs["workload_key"] == "wk" and loaded.user_attrs["space"] == SPACE.to_dict()
    assert loaded.metric_names == ["samples_per_s", "peak_bytes"]
    again = open_study("s", sqlite(tmp_path), workload_key="wk", space=SPACE)
    assert again._study_id == study._study_id  # the same study, loaded


def test_a_study_of_another_workload_is_refused_with_one_line(tmp_path):
    open_study("s", sqlite(tmp_path), workload_key="wk", space=SPACE)
    with pytest.raises(UsageError) as info:
        open_study("s", sqlite(tmp_path), workload_key="other", space=SPACE)
    text = str(info.value)
    assert "different model" in text and "'s'" in text and "--study" in text and "\n" not in text
    with pytest.raises(UsageError, match="different model"):  # whether or not the space is given
        open_study("s", sqlite(tmp_path), workload_key="other")
    assert optuna.load_study(study_name="s", storage=sqlite(tmp_path)).user_attrs["workload_key"] == "wk"


@pytest.mark.parametrize("other", [
    SearchSpace(("fp32",), ("0", 2, "all"), (1, 2, 4), blocks=4),
    SearchSpace(("fp32", "bf16"), ("0", "all"), (1, 2, 4), blocks=4),
    SearchSpace(("fp32", "bf16"), ("0", 2, "all"), (1, 2, 4, 8), blocks=4),
    SearchSpace(("fp32", "bf16"), ("0", 2, "all"), (1, 2, 4), blocks=6),
])
def test_a_study_of_another_search_space_is_refused_with_one_line(tmp_path, other):
    open_study("s", sqlite(tmp_path), workload_key="wk", space=SPACE)
    with pytest.raises(UsageError) as info:
        open_study("s", sqlite(tmp_path), workload_key="wk", space=other)
    text = str(info.value)
    assert "another search space" in text and "\n" not in text
    assert "precisions fp32,bf16" in text and "segments 0,2,all" in text and "batch sizes 1,2,4" in text


def test_a_study_opened_without_a_space_takes_one_later(tmp_path):
    open_study("s", sqlite(tmp_path), workload_key="wk")  # as the plan checks open it
    open_study("s", sqlite(tmp_path), workload_key="wk", space=SPACE)
    assert optuna.load_study(study_name="s", storage=sqlite(tmp_path)).user_attrs["space"] == SPACE.to_dict()
    open_study("s", sqlite(tmp_path), workload_key="wk")  # and a later open without one does not care


def test_distributions_follow_the_space():
    d = distributions(SPACE)
    assert set(d) == {"precision", "segments", "batch_size", "compile"}
    assert d["compile"].choices == ("none",)  # eager only unless --compile asks for more
    assert d["precision"].choices == ("fp32", "bf16")
    assert d["segments"].choices == ("0", "2", "all")  # canonical names
    assert d["batch_size"].choices == (1, 2, 4)


def test_quiet_optuna_restores_the_verbosity():
    before = optuna.logging.get_verbosity()
    with quiet_optuna():
        assert optuna.logging.get_verbosity() == optuna.logging.WARNING
    assert optuna.logging.get_verbosity() == before
    with pytest.raises(KeyError), quiet_optuna():
        raise KeyError("x")
    assert optuna.logging.get_verbosity() == before


# --- plan checks ---------------------------------------------------------------------------------


def test_plan_checks_round_trip_under_their_key(tmp_path):
    url = sqlite(tmp_path)
    assert stored_plan_checks("s", url, workload_key="wk", key="a") is None
    checks = [{"plan": "2", "status": "exact", "batch_size": 2, "recomputed_blocks": ["h.0"]}]
    store_plan_checks("s", url, workload_key="wk", key="a", checks=checks)
    store_plan_checks("s", url, workload_key="wk", key="b", checks=[{"plan": "all", "status": "differs"}])
    assert stored_plan_checks("s", url, workload_key="wk", key="a") == checks  # the second key kept the first
    assert stored_plan_checks("s", url, workload_key="wk", key="b") == [{"plan": "all", "status": "differs"}]
    assert stored_plan_checks("s", url, workload_key="wk", key="c") is None
    with pytest.raises(UsageError, match="different model"):
        stored_plan_checks("s", url, workload_key="other", key="a")


# --- reusable ------------------------------------------------------------------------------------


def test_a_measurement_made_the_same_way_is_reused():
    m = ok(Config("fp32", "0", 4))
    assert reusable(attrs(m), settings_key="s", enforced_bytes=1000, timeout_s=10.0) == m


def test_nothing_stored_or_other_settings_is_not_reused():
    m = ok(Config("fp32", "0", 4))
    assert reusable({}, settings_key="s", enforced_bytes=None, timeout_s=None) is None
    assert reusable({"settings_key": "s", "status": "ok"}, settings_key="s", enforced_bytes=None, timeout_s=None) is None
    assert reusable(attrs(m, settings_key="other"), settings_key="s", enforced_bytes=None, timeout_s=None) is None


@pytest.mark.parametrize("stored_budget, budget, reused", [
    (1000, 2000, False),  # ran out of a smaller budget than today's: it may fit now
    (2000, 1000, True),  # ran out of a larger one: it runs out of this one too
    (1000, 1000, True),
    (None, 1000, True),  # ran out of the device itself, with no budget enforced
    (None, None, True),
])
def test_an_oom_is_reused_only_under_a_budget_no_larger(stored_budget, budget, reused):
    m = Measurement(Config("fp32", "0", 64), "oom", peak_bytes=1001, error="DefaultCPUAllocator: can't allocate memory")
    got = reusable(attrs(m, budget=stored_budget), settings_key="s", enforced_bytes=budget, timeout_s=None)
    assert (got == m) is reused and (got is None) is not reused


def test_an_oom_under_a_budget_is_not_reused_without_one():
    # No budget today is larger than any budget: a trial that ran out of 1000 bytes may fit now.
    m = Measurement(Config("fp32", "0", 64), "oom", peak_bytes=1001)
    assert reusable(attrs(m, budget=1000), settings_key="s", enforced_bytes=None, timeout_s=None) is None


def test_a_success_is_reused_whatever_the_budget():
    m = ok(Config("fp32", "0", 4), peak=5000)
    for stored, today in ((1000, 2000), (None, 1000), (10_000, None)):
        assert reusable(attrs(m, budget=stored), settings_key="s", enforced_bytes=today, timeout_s=None) == m


@pytest.mark.parametrize("stored_timeout, timeout, reused", [
    (10.0, 20.0, False),  # cut sooner than today's limit would cut it
    (10.0, None, False),  # no limit today
    (20.0, 10.0, True),
    (10.0, 10.0, True),
])
def test_a_timeout_is_reused_only_under_a_limit_no_longer(stored_timeout, timeout, reused):
    m = Measurement(Config("fp32", "0", 64), "timeout", error="ran past its limit")
    got = reusable(attrs(m, timeout=stored_timeout), settings_key="s", enforced_bytes=None, timeout_s=timeout)
    assert (got is not None) is reused


def test_a_failure_or_crash_is_reused_as_it_is():
    for status in ("failed", "crashed"):
        m = Measurement(Config("fp32", "0", 2), status, error="boom")
        assert reusable(attrs(m, budget=10, timeout=1.0), settings_key="s", enforced_bytes=10**9, timeout_s=100.0) == m


# --- record, abandon, config_of ------------------------------------------------------------------


@pytest.fixture
def study(tmp_path):
    return open_study("s", sqlite(tmp_path), workload_key="wk", space=SPACE)


def ask(study, config):
    study.enqueue_trial(config.to_dict())
    return study.ask(distributions(SPACE))


@pytest.mark.parametrize("status, state", [("ok", TrialState.COMPLETE), ("oom", TrialState.PRUNED),
                                           ("timeout", TrialState.PRUNED), ("failed", TrialState.FAIL),
                                           ("crashed", TrialState.FAIL)])
def test_record_stores_the_measurement_on_its_trial(study, status, state):
    config = Config("bf16", "all", 2)
    trial = ask(study, config)
    m = Measurement(config, status, peak_bytes=1234, samples_per_s=5.0 if status == "ok" else None, error=None)
    assert record(study, trial, m, {"settings_key": "s", "budget_bytes": 2000, "timeout_s": None})
    (stored,) = study.get_trials(deepcopy=False)
    assert stored.state == state == STATE[status] and stored.state in FINISHED
    assert stored.values == ([5.0, 1234.0] if status == "ok" else None)
    assert stored.user_attrs["status"] == status and stored.user_attrs["settings_key"] == "s"
    assert Measurement.from_dict(stored.user_attrs["measurement"]) == m
    assert config_of(stored) == config
    assert reusable(stored.user_attrs, settings_key="s", enforced_bytes=2000, timeout_s=None) == m


def test_a_memory_trial_is_stored_pruned_with_its_figures_and_a_timing_completes_it(study):
    config = Config("bf16", "all", 2)
    keys = {"settings_key": "s", "budget_bytes": 2000, "timeout_s": None}
    memory = Measurement(config, "ok", peak_bytes=1234, timed=False)
    record(study, ask(study, config), memory, keys)
    timing = dataclasses.replace(memory, timed=True, step_s=0.5, samples_per_s=4.0, memory_from=0)
    record(study, ask(study, config), timing, keys)
    first, second = study.get_trials(deepcopy=False)
    assert state_of(memory) == first.state == TrialState.PRUNED and first.values is None  # no samples/s objective
    assert first.user_attrs["figures"] == "memory" and first.user_attrs["status"] == "ok"
    assert second.state == TrialState.COMPLETE and second.values == [4.0, 1234.0]
    assert second.user_attrs["figures"] == "memory+time" and second.user_attrs["measurement"]["memory_from"] == 0
    assert [t.number for t in study.best_trials] == [second.number]  # Optuna's front leaves the memory trial out


def test_record_of_a_trial_another_worker_closed_writes_nothing_and_says_so(study):
    config = Config("fp32", "2", 4)
    trial = ask(study, config)
    abandon(study, study.get_trials(deepcopy=False)[0], "abandoned")  # judged stale elsewhere meanwhile
    assert record(study, trial, ok(config), {"settings_key": "s"}) is False  # the caller decides (search._Loop.keep)
    (only,) = study.get_trials(deepcopy=False)
    assert only.state == TrialState.FAIL and only.user_attrs["status"] == "abandoned"
    assert "measurement" not in only.user_attrs


def test_start_trial_writes_a_running_trial_with_its_parameters_and_attributes_at_once(study):
    study.enqueue_trial({"precision": "bf16", "segments": "all", "batch_size": 4})  # a queue it leaves alone
    config = Config("fp32", "2", 4)
    trial = start_trial(study, config, distributions(SPACE), {"worker": "host:ns:1"})
    queued, started = study.get_trials(deepcopy=False)
    assert queued.state == TrialState.WAITING
    assert started.number == trial.number == 1 and started.state == TrialState.RUNNING
    assert config_of(started) == config == Config.from_dict(started.params) and started.user_attrs == {"worker": "host:ns:1"}
    assert record(study, trial, ok(config), {"settings_key": "s"})  # the live trial stores like one from ask()
    assert study.get_trials(deepcopy=False)[1].state == TrialState.COMPLETE


def test_a_write_that_fails_while_the_trial_runs_is_tried_again_not_stored_twice(study, monkeypatch):
    # A busy SQLite file refuses the tell of a trial that is still running: storing the measurement as a
    # new trial would count the configuration twice (two workers' test saw 17 trials of a 16-point space).
    config = Config("fp32", "2", 4)
    trial = ask(study, config)
    tell, calls = study.tell, []

    def busy_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise optuna.exceptions.StorageInternalError("(sqlite3.OperationalError) database is locked")
        return tell(*args, **kwargs)

    monkeypatch.setattr(study, "tell", busy_once)
    monkeypatch.setattr("autotune.search.store.time.sleep", lambda s: None)
    record(study, trial, ok(config), {"settings_key": "s"})
    (stored,) = study.get_trials(deepcopy=False)
    assert len(calls) == 2 and stored.state == TrialState.COMPLETE and "measurement" in stored.user_attrs


def test_abandon_fails_a_running_trial_so_it_is_proposed_again(study):
    trial = ask(study, Config("fp32", "0", 1))
    abandon(study, trial, "interrupted")
    (stored,) = study.get_trials(deepcopy=False)
    assert stored.state == TrialState.FAIL and stored.user_attrs["status"] == "interrupted"
    assert "measurement" not in stored.user_attrs
    assert reusable(stored.user_attrs, settings_key="s", enforced_bytes=None, timeout_s=None) is None


def test_abandon_leaves_a_finished_trial_as_it_is(study):
    config = Config("fp32", "0", 1)
    trial = ask(study, config)
    record(study, trial, ok(config), {"settings_key": "s"})
    abandon(study, study.get_trials(deepcopy=False)[0], "abandoned")  # raises nothing
    (stored,) = study.get_trials(deepcopy=False)
    assert stored.state == TrialState.COMPLETE and stored.user_attrs["status"] == "ok"


def test_config_of_a_queued_trial_reads_its_queued_parameters(study):
    study.enqueue_trial({"precision": "bf16", "segments": "all", "batch_size": 4})
    study.ask()  # taken from the queue; its parameters are not written yet
    (running,) = study.get_trials(deepcopy=False)
    assert running.params == {} and config_of(running) == Config("bf16", "all", 4)
    study.ask()  # a trial with nothing queued says nothing
    assert config_of(study.get_trials(deepcopy=False)[1]) is None


def test_a_signal_inside_a_shielded_store_write_waits_for_its_end():
    # A Ctrl-C inside study.ask() once left a RUNNING trial nobody closed (test_reliability's SIGTERM test).
    import os
    import signal

    from autotune.signals import shielded

    done = []
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job's SIGINT may be ignored
    try:
        with pytest.raises(KeyboardInterrupt):
            with shielded():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("the write went on")
        assert done == ["the write went on"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler before the block is back
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("stored_host, host, reused", [
    (1000, 2000, False),  # ran out of a smaller host budget than today's: its host copies may fit now
    (2000, 1000, True),
    (1000, None, False),  # no host budget today
])
def test_a_host_oom_is_reused_only_under_a_host_budget_no_larger(stored_host, host, reused):
    m = Measurement(Config("fp32", "0+offload", 64), "oom", peak_bytes=10, host_peak_bytes=1001,
                    error="HostBudgetExceededError: host memory: activation offload tried to hold 1001 bytes")
    stored = {**attrs(m, budget=5000), "host_budget_bytes": stored_host}
    got = reusable(stored, settings_key="s", enforced_bytes=5000, timeout_s=None, host_budget_bytes=host)
    assert (got == m) is reused
    device_oom = dataclasses.replace(m, error="DefaultCPUAllocator: can't allocate memory")  # the device's: as before
    assert reusable({**attrs(device_oom, budget=5000), "host_budget_bytes": stored_host}, settings_key="s",
                    enforced_bytes=5000, timeout_s=None, host_budget_bytes=host) == device_oom


@pytest.mark.parametrize("host, reused", [(4000, True), (3000, False), (None, True)])
def test_an_offloaded_success_is_not_reused_under_a_host_budget_it_would_pass(host, reused):
    m = Measurement(Config("fp32", "0+state", 64), "ok", peak_bytes=10, host_peak_bytes=3500)
    got = reusable({**attrs(m, budget=5000), "host_budget_bytes": 8000}, settings_key="s", enforced_bytes=5000,
                   timeout_s=None, host_budget_bytes=host)
    assert (got == m) is reused
