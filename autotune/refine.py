"""The recommendation refined by real trials after the analysis: stages 5b and 5c of :func:`autotune.tuner.run`.

* :func:`exact_limit` (``--exact-limit``): the recommended variant's limit bisected with real trials.
* :func:`static_compile` (on unless ``--no-static-compile``): a compiled recommendation timed again compiled for its
  batch size alone.

Their trials are the report's, not the study's: their configurations are not the space's (other batch sizes, a
static compile), so workers sharing a study each run them, and a resumed search runs them again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune._log import logger
from autotune.analysis.pareto import bisect_limit
from autotune.execution.trial import TrialWork
from autotune.preparation import Study, Target
from autotune.records import Measurement, completed, usable_bytes
from autotune.report import Report
from autotune.vocabulary import EAGER, Status, Variant, compile_label, is_static, static_of

__all__ = ["exact_limit", "static_compile"]


# -- stage 5b: the recommended variant's limit, exact --------------------------------------------------------------


def exact_limit(report: Report, target: Target, study: Study, events: Any) -> Report:
    """Stage 5b (``--exact-limit``): the recommended variant's limit made exact by real trials, and the recommendation
    reconsidered at it.

    Between the largest batch that fits and the smallest that does not (measured, or implied by a memory line or a
    plan that needs no more), memory trials bisect in steps of ``--batch-multiple``, and the size above the limit is
    measured failing. The largest size within the budget less its headroom is found the same way and timed, so the
    recommendation considers training at it. These trials are the report's, not the study's (their sizes are not
    the space's): workers sharing a study each run them, and a resumed search runs them again.
    """
    rec = report.recommendation
    if rec is None or not target.searching.exact_limit:
        return report
    row = next(r for r in report.limits if Variant(r["precision"], r["segments"], r.get("compile", EAGER)) == rec.config.variant)
    lo, hi = row["max_batch_size"], row["min_oom_batch_size"]
    step = target.searching.batch_multiple
    measured = {m.config: m for m in report.trials}
    if lo is None or hi is None or (hi - lo <= step and rec.config.variant.at(hi) in measured):
        return report  # the space's top fits, or the limit is exact and measured already
    added: list[Measurement] = []

    def run(b: int, timed: bool = False, metered: bool = True) -> Measurement:
        config = rec.config.variant.at(b)
        if config in measured and not timed:
            return measured[config]
        events.trial_started(config)
        m = target.venue.run(study.workload, TrialWork(config, target.trial_settings, target.budget.enforced,
                                                       timed=timed, metered=metered))
        if timed and target.venue.slows_steps:
            m = completed(measured[config], m, None)  # the memory trial's peaks, this run's steps
        measured[config] = m
        added.append(m)
        events.trial_done(m, False)
        return m

    limit, above = bisect_limit(lambda b: run(b).fits(target.budget.bytes), lo, hi, step)
    run(above)  # measured failing, not implied
    # The recommendation leaves headroom: the largest size within it, bisected from the trials so far, is timed
    usable = usable_bytes(target.budget.bytes, target.budget.headroom)
    sizes = {c.batch_size: m for c, m in measured.items() if c.variant == rec.config.variant}
    lo_usable = max(b for b, m in sizes.items() if m.fits(usable))  # the recommendation's own size at least
    hi_usable = min(b for b, m in sizes.items() if b > lo_usable and not m.fits(usable))  # the limit's next at most
    best, _ = bisect_limit(lambda b: run(b).fits(usable), lo_usable, hi_usable, step)
    if measured[rec.config.variant.at(best)].memory_only:
        run(best, timed=True, metered=not target.venue.slows_steps)
    kept = {m.config: m for m in report.trials} | {m.config: m for m in added}  # a timing replaces its memory trial
    return dataclasses.replace(report, trials=tuple(kept.values()), search={
        **report.search, "exact_limit": {"precision": rec.precision, "segments": str(rec.config.plan), "max_batch_size": limit,
                                         "min_oom_batch_size": above, "max_batch_size_within_headroom": best,
                                         "batch_multiple": step, "trials": len(added)}})


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
    kept = {m.config: m for m in report.trials} | {fixed.config: fixed}
    if dynamic.status == Status.OK:  # the two timed side by side decide between them, not one pooled with an older run
        kept[rec.config] = completed(kept[rec.config], dynamic, None)
    side = {"precision": rec.precision, "segments": str(rec.config.plan), "batch_size": rec.batch_size,
            "compile": rec.config.compile, "static": static.compile,
            "dynamic_step_s": dynamic.step_s, "static_step_s": fixed.step_s, "static_peak_bytes": fixed.peak_bytes,
            "dynamic_peak_bytes": rec.peak_bytes, "static_compile_s": fixed.compile_s, "static_status": str(fixed.status),
            "static_over_dynamic": round(fixed.step_s / dynamic.step_s, 4) if fixed.step_s and dynamic.step_s else None}
    out = dataclasses.replace(report, trials=tuple(kept.values()), search={**report.search, "static_compile": side})
    chosen = out.recommendation
    logger.info("%s: step %.4g s static against %.4g s dynamic; recommended: %s", compile_label(static.compile),
                fixed.step_s or float("nan"), dynamic.step_s or float("nan"), chosen.config if chosen else None)
    return out
