"""Search strategies: which configuration to measure next, given what has been measured.

A strategy sees the search space and the measurements so far and proposes one configuration at
a time, or ``None`` when it is done. The driver (:mod:`autotune.search.loop`) runs each proposal as an
Optuna trial, so every strategy gets storage, resume and the trial record for free.

* ``auto`` (the default): model-guided bracketing of each plan's largest batch, then a
  throughput climb (:mod:`autotune.search.strategies.auto`).
* ``grid``: every configuration; the exhaustive reference.
* ``optuna``: Optuna's NSGA-II within ``n_trials``, for spaces too large for the other two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from autotune.errors import UsageError
from autotune.search.strategies.auto import AutoStrategy
from autotune.search.strategies.base import Proposal, Strategy
from autotune.search.strategies.grid import GridStrategy
from autotune.search.strategies.sampler import OptunaStrategy
from autotune.vocabulary import HEADROOM

if TYPE_CHECKING:
    from autotune.analysis.pareto import LineRule
    from autotune.records import Config, Measurement

__all__ = ["Strategy", "Proposal", "AutoStrategy", "GridStrategy", "OptunaStrategy", "STRATEGIES", "make_strategy"]

STRATEGIES = {"auto": AutoStrategy, "grid": GridStrategy, "optuna": OptunaStrategy}


def make_strategy(name: str, *, headroom: float = HEADROOM, budgets: tuple[int, ...] = (),
                  fixed_bytes_hint: float | None = None, n_trials: int | None = None,
                  line_rule: "LineRule | None" = None, predictions: "Mapping[Config, Measurement] | None" = None,
                  probed: int = 0, time_error: float | None = None) -> Strategy:
    """Return a new strategy called ``name`` (see ``STRATEGIES``) with the options it takes."""
    if name not in STRATEGIES:
        raise UsageError(f"unknown --strategy {name!r}: choose from {', '.join(STRATEGIES)}")
    if n_trials is not None and name != "optuna":
        raise UsageError(f"--n-trials is the trial budget of --strategy optuna; {name} decides its own trials")
    options: dict[str, Any] = {}
    if name == "auto":
        options = {"headroom": headroom, "budgets": budgets, "fixed_bytes_hint": fixed_bytes_hint, "line_rule": line_rule,
                   "predictions": predictions, "probed": probed, "time_error": time_error}
    elif name == "optuna":
        if n_trials is not None and n_trials < 1:
            raise UsageError(f"--n-trials {n_trials} must be at least 1")
        options = {"n_trials": n_trials}
    return STRATEGIES[name](**options)
