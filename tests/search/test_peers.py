"""Several peers on one study (processes sharing its storage): who is alive, who claimed a configuration first, what a survey reads."""

import dataclasses
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from optuna.trial import TrialState

from autotune.search import peers as workers
from autotune.records import Config, Measurement
from autotune.search.space import SearchSpace
from autotune.search.store import distributions, open_study, record
from autotune.search.peers import Heartbeat, claim, is_alive, survey, peer_id
from tests.paths import ROOT

SPACE = SearchSpace(("fp32", "bf16"), ("0", "all"), (1, 2, 4))
DIST = distributions(SPACE)
A, B = Config("fp32", "0", 2), Config("bf16", "all", 4)


@pytest.fixture
def study(tmp_path):
    return open_study("s", f"sqlite:///{tmp_path / 'trials.db'}", workload_key="wk", space=SPACE)


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # exited and reaped: its pid names no process
    return proc.pid


def here(pid):
    """The worker id a process ``pid`` on this machine would stamp."""
    host, ns, _ = peer_id().rsplit(":", 2)
    return f"{host}:{ns}:{pid}"


def running(study, config, **user_attrs):
    """A RUNNING trial of ``config`` with ``user_attrs``, as read back from the store."""
    study.enqueue_trial(config.to_dict())
    trial = study.ask(DIST)
    for key, value in user_attrs.items():
        trial.set_user_attr(key, value)
    return next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)


def finished(study, m, settings_key="s", budget=None):
    study.enqueue_trial(m.config.to_dict())
    trial = study.ask(DIST)
    record(study, trial, m, {"settings_key": settings_key, "budget_bytes": budget, "timeout_s": None})


def ok(config):
    return Measurement(config, "ok", peak_bytes=1000, samples_per_s=10.0)


def states(study):
    return {t.number: (t.state, t.user_attrs.get("status")) for t in study.get_trials(deepcopy=False)}


# --- peer_id -----------------------------------------------------------------------------------


def test_peer_id_is_host_pid_namespace_and_pid():
    host, ns, pid = peer_id().rsplit(":", 2)
    assert host == socket.gethostname() and pid == str(os.getpid())
    assert re.fullmatch(r"\d+-[0-9a-f-]{8}", ns), ns  # the namespace's inode and the boot's id


def test_another_process_here_has_the_same_host_and_namespace_and_its_own_pid():
    out = subprocess.run([sys.executable, "-c", "import os; from autotune.search.peers import peer_id; "
                          "print(peer_id()); print(os.getpid())"], capture_output=True, text=True, cwd=ROOT, check=True)
    theirs, pid = out.stdout.split()
    assert theirs == here(pid) and theirs != peer_id()


# --- is_alive ------------------------------------------------------------------------------------


def test_our_own_pid_is_a_trial_from_before(study):
    t = running(study, A, worker=peer_id(), heartbeat=time.time())
    assert is_alive(t, time.monotonic(), {}) is False  # this process runs one trial at a time


def test_a_live_process_on_this_machine_is_alive(study, live_pid):
    t = running(study, A, worker=here(live_pid), heartbeat=0.0)
    stamps = {}
    for now in (0.0, 10**6, 10**9):  # however old its stamp: the process is there
        assert is_alive(t, now, stamps) is True


def test_a_dead_process_on_this_machine_is_gone_at_once(study, dead_pid):
    t = running(study, A, worker=here(dead_pid), heartbeat=time.time())
    assert is_alive(t, 0.0, {}) is False


def test_another_machines_trial_lives_while_its_heartbeat_moves(study):
    stale = workers.STALE_S
    t = running(study, A, worker="elsewhere.example:4026531836-0123abcd:1234", heartbeat=1.0)
    stamps = {}
    assert is_alive(t, 1000.0, stamps) is True  # first seen now
    assert stamps[t.number] == (1.0, 1000.0)
    assert is_alive(t, 1000.0 + stale - 1, stamps) is True
    assert is_alive(t, 1000.0 + stale + 1, stamps) is False  # the stamp stood still for STALE_S of our clock
    moved = running(study, B, worker="elsewhere.example:4026531836-0123abcd:1234", heartbeat=2.0)
    stamps[moved.number] = (1.0, 1000.0)  # we saw 1.0 long ago; it has moved since
    assert is_alive(moved, 1000.0 + 10 * stale, stamps) is True
    assert stamps[moved.number] == (2.0, 1000.0 + 10 * stale)


def test_another_pid_namespace_is_judged_by_its_heartbeat_not_its_pid(study, dead_pid):
    host = socket.gethostname()
    t = running(study, A, worker=f"{host}:9999-ffffffff:{dead_pid}", heartbeat=5.0)  # a container's pid: not ours to check
    stamps = {}
    assert is_alive(t, 0.0, stamps) is True
    assert is_alive(t, workers.STALE_S + 1, stamps) is False


def test_a_small_stale_limit_is_read_when_judging(study, monkeypatch):
    monkeypatch.setattr(workers, "STALE_S", 0.5)
    t = running(study, A, worker="elsewhere:ns:1", heartbeat=1.0)
    stamps = {}
    assert is_alive(t, 10.0, stamps) is True
    assert is_alive(t, 10.4, stamps) is True
    assert is_alive(t, 10.6, stamps) is False


# --- claim ---------------------------------------------------------------------------------------


def test_claim_starts_a_trial_stamped_with_this_worker(study):
    trial = claim(study, A, DIST, settings_key="s", enforced_bytes=None, timeout_s=None)
    assert trial is not None and Config.from_dict(trial.params) == A
    (t,) = study.get_trials(deepcopy=False)
    assert t.state == TrialState.RUNNING and t.user_attrs["worker"] == peer_id()
    assert abs(t.user_attrs["heartbeat"] - time.time()) < 3600


def test_a_configuration_running_under_a_lower_numbered_trial_is_not_claimed_again(study):
    first = claim(study, A, DIST, settings_key="s", enforced_bytes=None, timeout_s=None)
    assert claim(study, A, DIST, settings_key="s", enforced_bytes=None, timeout_s=None) is None
    assert states(study) == {first.number: (TrialState.RUNNING, None)}  # seen before claiming: nothing written
    other = claim(study, B, DIST, settings_key="s", enforced_bytes=None, timeout_s=None)  # another configuration is free
    assert other is not None and Config.from_dict(other.params) == B


def test_a_configuration_finished_in_a_reusable_way_is_not_claimed(study):
    finished(study, ok(A))
    assert claim(study, A, DIST, settings_key="s", enforced_bytes=None, timeout_s=None) is None
    assert claim(study, A, DIST, settings_key="other settings", enforced_bytes=None, timeout_s=None) is not None  # measured another way


def test_a_memory_trial_does_not_take_the_timing_that_completes_it_but_a_timed_trial_does(study):
    finished(study, dataclasses.replace(ok(A), timed=False, samples_per_s=None))

    def timed(m):
        return m.timed

    first = claim(study, A, DIST, settings_key="s", enforced_bytes=None, timeout_s=None, enough=timed)
    assert first is not None  # the memory trial has no time: the timing is free to run
    study.tell(first, state=TrialState.FAIL)
    finished(study, ok(A))
    assert claim(study, A, DIST, settings_key="s", enforced_bytes=None, timeout_s=None, enough=timed) is None  # timed by someone


def test_an_oom_under_a_smaller_budget_is_claimed_again(study):
    finished(study, Measurement(A, "oom", peak_bytes=2000), budget=1000)
    assert claim(study, A, DIST, settings_key="s", enforced_bytes=4000, timeout_s=None) is not None


def test_claim_leaves_the_queue_alone(study):
    # Claims once went through Optuna's queue (enqueue_trial + ask): ask() popped another worker's configuration,
    # or one that worker had popped and closed meanwhile (UpdateFinishedTrialError from ask, a worker's exit 1).
    study.enqueue_trial(B.to_dict())  # a queued trial, of another tool or an older autotune
    trial = claim(study, A, DIST, settings_key="s", enforced_bytes=None, timeout_s=None)
    assert Config.from_dict(trial.params) == A
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    assert [t.system_attrs["fixed_params"] for t in waiting] == [B.to_dict()]


@pytest.mark.parametrize("other_first", [True, False])
def test_of_two_claims_at_the_same_moment_the_lower_numbered_keeps_the_configuration(study, monkeypatch, other_first):
    # Another worker's claim of the same configuration lands just before ours, or just after ours and before we
    # read the store: either way one claim is kept, the lower-numbered, whatever each worker read.
    start = workers.start_trial

    def with_another(study, config, distributions, user_attrs):
        if other_first:
            start(study, config, distributions, {"worker": "elsewhere:ns:1", "heartbeat": time.time()})
        ours = start(study, config, distributions, user_attrs)
        if not other_first:
            start(study, config, distributions, {"worker": "elsewhere:ns:1", "heartbeat": time.time()})
        return ours

    monkeypatch.setattr(workers, "start_trial", with_another)
    trial = claim(study, A, DIST, settings_key="s", enforced_bytes=None, timeout_s=None)
    assert (trial is None) is other_first
    ours = 1 if other_first else 0
    assert states(study)[ours] == ((TrialState.FAIL, "duplicate") if other_first else (TrialState.RUNNING, None))


@pytest.mark.parametrize("when", ["before our write", "after our write"])
def test_a_measurement_stored_since_the_workers_look_closes_its_claim(study, monkeypatch, when):
    # Another worker stores a trial, looks, and finds the search done: a claim decided on a look from before that
    # trial must not run, or the two workers' reports would differ (one holds a trial the other never saw).
    finished(study, ok(A))
    seen = set()
    survey(study, set(SPACE.configs()), "s", None, None, {}, seen=seen)
    assert seen == {0}
    start = workers.start_trial

    def with_news(study, config, distributions, user_attrs):
        if when == "before our write":
            finished(study, ok(B))
        ours = start(study, config, distributions, user_attrs)
        if when == "after our write":
            finished(study, ok(B))
        return ours

    monkeypatch.setattr(workers, "start_trial", with_news)
    other = Config("fp32", "all", 1)
    assert claim(study, other, DIST, settings_key="s", enforced_bytes=None, timeout_s=None, seen=seen) is None
    if when == "after our write":
        assert states(study)[1] == (TrialState.FAIL, "stale")
    seen = set()
    survey(study, set(SPACE.configs()), "s", None, None, {}, seen=seen)  # the next look sees the news
    monkeypatch.setattr(workers, "start_trial", start)
    assert claim(study, other, DIST, settings_key="s", enforced_bytes=None, timeout_s=None, seen=seen) is not None


def test_a_timeout_under_todays_limit_takes_the_configuration_as_the_survey_reads_it(study):
    # The claim judges a stored trial as the survey does: a time-out under the same limit is a measurement.
    study.enqueue_trial(A.to_dict())
    record(study, study.ask(DIST), Measurement(A, "timeout", error="cut"), {"settings_key": "s", "timeout_s": 30.0})
    assert claim(study, A, DIST, settings_key="s", enforced_bytes=None, timeout_s=30.0) is None
    assert claim(study, A, DIST, settings_key="s", enforced_bytes=None, timeout_s=60.0) is not None  # a longer limit


# --- survey --------------------------------------------------------------------------------------


def test_survey_reads_reusable_measurements_of_the_space(study):
    finished(study, Measurement(A, "failed", error="first try"))
    finished(study, ok(A))  # a later trial of the same configuration wins
    finished(study, ok(B), settings_key="other")  # measured another way
    outside = Config("fp32", "all", 1)
    finished(study, ok(outside))  # not among the configurations asked about
    found = survey(study, set(SPACE.configs()) - {outside}, "s", None, None, {})
    measured, in_flight = found.measured, found.in_flight
    assert measured == {A: ok(A)} and in_flight == set()


def test_survey_marks_a_trial_left_running_by_a_dead_process_failed(study, dead_pid, live_pid):
    gone = running(study, A, worker=here(dead_pid), heartbeat=time.time())
    alive = running(study, B, worker=here(live_pid), heartbeat=time.time())
    found = survey(study, set(SPACE.configs()), "s", None, None, {})
    measured, in_flight = found.measured, found.in_flight
    assert measured == {} and in_flight == {B}
    assert states(study)[gone.number] == (TrialState.FAIL, "abandoned")
    assert states(study)[alive.number] == (TrialState.RUNNING, None)
    # its configuration is free again
    assert claim(study, A, DIST, settings_key="s", enforced_bytes=None, timeout_s=None) is not None


def test_survey_abandons_a_trial_of_ours_from_before(study):
    mine = running(study, A, worker=peer_id(), heartbeat=time.time())
    in_flight = survey(study, set(SPACE.configs()), "s", None, None, {}).in_flight
    assert in_flight == set() and states(study)[mine.number] == (TrialState.FAIL, "abandoned")


def test_survey_abandons_another_machines_trial_once_its_heartbeat_stops(study, monkeypatch):
    monkeypatch.setattr(workers, "STALE_S", 0.0)  # any time at all without a new stamp is too long
    t = running(study, A, worker="elsewhere:ns:1", heartbeat=1.0)
    stamps = {}
    in_flight = survey(study, set(SPACE.configs()), "s", None, None, stamps).in_flight
    assert in_flight == {A}  # first seen: given the benefit of the doubt
    in_flight = survey(study, set(SPACE.configs()), "s", None, None, stamps).in_flight
    assert in_flight == set() and states(study)[t.number] == (TrialState.FAIL, "abandoned")


def test_survey_abandons_a_queued_trial_that_was_never_stamped(study, monkeypatch):
    monkeypatch.setattr(workers, "STALE_S", 0.0)
    study.enqueue_trial(B.to_dict())
    taken = study.ask()  # a worker took it from the queue and died before writing anything
    stamps = {}
    in_flight = survey(study, set(SPACE.configs()), "s", None, None, stamps).in_flight
    assert in_flight == {B}  # its queued parameters say what it would run
    in_flight = survey(study, set(SPACE.configs()), "s", None, None, stamps).in_flight
    assert in_flight == set() and states(study)[taken.number] == (TrialState.FAIL, "abandoned")


def test_a_configuration_both_measured_and_running_is_in_flight(study, live_pid):
    # A near tie timed again elsewhere: no worker proposes it meanwhile (a worker that did lost its claim, looked
    # again, proposed it again: hundreds of FAIL trials), and every worker waits for its figures.
    finished(study, ok(A))
    running(study, A, worker=here(live_pid), heartbeat=time.time())
    found = survey(study, set(SPACE.configs()), "s", None, None, {})
    measured, in_flight = found.measured, found.in_flight
    assert A in measured and in_flight == {A}


def test_a_memory_trial_being_timed_elsewhere_is_in_flight(study, live_pid):
    memory = dataclasses.replace(ok(A), timed=False, samples_per_s=None)
    finished(study, memory)
    running(study, A, worker=here(live_pid), heartbeat=time.time())
    numbers = {}
    found = survey(study, set(SPACE.configs()), "s", None, None, {}, numbers)
    measured, in_flight = found.measured, found.in_flight
    assert measured == {A: memory} and in_flight == {A}  # its timing runs: wait for it rather than time it twice
    assert numbers == {A: 0}


# --- Heartbeat -----------------------------------------------------------------------------------


def test_heartbeat_stamps_the_running_trial_until_it_stops(study, monkeypatch):
    monkeypatch.setattr(workers, "HEARTBEAT_S", 0.01)
    trial = claim(study, A, DIST, settings_key="s", enforced_bytes=None, timeout_s=None)
    trial.set_user_attr("heartbeat", 0.0)

    def stamp():
        return study.get_trials(deepcopy=False)[0].user_attrs["heartbeat"]

    with Heartbeat(study, trial) as beat:
        deadline = time.monotonic() + 30
        while stamp() == 0.0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stamp() > 0.0
    assert not beat._thread.is_alive()
    after = stamp()
    time.sleep(0.1)
    assert stamp() == after  # no stamps once the trial's worker is done with it


# --- Waiter --------------------------------------------------------------------------------------


class Clock:
    """time.monotonic and time.sleep of the workers module, on a clock that moves only when slept on."""

    def __init__(self, monkeypatch, on_sleep=lambda clock: None):
        self.now, self.sleeps, self.on_sleep = 0.0, [], on_sleep
        monkeypatch.setattr(workers.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(workers.time, "sleep", self.sleep)

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds
        self.on_sleep(self)


def test_a_waiter_backs_off_to_wait_s_and_starts_again_after_news(monkeypatch):
    clock = Clock(monkeypatch)
    waiter = workers.Waiter("postgresql://host/db")  # a server: no file to watch, one sleep per wait
    for _ in range(8):
        waiter.wait()
    expected = [min(workers.FIRST_WAIT_S * 2 ** i, workers.WAIT_S) for i in range(8)]
    assert clock.sleeps == pytest.approx(expected) and clock.sleeps[-1] == workers.WAIT_S
    waiter.reset()
    waiter.wait()
    assert clock.sleeps[-1] == pytest.approx(workers.FIRST_WAIT_S)


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_waiter_on_a_store_file_wakes_when_another_worker_writes(tmp_path, monkeypatch, kind):
    storage = {"sqlite": f"sqlite:///{tmp_path}/w.db", "journal": f"journal://{tmp_path}/w.log"}[kind]
    study = open_study("w", storage, workload_key="wk", space=SPACE)
    monkeypatch.setattr(workers, "FIRST_WAIT_S", 60.0)

    def another_worker_writes(clock):
        if len(clock.sleeps) == 3:
            claim(study, A, DIST, settings_key="s", enforced_bytes=None, timeout_s=None)

    clock = Clock(monkeypatch, another_worker_writes)
    workers.Waiter(storage).wait()
    assert len(clock.sleeps) == 4  # three polls, the write, then the grace that lets the writer claim first
    assert workers.GRACE_S <= clock.sleeps[-1] <= 2 * workers.GRACE_S and clock.now < 60.0


def test_claims_lost_in_a_row_wait_longer_up_to_wait_s_until_one_is_won(monkeypatch):
    monkeypatch.setattr(workers.random, "uniform", lambda lo, hi: hi)  # the longest wait each time
    clock = Clock(monkeypatch)
    waiter = workers.Waiter("postgresql://host/db")
    for _ in range(5):
        waiter.lost()
    assert clock.sleeps == [workers.GRACE_S, 2 * workers.GRACE_S, workers.WAIT_S, workers.WAIT_S, workers.WAIT_S]
    waiter.claimed()
    waiter.lost()
    assert clock.sleeps[-1] == workers.GRACE_S
