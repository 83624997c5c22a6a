"""``tune()``: the whole pipeline behind one call, shared by the CLI and the Python API.

:func:`run` reads top to bottom as its stages, each a function with typed inputs and outputs:

    Options -> resolve -> Target          the device's backend, the venue, the workload, budgets, the data's worst batches
            -> preflight -> ModelFacts    the model built once: its size, its blocks, its library's switch
            -> plan_study -> Study        the plans checked on the model, the space, the study's identity
            -> search -> SearchResult     trials in the Optuna study (autotune.search.loop)
            -> analyse -> Report          front, limits and recommendation derive from the trials
            -> exact_limit -> Report      the recommended variant's limit: its predicted exact limit confirmed by
                                          trials, or (--exact-limit) bisected by real trials
            -> static_compile -> Report   a compiled recommendation timed again compiled for its batch size alone
            -> probe -> Report            the best candidates train an epoch over a slice of the data
            -> eval_limits -> Report      the largest evaluation batch per precision and plan (autotune.eval_limits)
            -> compare_library -> Report  the library's own checkpointing beside autotune's plan

A dry run (``--dry-run``) predicts instead of searching (:mod:`autotune.dry_run`) and stops after the analysis and
its evaluation limits, predicted.
The first three stages live in :mod:`autotune.preparation`, the two after the analysis in :mod:`autotune.refine`; where trials, probe candidates and
plan checks run (this process, a worker, every rank) is the Target's venue, chosen once in
``resolve``.

A Ctrl-C at any stage after the search raises :class:`~autotune.errors.Interrupted` with the
report so far, marked partial; finished trials are in the store either way.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from autotune._log import logger
from autotune.device import resolve_device
from autotune.errors import Interrupted, first_line
from autotune.options import Options
from autotune.preparation import ModelFacts, Study, Target, floor_facts, plan_study, preflight, resolve
from autotune.analysis.pareto import LineRule, probe_candidates
from autotune.dry_run import predict, preflight_under, with_dry_run
from autotune.eval_limits import eval_limits
from autotune.refine import exact_limit, static_compile
from autotune.vocabulary import ALL, Parallel, Plan
from autotune.execution.fake_build import fake_buildable
from autotune.execution.predict import fake_tensors, quiet_fake_kernels
from autotune.execution.probe import ProbeWork
from autotune.execution.trial import TrialWork
from autotune.records import Config, Measurement, ProbeResult
from autotune.report import Report, SearchSection
from autotune.search.space import SearchSpace
from autotune.search.loop import SearchInterrupted, SearchResult, run_search
from autotune.search.predicted import Seeding, seed
from autotune.search.strategies import STRATEGIES, make_strategy
from autotune.training.workload import Workload

if TYPE_CHECKING:
    from autotune.execution.job import Job

__all__ = ["tune", "run", "Target", "ModelFacts", "Study", "resolve", "preflight", "plan_study", "search", "analyse",
           "exact_limit", "static_compile", "probe", "compare_library"]


def tune(model: str | type | Callable[[], nn.Module], *, progress: Any = None,
         on_trial: Callable[[Measurement, bool], None] | None = None,
         on_probe: Callable[[ProbeResult], None] | None = None, **options: Any) -> Report:
    """Measure training configurations of ``model`` and return the :class:`~autotune.report.Report`.

    ``options`` are the fields of :class:`~autotune.options.Options` (the CLI's flags: ``budget``,
    ``data``, ``precisions``, ``segments``, ``batch_sizes``, ``strategy``, ``isolation``, ``probe``,
    ...). Trials are stored in an Optuna study (default ``results/<study>.db``): running the same
    call again reuses them. ``progress`` receives the events of :class:`autotune.cli.progress.Progress`;
    ``on_trial(measurement, reused)`` and ``on_probe(result)`` are plain callbacks. Raises
    :class:`~autotune.errors.UsageError` for bad input and :class:`~autotune.errors.Interrupted`
    (holding the partial report) on Ctrl-C.
    """
    return run(Options(model=model, **options), progress=progress, on_trial=on_trial, on_probe=on_probe)


def run(options: Options, *, progress: Any = None, on_trial: Callable[[Measurement, bool], None] | None = None,
        on_probe: Callable[[ProbeResult], None] | None = None, before: Callable[[], None] | None = None) -> Report:
    """Run every stage for ``options``; return the report (see the module docstring).

    With ``options.parallel`` (``ddp``, ``fsdp``) under torchrun, rank 0 runs the stages and every
    rank trains each trial (:mod:`autotune.execution.ranks`); every rank returns rank 0's report, or
    raises what rank 0 raised. ``before()`` runs first where the stages run (rank 0): a check of the caller's
    own input (the CLI's --out) whose :class:`~autotune.errors.UsageError` then ends every rank alike.
    """
    if options.parallel != Parallel.NONE and not options.dry_run:  # a dry run predicts one rank here (--world-size)
        from autotune.execution.job import join
        from autotune.execution.ranks import follow, lead, own_spec

        device = resolve_device(options.device)
        job = join(options.parallel, device)
        if not job.leader:
            return follow(job, job.device(device), own_spec(options))
        return lead(job, lambda: _stages(options, progress, on_trial, on_probe, job, before))
    return _stages(options, progress, on_trial, on_probe, None, before)


def _stages(options: Options, progress: Any, on_trial: Callable[[Measurement, bool], None] | None,
            on_probe: Callable[[ProbeResult], None] | None, job: "Job | None",
            before: Callable[[], None] | None = None) -> Report:
    events = _Events(progress, on_trial, on_probe)
    if before is not None:
        before()
    target = resolve(options, job)
    with target.venue:  # a warm worker stops with the stages
        if target.searching.dry_run:
            return _dry_run(target, events)
        facts = preflight(target)
        study = plan_study(target, facts)
        result = search(target, facts, study, events)
        report = analyse(target, facts, study, result)
        if result.partial:
            raise Interrupted(report)
        report = _with_floor(report, target, facts)
        try:
            report = exact_limit(report, target, study, events)
            report = static_compile(report, target, study, events)
            report = probe(report, target, study, events)
            report = eval_limits(report, target, study)
            return compare_library(report, target, facts, study)
        except KeyboardInterrupt:
            raise Interrupted(dataclasses.replace(report, search=report.search.but(partial=True))) from None


def _dry_run(target: Target, events: "_Events") -> Report:
    """The dry run's stages (:mod:`autotune.dry_run`): the model built under fake tensors (it holds no memory), its
    preflight run there (on real tensors where they cannot run its forward), every configuration predicted."""
    mode = fake_tensors()
    with quiet_fake_kernels():
        built = fake_buildable(target.workload, mode)
        target = dataclasses.replace(target, workload=built.workload,
                                     notices=target.notices + ((built.notice,) if built.notice else ()))
        preflighted = preflight_under(mode, target, preflight)
        facts = preflighted.facts
        target = dataclasses.replace(target, notices=target.notices + preflighted.notices)
        study = plan_study(target, facts)
        dry_run = predict(target, facts, study, events, mode)
        report = with_dry_run(analyse(target, facts, study, dry_run.result), dry_run)
        report = _with_floor(report, target, facts)
        return eval_limits(report, target, study, mode=mode)


def _with_floor(report: Report, target: Target, facts: ModelFacts) -> Report:
    """Where nothing fits, the report with what batch 1 needs at least (the answer of exit 3)."""
    if not report.nothing_fits or not report.trials:
        return report
    return dataclasses.replace(report, workload={**report.workload, "floor": floor_facts(target, facts.chain)})


# -- stage 4: the search -----------------------------------------------------------------------------------------


def search(target: Target, facts: ModelFacts, study: Study, events: "_Events") -> SearchResult:
    """Stage 4: the strategy's trials in the study (partial when interrupted: the report is still made); ``auto`` on
    the tensor meter starts from the space predicted under fake tensors (:mod:`autotune.search.predicted`)."""
    searching = target.searching
    seeding = _seeding(target, study, facts)
    strategy = make_strategy(searching.strategy, headroom=target.budget.headroom, budgets=target.budget.all,
                             fixed_bytes_hint=facts.fixed_bytes, n_trials=searching.n_trials,
                             line_rule=LineRule.of(facts.fixed_bytes, facts.optimizer_state_bytes is not None,
                                                   (target.data_profile or {}).get("shapes_vary", False),
                                                   _held_fixed_bytes(facts)),
                             **({"predictions": seeding.in_space(study.space), "time_error": _time_error(seeding)}
                                if seeding else {}),
                             probed=_probed(target, study))
    space = study.space
    planned = strategy.planned(space)
    events.call("search_started", space_size=len(space), planned=planned, strategy=strategy.name,
                budget_bytes=target.budget.bytes)
    try:
        result = run_search(study.workload, space, strategy, venue=target.venue, enforced_bytes=target.budget.enforced,
                            settings=target.trial_settings, study_name=study.name, storage=study.storage,
                            workload_key=study.workload_key, on_trial=events.trial_done,
                            on_trial_start=events.trial_started)
    except SearchInterrupted as exc:
        result = exc.result
    finally:
        events.call("search_done")
    if seeding is None:
        return result
    order = {variant: i for i, variant in enumerate(space.variants())}
    predictions = tuple(sorted(seeding.predictions.values(), key=lambda m: (order[m.config.variant], m.batch_size)))
    described = seeding.describe()
    untimed = getattr(strategy, "outpaced_configs", None)  # a strategy that leaves configurations to the time model
    if untimed is not None and strategy.time_error is not None:
        described.update(time_error=strategy.time_error, not_timed_predicted_slower=len(untimed(
            space, {m.config: m for m in result.measurements}, target.budget.enforced)))
    return dataclasses.replace(result, predictions=predictions, seeding=described,
                               wall_s=result.wall_s + seeding.seconds, notices=seeding.notices)


def _time_error(seeding: Seeding) -> float | None:
    """The median error of the time model that priced ``seeding``'s predictions, as checked against measured steps
    (``autotune/timing/checked.json``), or None (no time predicted, or a model never checked)."""
    from autotune.timing.model import checked_error

    checked = checked_error(seeding.time_model) if seeding.time_model else None
    return None if checked is None else float(checked["median_abs_error"])


def _held_fixed_bytes(facts: ModelFacts) -> dict[str, int]:
    """The state of each true precision searched whose optimizer's state was measured (the line rule's fixed part)."""
    return {p: facts.fixed_bytes_of(p) for p, parts in facts.held.items() if parts["optimizer_state"] is not None}


def _probed(target: Target, study: Study) -> int:
    """How many of the front's fastest trials the probe (stage 6) will train after the search, under the budget trials
    run under (0: no probe, or one for a smaller budget than that): ``auto`` leaves near ties among them to it."""
    probe, budget = target.searching.probe, target.budget
    return probe.top if probe and study.workload.dataset is not None and budget.bytes == budget.enforced else 0


def _seeding(target: Target, study: Study, facts: ModelFacts) -> Seeding | None:
    """The space predicted for ``auto`` where a measured trial can confirm a prediction to the byte: on the tensor
    meter, in one process's training (not under --parallel); None elsewhere. On CUDA the caching allocator adds what
    a prediction of the tensors does not know exactly, so a search there measures each side itself."""
    if (not STRATEGIES[target.searching.strategy].starts_from_predictions
            or not target.backend.meter_class.predicted_exactly or target.job is not None):
        return None
    budget = target.budget
    return seed(study.workload, study.space, device=target.device, budget_bytes=budget.enforced,
                limits=(budget.bytes,), settings=target.trial_settings, fixed_bytes=facts.fixed_bytes,
                multiple=target.searching.batch_multiple, time_model=_time_model(target))


def _time_model(target: Target) -> Any:
    """What prices the predictions' steps for ``auto`` (:mod:`autotune.timing`): this CPU, calibrated once and cached;
    None on another device (a GPU here is not calibrated) or where the calibration fails (the search then times what
    its own measurements cannot separate, as before a time model)."""
    if target.device.type != "cpu":
        return None
    from autotune.timing.calibration import this_cpu

    try:
        return this_cpu()
    except Exception as exc:  # noqa: BLE001 - a time model only saves trials
        logger.warning("no time model for the search (this CPU's calibration failed: %s)", first_line(exc))
        return None


# -- stage 5: the report -----------------------------------------------------------------------------------------


def analyse(target: Target, facts: ModelFacts, study: Study, result: SearchResult) -> Report:
    """Stage 5: the report of the trials; its front, limits and recommendation derive from them."""
    searching, settings = target.searching, target.trial_settings
    return Report(
        environment=target.backend.environment(),
        workload=_workload_section(target, facts, study),
        budget_bytes=target.budget.bytes,
        headroom=target.budget.headroom,
        search=SearchSection(
            strategy=searching.strategy, n_trials_limit=searching.n_trials, n_trials=len(result.measurements),
            n_run=result.n_run, n_reused=result.n_reused, wall_s=round(result.wall_s, 3),
            study=result.study_name, storage=result.storage, space=study.space.to_dict(),
            warmup_steps=settings.warmup_steps, measure_steps=settings.measure_steps,
            settle_steps=settings.settle_steps, predictions=result.seeding, batch_multiple=searching.batch_multiple,
            trial_timeout_s=settings.timeout_s, memory_meter=_meters(target, study.space),
            isolation=target.isolation, more=target.venue.describe(), partial=result.partial,
            figures={f: sum(m.figures == f for m in result.measurements) for f in ("memory+time", "memory", "none")},
            timed_after_memory_trial=sum(m.memory_from is not None for m in result.measurements),
            setup_s=round(sum(m.setup_s or 0.0 for m in result.measurements), 3),
            steps_s=round(sum(m.steps_s or 0.0 for m in result.measurements), 3),
            **({"host_budget_bytes": target.host_budget_bytes, "host_budget_source": target.host_budget_source}
               if any(Plan(s).offload_mode for s in study.space.plans) else {}),
        ),
        trials=result.measurements,
        predictions=result.predictions,
        notices=target.notices + study.notices + result.notices,
        plan_checks=study.checks,
        data=target.data_profile,
        guard=settings.guard,
        target_batch_size=searching.target_batch_size,
        budgets=tuple(sorted(target.budget.extra)),
        distributed=None if target.job is None else {
            **target.job.describe(target.precisions),
            "isolation": "each rank's trial in its own process (--isolation none)",
            "batch_size": "per rank (micro-batch); samples/s count every rank's"},
    )


def _workload_section(target: Target, facts: ModelFacts, study: Study) -> dict[str, Any]:
    """The report's ``workload``: what was trained, as the study names it and the preflight measured it."""
    key = target.key
    return {
        "model": study.workload.name,
        "model_class": facts.model_class,
        "model_kwargs": key.model_kwargs,
        "data": key.data,
        "loss": key.loss,
        "step": key.step,
        # its name and kwargs (the study's), then the optimizer the preflight made: class, settings, source
        "optimizer": {**study.workload.optimizer.to_dict(), **(facts.optimizer or {}),
                      "state_bytes": facts.optimizer_state_bytes},
        "fixed_bytes": facts.fixed_bytes, **({"state_by_precision": facts.held} if facts.held else {}),  # bf16-true's
        "parameter_count": facts.parameter_count,
        "parameter_bytes": facts.parameter_bytes,
        # the parameters that train: the gradients and the optimizer's state are theirs (an adapter's, over frozen
        # weights)
        "trainable_parameter_count": (facts.parameter_count if facts.trainable_parameter_count is None
                                      else facts.trainable_parameter_count),
        "trainable_parameter_bytes": facts.state()["gradients"],
        "chain": None if facts.chain is None else facts.chain.to_dict(),
        "library_checkpointing": facts.library_checkpointing,
        "training_cache": list(facts.training_cache),
    }


# -- stage 6: the probe ------------------------------------------------------------------------------------------


def probe(report: Report, target: Target, study: Study, events: "_Events") -> Report:
    """Stage 6: the best candidates train an epoch over a slice of the data; return the report with their results."""
    settings = target.searching.probe
    if settings is None:
        return report
    if study.workload.dataset is None:
        notice = ("no --data: the probe (an epoch over a slice of your data) was skipped; the recommendation comes from "
                  "the short trials alone")
        logger.info(notice)
        return dataclasses.replace(report, notices=report.notices + (notice,))
    candidates = probe_candidates(report.pareto, target.budget.bytes, target.budget.headroom, settings.top)
    passes = 2 if target.venue.slows_steps else 1  # a slowing meter: metered, then timed
    results: list[ProbeResult] = []
    try:
        for i, candidate in enumerate(candidates, 1):
            events.call("probe_started", candidate.config, i, len(candidates))
            logger.debug("probe: %s over %.0f%% of the data, %d epoch(s)", candidate.config, 100 * settings.fraction,
                         settings.epochs)
            work = ProbeWork(candidate, target.budget.bytes, target.budget.headroom, settings, target.trial_settings.guard, passes,
                             target.host_budget_bytes)
            results.append(target.venue.run(study.workload, work))
            events.probe_done(results[-1])
    except KeyboardInterrupt:  # the probe is incomplete: report what it did, marked partial
        raise Interrupted(dataclasses.replace(report, probe=tuple(results), probe_settings=settings.to_dict(),
                                              search=report.search.but(partial=True))) from None
    return dataclasses.replace(report, probe=tuple(results), probe_settings=settings.to_dict())


# -- stage 7: the library's own checkpointing --------------------------------------------------------------------


def compare_library(report: Report, target: Target, facts: ModelFacts, study: Study) -> Report:
    """Stage 7: measure the library's per-layer checkpointing beside autotune's plan ``all``.

    Both at the recommendation's precision and batch size, as the search ran its trials; the
    plan's trial is taken from the search when it was measured there. The trials are not part of
    the search space, so they are reported, not stored. A comparison that cannot be made is a
    notice: the search and probe are kept.
    """
    rec, method = report.recommendation, facts.library_checkpointing
    if rec is None or not study.compare_library:
        return report
    if not any(c.plan == ALL and c.ok for c in report.plan_checks):
        return _with_notice(report, f"the comparison with {method} was not made: autotune's plan {ALL} did not pass its "
                                    f"check on this model")
    measured = {m.config: m for m in report.trials}
    ours_config = rec.config.variant.with_plan(ALL).at(rec.batch_size)  # every block recomputed, as the library's switch does
    logger.info("comparing %s with plan %s at %s, batch %d", method, ALL, rec.precision, rec.batch_size)
    try:
        lib = Workload.from_specs(**{**study.workload.spec, "library_checkpointing": True})  # rebuilt so in a worker
        library = compare_library_trial(target, lib, rec.config.variant.with_plan(0).at(rec.batch_size))
        ours = measured.get(ours_config)
        if ours is None or ours.memory_only:  # compared for speed too: a memory trial of the search is timed here
            ours = compare_library_trial(target, study.workload, ours_config)
    except Exception as exc:  # noqa: BLE001 - an extra measurement: its failure must not cost the report
        return _with_notice(report, f"the comparison with {method} could not be made ({type(exc).__name__}: "
                                    f"{first_line(exc)})")
    none = measured.get(rec.config.variant.with_plan(0).at(rec.batch_size))
    return dataclasses.replace(report, library_checkpointing={
        "method": method, "precision": rec.precision, "batch_size": rec.batch_size, "library": _row(library),
        "autotune": {"segments": ALL, **_row(ours)}, "none": None if none is None else _row(none),
    })


def _meters(target: Target, space: SearchSpace) -> str:
    """The meters the trials measured with: the device's, and for compiled trials on the CPU the allocator's."""
    meter = target.backend.meter_class
    if space.compiled and not meter.sees_compiled:  # the CPU's: compiled trials on its allocator's events
        return (f"{meter.__name__}; compiled trials: AllocatorMeter (the CPU allocator's events, the budget judged "
                f"after each step)")
    return meter.__name__


def compare_library_trial(target: Target, workload: Workload, config: Config) -> Measurement:
    """One trial of the comparison, where the search's trials run and as they ran."""
    return target.venue.run(workload, TrialWork(config, target.trial_settings, target.budget.enforced))


def _row(m: Measurement) -> dict[str, Any]:
    return {"status": m.status, "peak_bytes": m.peak_bytes, "step_s": m.step_s, "samples_per_s": m.samples_per_s,
            "error": m.error}


def _with_notice(report: Report, notice: str) -> Report:
    logger.warning(notice)
    return dataclasses.replace(report, notices=report.notices + (notice,))


class _Events:
    """The plain callbacks and the ``progress`` object's methods (those it has), as one."""

    def __init__(self, progress: Any, on_trial: Callable[[Measurement, bool], None] | None,
                 on_probe: Callable[[ProbeResult], None] | None) -> None:
        self.progress, self.on_trial, self.on_probe = progress, on_trial, on_probe

    def call(self, name: str, *args: Any, **kwargs: Any) -> None:
        method = getattr(self.progress, name, None)
        if method is not None:
            method(*args, **kwargs)

    def trial_started(self, config: Config) -> None:
        self.call("trial_started", config)

    def trial_done(self, m: Measurement, reused: bool) -> None:
        if self.on_trial:
            self.on_trial(m, reused)
        self.call("trial_done", m, reused)

    def probe_done(self, result: ProbeResult) -> None:
        if self.on_probe:
            self.on_probe(result)
        self.call("probe_done", result)
