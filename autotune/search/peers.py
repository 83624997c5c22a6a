"""Several peers on one study: who runs what, who is still alive, and who claimed a configuration first.

A *peer* is a process searching a study that others search too (several GPUs or nodes, one storage); it is not
the *worker* process a trial may run in (:mod:`autotune.execution.spawn`, ``--trials-per-worker``), nor a
DataLoader's worker (``--num-workers``). The trial store keeps a running trial's peer as its ``worker`` attribute,
the name stored studies already use.

Peers with the same storage and study share the work: each skips configurations finished or
running elsewhere; a configuration claimed by two peers at once is kept by the lower-numbered
trial (:func:`claim`). A running trial's peer stamps it every HEARTBEAT_S seconds; a RUNNING
trial whose peer is gone (its process no longer exists on this machine, or its stamp stopped
moving for STALE_S of our clock) is closed as failed and measured again. A peer with nothing
to claim waits (:class:`Waiter`): it reads the store less and less often, writes nothing, and is
woken early when a store in a file changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import socket
import threading
import time
from typing import Callable, Collection

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune._log import logger
from autotune.records import Config, Measurement
from autotune.search.store import FINISHED, abandon, config_of, reusable, stamp, start_trial

__all__ = ["HEARTBEAT_S", "STALE_S", "FIRST_WAIT_S", "WAIT_S", "GRACE_S", "peer_id", "is_alive", "Heartbeat",
           "Waiter", "survey", "claim"]

HEARTBEAT_S = 10.0  # a running trial's peer stamps it this often
STALE_S = 120.0  # a running trial of another machine whose stamp is older than this is abandoned
FIRST_WAIT_S = 0.05  # a waiting peer's first wait; each wait without news doubles it, up to WAIT_S
WAIT_S = 1.0  # the longest a waiting peer goes without reading the store
GRACE_S = 0.25  # a waiter woken by a change lets the peer that made it claim its next trial first
_POLL_S = 0.02  # how often a waiter looks at a store file's size and time


def _pid_namespace() -> str:
    """An id of this process's PID namespace and boot: PIDs can be checked only within the same one."""
    try:
        namespace = os.readlink("/proc/self/ns/pid").strip("pid:[]")
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{namespace}-{f.read().strip()[:8]}"  # after a reboot, old PIDs name other processes
    except OSError:
        return ""


def peer_id() -> str:
    """``HOST:PIDNS:PID``, the identity a peer stamps on the trials it runs."""
    return f"{socket.gethostname()}:{_pid_namespace()}:{os.getpid()}"


def is_alive(trial: FrozenTrial, now: float, stamps: dict[int, tuple[float, float]]) -> bool:
    """Whether a RUNNING trial's peer is still at it: its process exists, or its stamp still moves.

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


@dataclasses.dataclass(frozen=True)
class Survey:
    """What a look at the store found: the reusable ``measured`` (each configuration's latest), and the
    configurations peers are running now (``in_flight``)."""

    measured: dict[Config, Measurement]
    in_flight: set[Config]


def survey(study: optuna.Study, configs: set[Config], settings_key: str, enforced_bytes: int | None,
           timeout_s: float | None, stamps: dict[int, tuple[float, float]],
           numbers: dict[Config, int] | None = None,
           seen: set[int] | None = None, host_budget_bytes: int | None = None) -> Survey:
    """Read the store: reusable measurements, and configurations other peers are running now.

    Trials left RUNNING by a peer that is gone are marked failed, so they are measured again;
    so are trials a peer took from the queue but never stamped (it died in between). A
    configuration measured already can be running too (the timing that completes a memory trial, or
    a near tie timed again): it is in flight all the same, so that no peer proposes it meanwhile
    and every peer waits for its figures. ``numbers``, when given, receives the trial number of
    each measurement; ``seen`` the numbers of every finished trial that holds a measurement (what
    :func:`claim` compares the store with).
    """
    measured: dict[Config, Measurement] = {}
    in_flight: set[Config] = set()
    now = time.monotonic()
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        if t.state in FINISHED:
            if seen is not None and "measurement" in t.user_attrs:
                seen.add(t.number)
            m = reusable(t.user_attrs, settings_key=settings_key, enforced_bytes=enforced_bytes, timeout_s=timeout_s,
                         host_budget_bytes=host_budget_bytes)
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
    return Survey(measured, in_flight)


def claim(study: optuna.Study, config: Config, distributions: dict, *, settings_key: str, enforced_bytes: int | None,
          timeout_s: float | None, enough: Callable[[Measurement], bool] = lambda m: True,
          seen: Collection[int] | None = None, host_budget_bytes: int | None = None) -> optuna.Trial | None:
    """Start a trial of ``config``; None if another peer has it, or the store has news (nothing written, or our
    trial closed as ``duplicate`` or ``stale``).

    The store is read first: a configuration taken since the peer's last look costs no write.
    Then the claim is a RUNNING trial of the configuration, stamped with this peer, created in
    one write (:func:`autotune.search.store.start_trial`), and the store is read again. Stores number
    trials in the order their writes land (a database locks the study to number a new trial, a
    journal is one ordered log), so of two peers claiming one configuration at once, the later
    claim's reader sees the earlier claim: the lowest-numbered RUNNING trial of a configuration
    keeps it, whatever the timing. A finished trial takes the configuration when ``enough`` says
    its measurement has what this trial would measure (a memory trial does not take the timing
    that completes it).

    ``seen`` (the finished trials of the peer's last look, :func:`survey`) makes the claim stand
    only on the look it was decided on: a measurement stored since then (by a peer that may have
    just seen the search end) closes the claim, and the peer looks again. So no peer runs a
    trial that another, having read a later store, judged not to be needed: every peer's report
    holds the same trials.
    """
    def taken(ours: int | None) -> str | None:
        """Why ``config`` is not ours to run (a RUNNING trial of it numbered below ``ours``, any if None), or None."""
        for other in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, *FINISHED)):
            if other.number == ours:
                continue
            if other.state == TrialState.RUNNING:
                if config_of(other) == config and (ours is None or other.number < ours):
                    return "duplicate"
                continue
            if seen is not None and "measurement" in other.user_attrs and other.number not in seen:
                return "stale"
            if config_of(other) == config:
                stored = reusable(other.user_attrs, settings_key=settings_key, enforced_bytes=enforced_bytes,
                                  timeout_s=timeout_s, host_budget_bytes=host_budget_bytes)
                if stored is not None and enough(stored):
                    return "duplicate"
        return None

    if taken(None):
        return None
    trial = start_trial(study, config, distributions, {"worker": peer_id(), "heartbeat": time.time()})
    try:
        why = taken(trial.number)
        if why:  # another peer claimed or finished the same configuration first, or stored news
            abandon(study, trial, why)
            return None
    except BaseException:
        abandon(study, trial, "interrupted")
        raise
    return trial


class Waiter:
    """How a peer with nothing to claim waits for the store to change, writing nothing meanwhile.

    Each :meth:`wait` is twice the one before (FIRST_WAIT_S up to WAIT_S) until :meth:`reset`
    (the peer found news, or claimed a trial). A store in a file (SQLite, a journal) is watched
    between reads by its size and modification time, so a waiter wakes as soon as another peer
    writes; it then waits GRACE_S more, so that the peer who wrote, which claims its next trial
    at once, is not met by every waiter claiming the same configuration. A database server has no
    such cheap signal: its waiters read it at most every WAIT_S.
    """

    def __init__(self, storage: str) -> None:
        self._paths = _store_files(storage)
        self._delay = FIRST_WAIT_S
        self._lost = 0  # claims lost in a row

    def reset(self) -> None:
        """News in the store: the next wait is short again."""
        self._delay = FIRST_WAIT_S

    def claimed(self) -> None:
        """A claim won: news, and the end of a run of lost claims."""
        self.reset()
        self._lost = 0

    def wait(self) -> None:
        """Wait until the store changes or the current back-off ends, whichever comes first."""
        deadline = time.monotonic() + self._delay
        self._delay = min(2 * self._delay, WAIT_S)
        before = self._signature()
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(_POLL_S, left) if before is not None else left)
            if before is not None and self._signature() != before:
                time.sleep(GRACE_S * random.uniform(1.0, 2.0))
                return

    def lost(self) -> None:
        """After a claim lost to a peer that claimed the same configuration at the same moment: wait a
        random moment, so that peers in step fall out of it; longer after each loss in a row, so that
        no peer can claim in a tight loop, whatever its strategy proposes."""
        self._lost += 1
        time.sleep(random.uniform(0.0, min(GRACE_S * 2 ** (self._lost - 1), WAIT_S)))

    def _signature(self) -> tuple | None:
        if self._paths is None:
            return None
        return tuple(_stat(path) for path in self._paths)


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:  # not there (yet), like a write-ahead log between writes
        return None
    return st.st_size, st.st_mtime_ns


def _store_files(storage: str) -> tuple[str, ...] | None:
    """The files a storage URL writes to (SQLite with its journals; a journal file), or None for a server."""
    if storage.startswith("journal://"):
        return (storage[len("journal://"):],)
    if storage.startswith("sqlite:///"):
        path = storage[len("sqlite:///"):].partition("?")[0]
        return path, f"{path}-wal", f"{path}-journal"
    return None
