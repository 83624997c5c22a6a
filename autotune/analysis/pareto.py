"""The trade-off: the Pareto front of throughput vs peak memory, limits and the recommendation.

Also the rules the search and the probe share with it: what trials and confirmed predictions imply of sizes no trial
ran, which probed candidate wins (the bracket of a batch-size limit is :mod:`autotune.analysis.limits`'). No torch: a
report is analysed where it is read.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence, TypeVar

from autotune.vocabulary import HEADROOM, Plan, Status, Variant
from autotune.analysis.limits import bracket
from autotune.records import PREDICTED, Config, Measurement, ProbeResult, usable_bytes

if TYPE_CHECKING:
    from autotune.analysis.memory_model import MemoryModel

__all__ = ["feasible", "pareto_front", "recommend", "batch_limits", "implied_failures", "LineRule",
           "line_failures", "PREDICTION_TOLERANCE", "confirmed", "Implied", "prediction_failures", "prediction_fits",
           "probe_candidates", "choose", "predicted_choice", "PREDICTED_TIE"]

T = TypeVar("T")

# How far a measured peak may lie from its prediction for the prediction to stand for the variant's other sizes, and
# how far clear of a limit a predicted peak must be to imply that its size does not fit. On the tensor meter a
# prediction counts the same storages as the measurement (results/dry_run-cpu.md: 64 of 64 to the byte); 1% leaves
# room for what a fake kernel may make in another dtype (the norm statistics autotune corrects) on a model not yet seen.
PREDICTION_TOLERANCE = 0.01


def feasible(measurements: Iterable[Measurement], budget_bytes: int | None) -> list[Measurement]:
    """Return the trials that ran to the end with a peak within ``budget_bytes``."""
    return [m for m in measurements if m.fits(budget_bytes) and m.samples_per_s is not None]


def pareto_front(measurements: Iterable[Measurement], budget_bytes: int | None) -> list[Measurement]:
    """Return the feasible trials no other feasible trial beats on both throughput and peak memory.

    A trial is dominated when another is at least as fast and needs no more memory, and is
    strictly better in one of the two. The front is ordered by ascending peak memory.
    """
    points = sorted(feasible(measurements, budget_bytes), key=lambda m: (m.peak_bytes, -m.samples_per_s))
    front: list[Measurement] = []
    best_speed = float("-inf")
    for m in points:  # by ascending memory, a point joins the front only if it is faster than all before it
        if m.samples_per_s > best_speed:
            front.append(m)
            best_speed = m.samples_per_s
    return front


# Predicted step times within this share of the fastest predicted are not told apart where the time model's error was
# not measured (a card's, unchecked): the 5% of the best that a recommendation is held to. Where it was measured
# (autotune/timing/checked.json), a report uses that error instead (Report.predicted_tie).
PREDICTED_TIE = 0.05


def recommend(measurements: Iterable[Measurement], budget_bytes: int | None, headroom: float = HEADROOM, *,
              tie: float = PREDICTED_TIE) -> Measurement | None:
    """Return the fastest feasible trial whose peak stays within ``budget x (1 - headroom)``, or None.

    The headroom leaves room for what short trials do not see: fragmentation, longer batches,
    a framework's own buffers. On a tie in throughput the smaller peak wins. Where the step times are predicted
    (a dry run's), those within ``tie`` of the fastest (the time model's measured error) are not told apart, and the
    largest batch among them wins (:func:`predicted_choice`).
    """
    candidates = feasible(measurements, usable_bytes(budget_bytes, headroom))
    if not candidates:
        return None
    best = max(candidates, key=lambda m: (m.samples_per_s, -m.peak_bytes))
    if best.time_source != PREDICTED:
        return best
    return predicted_choice([m for m in candidates if m.time_source == PREDICTED], lambda m: m.samples_per_s,
                            lambda m: m.batch_size, lambda m: -m.peak_bytes, tie=tie)


def predicted_choice(options: Sequence[T], speed: Callable[[T], float], batch_size: Callable[[T], int],
                     then: Callable[[T], float] = lambda _: 0.0, *, tie: float = PREDICTED_TIE) -> T:
    """Of ``options`` whose ``speed`` (samples/s) is predicted: the largest batch among those within ``tie`` of the
    fastest (predictions the time model cannot tell apart: its measured error), then the fastest, then ``then``'s
    largest. A larger batch spreads the step's fixed costs (the optimizer's step, each op's dispatch) over more
    samples, the costs a time model prices least well: on our CPUs the bundled models' measured throughput mostly
    grows with the batch, where near ties in the prediction pointed the other way (results/time_model-cpu.md)."""
    fastest = max(speed(o) for o in options)
    near = [o for o in options if speed(o) >= (1 - tie) * fastest]
    return max(near, key=lambda o: (batch_size(o), speed(o), then(o)))


def probe_candidates(pareto: Iterable[Measurement], budget_bytes: int | None, headroom: float, top: int) -> list[Measurement]:
    """Return up to ``top`` front trials within ``budget x (1 - headroom)``, fastest first."""
    fitting = feasible(pareto, usable_bytes(budget_bytes, headroom))
    return sorted(fitting, key=lambda m: (-m.samples_per_s, m.peak_bytes))[:top]


def choose(results: Iterable[ProbeResult]) -> ProbeResult | None:
    """Return the fastest accepted probe candidate, or None when every one was rejected."""
    accepted = [r for r in results if r.accepted and r.samples_per_s]
    return max(accepted, key=lambda r: (r.samples_per_s, -(r.peak_bytes_max or 0)), default=None)


def _too_big(m: Measurement, limit: float | None) -> bool:
    """Whether the trial measured that its configuration does not fit ``limit`` (out of memory, or over it)."""
    return m.status == Status.OOM or (m.status == Status.OK and not m.fits(limit))


def implied_failures(measurements: Iterable[Measurement], limit: float | None, plans: Iterable[str],
                     blocks: int | None) -> dict[Config, Config]:
    """Configurations not measured that are known not to fit ``limit``: {implied: the measured trial implying it}.

    A plan that needs no more memory than another (:meth:`autotune.plans.Plan.needs_no_more_memory_than`)
    and ran out of memory at a batch size means the other does not fit there either. Only the
    failing side of a bracket is implied so (a largest fitting batch is measured, or implied by a confirmed
    prediction: :func:`prediction_fits`).
    """
    measured = {m.config: m for m in measurements}
    implied: dict[Config, Config] = {}
    for m in sorted(measured.values(), key=lambda m: m.config):
        if not _too_big(m, limit):
            continue
        for plan in plans:
            config = m.config.variant.with_plan(plan).at(m.batch_size)
            if (config not in measured and config not in implied and plan != m.config.plan
                    and m.config.plan.needs_no_more_memory_than(plan, blocks)):
                implied[config] = m.config
    return implied


@dataclasses.dataclass(frozen=True)
class LineRule:
    """When a variant's own memory line may imply that a batch size does not fit (see :func:`line_failures`).

    The line is measured, not assumed. Its fixed part is ``state_bytes``, what a step holds whatever
    the batch: weights, gradients and the optimizer's state, measured for the model with the user's
    optimizer (mixed precision keeps fp32 weights, gradients and state, so one measurement serves every
    plan of the autocast modes and fp32), and for a true precision (bf16-true, the state in bf16) its own,
    measured so too (``by_precision``). Its slope, per sample, comes from the
    variant's own ok trials, least squares through that fixed part. A size is implied not to fit
    where the line predicts at least ``margin`` times the limit; where the variant has two or more ok
    trials the line must also fit each within ``tolerance``. ``min_points`` is 2 where batches change
    shape with their size (the worst batches of real data): one batch's shape says nothing of a
    larger one's.
    """

    state_bytes: float
    min_points: int = 1
    margin: float = 1.25
    tolerance: float = 0.02
    name: str = "memory-line"
    by_precision: tuple[tuple[str, float], ...] = ()  # a precision whose state differs (bf16-true): its own

    @classmethod
    def of(cls, fixed_bytes: float | None, state_measured: bool, shapes_vary: bool,
           by_precision: Mapping[str, float] | None = None) -> "LineRule | None":
        """The rule a workload allows: None where the optimizer's state was not measured (its size is a guess)."""
        if fixed_bytes is None or not state_measured:
            return None
        return cls(float(fixed_bytes), min_points=2 if shapes_vary else 1,
                   by_precision=tuple((p, float(b)) for p, b in sorted((by_precision or {}).items())))

    def state_for(self, precision: str) -> float:
        """The fixed part of ``precision``'s lines: its own state where it differs (bf16-true), else ``state_bytes``."""
        return dict(self.by_precision).get(precision, self.state_bytes)

    def per_sample(self, peaks: Mapping[int, float], precision: str | None = None) -> float | None:
        """The line's bytes per sample through ``peaks`` ({batch size: ok trial's peak}) of ``precision``, or None where
        the rule may not use them (too few, a line that does not rise, or one that misses a point by more than the
        tolerance)."""
        if len(peaks) < self.min_points or not peaks:
            return None
        state = self.state_for(precision) if precision is not None else self.state_bytes
        slope = sum(b * (y - state) for b, y in peaks.items()) / sum(b * b for b in peaks)
        if slope <= 0:
            return None
        if len(peaks) >= 2 and any(abs(state + slope * b - y) > self.tolerance * y for b, y in peaks.items()):
            return None
        return slope


def line_failures(measurements: Iterable[Measurement], limit: float | None, batch_sizes: Iterable[int],
                  rule: LineRule | None) -> dict[Config, int]:
    """Configurations not measured that the variant's memory line says do not fit ``limit``: {config: predicted bytes}.

    Only sizes above the variant's largest fitting trial, where ``rule`` (:class:`LineRule`) allows it.
    """
    if rule is None or limit is None:
        return {}
    measured = {m.config: m for m in measurements}
    peaks: dict[Variant, dict[int, float]] = {}
    for m in measured.values():
        if m.status == Status.OK and m.peak_bytes:
            peaks.setdefault(m.config.variant, {})[m.batch_size] = float(m.peak_bytes)
    implied: dict[Config, int] = {}
    for variant, points in peaks.items():
        if Plan(variant[1]).state:
            continue  # its line does not start at the state (rule.state_bytes): the state is in host memory
        slope = rule.per_sample(points, variant.precision)
        if slope is None:
            continue
        above = max((m.batch_size for m in measured.values() if m.config.variant == variant and m.fits(limit)), default=0)
        for b in sorted(batch_sizes):
            predicted = rule.state_for(variant.precision) + slope * b
            config = variant.at(b)
            if b > above and config not in measured and predicted >= rule.margin * limit:
                implied[config] = round(predicted)
    return implied


def confirmed(measurements: Iterable[Measurement], predictions: Mapping[Config, Measurement],
              tolerance: float = PREDICTION_TOLERANCE) -> dict[Variant, Config]:
    """The variants whose predictions stand: {variant: the measured trial that confirms them}.

    A variant's predictions stand where it has a measured trial that ran to the end and whose peak lies within
    ``tolerance`` of its own prediction, and none that :func:`refuted` counts against it. Where no measured trial
    contradicts any prediction, a variant with none of its own stands on the first confirming trial of its mode
    (precision and compile mode): the fake tensors run the same step code for every plan, and a model they count
    wrongly shows it in the first trial compared (a contradiction anywhere puts every variant back on trials of its
    own). The search and the report both read this one rule."""
    measurements = list(measurements)
    against = refuted(measurements, predictions, tolerance)
    agree: dict[Variant, Config] = {}
    for m in measurements:
        p = predictions.get(m.config)
        if (m.status == Status.OK and m.peak_bytes and p is not None and p.status == Status.OK and p.peak_bytes
                and abs(m.peak_bytes - p.peak_bytes) <= tolerance * p.peak_bytes):
            agree.setdefault(m.config.variant, m.config)
    own = {v: c for v, c in agree.items() if v not in against}
    if against:
        return own
    by_mode: dict[object, Config] = {}
    for variant, config in own.items():
        by_mode.setdefault(variant.mode, config)
    for config in predictions:
        if config.variant not in own and config.variant.mode in by_mode:
            own[config.variant] = by_mode[config.variant.mode]
    return own


def refuted(measurements: Iterable[Measurement], predictions: Mapping[Config, Measurement],
            tolerance: float = PREDICTION_TOLERANCE) -> set[Variant]:
    """The variants a measured trial contradicts: it ran to the end where its prediction did not fit, failed, or
    missed its peak by more than ``tolerance`` (a model whose memory fake tensors miss: the variant is then searched,
    and reported, on measurements alone)."""
    against = set()
    for m in measurements:
        p = predictions.get(m.config)
        if m.status != Status.OK or not m.peak_bytes or p is None:
            continue
        if p.status != Status.OK or not p.peak_bytes or abs(m.peak_bytes - p.peak_bytes) > tolerance * p.peak_bytes:
            against.add(m.config.variant)
    return against


@dataclasses.dataclass(frozen=True)
class Implied:
    """What a confirmed prediction implies of a configuration no trial ran: its ``predicted_bytes`` (its peak) and the
    trial that confirmed its variant's predictions (``confirmed_by``)."""

    predicted_bytes: int
    confirmed_by: Config


def prediction_failures(measurements: Iterable[Measurement], limit: float | None,
                        predictions: Mapping[Config, Measurement] | None,
                        tolerance: float = PREDICTION_TOLERANCE) -> dict[Config, Implied]:
    """Configurations not measured that a confirmed prediction (:func:`confirmed`) says do not fit ``limit``:
    {config: :class:`Implied`}.

    Only sizes above the variant's largest fitting trial, predicted out of memory or over ``limit`` by more than
    ``tolerance`` (a peak predicted that close to the limit is measured)."""
    if not predictions or limit is None:
        return {}
    measurements = list(measurements)
    measured = {m.config for m in measurements}
    standing = confirmed(measurements, predictions, tolerance)
    implied: dict[Config, Implied] = {}
    for config, p in predictions.items():
        if config.variant not in standing or config in measured or not p.peak_bytes:
            continue
        above = max((m.batch_size for m in measurements if m.config.variant == config.variant and m.fits(limit)),
                    default=0)
        if config.batch_size > above and (p.status == Status.OOM or p.peak_bytes > (1 + tolerance) * limit):
            implied[config] = Implied(p.peak_bytes, standing[config.variant])
    return implied


def prediction_fits(measurements: Iterable[Measurement], limit: float | None,
                    predictions: Mapping[Config, Measurement] | None,
                    tolerance: float = PREDICTION_TOLERANCE) -> dict[Config, Implied]:
    """Configurations not measured that a confirmed prediction (:func:`confirmed`) says fit ``limit``, clear of it by
    more than ``tolerance``: {config: :class:`Implied`}."""
    if not predictions:
        return {}
    measurements = list(measurements)
    measured = {m.config for m in measurements}
    standing = confirmed(measurements, predictions, tolerance)
    return {c: Implied(p.peak_bytes, standing[c.variant]) for c, p in predictions.items()
            if c.variant in standing and c not in measured and p.status == Status.OK and p.peak_bytes
            and (limit is None or p.peak_bytes <= (1 - tolerance) * limit)}


def batch_limits(measurements: Iterable[Measurement], budget_bytes: int | None, *,
                 batch_sizes: Sequence[int] | None = None, model: "MemoryModel | None" = None,
                 plans: Iterable[str] = (), blocks: int | None = None, line_rule: LineRule | None = None,
                 predictions: Mapping[Config, Measurement] | None = None) -> list[dict]:
    """Per variant (precision, plan, compile mode): the largest feasible batch size and the smallest infeasible one.

    The infeasible one is measured, or implied: by a measured failure of a plan that needs no
    more memory (``plans`` and ``blocks`` given; ``min_oom_implied_by`` names that trial,
    ``min_oom_rule`` is ``nested-plan``), or by the variant's memory line (``line_rule`` and
    ``batch_sizes`` given; ``min_oom_rule`` ``memory-line``, with ``min_oom_predicted_bytes``), or by the search's
    predictions where a measured trial confirmed its variant's (``predictions``; ``min_oom_rule`` ``prediction``,
    ``min_oom_implied_by`` the confirming trial, with ``min_oom_predicted_bytes``: :func:`prediction_failures`).
    With the space's ``batch_sizes``, each row also says whether the two are neighbours there
    (``bracketed``: the limit is exact), and with a fitted ``model`` it adds the model's
    ``predicted_max_batch_size`` for rows that are not.
    """
    measurements = list(measurements)
    variants: dict[Variant, list[Measurement]] = {}
    for m in measurements:
        variants.setdefault(m.config.variant, []).append(m)
    by_variant = _implied_failing_sides(measurements, budget_bytes, batch_sizes, plans, blocks, line_rule, predictions)
    for variant in by_variant:  # a variant no trial ran, whose failing side another's failure implies: "none" fits
        variants.setdefault(variant, [])
    fits_implied: dict[Variant, dict[int, Implied]] = {}
    for config, implied in prediction_fits(measurements, budget_bytes, predictions).items():
        fits_implied.setdefault(config.variant, {})[config.batch_size] = implied
        variants.setdefault(config.variant, [])  # a variant no trial ran whose predictions stand: its fits implied
    rows = []
    for variant, trials in variants.items():  # in the order the trials came
        own_fits = fits_implied.get(variant, {})
        fitting = [m.batch_size for m in trials if m.fits(budget_bytes)] + list(own_fits)
        too_big: dict[int, dict | None] = {m.batch_size: None for m in trials if _too_big(m, budget_bytes)}
        above = max(fitting, default=0)
        for b, source in by_variant.get(variant, {}).items():
            if b > above and all(b < t for t in too_big):
                too_big[b] = source  # implied, and smaller than any measured failure
        smallest = min(too_big) if too_big else None
        row = {"precision": variant.precision, "segments": variant.plan, "compile": variant.compile,
               "max_batch_size": max(fitting) if fitting else None, "min_oom_batch_size": smallest}
        if smallest is not None and too_big[smallest] is not None:
            row.update(too_big[smallest])
        if row["max_batch_size"] in own_fits:  # no trial of its own: the confirmed prediction says it fits
            implied = own_fits[row["max_batch_size"]]
            row.update(max_implied_by=str(implied.confirmed_by), max_rule="prediction",
                       max_predicted_bytes=implied.predicted_bytes)
        if batch_sizes is not None:
            sizes = sorted(batch_sizes)
            outcomes = {b: False for b in too_big if b in sizes} | {b: True for b in own_fits if b in sizes}
            outcomes.update({m.batch_size: m.fits(budget_bytes) for m in trials if m.batch_size in sizes})
            known = bracket(sizes, outcomes)
            row["bracketed"] = known.closed
            if not row["bracketed"] and model is not None and variant in model.lines:
                open_ = [sizes[i] for i in known.open
                         if budget_bytes is None or model.estimate(variant, sizes[i]) <= budget_bytes]
                row["predicted_max_batch_size"] = open_[-1] if open_ else row["max_batch_size"]
        rows.append(row)
    return rows


def _implied_failing_sides(measurements: list[Measurement], budget_bytes: int | None, batch_sizes: Sequence[int] | None,
                           plans: Iterable[str], blocks: int | None, line_rule: LineRule | None,
                           predictions: Mapping[Config, Measurement] | None) -> dict[Variant, dict[int, dict]]:
    """{variant: {batch size: how its failure is implied}}: by the memory line, by a confirmed prediction, or by a
    measured failure of a plan that needs no more memory (the last said wins: a measured trial first)."""
    by_variant: dict[Variant, dict[int, dict]] = {}
    line = line_failures(measurements, budget_bytes, batch_sizes or (), line_rule)
    for config, predicted in line.items():
        by_variant.setdefault(config.variant, {})[config.batch_size] = {
            "min_oom_implied_by": "memory line", "min_oom_rule": line_rule.name, "min_oom_predicted_bytes": predicted}
    for config, implied in prediction_failures(measurements, budget_bytes, predictions).items():
        by_variant.setdefault(config.variant, {})[config.batch_size] = {
            "min_oom_implied_by": str(implied.confirmed_by), "min_oom_rule": "prediction",
            "min_oom_predicted_bytes": implied.predicted_bytes}
    for config, source in implied_failures(measurements, budget_bytes, plans, blocks).items():
        by_variant.setdefault(config.variant, {})[config.batch_size] = {
            "min_oom_implied_by": str(source), "min_oom_rule": "nested-plan"}
    return by_variant
