"""Auto: bracket each plan's largest batch with the memory model, then climb throughput.

For a fixed precision, compile mode and checkpoint plan, peak memory is monotone and close to linear in the
batch size (:mod:`autotune.analysis.memory_model`). The strategy works in four phases, each a function of
the measurements alone, so a resumed search or a second worker picks up where the store stands:

1. **Bracket** every plan's boundary under the budget, exactly at the resolution of the batch
   sizes: the largest size that fits is a measured trial, and so is the next size up (which does
   not fit) unless a plan that needs no more memory failed at that size
   (:meth:`autotune.plans.Plan.needs_no_more_memory_than`; the limits name the trial that implies it)
   or the variant's own memory line, measured, predicts at least 1.25x the budget there
   (:class:`autotune.analysis.pareto.LineRule`; the limits give the predicted bytes). Plans
   go from the most recompute to the least, so such failures come first. The next trial of a plan
   is the size the model predicts to be the largest that fits, inside the bracket still open;
   where the memory line may imply failures, the largest predicted under 1.25x the budget
   (were the size below it to fit, that size could not be implied and would be measured anyway).
   Before any peak is known: the largest size for the search's first plan (the one that keeps the
   least often fits it, which closes its bracket in one trial), then the middle size, whose
   activations outweigh the fixed part, then the smallest. After three trials of a plan without
   closing it, plain bisection. These trials are memory trials (metered, not timed), except where
   the climb (3.) starts.
2. **Other budgets** (``--budgets``): a plan's boundary under a smaller budget comes from the
   measured peaks where they bracket it, from the model where its prediction is clear of the
   budget by more than its error, and from one more memory trial where it is not.
3. **Throughput.** At each batch size the fastest block plan is the one that recomputes the fewest
   blocks and fits within the budget less headroom (checkpointing only adds recompute), so
   the other block plans cannot enter the front there and are not timed. A selective plan is not
   ordered in time against block plans (it recomputes less, but runs a dispatch mode over every
   operation; on a CPU that can cost more than recomputing whole blocks), so each selective plan
   has an envelope of its own, after no checkpointing. Along each envelope, per
   precision, the strategy climbs from the fastest timed point (at first: the largest batch of
   the plan with the least recompute) to a local maximum of samples/s: both neighbours timed and
   slower. A point measured only for memory is completed by
   a timing. A precision that is slower in every configuration timed in both and fits the limit
   nowhere the faster one does not (:func:`_dominates`) is not climbed; the precision with the
   fastest trial climbs first, so the other is often found slower before it climbs. A climb step
   the time model
   (:func:`step_time_bound`: the plan without recompute's ``a + c b``, times ``1 + k r`` for a
   recompute share ``r``) says cannot beat the fastest trial by more than the timing noise is not
   timed. Where the search's predictions carry step times (:mod:`autotune.timing`, the CPU calibrated), every
   precision's climb starts at the configuration they say is fastest, and a configuration they say loses to the
   fastest predicted under the limit by more than twice the model's median error (``time_error``: the error of a
   comparison of two predictions) is not timed either (:meth:`AutoStrategy._outpaced`): a precision predicted
   slower everywhere is not timed at all.
4. **Near ties.** Where the fastest trial under a budget and the next lie within their spreads of
   each other, each is timed once more, alternately, and judged on the steps of both runs; not
   where the probe will train both after the search (``probed``): it decides between them.

The phases read the measurements through a :class:`~autotune.search.strategies.view.View`.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from autotune.analysis.limits import bracket
from autotune.analysis.pareto import LineRule, pareto_front, probe_candidates
from autotune.vocabulary import HEADROOM, Plan, Status, Variant
from autotune.records import Config, Measurement, usable_bytes
from autotune.search.space import SearchSpace
from autotune.search.strategies.base import Proposal, Strategy
from autotune.search.strategies.view import Mode, View, step_time_bound, variant_of

__all__ = ["AutoStrategy", "next_in_bracket", "step_time_bound"]

_BISECT_AFTER = 3  # trials of one plan after which the model is not trusted to close its bracket


def next_in_bracket(sizes: list[int], outcomes: Mapping[int, bool], predicted: Mapping[int, float] | None,
                    limit: float | None, tries: int, margin: float = 1.0, top_first: bool = False) -> int | None:
    """The next batch size to measure to close the bracket of one plan, or None when it is closed.

    ``predicted`` maps batch sizes to the model's peak bytes (None where the model knows nothing):
    the guess is the largest open size predicted under ``margin`` times ``limit`` (the memory line's
    margin where its rule applies: a size predicted between the limit and that margin cannot be implied
    not to fit, so it is measured either way, and first it may close the bracket alone). ``tries`` is
    how many trials the plan had; ``top_first``: the search's first plan, which begins at the largest size.
    """
    known = bracket(sizes, outcomes)
    if not known.open:  # closed, or nothing below a size that does not fit
        return None
    lo, hi, open_ = known.lo, known.hi, list(known.open)
    if tries >= _BISECT_AFTER:
        return sizes[(lo + hi) // 2]
    if not predicted:  # nothing to go by (no trial of the search fitted yet): the middle size, whose peak draws a
        # line, then the smallest; the search's first trial first tries the largest, where the plan that keeps the
        # least (bracketed first) often fits, closing its bracket in one trial
        order = [open_[-1], open_[len(open_) // 2], open_[0]] if top_first else [open_[len(open_) // 2], open_[0]]
        return sizes[order[min(tries, len(order) - 1)]]
    fitting = [i for i in open_ if limit is None or predicted[sizes[i]] <= limit * margin]
    return sizes[fitting[-1] if fitting else open_[0]]


def _dominates(fast: Mode, slow: Mode, view: "View", limit: float | None) -> bool:
    """Whether mode ``fast`` (precision, compile mode) beats ``slow`` under ``limit``: faster in every configuration
    timed in both (at least one), and fitting ``limit`` wherever ``slow`` may, in every plan at every batch size.

    "May fit" is what the envelopes read (:meth:`View.fits`): the measurements, the failures implied, the confirmed
    predictions, else the expected peaks (predictions, or the memory model's line). The climb times only
    configurations its envelopes hold, so a slow mode that fits nowhere the fast one does not has no configuration
    the recommendation could take: the fast mode's own one there is faster. (Fitted lines alone were the rule before:
    two modes that keep the same bytes, fp16 and bf16 autocast, drew lines a few bytes apart from the trials each
    happened to have, and the slower mode was climbed, at its slow steps.)
    """
    measured = view.measured
    pairs = [(m.samples_per_s, measured[variant_of(fast, c.plan).at(c.batch_size)].samples_per_s)
             for c, m in measured.items() if c.variant.mode == slow and m.samples_per_s is not None
             and variant_of(fast, c.plan).at(c.batch_size) in measured]
    if not pairs or any(q is None or q <= s for s, q in pairs):
        return False
    for plan in view.ordered:
        quick, slower = variant_of(fast, plan), variant_of(slow, plan)
        known = {v: view.outcomes(v, limit) for v in (quick, slower)}
        if any(view.fits(slower, b, limit, known[slower]) and not view.fits(quick, b, limit, known[quick])
               for b in view.sizes):
            return False
    return True


_WAIT = object()  # a phase that must wait for other workers' trials before the next phase may start
_NOISE = 0.05  # the least timing noise between two trials assumed when skipping a climb step (a spread may read 0)


class AutoStrategy(Strategy):
    """Model-guided bracketing of each plan's batch limit, then a throughput climb (module docstring)."""

    name = "auto"
    starts_from_predictions = True

    def __init__(self, *, headroom: float = HEADROOM, budgets: Iterable[int] = (), fixed_bytes_hint: float | None = None,
                 line_rule: LineRule | None = None, predictions: Mapping[Config, Measurement] | None = None,
                 probed: int = 0, time_error: float | None = None) -> None:
        self.headroom = headroom
        self.budgets = tuple(sorted(set(budgets)))
        self.fixed_bytes_hint = fixed_bytes_hint
        self.line_rule = line_rule  # where the memory line may imply a failing side (the tuner's, from measured state)
        self.predictions = dict(predictions or {})  # the space predicted before the search (tensor meter only)
        # How many of the front's fastest trials under the budget less headroom the probe trains after the search, on
        # the data, and chooses the recommendation from (0: no probe)
        self.probed = probed
        # The median error of the time model that priced the predictions' steps (None: none did): a configuration
        # predicted to lose by more than twice it, the error of a comparison of two predictions, is not timed
        self.time_error = time_error

    def propose(self, space: SearchSpace, measured: Mapping[Config, Measurement], enforced_bytes: int | None,
                *, pending: frozenset[Config] = frozenset()) -> Proposal | None:
        view = View(space, measured, self.fixed_bytes_hint, pending, self.line_rule, self.predictions)
        for phase in (self._bracket, self._other_budgets, self._throughput, self._near_ties):
            proposal = phase(view, enforced_bytes)
            if proposal is _WAIT:
                return None  # the rest depends on trials other workers are running
            if proposal is not None:
                return proposal
        return None

    def _limits(self, enforced_bytes: int | None) -> list[float | None]:
        """The usable share of every budget, the largest first: where a recommendation may be."""
        return [usable_bytes(b, self.headroom) for b in dict.fromkeys([enforced_bytes, *reversed(self.budgets)])]

    def _bracket(self, view: View, enforced_bytes: int | None):
        """1. The budget's boundary of every plan: its largest fitting size measured, the next size up measured
        or implied. A trial is timed only where it can be on a precision's throughput envelope."""
        waiting = False
        for variant in view.variants:
            own = view.by_variant.get(variant, {})
            # The search's first plan begins at the largest size: every trial so far is its own, one of them there
            top_first = len(own) == len(view.measured) and (not own or view.sizes[-1] in own)
            margin = view.line_rule.margin if view.line_rule and not view.by_prediction(variant) else 1.0
            b = next_in_bracket(view.sizes, view.outcomes(variant, enforced_bytes), view.predicted(variant),
                                enforced_bytes, len(own), margin=margin, top_first=top_first)
            b = self._confirming_size(view, variant, own) or b
            if b is None:
                continue
            if variant in view.busy:
                waiting = True
                continue
            config = variant.at(b)
            # Timed at once only where the climb (3.) starts: the largest batch of the plan without recompute on an
            # envelope (as predicted now), not a point the bracket passes on its way there.
            wanted = variant[1] == view.ordered[0] and any(
                config == max((c for c in envelope if c.plan == variant[1]), key=lambda c: c.batch_size, default=None)
                for limit in self._limits(enforced_bytes) for envelope in view.envelopes(config.variant.mode, limit))
            return Proposal(config, timed=wanted)
        return _WAIT if waiting else None

    @staticmethod
    def _confirming_size(view: View, variant: Variant, own: Mapping[int, Measurement]) -> int | None:
        """Where a plan with recompute checks its predictions: the space's middle size, cheap to measure and large
        enough that activations weigh in the comparison; once a trial there agrees, the predictions close the plan's
        bracket (:func:`~autotune.analysis.pareto.prediction_fits`). None where the plan has no predictions, has them
        confirmed or contradicted already, is the plan without recompute (its bracket begins at its predicted limit,
        where the climb starts), or is predicted not to fit there."""
        middle = view.sizes[len(view.sizes) // 2]
        p = view.predictions.get(variant.at(middle))
        if (not view.by_prediction(variant) or variant in view.standing or variant[1] == view.ordered[0] or own
                or p is None or p.status != Status.OK):
            return None
        return middle

    def _other_budgets(self, view: View, enforced_bytes: int | None) -> Proposal | None:
        """2. Smaller budgets: a memory trial only where neither the measurements nor the model settle a boundary."""
        margin = max(0.05, view.model.relative_error())
        for limit in (b for b in self.budgets if enforced_bytes is None or b < enforced_bytes):
            for variant in view.variants:
                b = self._uncertain(view.sizes, view.outcomes(variant, limit), view.predicted(variant), limit, margin)
                if b is not None and variant.at(b) not in view.pending:
                    return Proposal(variant.at(b), timed=False)
        return None

    def _throughput(self, view: View, enforced_bytes: int | None) -> Proposal | None:
        """3. Throughput along each precision's envelope, for every budget less headroom; a precision slower
        wherever both were measured, and needing more memory in every plan, is skipped."""
        for limit in self._limits(enforced_bytes):
            # The precision with the fastest timed trial first: a slower one is often dominated once both are timed.
            fastest = {p: max((m.samples_per_s for c, m in view.measured.items() if c.variant.mode == p
                               and m.samples_per_s is not None and m.fits(limit)), default=0.0)
                       for p in view.modes}
            # Every precision's climb starts before any goes on (a precision timed nowhere cannot be found slower:
            # where predictions closed every bracket, no memory trial of the search timed its start on the way)
            for starting in (True, False):
                for mode in sorted(view.modes, key=lambda p: -fastest[p]):
                    if (starting and fastest[mode]) or any(_dominates(other, mode, view, limit)
                                                           for other in view.modes if other != mode):
                        continue
                    for envelope in view.envelopes(mode, limit):
                        outpaced = {c for c in envelope if not view.timed(c) and self._outpaced(view, c, limit)}
                        config = self._climb(envelope, view, view.best(limit), outpaced)
                        if config is not None and config not in view.pending:
                            return Proposal(config)  # a memory trial of it is completed by this timing
        return None

    def outpaced_configs(self, space: SearchSpace, measured: Mapping[Config, Measurement],
                         enforced_bytes: int | None) -> list[Config]:
        """The configurations under the budget less headroom that the time model's predictions left untimed
        (:meth:`_outpaced`), as the measurements stand: what the report counts."""
        view = View(space, measured, self.fixed_bytes_hint, frozenset(), self.line_rule, self.predictions)
        limit = self._limits(enforced_bytes)[0]
        return [c for c in space.configs() if not view.timed(c) and view.by_prediction(c.variant)
                and view.fits(c.variant, c.batch_size, limit, view.outcomes(c.variant, limit))
                and self._outpaced(view, c, limit)]

    def _outpaced(self, view: View, config: Config, limit: float | None) -> bool:
        """Whether the time model's predictions say ``config`` loses to another configuration that fits ``limit`` (the
        memory the recommendation under it may take) by more than the model can be wrong in a comparison of two
        predictions (twice its median error, :attr:`time_error`): such a configuration is not timed under ``limit``;
        a smaller budget (``--budgets``) weighs it again under its own limit."""
        if self.time_error is None:
            return False
        own, fastest = view.predicted_speed(config), view.fastest_predicted(limit)
        return own is not None and fastest is not None and fastest > own * (1 + 2 * self.time_error)

    def _near_ties(self, view: View, enforced_bytes: int | None) -> Proposal | None:
        """4. Where the fastest trial under a budget and another lie within their spreads of each other, time
        each once more, alternately, in fresh trials: one run's noise does not pick the recommendation. Not where
        the probe will train both (:attr:`probed`): it times them again itself, over an epoch of the data, and the
        recommendation is its choice."""
        for limit in self._limits(enforced_bytes):
            ranked = sorted((m for m in view.measured.values() if m.fits(limit) and m.samples_per_s is not None),
                            key=lambda m: (-m.samples_per_s, m.peak_bytes or 0))
            if len(ranked) < 2:
                continue
            best, probed = ranked[0], self._probed(view, enforced_bytes) if limit == self._limits(enforced_bytes)[0] else set()
            for other in ranked[1:3]:
                if not _overlap(best, other):
                    break
                if best.config in probed and other.config in probed:
                    continue  # the probe decides between them, on more steps than a trial's
                for m in sorted((best, other), key=lambda m: m.timings):  # the fewer timings first: alternating
                    if m.timings < 2 and m.config not in view.pending:
                        return Proposal(m.config)
        return None

    def _probed(self, view: View, enforced_bytes: int | None) -> set[Config]:
        """The configurations the probe will train after the search, as the measurements stand (the tuner's
        :func:`~autotune.analysis.pareto.probe_candidates` of the front under the budget)."""
        if not self.probed:
            return set()
        front = pareto_front(view.measured.values(), enforced_bytes)
        return {m.config for m in probe_candidates(front, enforced_bytes, self.headroom, self.probed)}

    @staticmethod
    def _uncertain(sizes, outcomes, predicted, limit, margin) -> int | None:
        """A size whose fit under ``limit`` neither the measurements nor the model settle, or None."""
        for i in bracket(sizes, outcomes).open:
            guess = None if predicted is None else predicted[sizes[i]]
            if guess is None or abs(guess - limit) <= margin * limit:
                return sizes[i]
        return None

    @staticmethod
    def _climb(envelope: list[Config], view: View, best: Measurement | None = None,
               outpaced: frozenset[Config] | set[Config] = frozenset()) -> Config | None:
        """The next point of a throughput climb along ``envelope``, or None at a local maximum.

        A point the time model says cannot beat ``best`` (the fastest timed trial under the limit) by more
        than the timing noise is not timed (:func:`step_time_bound`), nor one the predicted step times say loses by
        more than their error (``outpaced``): both count as timed and slower."""
        speeds = {i: view.measured[c].samples_per_s for i, c in enumerate(envelope) if view.timed(c)}
        if not envelope or (not speeds and all(c in outpaced for c in envelope)):
            return None
        if not speeds:  # start where the predicted step times say is fastest, else at the largest batch of the plan
            # with the least recompute, where training usually starts
            predicted = {c: view.predicted_speed(c) for c in envelope if c not in outpaced}
            if all(v is not None for v in predicted.values()):
                return max(predicted, key=lambda c: (predicted[c], c.batch_size))
            first = view.ordered[0]
            return next((c for c in reversed(envelope) if c.plan == first), envelope[-1])
        # Hill climbing: measure the neighbours of the fastest point until both are measured and slower.
        # (A step to the neighbour costs one trial; a bisection would cost more where the maximum sits
        # near the largest batch, as it does on GPUs.) The larger neighbour first.
        top = max(speeds, key=lambda i: (speeds[i], -i))
        steps = [i for i in (top + 1, top - 1) if 0 <= i < len(envelope) and i not in speeds]
        bounds = {i: view.speed_bound(envelope[i]) if best is not None else None for i in steps}
        # A checkpointed step the time model cannot bound yet waits for a step without recompute, which may give it one.
        steps.sort(key=lambda i: best is not None and not Plan(envelope[i].plan).off and bounds[i] is None)
        for i in steps:
            if envelope[i] in outpaced or (
                    bounds[i] is not None and bounds[i] <= best.samples_per_s * (1 + max(_NOISE, best.step_s_spread or 0.0))):
                continue  # it cannot win: as if timed and slower
            return envelope[i]
        return None


def _overlap(a: Measurement, b: Measurement) -> bool:
    """Whether two trials' samples/s lie within their spreads of each other (the spread of each one's step times)."""
    return abs(a.samples_per_s - b.samples_per_s) <= (
        a.samples_per_s * (a.step_s_spread or 0.0) + b.samples_per_s * (b.step_s_spread or 0.0)) / 2
