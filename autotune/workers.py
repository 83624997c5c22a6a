"""Several workers on one study: who runs what, who is still alive, and who claimed a configuration first.

Workers with the same storage and study share the work: each skips configurations finished or
running elsewhere; a configuration claimed by two workers at once is kept by the lower-numbered
trial. A running trial's worker stamps it every HEARTBEAT_S seconds; a RUNNING trial whose worker
is gone (its process no longer exists on this machine, or its stamp stopped moving for STALE_S of
our clock) is closed as failed and measured again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from typing import Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune._log import logger
from autotune.records import Config, Measurement
from autotune.store import FINISHED, abandon, config_of, reusable, stamp

__all__ = ["HEARTBEAT_S", "STALE_S", "worker_id", "is_alive", "Heartbeat", "survey", "claim"]

HEARTBEAT_S = 10.0  # a running trial's worker stamps it this often
STALE_S = 120.0  # a running trial of another machine whose stamp is older than this is abandoned


def _pid_namespace() -> str:
    """An id of this process's PID namespace and boot: PIDs can be checked only within the same one."""
    try:
        namespace = os.readlink("/proc/self/ns/pid").strip("pid:[]")
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{namespace}-{f.read().strip()[:8]}"  # after a reboot, old PIDs name other processes
    except OSError:
        return ""


def worker_id() -> str:
    """``HOST:PIDNS:PID``, the identity a worker stamps on the trials it runs."""
    return f"{socket.gethostname()}:{_pid_namespace()}:{os.getpid()}"


def is_alive(trial: FrozenTrial, now: float, stamps: dict[int, tuple[float, float]]) -> bool:
    """Whether a RUNNING trial's worker is still at it: its process exists, or its stamp still moves.

    ``stamps`` maps trial numbers to (last stamp seen, when we first saw it, by our clock): another
    machine's trial is abandoned only when its heartbeat has not changed for STALE_S of our time,
    so clocks that disagree between machines do not matter.
    """
    host, ns, pid = (str(trial.user_attrs.get("worker", "")).rsplit(":", 2) + ["", "", ""])[:3]
    if host == socket.gethostname() and ns == _pid_namespace() and pid.isdigit():
        if int(pid) == os.getpid():
            return False  # ours, from before: this process runs one trial at a time
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    stamp = trial.user_attrs.get("heartbeat")
    seen = stamps.get(trial.number)
    if seen is None or seen[0] != stamp:
        stamps[trial.number] = (stamp, now)
        return True
    return now - seen[1] < STALE_S


class Heartbeat:
    """Stamp a running trial every HEARTBEAT_S seconds, from a background thread."""

    def __init__(self, study: optuna.Study, trial: optuna.Trial) -> None:
        self._study, self._trial = study, trial
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autotune-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a missed stamp only makes the trial look older
                stamp(self._study, self._trial, "heartbeat", time.time())

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def survey(study: optuna.Study, configs: set[Config], settings_key: str, budget_bytes: int | None,
            timeout_s: float | None, stamps: dict[int, tuple[float, float]],
            numbers: dict[Config, int] | None = None) -> tuple[dict[Config, Measurement], set[Config]]:
    """Read the store: reusable measurements, and configurations other workers are running now.

    Trials left RUNNING by a worker that is gone are marked failed, so they are measured again;
    so are trials a worker took from the queue but never stamped (it died in between). A
    configuration measured so far only for memory can be running too (its timing). ``numbers``,
    when given, receives the trial number of each measurement.
    """
    measured: dict[Config, Measurement] = {}
    in_flight: set[Config] = set()
    now = time.monotonic()
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        if t.state in FINISHED:
            m = reusable(t.user_attrs, settings_key=settings_key, budget_bytes=budget_bytes, timeout_s=timeout_s)
            if m is not None and m.config in configs:
                measured[m.config] = m  # later trials of the same configuration win
                if numbers is not None:
                    numbers[m.config] = t.number
        elif t.state == TrialState.RUNNING and "worker" not in t.user_attrs:
            if not is_alive(t, now, stamps):  # keyed on its (absent) stamp: abandoned after STALE_S unstamped
                logger.info("trial %d was taken from the queue but never started: it will be measured again", t.number)
                abandon(study, t, "abandoned")
            elif config_of(t) is not None:
                in_flight.add(config_of(t))
        elif t.state == TrialState.RUNNING:
            if is_alive(t, now, stamps) and config_of(t) is not None:
                in_flight.add(config_of(t))
            else:
                logger.info("trial %d (%s) was left running by %s, which is gone: it will be measured again",
                            t.number, t.params, t.user_attrs["worker"])
                abandon(study, t, "abandoned")
    return measured, {c for c in in_flight if c not in measured or measured[c].memory_only}


def claim(study: optuna.Study, config: Config, distributions: dict, *, settings_key: str,
           budget_bytes: int | None, enough: Callable[[Measurement], bool] = lambda m: True) -> optuna.Trial | None:
    """Start a trial of ``config`` (or of another worker's queued configuration); None if already taken.

    A finished trial of the configuration takes it when ``enough`` says its measurement has what
    this trial would measure (a memory trial does not take a timing that completes it).
    """
    study.enqueue_trial(dataclasses.asdict(config))
    trial = study.ask(distributions)
    try:
        trial.set_user_attr("worker", worker_id())
        trial.set_user_attr("heartbeat", time.time())
        config = Config(**trial.params)
        for other in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, *FINISHED)):
            if other.number == trial.number or config_of(other) != config:
                continue
            stored = reusable(other.user_attrs, settings_key=settings_key, budget_bytes=budget_bytes,
                              timeout_s=None) if other.state in FINISHED else None
            taken = (other.state == TrialState.RUNNING and other.number < trial.number) or (
                stored is not None and enough(stored))
            if taken:  # another worker claimed or finished the same configuration first
                abandon(study, trial, "duplicate")
                return None
    except BaseException:
        abandon(study, trial, "interrupted")
        raise
    return trial
