"""Search strategies: which configuration to measure next, given what has been measured.

A strategy sees the search space and the measurements so far and proposes one configuration at
a time, or ``None`` when it is done. The driver (:mod:`autotune.search`) runs each proposal as an
Optuna trial, so every strategy gets storage, resume and the trial record for free.
"""

from __future__ import annotations

from autotune.errors import UsageError
from autotune.strategies.base import Strategy
from autotune.strategies.grid import GridStrategy

__all__ = ["Strategy", "GridStrategy", "STRATEGIES", "make_strategy"]

STRATEGIES = {"grid": GridStrategy}


def make_strategy(name: str) -> Strategy:
    """Return a new strategy called ``name`` (see ``STRATEGIES``)."""
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise UsageError(f"unknown --strategy {name!r}: choose from {', '.join(STRATEGIES)}") from None
