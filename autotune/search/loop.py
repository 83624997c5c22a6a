"""The search loop: a strategy's proposals become trials of the study until the strategy is done.

Each round reads the store (:func:`autotune.search.peers.survey`: measurements to reuse, trials other
peers run now), asks the strategy for a configuration, claims it (:func:`autotune.search.peers.claim`)
and runs it as a real training trial at the venue it was given (:mod:`autotune.execution.venue`:
this process, a worker process, every rank of a job), then records it (:mod:`autotune.search.store`).

* **Resume.** Finished trials are reused when they were measured the same way (trial settings,
  and for an OOM a budget at least as large). A trial left RUNNING by a process that is gone is
  marked failed and measured again.
* **Parallel peers.** Several processes with the same storage and study share the work; a
  peer whose strategy is done, or waits for another's trial, or lost a claim to a peer that
  claimed the same configuration at the same moment, waits without writing to the store
  (:class:`autotune.search.peers.Waiter`) and looks again, so every peer's report holds the same
  measurements.
* **Interruption.** Ctrl-C marks the running trial failed (it is re-run next time) and raises
  :class:`SearchInterrupted` with everything measured so far.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from typing import Callable

import optuna

from autotune._log import logger
from autotune.errors import AutotuneError
from autotune.execution.trial import TrialWork
from autotune.execution.work import Venue
from autotune.records import Config, Measurement, TrialSettings, completed, retimed
from autotune.search.space import SearchSpace
from autotune.search.store import abandon, distributions, fingerprint, open_study, quiet_optuna, record
from autotune.signals import shielded
from autotune.search.strategies import Proposal, Strategy
from autotune.search.peers import Heartbeat, Waiter, claim, survey
from autotune.training.workload import Workload
from autotune.vocabulary import Status

__all__ = ["SearchResult", "SearchInterrupted", "run_search"]


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The measurements of one search, in the order of the space, and how they were obtained."""

    measurements: tuple[Measurement, ...]
    n_run: int  # trials run by this peer
    n_reused: int  # trials taken from the store: measured earlier, or by other peers
    wall_s: float
    study_name: str
    storage: str
    partial: bool = False  # True when the search was interrupted before its strategy was done
    predictions: tuple[Measurement, ...] = ()  # what the search started from (autotune.search.predicted)
    seeding: dict | None = None  # how they were made (the report's search.predictions)
    notices: tuple[str, ...] = ()


class SearchInterrupted(AutotuneError):
    """The search was interrupted (Ctrl-C); ``result`` holds what was measured so far."""

    def __init__(self, result: SearchResult) -> None:
        super().__init__("interrupted; finished trials are kept in the store")
        self.result = result


class _Loop:
    """One peer's search: what it has seen of the store, what it ran, and the trial it is running."""

    def __init__(self, study: optuna.Study, storage: str, space: SearchSpace, *, settings: TrialSettings,
                 enforced_bytes: int | None, on_trial: Callable[[Measurement, bool], None] | None) -> None:
        self.study, self.storage, self.space, self.settings, self.enforced_bytes = study, storage, space, settings, enforced_bytes
        self.on_trial = on_trial
        # How a trial trains, without its time limit (a time-out is judged against the limit it ran under).
        # Limits, not how a trial trains: a study resumed with another time limit or host budget keeps its trials
        self.settings_key = fingerprint(**{k: v for k, v in dataclasses.asdict(settings).items()
                                           if k not in ("timeout_s", "host_budget_bytes")})
        self.attrs = {"budget_bytes": enforced_bytes, "settings_key": self.settings_key, "timeout_s": settings.timeout_s,
                      "host_budget_bytes": settings.host_budget_bytes}
        self.distributions = distributions(space)
        self.configs = set(space.configs())
        self.stamps: dict[int, tuple[float, float]] = {}
        self.numbers: dict[Config, int] = {}  # the store's trial number of each measurement
        self.mine: set[Config] = set()
        self.runs = 0  # trials this peer ran (a configuration timed after its memory trial counts twice)
        self.reported: dict[Config, tuple] = {}  # what on_trial last heard of each configuration
        self.measured: dict[Config, Measurement] = {}
        self.trial: optuna.Trial | None = None  # the trial this peer is running, if any
        self.finished: Measurement | None = None  # its measurement, once taken and until stored
        self.in_flight: set[Config] = set()  # what other peers ran at the last look
        self.seen: set[int] = set()  # the finished trials with a measurement at the last look

    def look(self) -> bool:
        """Read the store; report measurements not seen before; return whether anything changed since the last look."""
        self.seen = set()
        found = survey(self.study, self.configs, self.settings_key, self.enforced_bytes, self.settings.timeout_s,
                       self.stamps, self.numbers, self.seen, host_budget_bytes=self.settings.host_budget_bytes)
        self.measured, in_flight = found.measured, found.in_flight
        news = in_flight != self.in_flight
        self.in_flight = in_flight
        for config, m in self.measured.items():
            seen = (m.status, m.timed, m.timings)  # a timing that completes a memory trial is news too
            if self.reported.get(config) != seen:
                self.reported[config] = seen
                news = True
                if self.on_trial:
                    self.on_trial(m, config not in self.mine)
        return news

    def enough(self, m: Measurement) -> bool:
        """Whether a stored trial measured what a trial of its configuration would add now."""
        earlier = self.measured.get(m.config)
        if earlier is None or earlier.status != Status.OK:
            return True  # measured: nothing to add
        return m.timed and m.timings > (earlier.timings if earlier.timed else 0)

    def claim(self, config: Config, *, on_the_look: bool = True) -> optuna.Trial | None:
        """Start a trial of ``config`` as the running trial (None: another peer has it, or, ``on_the_look``, the
        store has measurements the last look did not see)."""
        with shielded():  # a Ctrl-C before the trial is ours to close (self.trial) would leave it RUNNING
            self.trial = claim(self.study, config, self.distributions, settings_key=self.settings_key,
                               enforced_bytes=self.enforced_bytes, timeout_s=self.settings.timeout_s,
                               enough=self.enough, seen=self.seen if on_the_look else None,
                               host_budget_bytes=self.settings.host_budget_bytes)
        return self.trial

    def measure(self, proposal: Proposal, run: Callable[..., Measurement], slows_steps: bool) -> Measurement:
        """Run the proposal (``run(timed=, metered=)``); a timing of a configuration measured before joins its figures.

        With a meter that slows steps (the tensor meter) the timing runs unmetered and the peaks are
        the memory trial's; with one that does not (CUDA) the timing trial measures both itself.
        """
        earlier = self.measured.get(proposal.config)
        if earlier is None or earlier.status != Status.OK:
            return run(timed=proposal.timed, metered=True)
        timing = run(timed=True, metered=not slows_steps)
        if earlier.timed:
            return retimed(earlier, timing)  # a near tie timed again: the steps of both runs
        return completed(earlier, timing, self.numbers.get(proposal.config)) if slows_steps else timing

    def keep(self, m: Measurement) -> None:
        """Store the running trial's measurement and count it as this peer's.

        If another peer closed the trial meanwhile (it judged the trial stale: its heartbeat
        stalled), the measurement is stored under a new claim of its configuration, unless the
        configuration is measured or running elsewhere by now: then it is given up with a notice,
        so that nothing is measured twice.
        """
        self.finished = m
        with shielded():  # stored and counted whole: a Ctrl-C half-way would store it twice or leave it RUNNING
            stored = record(self.study, self.trial, m, self.attrs)
            if not stored:
                closed = self.trial.number
                self.claim(m.config, on_the_look=False)  # measured already: whatever the store holds now
                stored = self.trial is not None and record(self.study, self.trial, m, self.attrs)
                if not stored:
                    logger.warning("trial %d (%s) was closed by another peer, which judged it stale, and the "
                                   "configuration is measured or claimed elsewhere now: this measurement is given up",
                                   closed, m.config)
            self.trial = self.finished = None
            if stored:
                self.mine.add(m.config)
                self.runs += 1
                self.measured[m.config] = m  # in the report even if Ctrl-C comes before the next look at the store

    def interrupted(self) -> None:
        """Ctrl-C: store a measurement already taken; otherwise close the running trial so it is run again."""
        if self.trial is not None and self.finished is not None:
            self.keep(self.finished)
        elif self.trial is not None:
            abandon(self.study, self.trial, "interrupted")

    def result(self, started: float, partial: bool) -> SearchResult:
        ordered = tuple(self.measured[c] for c in self.space.configs() if c in self.measured)
        return SearchResult(ordered, self.runs, len(ordered) - len(self.mine & set(self.measured)),
                            time.monotonic() - started, self.study.study_name, self.storage, partial)


@contextlib.contextmanager
def _heap_frozen():
    """Leave what exists now (torch, the store, the workload) out of the garbage collections inside the block.

    Each trial ends with a full collection (a model's weights may sit in a reference cycle), which
    walks every object of the process: 0.2 to 0.9 s a trial on our 2-core CPU, most of a short
    trial's cost and the same on a GPU. Objects alive now outlive the search anyway; frozen
    (``gc.freeze``), they are skipped, and unfrozen when the search ends, unless the process had
    frozen its heap itself before (a server that forks, our test suite): then it stays frozen.
    """
    ours = gc.get_freeze_count() == 0
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if ours:
            gc.unfreeze()


def run_search(
    workload: Workload,
    space: SearchSpace,
    strategy: Strategy,
    *,
    venue: Venue,
    enforced_bytes: int | None,
    settings: TrialSettings,
    study_name: str,
    storage: str,
    workload_key: str,
    on_trial: Callable[[Measurement, bool], None] | None = None,
    on_trial_start: Callable[[Config], None] | None = None,
) -> SearchResult:
    """Run the strategy's proposals as trials in the study until it is done; return every measurement.

    Each trial runs at ``venue`` (this process, a worker process, every rank of a job) under
    ``enforced_bytes``, the largest budget (a smaller one is judged by the peaks measured).
    ``on_trial(measurement, reused)`` is called once for each measurement as it becomes known,
    ``reused`` when it comes from the store; ``on_trial_start(config)`` when this peer starts
    measuring one.
    """
    started = time.monotonic()
    loop = _Loop(open_study(study_name, storage, workload_key=workload_key, space=space), storage, space,
                 settings=settings, enforced_bytes=enforced_bytes, on_trial=on_trial)
    waiter = Waiter(storage)
    try:
        with quiet_optuna(), _heap_frozen():
            while True:
                if loop.look():
                    waiter.reset()
                proposal = strategy.propose(space, loop.measured, enforced_bytes, pending=frozenset(loop.in_flight))
                if proposal is None:
                    if not loop.in_flight:
                        break
                    waiter.wait()  # others are measuring; their results belong in our report too
                    continue
                if loop.claim(proposal.config) is None:
                    waiter.lost()  # claimed at the same moment by another peer: the next look shows it running
                    continue
                waiter.claimed()
                config = proposal.config
                logger.debug("trial %d: %s%s", loop.trial.number, config, "" if proposal.timed else " (memory)")
                if on_trial_start:
                    on_trial_start(config)

                def run(**kind: bool) -> Measurement:
                    return venue.run(workload, TrialWork(config, settings, enforced_bytes, asked_at=time.time(), **kind))

                with Heartbeat(loop.study, loop.trial):
                    loop.finished = loop.measure(proposal, run, venue.slows_steps)
                loop.keep(loop.finished)
    except KeyboardInterrupt:
        loop.interrupted()
        raise SearchInterrupted(loop.result(started, partial=True)) from None
    except BaseException:
        if loop.trial is not None:
            abandon(loop.study, loop.trial, "error")
        raise
    return loop.result(started, partial=False)
