"""The search driver: an Optuna study whose trials are real training runs.

Each configuration a strategy proposes becomes an Optuna trial (ask -> run -> tell) with its
parameters (precision, segments, batch_size) and the whole measurement as user attributes. The
study lives in an Optuna storage: by default a SQLite file in ``results/`` named after the study,
so a search that stops is continued by running the same command again, and any Optuna storage
URL lets several workers share one study. Finished trials are reused when they were measured
the same way (device, trial settings, and for an OOM a budget at least as large).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import time
from typing import Callable, Iterator

import optuna
import torch

from autotune._log import logger
from autotune.errors import UsageError
from autotune.meters import Meter
from autotune.space import Config, SearchSpace
from autotune.strategies import Strategy
from autotune.trial import Measurement, TrialSettings, run_trial
from autotune.workload import Workload

__all__ = ["SearchResult", "run_search", "default_study_name", "default_storage", "open_study"]

_STATE = {"ok": optuna.trial.TrialState.COMPLETE, "oom": optuna.trial.TrialState.PRUNED,
          "timeout": optuna.trial.TrialState.PRUNED, "failed": optuna.trial.TrialState.FAIL}


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The measurements of one search, in the order of the space, and how they were obtained."""

    measurements: tuple[Measurement, ...]
    n_run: int  # trials run by this search
    n_reused: int  # trials taken from the store, measured earlier
    wall_s: float
    study_name: str
    storage: str


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


def open_study(study_name: str, storage: str, *, workload_key: str) -> optuna.Study:
    """Create or load the study; refuse one that holds trials of a different workload."""
    try:
        with _quiet_optuna():
            study = optuna.create_study(
                study_name=study_name, storage=storage, directions=["maximize", "minimize"], load_if_exists=True
            )
    except Exception as exc:  # a bad URL, an unreachable server, a read-only file
        raise UsageError(f"cannot open the trial store --storage {storage!r}: {type(exc).__name__}: {exc}") from None
    known = study.user_attrs.get("workload_key")
    if known is None:
        study.set_user_attr("workload_key", workload_key)
    elif known != workload_key:
        raise UsageError(
            f"study {study_name!r} in {storage} holds trials of a different model, data, loss or device: "
            f"pass another --study name (or --storage) to start a new one"
        )
    return study


def _reusable(attrs: dict, *, settings_key: str, budget_bytes: int | None) -> Measurement | None:
    """Return the stored measurement if it answers the same question under this budget."""
    data = attrs.get("measurement")
    if data is None or attrs.get("settings_key") != settings_key:
        return None
    measurement = Measurement.from_dict(data)
    stored_budget = attrs.get("budget_bytes")
    if measurement.status == "oom" and budget_bytes is not None and stored_budget is not None and stored_budget < budget_bytes:
        return None  # it ran out of a smaller budget than today's: it may fit now
    return measurement


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
    on_trial: Callable[[Measurement, bool], None] | None = None,
) -> SearchResult:
    """Run the strategy's proposals as trials in the study until it is done; return every measurement.

    ``on_trial(measurement, reused)`` is called for each measurement as it becomes known.
    """
    started = time.monotonic()
    study = open_study(study_name, storage, workload_key=workload_key)
    settings_key = fingerprint(**dataclasses.asdict(settings))
    measured: dict[Config, Measurement] = {}
    configs = set(space.configs())
    for frozen in study.get_trials(deepcopy=False, states=tuple(set(_STATE.values()))):
        m = _reusable(frozen.user_attrs, settings_key=settings_key, budget_bytes=budget_bytes)
        if m is not None and m.config in configs:
            measured[m.config] = m  # later trials of the same configuration win
    n_reused = len(measured)
    for m in measured.values():
        if on_trial:
            on_trial(m, True)
    distributions = {
        "precision": optuna.distributions.CategoricalDistribution(space.precisions),
        "segments": optuna.distributions.CategoricalDistribution(space.segments),
        "batch_size": optuna.distributions.CategoricalDistribution(space.batch_sizes),
    }
    n_run = 0
    with _quiet_optuna():
        while (config := strategy.propose(space, measured, budget_bytes)) is not None:
            if config in measured or config not in configs:
                raise RuntimeError(f"strategy {strategy.name} proposed {config}, which is measured or outside the space")
            study.enqueue_trial(dataclasses.asdict(config))
            trial = study.ask(distributions)
            config = Config(**trial.params)  # the queued configuration this trial took
            logger.debug("trial %d: %s", trial.number, config)
            try:
                m = run_trial(workload, config, device=device, meter=meter, settings=settings)
            except BaseException:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)  # interrupted: nothing measured
                raise
            for key, value in (
                ("measurement", m.to_dict()),
                ("status", m.status),
                ("budget_bytes", budget_bytes),
                ("settings_key", settings_key),
            ):
                trial.set_user_attr(key, value)
            if m.status == "ok":
                study.tell(trial, [m.samples_per_s, m.peak_bytes])
            else:
                study.tell(trial, state=_STATE[m.status])
            measured[m.config] = m
            n_run += 1
            if on_trial:
                on_trial(m, False)
    ordered = tuple(measured[c] for c in space.configs() if c in measured)
    return SearchResult(ordered, n_run, n_reused, time.monotonic() - started, study_name, storage)
