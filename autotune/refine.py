"""The recommendation refined by real trials after the analysis: stages 5b and 5c of :func:`autotune.tuner.run`.

* :func:`exact_limit` (``--exact-limit``): the recommended variant's limit bisected with real trials.
* :func:`static_compile` (on unless ``--no-static-compile``): a compiled recommendation timed again compiled for its
  batch size alone.

Their trials are the report's, not the study's: their configurations are not the space's (other batch sizes, a
static compile), so peers sharing a study each run them, and a resumed search runs them again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune._log import logger
from autotune.analysis.limits import bisect_limit
from autotune.execution.trial import TrialWork
from autotune.preparation import Study, Target
from autotune.records import Measurement, completed, usable_bytes
from autotune.report import Report
from autotune.vocabulary import Status, Variant, compile_label, is_static, static_of

__all__ = ["exact_limit", "static_compile"]


# -- stage 5b: the recommended variant's limit, exact --------------------------------------------------------------


def exact_limit(report: Report, target: Target, study: Study, events: Any) -> Report:
    """Stage 5b: the recommended variant's limit made exact by real trials, and the recommendation reconsidered at it.

    By default, where the search's predictions made the recommended variant's limit exact
    (:func:`~autotune.analysis.exact.exact_limits`), its predicted sides are measured: a memory trial at the largest
    size predicted to fit and one at the next (``search.exact_limit.confirmed``). Where a trial contradicts its
    prediction, the predictions of every variant fall back on trials of their own (a notice says so) and the
    recommended variant's limit is bisected by real trials as below.

    With ``--exact-limit``, between the largest batch that fits and the smallest that does not (measured, or implied
    by a memory line or a plan that needs no more), memory trials bisect in steps of ``--batch-multiple``, and the size
    above the limit is measured failing. The largest size within the budget less its headroom is found the same way
    and timed, so the recommendation considers training at it. These trials are the report's, not the study's (their
    sizes are not the space's): peers sharing a study each run them, and a resumed search runs them again.
    """
    rec = report.recommendation
    if rec is None:
        return report
    variant = rec.config.variant
    row = _row(report, variant)
    # The sides of its limit the search's predictions gave (exact_limits): {field: batch size}
    predicted = {size: row[size] for size, rule in (("max_batch_size", "max_rule"), ("min_oom_batch_size", "min_oom_rule"))
                 if row.get(rule) == "prediction"}
    if not predicted and not target.searching.exact_limit:
        return report
    trials = _LimitTrials(report, target, study, events, variant)
    side: dict[str, Any] = {"precision": rec.precision, "segments": str(rec.config.plan),
                            "batch_multiple": target.searching.batch_multiple}
    if predicted:
        for b in predicted.values():  # the largest size predicted to fit, and the next
            trials.run(b)
        report = trials.joined(report)
        row = _row(report, variant)
        confirmed = (all(row[size] == b for size, b in predicted.items())
                     and not any(row.get(k) == "prediction" for k in ("max_rule", "min_oom_rule")))
        side.update({f"predicted_{size}": b for size, b in predicted.items()}, confirmed=confirmed)
        if not confirmed:
            report = dataclasses.replace(report, notices=report.notices + (
                f"the search's predicted limit of {variant} was not confirmed by its trials at "
                f"{' and '.join(map(str, predicted.values()))}: every variant's limit stands on its own trials, and "
                f"this one was bisected by real trials",))
            logger.warning(report.notices[-1])
    if not (predicted and side["confirmed"] and not target.searching.exact_limit):
        side.update(_bisected(trials, row, target))
    side.update(max_batch_size=side.get("max_batch_size", row["max_batch_size"]),
                min_oom_batch_size=side.get("min_oom_batch_size", row["min_oom_batch_size"]), trials=len(trials.added))
    if not trials.added:
        return report  # the space's top fits, or the limit is exact and measured already
    return dataclasses.replace(trials.joined(report), search=report.search.but(exact_limit=side))


class _LimitTrials:
    """The real trials of one variant that stage 5b runs: each a memory trial (or a timing of one), reported as it
    ends; ``added`` holds them, ``measured`` the report's trials with them."""

    def __init__(self, report: Report, target: Target, study: Study, events: Any, variant: Variant) -> None:
        self.target, self.study, self.events, self.variant = target, study, events, variant
        self.measured = {m.config: m for m in report.trials}
        self.added: list[Measurement] = []

    def run(self, b: int, timed: bool = False, metered: bool = True) -> Measurement:
        config, target = self.variant.at(b), self.target
        if config in self.measured and not timed:
            return self.measured[config]
        self.events.trial_started(config)
        m = target.venue.run(self.study.workload, TrialWork(config, target.trial_settings, target.budget.enforced,
                                                            timed=timed, metered=metered))
        if timed and target.venue.slows_steps:
            m = completed(self.measured[config], m, None)  # the memory trial's peaks, this run's steps
        self.measured[config] = m
        self.added.append(m)
        self.events.trial_done(m, False)
        return m

    def joined(self, report: Report) -> Report:
        """``report`` with the trials run so far (a timing replaces its memory trial)."""
        return report.with_trials(*self.added)


def _bisected(trials: _LimitTrials, row: dict, target: Target) -> dict[str, Any]:
    """The limit of ``row``'s variant bisected by real memory trials between its sides, the size above measured
    failing; with ``--exact-limit``, the largest size within the headroom bisected and timed too. What the report's
    ``search.exact_limit`` says of them (nothing where the limit is exact and measured already, or the top fits)."""
    lo, hi, step = row["max_batch_size"], row["min_oom_batch_size"], target.searching.batch_multiple
    if lo is None or hi is None or (hi - lo <= step and trials.variant.at(hi) in trials.measured):
        return {}
    found = bisect_limit(lambda b: trials.run(b).fits(target.budget.bytes), lo, hi, step)
    limit, above = found.max_batch_size, found.min_oom_batch_size
    trials.run(above)  # measured failing, not implied
    if not target.searching.exact_limit:
        return {"max_batch_size": limit, "min_oom_batch_size": above}
    # The recommendation leaves headroom: the largest size within it, bisected from the trials so far, is timed
    usable = usable_bytes(target.budget.bytes, target.budget.headroom)
    sizes = {c.batch_size: m for c, m in trials.measured.items() if c.variant == trials.variant}
    lo_usable = max(b for b, m in sizes.items() if m.fits(usable))  # the recommendation's own size at least
    hi_usable = min(b for b, m in sizes.items() if b > lo_usable and not m.fits(usable))  # the limit's next at most
    best = bisect_limit(lambda b: trials.run(b).fits(usable), lo_usable, hi_usable, step).max_batch_size
    if trials.measured[trials.variant.at(best)].memory_only:
        trials.run(best, timed=True, metered=not target.venue.slows_steps)
    return {"max_batch_size": limit, "min_oom_batch_size": above, "max_batch_size_within_headroom": best}


def _row(report: Report, variant: Variant) -> dict:
    """The report's limit row of ``variant``."""
    row = report.limit(variant)
    assert row is not None, variant  # the recommendation's variant has a row: its trials made it
    return row


# -- stage 5c: a compiled recommendation, timed static ---------------------------------------------------------------


def static_compile(report: Report, target: Target, study: Study, events: Any) -> Report:
    """Stage 5c: a compiled recommendation timed again compiled for its batch size alone (``MODE+static``:
    ``torch.compile(model, dynamic=False)``), right after the same configuration as the search compiled it.

    The search's compiled trials mark the batch dimension dynamic, so that one graph serves every batch size. Training
    at one batch size, plain ``torch.compile(model)`` builds a static graph, which can be faster (inductor specialises
    its kernels to the size) and hold other memory. The static trial joins the report's trials, and the search's
    configuration keeps its memory figures with the timing run beside it (not pooled with the search's older one:
    the two runs side by side decide), so the recommendation is the static one where that is faster and fits within
    the headroom. ``search.static_compile`` keeps the two runs side by side. Where the data's batches may differ in
    shape (``--data``, its profile's ``shapes_vary``), a static graph would compile again for each: the stage is
    skipped, with a notice.
    """
    rec = report.recommendation
    if rec is None or not rec.config.compiled or is_static(rec.config.compile) or not target.searching.static_compile:
        return report
    if (target.data_profile or {}).get("shapes_vary"):
        notice = ("the compiled recommendation was not timed static (dynamic=False): the batches of --data may differ "
                  "in shape, and a static graph compiles again for every new shape")
        logger.info(notice)
        return dataclasses.replace(report, notices=report.notices + (notice,))
    static = dataclasses.replace(rec.config, compile=static_of(rec.config.compile))
    logger.info("timing %s again compiled static (dynamic=False) at batch %d, beside the search's dynamic graph",
                rec.config, rec.batch_size)
    runs: dict[bool, Measurement] = {}
    for config, metered in ((rec.config, False), (static, True)):  # the search measured the dynamic one's memory
        events.trial_started(config)
        runs[metered] = target.venue.run(study.workload, TrialWork(config, target.trial_settings,
                                                                   target.budget.enforced, metered=metered))
        events.trial_done(runs[metered], False)
    dynamic, fixed = runs[False], runs[True]
    # the two timed side by side decide between them, not one pooled with an older run
    timed = (completed(rec, dynamic, None),) if dynamic.status == Status.OK else ()
    side = {"precision": rec.precision, "segments": str(rec.config.plan), "batch_size": rec.batch_size,
            "compile": rec.config.compile, "static": static.compile,
            "dynamic_step_s": dynamic.step_s, "static_step_s": fixed.step_s, "static_peak_bytes": fixed.peak_bytes,
            "dynamic_peak_bytes": rec.peak_bytes, "static_compile_s": fixed.compile_s, "static_status": str(fixed.status),
            "static_over_dynamic": round(fixed.step_s / dynamic.step_s, 4) if fixed.step_s and dynamic.step_s else None}
    out = dataclasses.replace(report.with_trials(fixed, *timed), search=report.search.but(static_compile=side))
    chosen = out.recommendation
    logger.info("%s: step %.4g s static against %.4g s dynamic; recommended: %s", compile_label(static.compile),
                fixed.step_s or float("nan"), dynamic.step_s or float("nan"), chosen.config if chosen else None)
    return out
