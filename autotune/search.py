"""The search driver: an Optuna study whose trials are real training runs.

Each configuration a strategy proposes becomes an Optuna trial (enqueue -> ask -> run -> tell)
with its parameters (precision, segments, batch_size) and the whole measurement as user
attributes. The study lives in an Optuna storage: by default a SQLite file in ``results/`` named
after the study.

* **Resume.** Finished trials are reused when they were measured the same way (trial settings,
  and for an OOM a budget at least as large). A trial left RUNNING by a process that is gone
  (killed, crashed, its machine asleep) is marked failed and measured again.
* **Parallel workers.** Several processes with the same storage and study share the work: each
  skips configurations that are finished or running elsewhere, a configuration claimed by two
  workers at once is kept by the lower-numbered trial, and a worker whose strategy is done waits
  for the others' running trials, so every worker's report holds the same measurements.
* **Interruption.** Ctrl-C marks the running trial failed (it is re-run next time) and raises
  :class:`SearchInterrupted` with everything measured so far.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import socket
import threading
import time
import warnings
from typing import Callable, Iterator

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState

from autotune._log import logger
from autotune.errors import AutotuneError, UsageError, first_line
from autotune.meters import Meter
from autotune.plans import canonical
from autotune.space import Config, SearchSpace
from autotune.strategies import Strategy
from autotune.trial import Measurement, TrialSettings, run_trial
from autotune.workload import Workload

__all__ = ["SearchResult", "SearchInterrupted", "run_search", "default_study_name", "default_storage", "open_study", "run_one",
           "stored_plan_checks", "store_plan_checks"]

_STATE = {"ok": TrialState.COMPLETE, "oom": TrialState.PRUNED, "timeout": TrialState.PRUNED,
          "failed": TrialState.FAIL, "crashed": TrialState.FAIL}
_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
HEARTBEAT_S = 10.0  # a running trial's worker stamps it this often
STALE_S = 120.0  # a running trial of another machine whose stamp is older than this is abandoned
_OPEN_ATTEMPTS = 3
WAIT_S = 1.0  # how often a worker with nothing to do looks at the others' running trials


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The measurements of one search, in the order of the space, and how they were obtained."""

    measurements: tuple[Measurement, ...]
    n_run: int  # trials run by this worker
    n_reused: int  # trials taken from the store: measured earlier, or by other workers
    wall_s: float
    study_name: str
    storage: str
    partial: bool = False  # True when the search was interrupted before its strategy was done


class SearchInterrupted(AutotuneError):
    """The search was interrupted (Ctrl-C); ``result`` holds what was measured so far."""

    def __init__(self, result: SearchResult) -> None:
        super().__init__("interrupted; finished trials are kept in the store")
        self.result = result


def default_study_name(workload: Workload, device: torch.device, fingerprint: str | None = None) -> str:
    """Return ``MODEL-DEVICE`` (with a short hash of non-default workload options), safe as a file name."""
    model = re.sub(r"[^A-Za-z0-9_.-]+", "-", workload.name.rpartition(":")[2] or workload.name)
    suffix = f"-{fingerprint[:8]}" if fingerprint else ""
    return f"{model}{suffix}-{device.type}"


def default_storage(study_name: str, results_dir: str = "results") -> str:
    """Return the SQLite URL of ``results/<study>.db``, creating the folder."""
    os.makedirs(results_dir, exist_ok=True)
    return f"sqlite:///{os.path.join(results_dir, study_name)}.db"


def fingerprint(**parts: object) -> str:
    """Return a stable hash of JSON-serialisable parts: what makes two searches measure the same thing."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one INFO line per trial would drown our table
    try:
        yield
    finally:
        optuna.logging.set_verbosity(previous)


def make_storage(url: str) -> str | optuna.storages.BaseStorage:
    """Return what Optuna takes for ``url``: an RDB URL as it is, or a journal file for ``journal:///PATH``.

    A journal file (``optuna.storages.JournalStorage``) is the storage Optuna recommends for
    several processes on one machine or a shared file system; SQLite suits one worker.
    """
    if url.startswith("journal://"):
        path = url[len("journal://"):]
        if not path:
            raise UsageError(f"--storage {url!r}: write journal:///path/to/file.log")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"cannot open the trial store --storage {url!r}: the folder {folder} does not exist")
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    return url


METRIC_NAMES = ("samples_per_s", "peak_bytes")  # the study's two objectives, maximised and minimised


def open_study(study_name: str, storage: str, *, workload_key: str, space: SearchSpace | None = None) -> optuna.Study:
    """Create or load the study; refuse one made for a different workload or search space."""
    for attempt in range(_OPEN_ATTEMPTS):
        try:
            with _quiet_optuna():
                study = optuna.create_study(
                    study_name=study_name, storage=make_storage(storage), directions=["maximize", "minimize"],
                    load_if_exists=True,
                )
            break
        except UsageError:
            raise
        except Exception as exc:  # a bad URL, an unreachable server, a read-only file
            # Workers starting together on a new database race to create its tables: try again.
            if attempt == _OPEN_ATTEMPTS - 1:
                raise UsageError(f"cannot open the trial store --storage {storage!r}: {type(exc).__name__}: "
                                 f"{first_line(exc)}") from None
            time.sleep(0.5 * (attempt + 1))
    expected = {"workload_key": workload_key}
    if space is not None:
        expected["space"] = space.to_dict()
    known = study.user_attrs
    for key, value in expected.items():
        if key not in known:
            study.set_user_attr(key, value)
    if "workload_key" not in known:  # a new study: name its objectives for Optuna's own tools (optuna-dashboard)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # stable since 3.2 in practice
            study.set_metric_names(list(METRIC_NAMES))
    if known.get("workload_key", workload_key) != workload_key:
        raise UsageError(
            f"study {study_name!r} in {storage} holds trials of a different model, data, loss or device: "
            f"pass another --study name (or --storage) to start a new one"
        )
    if space is not None and known.get("space", space.to_dict()) != space.to_dict():
        old = known["space"]
        raise UsageError(
            f"study {study_name!r} was made for another search space (precisions {','.join(old['precisions'])}, "
            f"segments {','.join(map(str, old['segments']))}, batch sizes {','.join(map(str, old['batch_sizes']))}): "
            f"pass the same flags, or another --study name"
        )
    return study


def stored_plan_checks(study_name: str, storage: str, *, workload_key: str, key: str) -> list[dict] | None:
    """The plan checks stored in the study under ``key`` (how they were made), or None."""
    study = open_study(study_name, storage, workload_key=workload_key)
    return (study.user_attrs.get("plan_checks") or {}).get(key)


def store_plan_checks(study_name: str, storage: str, *, workload_key: str, key: str, checks: list[dict]) -> None:
    """Keep the plan checks in the study, so that a resumed search (or another worker) reuses them."""
    study = open_study(study_name, storage, workload_key=workload_key)
    study.set_user_attr("plan_checks", {**(study.user_attrs.get("plan_checks") or {}), key: checks})


def _reusable(attrs: dict, *, settings_key: str, budget_bytes: int | None, timeout_s: float | None) -> Measurement | None:
    """Return the stored measurement if it answers the same question under this budget and time limit."""
    data = attrs.get("measurement")
    if data is None or attrs.get("settings_key") != settings_key:
        return None
    measurement = Measurement.from_dict(data)
    stored_budget = attrs.get("budget_bytes")
    if measurement.status == "oom" and budget_bytes is not None and stored_budget is not None and stored_budget < budget_bytes:
        return None  # it ran out of a smaller budget than today's: it may fit now
    stored_timeout = attrs.get("timeout_s")
    if measurement.status == "timeout" and stored_timeout is not None and (timeout_s is None or stored_timeout < timeout_s):
        return None  # it was cut sooner than today's limit would cut it
    return measurement


def _pid_namespace() -> str:
    """An id of this process's PID namespace and boot: PIDs can be checked only within the same one."""
    try:
        namespace = os.readlink("/proc/self/ns/pid").strip("pid:[]")
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{namespace}-{f.read().strip()[:8]}"  # after a reboot, old PIDs name other processes
    except OSError:
        return ""


def _worker_id() -> str:
    """``HOST:PIDNS:PID``, the identity a worker stamps on the trials it runs."""
    return f"{socket.gethostname()}:{_pid_namespace()}:{os.getpid()}"


def _is_alive(trial: FrozenTrial, now: float, stamps: dict[int, tuple[float, float]]) -> bool:
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


class _Heartbeat:
    """Stamp a running trial every HEARTBEAT_S seconds, from a background thread."""

    def __init__(self, study: optuna.Study, trial: optuna.Trial) -> None:
        self._study, self._trial_id = study, trial._trial_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autotune-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a missed stamp only makes the trial look older
                self._study._storage.set_trial_user_attr(self._trial_id, "heartbeat", time.time())

    def __enter__(self) -> "_Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_search(
    workload: Workload,
    space: SearchSpace,
    strategy: Strategy,
    *,
    device: torch.device,
    meter: Meter,
    budget_bytes: int | None,
    settings: TrialSettings,
    study_name: str,
    storage: str,
    workload_key: str,
    isolation: str = "none",
    on_trial: Callable[[Measurement, bool], None] | None = None,
    on_trial_start: Callable[[Config], None] | None = None,
) -> SearchResult:
    """Run the strategy's proposals as trials in the study until it is done; return every measurement.

    ``isolation`` is ``"none"`` (trials run in this process with ``meter``) or ``"process"``
    (each trial in a fresh worker process). ``on_trial(measurement, reused)`` is called once for
    each measurement as it becomes known, ``reused`` when it comes from the store;
    ``on_trial_start(config)`` when this worker starts measuring one.
    """
    started = time.monotonic()
    study = open_study(study_name, storage, workload_key=workload_key, space=space)
    # How a trial trains, without its time limit (a time-out is judged against the limit it ran under).
    settings_key = fingerprint(**{k: v for k, v in dataclasses.asdict(settings).items() if k != "timeout_s"})
    stamps: dict[int, tuple[float, float]] = {}
    distributions = {
        "precision": optuna.distributions.CategoricalDistribution(space.precisions),
        "segments": optuna.distributions.CategoricalDistribution(space.segments),
        "batch_size": optuna.distributions.CategoricalDistribution(space.batch_sizes),
    }
    configs = set(space.configs())
    mine: set[Config] = set()
    reported: set[Config] = set()
    measured: dict[Config, Measurement] = {}

    def result(partial: bool) -> SearchResult:
        ordered = tuple(measured[c] for c in space.configs() if c in measured)
        return SearchResult(ordered, len(mine), len(ordered) - len(mine & set(measured)),
                            time.monotonic() - started, study_name, storage, partial)

    trial = None  # the trial this worker is running, if any
    finished = None  # its measurement, once taken and until stored
    record_attrs = {"budget_bytes": budget_bytes, "settings_key": settings_key, "timeout_s": settings.timeout_s}
    try:
        with _quiet_optuna():
            while True:
                measured, in_flight = _survey(study, configs, settings_key, budget_bytes, settings.timeout_s, stamps)
                for config, m in measured.items():
                    if config not in reported:
                        reported.add(config)
                        if on_trial:
                            on_trial(m, config not in mine)
                config = strategy.propose(space, measured, budget_bytes, pending=frozenset(in_flight))
                if config is None:
                    if not in_flight:
                        break
                    time.sleep(WAIT_S)  # others are measuring; their results belong in our report too
                    continue
                trial = _claim(study, config, distributions, settings_key=settings_key, budget_bytes=budget_bytes)
                if trial is None:
                    continue
                config = Config(**trial.params)
                logger.debug("trial %d: %s", trial.number, config)
                if on_trial_start:
                    on_trial_start(config)
                with _Heartbeat(study, trial):
                    m = run_one(workload, config, device=device, meter=meter, budget_bytes=budget_bytes,
                                 settings=settings, isolation=isolation)
                finished = m
                _record(study, trial, m, distributions, record_attrs)
                trial = finished = None
                mine.add(config)
                measured[config] = m  # in the report even if Ctrl-C comes before the next look at the store
    except KeyboardInterrupt:
        if trial is not None and finished is not None:  # measured, not yet stored: store it, it is done
            _record(study, trial, finished, distributions, record_attrs)
            mine.add(finished.config)
            measured[finished.config] = finished
        elif trial is not None:
            _abandon(study, trial, "interrupted")
        raise SearchInterrupted(result(partial=True)) from None
    except BaseException:
        if trial is not None:
            _abandon(study, trial, "error")
        raise
    return result(partial=False)


def run_one(workload: Workload, config: Config, *, device: torch.device, meter: Meter, budget_bytes: int | None,
             settings: TrialSettings, isolation: str) -> Measurement:
    """Run one trial in this process with ``meter``, or (``isolation="process"``) in a fresh worker."""
    if isolation == "process":
        from autotune.isolation import run_trial_isolated

        return run_trial_isolated(workload, config, device=device, budget_bytes=budget_bytes, settings=settings)
    return run_trial(workload, config, device=device, meter=meter, settings=settings)


def _config_of(trial: FrozenTrial) -> Config | None:
    """The configuration a trial measures: its parameters, or those it was queued with.

    A trial popped from the queue is RUNNING a moment before its parameters are written; its
    queued parameters say what it will run.
    """
    params = trial.params if len(trial.params) == 3 else trial.system_attrs.get("fixed_params", {})
    try:
        return Config(params["precision"], canonical(params["segments"]), int(params["batch_size"]))
    except (KeyError, TypeError, ValueError, UsageError):
        return None


def _survey(study: optuna.Study, configs: set[Config], settings_key: str, budget_bytes: int | None,
            timeout_s: float | None, stamps: dict[int, tuple[float, float]]) -> tuple[dict[Config, Measurement], set[Config]]:
    """Read the store: reusable measurements, and configurations other workers are running now.

    Trials left RUNNING by a worker that is gone are marked failed, so they are measured again;
    so are trials a worker took from the queue but never stamped (it died in between).
    """
    measured: dict[Config, Measurement] = {}
    in_flight: set[Config] = set()
    now = time.monotonic()
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        if t.state in _FINISHED:
            m = _reusable(t.user_attrs, settings_key=settings_key, budget_bytes=budget_bytes, timeout_s=timeout_s)
            if m is not None and m.config in configs:
                measured[m.config] = m  # later trials of the same configuration win
        elif t.state == TrialState.RUNNING and "worker" not in t.user_attrs:
            if not _is_alive(t, now, stamps):  # keyed on its (absent) stamp: abandoned after STALE_S unstamped
                logger.info("trial %d was taken from the queue but never started: it will be measured again", t.number)
                _abandon(study, t, "abandoned")
            elif _config_of(t) is not None:
                in_flight.add(_config_of(t))
        elif t.state == TrialState.RUNNING:
            if _is_alive(t, now, stamps) and _config_of(t) is not None:
                in_flight.add(_config_of(t))
            else:
                logger.info("trial %d (%s) was left running by %s, which is gone: it will be measured again",
                            t.number, t.params, t.user_attrs["worker"])
                _abandon(study, t, "abandoned")
    return measured, in_flight - set(measured)


def _claim(study: optuna.Study, config: Config, distributions: dict, *, settings_key: str,
           budget_bytes: int | None) -> optuna.Trial | None:
    """Start a trial of ``config`` (or of another worker's queued configuration); None if already taken."""
    study.enqueue_trial(dataclasses.asdict(config))
    trial = study.ask(distributions)
    try:
        trial.set_user_attr("worker", _worker_id())
        trial.set_user_attr("heartbeat", time.time())
        config = Config(**trial.params)
        for other in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, *_FINISHED)):
            if other.number == trial.number or _config_of(other) != config:
                continue
            taken = (other.state == TrialState.RUNNING and other.number < trial.number) or (
                other.state in _FINISHED
                and _reusable(other.user_attrs, settings_key=settings_key, budget_bytes=budget_bytes, timeout_s=None)
            )
            if taken:  # another worker claimed or finished the same configuration first
                _abandon(study, trial, "duplicate")
                return None
    except BaseException:
        _abandon(study, trial, "interrupted")
        raise
    return trial


def _record(study: optuna.Study, trial: optuna.Trial, m: Measurement, distributions: dict, attrs: dict) -> None:
    """Store a measurement on its trial; as a new trial if another worker closed ours meanwhile."""
    attrs = {"status": m.status, **attrs, "measurement": m.to_dict()}  # the measurement last: it marks a stored trial
    values = [m.samples_per_s, m.peak_bytes] if m.status == "ok" else None
    try:
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        study.tell(trial, values, state=_STATE[m.status])
    except (RuntimeError, ValueError, optuna.exceptions.OptunaError):
        # Judged stale by another worker (a stalled heartbeat) and failed: the measurement still counts.
        logger.info("trial %d was closed by another worker; its measurement is stored as a new trial", trial.number)
        study.add_trial(optuna.trial.create_trial(
            params=dataclasses.asdict(m.config), distributions=distributions, state=_STATE[m.status], values=values,
            user_attrs={**attrs, "worker": _worker_id()}))


def _abandon(study: optuna.Study, trial: optuna.Trial | FrozenTrial, why: str) -> None:
    """Close a trial that measured nothing, so that its configuration is proposed again."""
    with contextlib.suppress(Exception):  # it may have been closed meanwhile by its own worker
        study._storage.set_trial_user_attr(trial._trial_id, "status", why)
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
