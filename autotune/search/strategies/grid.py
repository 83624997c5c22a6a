"""Grid: every point of the space, smallest batch first within each (precision, plan)."""

from __future__ import annotations

from typing import Mapping

from autotune.records import Config, Measurement
from autotune.search.space import SearchSpace
from autotune.search.strategies.base import Proposal, Strategy

__all__ = ["GridStrategy"]


class GridStrategy(Strategy):
    """Measure every configuration of the space: the exhaustive reference other strategies are judged by."""

    name = "grid"

    def planned(self, space: SearchSpace) -> int | None:
        return len(space)

    def propose(self, space: SearchSpace, measured: Mapping[Config, Measurement], enforced_bytes: int | None,
                *, pending: frozenset[Config] = frozenset()) -> Proposal | None:
        config = next((c for c in space.configs() if c not in measured and c not in pending), None)
        return None if config is None else Proposal(config)
