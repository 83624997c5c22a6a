"""What the measurements say, as ``auto``'s phases read them (:mod:`autotune.search.strategies.auto`).

A :class:`View` is made afresh for every proposal from the stored measurements (and the predictions the search
started from): the memory model fitted to them, each variant's trials, the failures implied, the confirmed
predictions, the envelopes the throughput climb walks; and :func:`step_time_bound`, the time model a climb step is
weighed with.
"""

from __future__ import annotations

from typing import Mapping

from autotune.analysis.memory_model import Line, MemoryModel, fit_line
from autotune.analysis.pareto import (LineRule, confirmed, implied_failures, line_failures, prediction_failures,
                                      prediction_fits, refuted)
from autotune.records import PREDICTED, Config, Measurement
from autotune.search.space import SearchSpace
from autotune.vocabulary import EAGER, Plan, Status, Variant

__all__ = ["View", "Mode", "step_time_bound", "variant_of"]

Mode = tuple[str, str]  # (precision, compile mode): a variant's all but its plan, what envelopes and dominance compare


def variant_of(mode: Mode | str, plan: str) -> Variant:
    """The variant of ``mode`` with ``plan`` (a precision alone: its eager mode)."""
    precision, compile = (mode, EAGER) if isinstance(mode, str) else mode
    return Variant(precision, plan, compile)


def step_time_bound(config: Config, measured: Mapping[Config, Measurement], blocks: int | None) -> float | None:
    """An optimistic samples/s of ``config`` from the trials timed so far; None without a model.

    The time model: a step of the plan without recompute takes ``a + c b`` (least squares through
    that plan's timed trials of the precision, two or more), and recomputing a share ``r`` of the
    blocks multiplies it by ``1 + k r``. ``k`` is the smallest any timed checkpointed plan of the
    precision shows (0 before one is timed, or if one was faster): recompute only adds work, so the
    bound errs towards a faster step. For the plan without recompute itself the line speaks only
    outside its timed sizes: above them a step's time grows at least as fast as the line (caches and
    memory traffic do not make a large batch cheaper per sample), below them a positive ``a`` is the
    step's fixed cost, and a negative one makes the bound larger still. Between two timed sizes a
    curve may bulge above the line, so there it says nothing.
    """
    plan = config.plan
    # Plans that keep the state in host memory step the optimizer on the CPU: a line of their own (0+state's)
    kind = [c for c in measured if c.variant.mode == config.variant.mode and c.plan.state == plan.state]
    steps = {c.batch_size: measured[c].step_s for c in kind
             if c.plan.without_state.off and measured[c].step_s and measured[c].timed}
    if len(steps) < 2 or (plan.without_state.off and min(steps) <= config.batch_size <= max(steps)):
        return None  # no line yet; or a point between the plan's own timed ones, where a curve may bulge above it
    base = fit_line(steps).at

    ks = [(m.step_s / base(m.batch_size) - 1) / share for cfg, m in ((c, measured[c]) for c in kind)
          if m.step_s and m.timed and base(m.batch_size) > 0 and (share := Plan(cfg.plan).recompute_share(blocks)) > 0]
    k = max(0.0, min(ks, default=0.0))
    step = base(config.batch_size) * (1 + k * plan.recompute_share(blocks))
    return config.batch_size / step if step > 0 else None


class View:
    """What the measurements say, as the phases read it: the memory model, each variant's trials, implied failures."""

    def __init__(self, space: SearchSpace, measured: Mapping[Config, Measurement], fixed_bytes_hint: float | None,
                 pending: frozenset[Config], line_rule: LineRule | None = None,
                 predictions: Mapping[Config, Measurement] | None = None) -> None:
        self.space, self.measured, self.pending, self.line_rule = space, measured, pending, line_rule
        self.predictions, self.fixed_bytes_hint = predictions or {}, fixed_bytes_hint
        self.sizes = sorted(space.batch_sizes)
        self.ordered = space.ordered_plans()  # least recompute first
        # Bracketed from the most recompute down: a plan's failure implies the failures of the plans that
        # recompute a subset of its blocks. Precisions alternate, so a precision's ratio is learnt early.
        self.variants = [Variant(p, s, c) for c in space.compiles for s in reversed(self.ordered) for p in space.precisions]
        self.modes: list[Mode] = [(p, c) for c in space.compiles for p in space.precisions]
        self.model = MemoryModel.fit(measured.values(), self.variants, fixed_bytes_hint=fixed_bytes_hint,
                                     blocks=space.blocks)
        self.busy = {c.variant for c in pending}
        self.by_variant: dict[Variant, dict[int, Measurement]] = {}
        for c, m in measured.items():
            self.by_variant.setdefault(c.variant, {})[c.batch_size] = m
        self._implied: dict[float | None, tuple[dict[Config, object], dict[Config, object]]] = {}
        self.standing = confirmed(measured.values(), self.predictions)  # variants whose predictions a trial confirmed
        # Variants whose predictions a measured trial contradicted: searched on measurements alone
        self.refuted = refuted(measured.values(), self.predictions)
        self._steps: dict[Variant, dict[int, float]] = {}  # each variant's predicted step times, by batch size

    def outcomes(self, variant: Variant, limit: float | None) -> dict[int, bool]:
        """Batch size -> fits ``limit``: measured, or implied not to by a plan that needs no more memory, by the
        variant's memory line (:class:`~autotune.analysis.pareto.LineRule`) or by its confirmed predictions, or
        implied to by its confirmed predictions (clear of ``limit``)."""
        if limit not in self._implied:
            self._implied[limit] = ({
                **line_failures(self.measured.values(), limit, self.sizes, self.line_rule),
                **prediction_failures(self.measured.values(), limit, self.predictions),
                **implied_failures(self.measured.values(), limit, self.space.plans, self.space.blocks)},
                prediction_fits(self.measured.values(), limit, self.predictions))
        fails, fits = self._implied[limit]
        known = {c.batch_size: False for c in fails if c.variant == variant}
        known.update({c.batch_size: True for c in fits if c.variant == variant})
        known.update({b: m.fits(limit) for b, m in self.by_variant.get(variant, {}).items()})
        return known

    def predicted(self, variant: Variant) -> dict[int, float] | None:
        """Batch size -> the peak bytes expected: the search's prediction of the size (a size above the variant's
        first predicted failure: none fits), or, without predictions or where a measurement refuted them, the
        memory model's line; None where neither knows anything."""
        if self.by_prediction(variant):
            guesses = {b: self.guess(variant, b) for b in self.sizes}
            if all(g is not None for g in guesses.values()):
                return guesses
        return None if variant not in self.model.lines else {b: self.model.estimate(variant, b) for b in self.sizes}

    def by_prediction(self, variant: Variant) -> bool:
        """Whether ``variant``'s expected peaks are its predictions."""
        return variant not in self.refuted and any(
            variant.at(b) in self.predictions and self.predictions[variant.at(b)].status.measured_memory
            for b in self.sizes)

    def guess(self, variant: Variant, b: int) -> float | None:
        """The peak bytes expected at ``b``: predicted (infinite where predicted out of memory, or above a size
        predicted so), else the memory model's line."""
        if not self.by_prediction(variant):
            return self.model.estimate(variant, b)
        points: dict[int, float] = {}
        for size in self.sizes:
            p = self.predictions.get(variant.at(size))
            if p is None or not p.status.measured_memory:  # a prediction that failed says nothing of memory
                continue
            if p.status == Status.OOM or not p.peak_bytes:
                return float("inf") if size <= b else self._between(points, b, variant)
            points[size] = float(p.peak_bytes)
        return self._between(points, b, variant)

    def _between(self, points: dict[int, float], b: int, variant: Variant) -> float | None:
        """At a size not predicted: the line through the variant's predicted peaks (the memory model's with fewer
        than two). A guess that picks the next trial; only a prediction of the size itself implies anything."""
        if b in points:
            return points[b]
        # one point: through the fixed part (the state), where it is known and below the point, else through 0
        line = Line.through(points, self.fixed_bytes_hint) or Line.through(points, 0.0)
        return line.at(b) if line is not None else self.model.estimate(variant, b)

    def predicted_speed(self, config: Config) -> float | None:
        """The samples/s the time model predicts for ``config``: its own prediction's (``time_source`` predicted),
        else read between its variant's predicted step times (a step's time drawn straight between the two predicted
        sizes around it; beyond them, the nearest one's samples/s: more than a smaller batch reaches, as the step's
        fixed costs weigh more there, and as much as a larger one can, were it to fit), or None: no step time
        predicted for the variant, or a variant whose predicted peaks a measured trial contradicted."""
        if config.variant in self.refuted:
            return None
        p = self.predictions.get(config)
        if p is not None:
            return p.samples_per_s if p.status == Status.OK and p.time_source == PREDICTED else None
        steps = self._predicted_steps(config.variant)
        b = config.batch_size
        below, above = [s for s in steps if s < b], [s for s in steps if s > b]
        if not below or not above:
            nearest = below[-1] if below else above[0] if above else None
            return None if nearest is None else nearest / steps[nearest]
        lo, hi = below[-1], above[0]
        step = steps[lo] + (steps[hi] - steps[lo]) * (b - lo) / (hi - lo)
        return b / step if step > 0 else None

    def _predicted_steps(self, variant: Variant) -> dict[int, float]:
        """{batch size: predicted step seconds} of ``variant``'s predictions with a step time, by size."""
        if variant not in self._steps:
            self._steps[variant] = dict(sorted(
                (c.batch_size, m.step_s) for c, m in self.predictions.items()
                if c.variant == variant and m.status == Status.OK and m.time_source == PREDICTED and m.step_s))
        return self._steps[variant]

    def fastest_predicted(self, limit: float | None) -> float | None:
        """The most samples/s a prediction of its own (not read between others) gives a configuration whose predicted
        peak fits ``limit``, or None."""
        speeds = [self.predicted_speed(c) for c, p in self.predictions.items() if p.fits(limit)]
        return max((s for s in speeds if s is not None), default=None)

    def speed_bound(self, config: Config) -> float | None:
        """The most samples/s ``config`` can reach, by the time model (:func:`step_time_bound`), or None."""
        return step_time_bound(config, self.measured, self.space.blocks)

    def best(self, limit: float | None) -> Measurement | None:
        """The fastest timed trial within ``limit``."""
        timed = [m for m in self.measured.values() if m.fits(limit) and m.samples_per_s is not None]
        return max(timed, key=lambda m: (m.samples_per_s, -(m.peak_bytes or 0)), default=None)

    def timed(self, config: Config) -> bool:
        """Whether ``config`` has a step time."""
        m = self.measured.get(config)
        return m is not None and m.samples_per_s is not None

    def envelopes(self, mode: Mode, limit: float | None) -> list[list[Config]]:
        """The envelope of each chain of plans (:meth:`envelope`): the block plans, and each selective or offloading
        plan after no checkpointing; plans with the state in host memory (+state) in chains of their own. Time orders
        the plans of a chain, not a selective plan against a block plan, nor a plan whose copies to the host cost time
        against one that recomputes."""
        unordered = [s for s in self.ordered if Plan(s).selective or Plan(s).offload]
        blocks = [[s for s in self.ordered if s not in unordered and Plan(s).state == state] for state in (False, True)]

        def off(state: bool) -> list[str]:  # no checkpointing, with the state where ``state`` says
            return [s for s in self.ordered if Plan(s).base.off and not Plan(s).offload and Plan(s).state == state]

        chains = [*blocks, *([*off(Plan(own).state), own] for own in unordered)]
        envelopes: list[list[Config]] = []
        for chain in chains:
            envelope = self.envelope(mode, limit, chain)
            if envelope and envelope not in envelopes:
                envelopes.append(envelope)
        return envelopes

    def envelope(self, mode: Mode, limit: float | None, chain: list[str]) -> list[Config]:
        """Per batch size, the plan of ``chain`` (least recompute first) that fits ``limit`` (measured, implied or
        predicted) first: the fastest of the chain there, since checkpointing more blocks only adds recompute."""
        envelope: list[Config] = []
        outcomes = {s: self.outcomes(variant_of(mode, s), limit) for s in chain}
        for b in self.sizes:
            for s in chain:
                if self.fits(variant_of(mode, s), b, limit, outcomes[s]):
                    envelope.append(variant_of(mode, s).at(b))
                    break
        return envelope

    def fits(self, variant: Variant, b: int, limit: float | None, known: Mapping[int, bool]) -> bool:
        """Whether ``variant`` at ``b`` may fit ``limit``, as the envelopes read it: as ``known``
        (:meth:`outcomes`), else not if a smaller size failed the limit, else as expected (:meth:`guess`)."""
        if b in known:
            return known[b]
        guess = self.guess(variant, b)
        return (guess is not None and (limit is None or guess <= limit)
                and all(ok for size, ok in known.items() if size < b))
