"""The strategy interface."""

from __future__ import annotations

import abc
from typing import Mapping

from autotune.records import Config, Measurement
from autotune.space import SearchSpace

__all__ = ["Strategy"]


class Strategy(abc.ABC):
    """Propose the next configuration to measure.

    ``propose`` is called again after each trial with every measurement so far (including those
    reused from the trial store) and returns a configuration of ``space`` that is not yet in
    ``measured``, or ``None`` when the search is complete. ``budget_bytes`` lets a strategy skip
    configurations that cannot fit. ``pending`` holds configurations that other workers are
    measuring right now: propose something else (their results arrive in a later call).
    """

    name: str

    @abc.abstractmethod
    def propose(self, space: SearchSpace, measured: Mapping[Config, Measurement], budget_bytes: int | None,
                *, pending: frozenset[Config] = frozenset()) -> Config | None:
        """Return the next configuration to run, or ``None`` to stop."""
