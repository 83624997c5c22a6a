"""The trial store: an Optuna study holding every trial's measurement, and how trials go in and out.

Each configuration is an Optuna trial with its parameters (precision, segments, batch_size) and
the whole measurement as user attributes; the study's user attributes hold what makes its trials
comparable (the workload's key, the search space) and the plan checks. The storage is any Optuna
URL, by default a SQLite file in ``results/`` named after the study, or a journal file. Optuna's
private API (the study's storage and id) is used in two places, :func:`start_trial` and :func:`stamp`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import time
import warnings
from datetime import datetime
from typing import Any, Iterator

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune._log import logger
from autotune.errors import UsageError, first_line
from autotune.vocabulary import Status
from autotune.records import Config, Measurement
from autotune.search.space import SearchSpace

__all__ = [
    "METRIC_NAMES", "STATE", "FINISHED", "fingerprint", "default_study_name", "default_storage", "make_storage",
    "open_study", "distributions", "stored_plan_checks", "store_plan_checks", "reusable", "config_of", "start_trial",
    "record", "state_of", "abandon", "stamp", "quiet_optuna",
]

STATE = {status: getattr(TrialState, status.state) for status in Status}  # how each outcome is stored
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
METRIC_NAMES = ("samples_per_s", "peak_bytes")  # the study's two objectives, maximised and minimised
_OPEN_ATTEMPTS = 3
_RECORD_ATTEMPTS = 3  # writes of a finished trial, while it is still running in the store


def default_study_name(model_name: str, device_type: str, options_key: str | None = None) -> str:
    """Return ``MODEL-DEVICE`` (with a short hash of non-default workload options), safe as a file name."""
    model = re.sub(r"[^A-Za-z0-9_.-]+", "-", model_name.rpartition(":")[2] or model_name)
    suffix = f"-{options_key[:8]}" if options_key else ""
    return f"{model}{suffix}-{device_type}"


def default_storage(study_name: str, results_dir: str = "results") -> str:
    """Return the SQLite URL of ``results/<study>.db``, creating the folder."""
    os.makedirs(results_dir, exist_ok=True)
    return f"sqlite:///{os.path.join(results_dir, study_name)}.db"


def fingerprint(**parts: object) -> str:
    """Return a stable hash of JSON-serialisable parts: what makes two searches measure the same thing."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Silence Optuna's INFO lines (one per trial would drown our table) inside the block."""
    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(previous)


def make_storage(url: str) -> str | optuna.storages.BaseStorage:
    """Return what Optuna takes for ``url``: an RDB URL as it is, or a journal file for ``journal:///PATH``.

    A journal file (``optuna.storages.JournalStorage``) is the storage Optuna recommends for
    several processes on one machine or a shared file system; SQLite suits one peer.
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


def open_study(study_name: str, storage: str, *, workload_key: str, space: SearchSpace | None = None) -> optuna.Study:
    """Create or load the study; refuse one made for a different workload or search space."""
    for attempt in range(_OPEN_ATTEMPTS):
        try:
            with quiet_optuna():
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
    if space is not None and "space" in known and SearchSpace.from_dict(known["space"]).to_dict() != space.to_dict():
        old = known["space"]
        raise UsageError(
            f"study {study_name!r} was made for another search space (precisions {','.join(old['precisions'])}, "
            f"segments {','.join(map(str, old['segments']))}, batch sizes {','.join(map(str, old['batch_sizes']))}): "
            f"pass the same flags, or another --study name"
        )
    return study


def distributions(space: SearchSpace) -> dict[str, optuna.distributions.BaseDistribution]:
    """The Optuna distributions of ``space``'s four parameters, as the store and the sampler declare them."""
    return {
        "precision": optuna.distributions.CategoricalDistribution(space.precisions),
        "segments": optuna.distributions.CategoricalDistribution(space.plans),
        "batch_size": optuna.distributions.CategoricalDistribution(space.batch_sizes),
        "compile": optuna.distributions.CategoricalDistribution(space.compiles),
    }


def stored_plan_checks(study_name: str, storage: str, *, workload_key: str, key: str) -> list[dict] | None:
    """The plan checks stored in the study under ``key`` (how they were made), or None."""
    study = open_study(study_name, storage, workload_key=workload_key)
    return (study.user_attrs.get("plan_checks") or {}).get(key)


def store_plan_checks(study_name: str, storage: str, *, workload_key: str, key: str, checks: list[dict]) -> None:
    """Keep the plan checks in the study, so that a resumed search (or another peer) reuses them."""
    study = open_study(study_name, storage, workload_key=workload_key)
    study.set_user_attr("plan_checks", {**(study.user_attrs.get("plan_checks") or {}), key: checks})


def reusable(attrs: dict, *, settings_key: str, enforced_bytes: int | None, timeout_s: float | None,
             host_budget_bytes: int | None = None) -> Measurement | None:
    """Return the stored measurement if it answers the same question under this budget, time limit and host budget."""
    data = attrs.get("measurement")
    if data is None or attrs.get("settings_key") != settings_key:
        return None
    measurement = Measurement.from_dict(data)
    stored_budget = attrs.get("budget_bytes")
    if measurement.status == Status.OOM and stored_budget is not None and (enforced_bytes is None or stored_budget < enforced_bytes):
        return None  # it ran out of a smaller budget than today's (or today has none): it may fit now
    stored_timeout = attrs.get("timeout_s")
    if measurement.status == Status.TIMEOUT and stored_timeout is not None and (timeout_s is None or stored_timeout < timeout_s):
        return None  # it was cut sooner than today's limit would cut it
    stored_host = attrs.get("host_budget_bytes")
    if (measurement.status == Status.OOM and "host memory" in (measurement.error or "") and stored_host is not None
            and (host_budget_bytes is None or stored_host < host_budget_bytes)):
        return None  # it ran out of a smaller host budget than today's (offloaded activations): it may fit now
    if (measurement.status == Status.OK and measurement.host_peak_bytes is not None and host_budget_bytes is not None
            and measurement.host_peak_bytes > host_budget_bytes):
        return None  # it fitted a larger host budget than today's: today it would run out of host memory
    return measurement


def config_of(trial: FrozenTrial) -> Config | None:
    """The configuration a trial measures: its parameters, or those it was queued with.

    A trial popped from the queue is RUNNING a moment before its parameters are written; its
    queued parameters say what it will run.
    """
    params = trial.params if len(trial.params) >= 3 else trial.system_attrs.get("fixed_params", {})  # 3: before compile
    try:
        return Config.from_dict(params)
    except (KeyError, TypeError, ValueError, UsageError):
        return None


def start_trial(study: optuna.Study, config: Config, distributions: dict, user_attrs: dict) -> optuna.Trial:
    """Create a RUNNING trial of ``config`` holding ``user_attrs``, in one write, and return it.

    One write, not Optuna's ``enqueue_trial`` + ``ask``: ``ask`` pops the oldest queued trial, which
    may be another peer's configuration, or one that another peer has popped and closed since
    this one listed the queue (Optuna then raises ``UpdateFinishedTrialError`` from ``ask``); and a
    trial's number would be the moment it was queued, not the moment it was claimed. A trial
    created here is numbered when it is written: the claim protocol (:func:`autotune.search.peers.claim`)
    orders claims by that number.
    """
    template = FrozenTrial(
        number=-1, state=TrialState.RUNNING, value=None, datetime_start=datetime.now(), datetime_complete=None,
        params=config.to_dict(), distributions=distributions, user_attrs=user_attrs, system_attrs={},
        intermediate_values={}, trial_id=-1)
    trial_id = study._storage.create_new_trial(study._study_id, template_trial=template)
    return optuna.Trial(study, trial_id)


def record(study: optuna.Study, trial: optuna.Trial, m: Measurement, attrs: dict) -> bool:
    """Store a measurement on its running trial; False when another peer has closed the trial meanwhile.

    A write that fails while the trial is still running (a busy SQLite file, a dropped database
    connection) is tried again: storing it as a second trial would count the configuration twice.
    A trial closed by another peer (judged stale when its heartbeat stalled) is left as it is:
    the caller decides whether the measurement is still wanted (:meth:`autotune.search.loop._Loop.keep`).
    """
    attrs = {"status": m.status, "figures": m.figures, **attrs, "measurement": m.to_dict()}  # the measurement last:
    # it marks a stored trial
    state = state_of(m)
    values = [m.samples_per_s, m.peak_bytes] if state == TrialState.COMPLETE else None
    for attempt in itertools.count(1):
        try:
            for key, value in attrs.items():
                trial.set_user_attr(key, value)
            study.tell(trial, values, state=state)
            return True
        except (RuntimeError, ValueError, optuna.exceptions.OptunaError) as exc:
            if _state_of(study, trial.number) in FINISHED:
                return False
            if attempt == _RECORD_ATTEMPTS:
                raise
            logger.info("storing trial %d failed (%s: %s): trying again", trial.number, type(exc).__name__,
                        first_line(exc))
            time.sleep(0.5 * attempt)


def state_of(m: Measurement) -> TrialState:
    """The Optuna state a measurement is stored in.

    A trial with both figures is COMPLETE with its two objectives (samples/s, peak bytes). A memory
    trial that fit has no samples/s: it is PRUNED (Optuna's state for a trial stopped before its
    objectives were all evaluated) with ``figures: "memory"``, so Optuna's own tools (best trials,
    the dashboard's front) leave it out; its peak is in the measurement. A later timing of the same
    configuration is a new COMPLETE trial whose measurement carries both (``memory_from`` names the
    memory trial), and replaces it wherever the store is read. Out-of-memory and time-outs are
    PRUNED, failures FAIL.
    """
    if m.memory_only:
        return TrialState.PRUNED
    return STATE[m.status]


def _state_of(study: optuna.Study, number: int) -> TrialState | None:
    """The state the store holds for trial ``number`` now (None if it cannot say)."""
    try:
        return next((t.state for t in study.get_trials(deepcopy=False) if t.number == number), None)
    except Exception:  # noqa: BLE001 - the store may be what failed
        return None



def abandon(study: optuna.Study, trial: optuna.Trial | FrozenTrial, why: str) -> None:
    """Close a trial that measured nothing, so that its configuration is proposed again."""
    with contextlib.suppress(Exception):  # it may have been closed meanwhile by its own peer
        stamp(study, trial, "status", why)
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)


def stamp(study: optuna.Study, trial: optuna.Trial | FrozenTrial, key: str, value: Any) -> None:
    """Set a user attribute of ``trial``, also one read back from the store or owned by another thread.

    Optuna's public ``Trial.set_user_attr`` belongs to the live ``Trial`` object of the process
    that asked for it; a trial read back from the store (a ``FrozenTrial``: another peer's trial
    that is abandoned, or ours from the heartbeat thread) has no public way to be written. So the
    storage is called with the trial's id: Optuna's private ``_storage`` and ``_trial_id``, used
    here and nowhere else.
    """
    study._storage.set_trial_user_attr(trial._trial_id, key, value)
