"""The strategy interface."""

from __future__ import annotations

import abc
import dataclasses
from typing import Mapping

from autotune.records import Config, Measurement
from autotune.search.space import SearchSpace

__all__ = ["Strategy", "Proposal"]


@dataclasses.dataclass(frozen=True)
class Proposal:
    """A configuration to measure, and whether its time is needed.

    ``timed=False`` asks for a memory trial: its peak, not its speed (the bracket of a batch limit
    needs no more). A timed proposal of a configuration measured so far only for memory completes
    it with a timing run; a timed proposal of a timed configuration times it again (a near tie).
    """

    config: Config
    timed: bool = True


class Strategy(abc.ABC):
    """Propose the next configuration to measure.

    ``propose`` is called again after each trial with every measurement so far (including those
    reused from the trial store) and returns a :class:`Proposal` of a configuration of ``space``:
    one not yet in ``measured``, or one whose figures a timed run completes or makes surer
    (:class:`Proposal`); ``None`` when the search is complete. ``enforced_bytes`` lets a strategy skip
    configurations that cannot fit. ``pending`` holds configurations that other workers are
    measuring right now: propose something else (their results arrive in a later call).
    """

    name: str
    #: Whether the strategy starts from the space predicted under fake tensors (:mod:`autotune.search.predicted`)
    starts_from_predictions: bool = False

    def planned(self, space: SearchSpace) -> int | None:
        """How many configurations of ``space`` the strategy will measure, where it knows beforehand (None: it decides
        as the measurements come)."""
        return None

    @abc.abstractmethod
    def propose(self, space: SearchSpace, measured: Mapping[Config, Measurement], enforced_bytes: int | None,
                *, pending: frozenset[Config] = frozenset()) -> Proposal | None:
        """Return the next configuration to run, or ``None`` to stop."""
