"""Optuna: a multi-objective sampler (NSGA-II) over the whole space, within a trial budget.

For spaces too large to bracket plan by plan (many precisions x plans x batch sizes), NSGA-II
evolves a population towards the front of (samples/s up, peak memory down). A trial that runs out
of memory, is cut, or exceeds the budget counts as zero samples/s at twice the budget, so every
feasible point dominates it. The sampler's own study lives in memory next to the trial store; the
driver still runs every proposal as a trial of the stored study. A configuration the sampler asks
for again is answered from the measurements without running it.
"""

from __future__ import annotations

from typing import Mapping

import optuna

from autotune.records import Config, Measurement
from autotune.search.space import SearchSpace
from autotune.search.store import distributions as space_distributions
from autotune.search.strategies.base import Proposal, Strategy

__all__ = ["OptunaStrategy"]


class OptunaStrategy(Strategy):
    """NSGA-II proposals until ``n_trials`` configurations are measured (default: a quarter of the space)."""

    name = "optuna"

    def __init__(self, *, n_trials: int | None = None, seed: int = 0) -> None:
        self.n_trials = n_trials
        self.seed = seed
        self._shadow: optuna.Study | None = None
        self._asked: dict[Config, optuna.Trial] = {}  # proposed, not measured yet
        self._told: set[Config] = set()

    def planned(self, space: SearchSpace) -> int | None:
        return min(len(space), self._limit(space))

    def _limit(self, space: SearchSpace) -> int:
        """The configurations measured before it stops: ``n_trials``, else a quarter of the space."""
        return self.n_trials if self.n_trials is not None else max(1, len(space) // 4)

    def _values(self, m: Measurement, enforced_bytes: int | None) -> list[float]:
        if m.fits(enforced_bytes) and m.samples_per_s is not None:
            return [m.samples_per_s, float(m.peak_bytes or 0)]
        return [0.0, 2.0 * float(enforced_bytes or m.peak_bytes or 1)]

    def propose(self, space: SearchSpace, measured: Mapping[Config, Measurement], enforced_bytes: int | None,
                *, pending: frozenset[Config] = frozenset()) -> Proposal | None:
        limit = self._limit(space)
        distributions = space_distributions(space)  # as the store declares them
        if self._shadow is None:
            sampler = optuna.samplers.NSGAIISampler(population_size=max(4, min(20, limit // 3)), seed=self.seed)
            self._shadow = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
        for config, m in measured.items():  # what the driver measured, and what came from the store
            if config in self._told:
                continue
            self._told.add(config)
            trial = self._asked.pop(config, None)
            if trial is not None:
                self._shadow.tell(trial, self._values(m, enforced_bytes))
            else:
                self._shadow.add_trial(optuna.trial.create_trial(
                    params=config.to_dict(),
                    distributions=distributions, values=self._values(m, enforced_bytes)))
        if len(measured) >= limit or len(measured.keys() | pending) >= len(space):  # pending: measured ones too
            return None
        for _ in range(10 * len(space)):
            trial = self._shadow.ask(distributions)
            config = Config.from_dict(trial.params)
            if config in measured:
                self._shadow.tell(trial, self._values(measured[config], enforced_bytes))
            elif config in pending or config in self._asked:
                self._shadow.tell(trial, state=optuna.trial.TrialState.FAIL)
            else:
                self._asked[config] = trial
                return Proposal(config)
        # The sampler keeps asking for what is known: take the next configuration nobody has.
        config = next((c for c in space.configs() if c not in measured and c not in pending and c not in self._asked), None)
        return None if config is None else Proposal(config)
