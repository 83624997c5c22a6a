"""Auto: bracket each plan's largest batch with the memory model, then climb throughput.

For a fixed precision and checkpoint plan, peak memory is monotone and close to linear in the
batch size (:mod:`autotune.memory_model`). The strategy works in three phases, each a function of
the measurements alone, so a resumed search or a second worker picks up where the store stands:

1. **Bracket** every plan's boundary under the budget, exactly at the resolution of the batch
   sizes: the largest size that fits and the next size up (which does not) are both measured. The
   next trial of a plan is the size the model predicts to be the largest that fits, inside the
   bracket still open; after three trials of a plan without closing it, plain bisection.
2. **Other budgets** (``--budgets``): a plan's boundary under a smaller budget comes from the
   measured peaks where they bracket it, from the model where its prediction is clear of the
   budget by more than its error, and from one more trial where it is not.
3. **Throughput.** At each batch size the fastest plan is the one that recomputes the fewest
   blocks and fits within the budget less headroom (checkpointing only adds recompute), so
   the other plans cannot enter the front there and are not measured further. Along that
   envelope, per precision, the strategy climbs from the fastest measured point to a local
   maximum of samples/s: both neighbours measured and slower. A precision that is slower in
   every configuration measured in both and needs more memory in every plan is not climbed.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from autotune.memory_model import MemoryModel
from autotune.pareto import bracket
from autotune.records import Config, Measurement, usable_bytes
from autotune.space import SearchSpace
from autotune.strategies.base import Strategy

__all__ = ["AutoStrategy", "next_in_bracket"]

_BISECT_AFTER = 3  # trials of one plan after which the model is not trusted to close its bracket


def next_in_bracket(sizes: list[int], outcomes: Mapping[int, bool], predicted: Mapping[int, float] | None,
                    limit: float | None, tries: int) -> int | None:
    """The next batch size to measure to close the bracket of one plan, or None when it is closed.

    ``predicted`` maps batch sizes to the model's peak bytes (None where the model knows nothing):
    the guess is the largest open size predicted to fit. ``tries`` is how many trials the plan had.
    """
    lo, hi = bracket(sizes, outcomes)
    if hi == lo + 1 or (lo == -1 and hi == 0):
        return None
    open_ = list(range(lo + 1, hi))
    if tries >= _BISECT_AFTER:
        return sizes[(lo + hi) // 2]
    if not predicted:
        return sizes[open_[0]]
    fitting = [i for i in open_ if limit is None or predicted[sizes[i]] <= limit]
    return sizes[fitting[-1] if fitting else open_[0]]


def _dominates(fast: str, slow: str, measured: Mapping[Config, Measurement], model: MemoryModel,
               variants: list[tuple[str, str]], smallest: int, largest: int) -> bool:
    """Whether precision ``fast`` beats ``slow`` on both axes: faster in every configuration measured in both
    (at least one), and predicted to need no more memory in any plan at any batch size."""
    pairs = [(m.samples_per_s, measured[Config(fast, c.segments, c.batch_size)].samples_per_s)
             for c, m in measured.items() if c.precision == slow and m.samples_per_s is not None
             and Config(fast, c.segments, c.batch_size) in measured]
    if not pairs or any(q is None or q <= s for s, q in pairs):
        return False
    for _, segments in (pl for pl in variants if pl[0] == slow):
        a, b = model.lines.get((fast, segments)), model.lines.get((slow, segments))
        if a is None or b is None or any(a.predict(n) > b.predict(n) * (1 + 1e-9) for n in (smallest, largest)):
            return False  # two lines: no higher at both ends, no higher anywhere between
    return True


class AutoStrategy(Strategy):
    """Model-guided bracketing of each plan's batch limit, then a throughput climb (module docstring)."""

    name = "auto"

    def __init__(self, *, headroom: float = 0.1, budgets: Iterable[int] = (), fixed_bytes_hint: float | None = None) -> None:
        self.headroom = headroom
        self.budgets = tuple(sorted(set(budgets)))
        self.fixed_bytes_hint = fixed_bytes_hint

    def propose(self, space: SearchSpace, measured: Mapping[Config, Measurement], budget_bytes: int | None,
                *, pending: frozenset[Config] = frozenset()) -> Config | None:
        sizes = sorted(space.batch_sizes)
        ordered = space.ordered_plans()  # least recompute first
        variants = [(p, s) for s in ordered for p in space.precisions]  # a precision's ratio early
        model = MemoryModel.fit(measured.values(), variants, fixed_bytes_hint=self.fixed_bytes_hint, blocks=space.blocks)
        busy = {c.variant for c in pending}
        by_variant: dict[tuple[str, str], dict[int, Measurement]] = {}
        for c, m in measured.items():
            by_variant.setdefault(c.variant, {})[c.batch_size] = m

        def outcomes(variant, limit):
            return {b: m.fits(limit) for b, m in by_variant.get(variant, {}).items()}

        def predicted(variant):
            return None if variant not in model.lines else {b: model.predict(variant, b) for b in sizes}

        # 1. The budget's boundary of every plan, measured on both sides.
        waiting = False
        for variant in variants:
            b = next_in_bracket(sizes, outcomes(variant, budget_bytes), predicted(variant), budget_bytes,
                                len(by_variant.get(variant, {})))
            if b is not None:
                if variant in busy:
                    waiting = True
                    continue
                return Config(*variant, b)
        if waiting:
            return None  # the rest depends on trials other workers are running
        # 2. Smaller budgets: measure a boundary only where the model is not clear of it.
        margin = max(0.05, model.relative_error())
        for limit in (b for b in self.budgets if budget_bytes is None or b < budget_bytes):
            for variant in variants:
                b = self._uncertain(sizes, outcomes(variant, limit), predicted(variant), limit, margin)
                if b is not None and Config(*variant, b) not in pending:
                    return Config(*variant, b)
        # 3. Throughput along each precision's envelope, for every budget less headroom; a precision
        # slower wherever both were measured, and needing more memory in every plan, is skipped.
        for budget in dict.fromkeys([budget_bytes, *self.budgets]):
            limit = usable_bytes(budget, self.headroom)
            for precision in space.precisions:
                if any(_dominates(other, precision, measured, model, variants, sizes[0], sizes[-1])
                       for other in space.precisions if other != precision):
                    continue
                config = self._climb(precision, ordered, sizes, by_variant, model, limit)
                if config is not None and config not in pending:
                    return config
        return None

    @staticmethod
    def _uncertain(sizes, outcomes, predicted, limit, margin) -> int | None:
        """A size whose fit under ``limit`` neither the measurements nor the model settle, or None."""
        lo, hi = bracket(sizes, outcomes)
        for i in range(lo + 1, hi):
            guess = None if predicted is None else predicted[sizes[i]]
            if guess is None or abs(guess - limit) <= margin * limit:
                return sizes[i]
        return None

    @staticmethod
    def _climb(precision, segments, sizes, by_variant, model, limit) -> Config | None:
        """The next point of the precision's throughput climb under ``limit``, or None at a local maximum."""
        envelope: list[Config] = []
        for b in sizes:
            for s in segments:  # least recompute first
                trials = by_variant.get((precision, s), {})
                if b in trials:
                    fits = trials[b].fits(limit)
                else:  # not measured: not if a smaller size of the plan failed the limit, else as predicted
                    guess = model.predict((precision, s), b)
                    fits = (guess is not None and (limit is None or guess <= limit)
                            and all(m.fits(limit) for c, m in trials.items() if c < b))
                if fits:
                    envelope.append(Config(precision, s, b))
                    break
        speeds = {i: by_variant[c.variant][c.batch_size].samples_per_s for i, c in enumerate(envelope)
                  if c.batch_size in by_variant.get(c.variant, {})}
        if not envelope:
            return None
        if not speeds:
            return envelope[-1]
        # Hill climbing: measure the neighbours of the fastest point until both are measured and slower.
        # (A step to the neighbour costs one trial; a bisection would cost more where the maximum sits
        # near the largest batch, as it does on GPUs.) The larger neighbour first.
        best = max(speeds, key=lambda i: (speeds[i], -i))
        for i in (best + 1, best - 1):
            if 0 <= i < len(envelope) and i not in speeds:
                return envelope[i]
        return None
