"""``tune()``: the whole pipeline behind one call, shared by the CLI and the Python API.

:func:`run` reads top to bottom as its stages, each a function with typed inputs and outputs:

    Options -> resolve -> Target          the device's backend, the workload, budgets, the data's worst batches
            -> preflight -> ModelFacts    the model built once: its size, its blocks, its library's switch
            -> plan_study -> Study        the plans checked on the model, the space, the study's identity
            -> search -> SearchResult     trials in the Optuna study (autotune.search.loop)
            -> analyse -> Report          front, limits and recommendation derive from the trials
            -> probe -> Report            the best candidates train an epoch over a slice of the data
            -> compare_library -> Report  the library's own checkpointing beside autotune's plan

A Ctrl-C at any stage after the search raises :class:`~autotune.errors.Interrupted` with the
report so far, marked partial; finished trials are in the store either way.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from autotune._log import logger
from autotune.plans.checkpointing import Chain, find_chain, order_chain
from autotune.training.data import scan_items, worst_indices
from autotune.device import Backend, backend_for, resolve_device
from autotune.errors import Interrupted, UsageError, first_line
from autotune.options import Options
from autotune.analysis.pareto import probe_candidates
from autotune.plans.check import run_checks
from autotune.plans import ALL, Plan, auto_plans
from autotune.training.precision import keep_in_fp32
from autotune.execution.probe import ProbeWork
from autotune.execution.trial import TrialWork
from autotune.execution.venue import venue_for
from autotune.execution.work import Venue
from autotune.records import Config, Measurement, PlanCheck, ProbeResult
from autotune.report import Report
from autotune.search.loop import SearchInterrupted, SearchResult, run_search
from autotune.search.space import SearchSpace
from autotune.search.store import default_storage, default_study_name, fingerprint, store_plan_checks, stored_plan_checks
from autotune.search.strategies import make_strategy
from autotune.thirdparty import library_checkpointing
from autotune.units import format_bytes
from autotune.training.workload import Workload, parse_model_kwargs, to_device

if TYPE_CHECKING:
    from autotune.execution.job import Job

__all__ = ["tune", "run", "Target", "ModelFacts", "Study", "resolve", "preflight", "plan_study", "search", "analyse",
           "probe", "compare_library"]


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
        on_probe: Callable[[ProbeResult], None] | None = None) -> Report:
    """Run every stage for ``options``; return the report (see the module docstring).

    With ``options.parallel`` (``ddp``, ``fsdp``) under torchrun, rank 0 runs the stages and every
    rank trains each trial (:mod:`autotune.execution.ranks`); every rank returns rank 0's report, or
    raises what rank 0 raised.
    """
    if options.parallel != "none":
        from autotune.execution.job import join
        from autotune.execution.ranks import follow, lead

        device = resolve_device(options.device)
        job = join(options.parallel, device)
        if not job.leader:
            return follow(job, job.device(device))
        return lead(job, lambda: _stages(options, progress, on_trial, on_probe, job))
    return _stages(options, progress, on_trial, on_probe, None)


def _stages(options: Options, progress: Any, on_trial: Callable[[Measurement, bool], None] | None,
            on_probe: Callable[[ProbeResult], None] | None, job: "Job | None") -> Report:
    events = _Events(progress, on_trial, on_probe)
    target = resolve(options, job)
    facts = preflight(target)
    study = plan_study(target, facts)
    result = search(target, facts, study, events)
    report = analyse(target, facts, study, result)
    if result.partial:
        raise Interrupted(report)
    try:
        report = probe(report, target, study, events)
        return compare_library(report, target, facts, study)
    except KeyboardInterrupt:
        raise Interrupted(dataclasses.replace(report, search={**report.search, "partial": True})) from None


# -- stage 1: the options, resolved against this machine ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """What the options mean here: the device's backend, the workload and the budgets, in bytes."""

    options: Options
    backend: Backend
    workload: Workload
    budget_bytes: int | None  # the recommendation's budget: --budget, else the largest of --budgets, else the device
    budgets: tuple[int, ...]  # the other budgets recommended for, from the same trials
    precisions: tuple[str, ...]
    isolation: str  # "process" or "none"
    venue: Venue  # where trials, probe candidates and plan checks run: this process, a worker, every rank
    data_profile: dict[str, Any] | None  # the item sizes and how batches were chosen (with data)
    notices: tuple[str, ...]
    job: "Job | None" = None  # --parallel: this rank's place in the job (rank 0: the leader)

    @property
    def enforced_bytes(self) -> int | None:
        """The budget trials run under: the largest (a smaller one is judged by the peaks measured)."""
        return None if self.budget_bytes is None else max((self.budget_bytes, *self.budgets))

    @property
    def device(self) -> torch.device:
        return self.backend.device


def resolve(options: Options, job: "Job | None" = None) -> Target:
    """Stage 1: the device, the workload (with the data's worst batch of every size), budgets and precisions."""
    device = resolve_device(options.device)
    backend = backend_for(job.device(device) if job else device)
    workload = Workload.from_specs(options.model, model_kwargs=options.model_kwargs, data=options.data, loss=options.loss)
    budget = options.budget if options.budget is not None else backend.total_bytes()
    isolation = backend.default_isolation if options.isolation == "auto" else options.isolation
    if job is not None:
        isolation = "none"  # each rank runs its part of a trial in its own process (options refuse "process")
    venue = venue_for(isolation, backend.device, job)
    venue.admit(workload)  # one clear line now, not every trial crashed later
    workload, profile = _with_data(workload, options.batch_sizes)
    notices = list(workload.notes)
    for notice in notices:
        logger.warning(notice)
    if workload.dataset is None:  # said once, as information (--quiet keeps it to the JSON)
        notices.append("no --data: the limits hold for the shapes of the model's example_batch; pass --data for limits "
                       "that hold over your dataset's batches")
        logger.info(notices[-1])
    return Target(options, backend, workload, budget, tuple(b for b in options.budgets if b != budget),
                  _precisions(options.precisions, backend), isolation, venue, profile, tuple(notices), job)


def _with_data(workload: Workload, batch_sizes: Sequence[int]) -> tuple[Workload, dict[str, Any] | None]:
    """The workload with the worst batch of every size found once for every trial, and the data's profile."""
    if workload.dataset is None:
        return workload, None
    if max(batch_sizes) > len(workload.dataset):
        too_big = [b for b in batch_sizes if b > len(workload.dataset)]
        raise UsageError(
            f"--data has {len(workload.dataset)} items, fewer than the batch sizes {','.join(map(str, too_big))}: "
            f"pass --batch-sizes up to {len(workload.dataset)}, or more data"
        )
    items = scan_items(workload.dataset)
    return workload.with_worst_batches({b: worst_indices(items, b) for b in batch_sizes}), {
        **items.to_dict(), "memory_batch": "the worst batch of each size", "timed_batches": "random draws from the whole dataset"}


def _precisions(asked: Sequence[str] | None, backend: Backend) -> tuple[str, ...]:
    """The precisions to search: those asked for (each must run here), else the device's defaults."""
    if asked is None:
        return tuple(backend.default_precisions())
    supported = backend.supported_precisions()
    unsupported = [p for p in asked if p not in supported]
    if unsupported:
        raise UsageError(f"{', '.join(unsupported)} is not supported on {backend.device}: use --precisions "
                         f"{','.join(supported)}")
    return tuple(asked)


# -- stage 2: the model, built once -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What building the model once and running one forward pass said about it."""

    model_class: str
    parameter_count: int
    parameter_bytes: int
    chain: Chain | None  # the repeated blocks, in forward order
    library_checkpointing: str | None  # the library's own per-layer checkpointing switch, if it has one


def preflight(target: Target) -> ModelFacts:
    """Stage 2: build the model and run one forward pass: bad input fails here, before any trial.

    The model is dropped and its memory handed back (reference cycles collected first: every
    Hugging Face model and any model after ``--fp32-modules`` holds its weights in one) before the
    trials measure.
    """
    workload, device, batch_size = target.workload, target.device, min(target.options.batch_sizes)
    model = workload.build_model()
    keep_in_fp32(model, target.options.fp32_modules, device.type)  # --fp32-modules names the model lacks fail here
    params = list(model.parameters())
    facts = ModelFacts(type(model).__name__, sum(p.numel() for p in params),
                       sum(p.numel() * p.element_size() for p in params), find_chain(model), None)
    del params
    _check_fits(facts, target.budget_bytes)
    try:
        chain = _forward(model, workload, device, batch_size, facts)
        library = _library_switch(model)
    finally:
        del model
        target.backend.release()  # gc.collect, then the allocator's cache: nothing of the preflight stays
    return dataclasses.replace(facts, chain=chain, library_checkpointing=library)


def _check_fits(facts: ModelFacts, budget_bytes: int | None) -> None:
    if budget_bytes is not None and facts.parameter_bytes >= budget_bytes:
        raise UsageError(
            f"--budget {format_bytes(budget_bytes)} is smaller than the model's parameters alone "
            f"({facts.parameter_count:,} parameters, {format_bytes(facts.parameter_bytes)}); training needs about 4x that "
            f"with AdamW: raise --budget"
        )


def _forward(model: nn.Module, workload: Workload, device: torch.device, batch_size: int, facts: ModelFacts) -> Chain | None:
    """One forward pass without gradients on a batch of ``batch_size``; return the chain in forward order."""
    try:
        model.to(device)
        batch = to_device(workload.make_batch(model, batch_size), device)
        with torch.no_grad():
            if facts.chain is None:
                workload.loss(model, batch)
                return None
            return order_chain(model, facts.chain, lambda: workload.loss(model, batch))  # which block runs when
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(
            f"{facts.model_class} failed on a batch of {batch_size}: {type(exc).__name__}: {first_line(exc)} "
            f"(check --data, --loss and the model's example_batch)"
        ) from None


def _library_switch(model: nn.Module) -> str | None:
    """On this throwaway model: has its library a per-layer checkpointing switch of its own?"""
    try:
        return library_checkpointing(model)
    except Exception as exc:  # noqa: BLE001 - a switch that fails is one not compared with
        logger.info("the model's own checkpointing switch failed (%s: %s): not compared", type(exc).__name__,
                    first_line(exc))
        return None


# -- stage 3: the plans checked, the space and the study ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Study:
    """The search's space and where its trials live; the checks that chose its plans."""

    workload: Workload  # with the chain: plans count in the blocks' forward order, in workers too
    space: SearchSpace
    name: str
    storage: str
    workload_key: str  # what the study's trials are trials of: model, options, data, loss, kind of device
    checks: tuple[PlanCheck, ...]
    notices: tuple[str, ...]
    compare_library: bool  # the library's switch is measured after the probe


def plan_study(target: Target, facts: ModelFacts) -> Study:
    """Stage 3: the study's identity, every plan checked on the model (or the checks it stored), the space."""
    options, workload = target.options, target.workload.with_chain(facts.chain)
    kwargs = parse_model_kwargs(options.model_kwargs)  # the same kwargs as text or dict make the same study
    described = {"model_kwargs": kwargs, "data": _describe(options.data), "loss": _describe(options.loss)}
    # Workers on several GPUs of one kind share a study: the key names the kind of device, not its index.
    # A distributed job's trials are another job's: the wrapper and world size are part of what they measure.
    job = target.job
    parallel = {"parallel": f"{job.wrapper}x{job.world_size}"} if job else {}
    workload_key = fingerprint(model=workload.name, **described, device=target.backend.kind, **parallel)
    options_key = fingerprint(**described) if (kwargs or options.data or options.loss) else None
    name = options.study or default_study_name(workload.name, target.device.type, options_key)
    if job and not options.study:
        name = f"{name}-{job.wrapper}{job.world_size}"
    storage = options.storage or default_storage(name, options.results_dir)
    notices: list[str] = []
    plans = _plans(options.segments, facts.chain, facts.model_class, notices)
    compared = options.compare_library and facts.library_checkpointing is not None and facts.chain is not None
    # The library comparison measures plan all beside the library's switch: it is checked too.
    checks = _checked_plans(workload, (*plans, *((ALL,) if compared else ())), target, study_name=name,
                            storage=storage, workload_key=workload_key)
    space = SearchSpace(target.precisions, _surviving_plans(plans, checks, notices), options.batch_sizes,
                        blocks=facts.chain.length if facts.chain else None)
    return Study(workload, space, name, storage, workload_key, tuple(checks), tuple(notices), compared)


def _plans(segments: tuple[str, ...] | None, chain: Chain | None, model_class: str, notices: list[str]) -> tuple[str, ...]:
    """Resolve ``--segments`` (None: auto) against the model's blocks: the plan names to search."""
    if chain is None:
        if segments and not all(Plan(n).off for n in segments):
            raise UsageError(f"{model_class} has no repeated blocks to checkpoint: use --segments 0")
        if segments is None:
            notices.append(f"{model_class} has no repeated blocks: checkpointing is not tried (segments 0 only)")
            logger.warning(notices[-1])
        return segments or ("0",)
    if segments is None:
        return tuple(auto_plans(chain.length))
    for name in segments:
        Plan(name).fits(chain.length, chain.describe())
    return segments


def _checked_plans(workload: Workload, plans: Sequence[str], target: Target, *, study_name: str, storage: str,
                   workload_key: str) -> list[PlanCheck]:
    """Check every plan on the model (one step with and without it), or reuse the checks stored in the study."""
    to_check = [p for p in dict.fromkeys(map(Plan, plans)) if not p.off]
    if not to_check:
        return []
    settings, batch_size = target.options.trial_settings, min(target.options.batch_sizes)
    key = fingerprint(plans=to_check, batch_size=batch_size, seed=settings.seed, guard=settings.guard,
                      chain=workload.chain.to_dict() if workload.chain else None)
    stored = stored_plan_checks(study_name, storage, workload_key=workload_key, key=key)
    if stored is not None:
        return [PlanCheck.from_dict(c) for c in stored]
    logger.info("checking %d checkpoint plan(s) on %s: one step with and without each, batch %d, fp32",
                len(to_check), workload.name, batch_size)
    started = time.monotonic()
    checks = run_checks(workload, to_check, venue=target.venue, batch_size=batch_size, seed=settings.seed,
                        guard=settings.guard, timeout_s=settings.timeout_s)
    logger.info("checked in %.1f s: %s", time.monotonic() - started, ", ".join(f"{c.plan} {c.status}" for c in checks))
    store_plan_checks(study_name, storage, workload_key=workload_key, key=key, checks=[c.to_dict() for c in checks])
    return checks


def _surviving_plans(plans: Sequence[str], checks: Sequence[PlanCheck], notices: list[str]) -> tuple[str, ...]:
    """The plans to search: those that recompute nothing or passed their check. Each dropped plan is a notice."""
    failed = {c.plan: c for c in checks if not c.ok and c.plan in plans}
    for check in failed.values():
        notices.append(f"{check.describe()}: dropped")
        logger.warning(notices[-1])
    kept = tuple(p for p in plans if p not in failed)
    if not kept:
        notices.append("no checkpoint plan passed its check on this model: the search goes on without checkpointing "
                       "(segments 0)")
        logger.warning(notices[-1])
        kept = ("0",)
    return kept


def _describe(obj: Any) -> str | None:
    """A stable name for a spec or object: the same across runs (no memory addresses)."""
    if obj is None or isinstance(obj, str):
        return obj
    name = f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"
    return f"{name}[{len(obj)}]" if hasattr(obj, "__len__") and not callable(obj) else name


# -- stage 4: the search -----------------------------------------------------------------------------------------


def search(target: Target, facts: ModelFacts, study: Study, events: "_Events") -> SearchResult:
    """Stage 4: the strategy's trials in the study (partial when interrupted: the report is still made)."""
    options = target.options
    budgets = (target.budget_bytes, *target.budgets) if target.budget_bytes is not None else ()
    strategy = make_strategy(options.strategy, headroom=options.headroom, budgets=budgets,
                             fixed_bytes_hint=4 * facts.parameter_bytes, n_trials=options.n_trials)
    space = study.space
    planned = {"grid": len(space), "optuna": min(len(space), options.n_trials or max(1, len(space) // 4))}.get(strategy.name)
    events.call("search_started", space_size=len(space), planned=planned, strategy=strategy.name,
                budget_bytes=target.budget_bytes)
    try:
        return run_search(study.workload, space, strategy, venue=target.venue, budget_bytes=target.enforced_bytes,
                          settings=options.trial_settings, study_name=study.name, storage=study.storage,
                          workload_key=study.workload_key, on_trial=events.trial_done,
                          on_trial_start=events.trial_started)
    except SearchInterrupted as exc:
        return exc.result
    finally:
        events.call("search_done")


# -- stage 5: the report -----------------------------------------------------------------------------------------


def analyse(target: Target, facts: ModelFacts, study: Study, result: SearchResult) -> Report:
    """Stage 5: the report of the trials; its front, limits and recommendation derive from them."""
    options = target.options
    return Report(
        environment=target.backend.environment(),
        workload={
            "model": study.workload.name,
            "model_class": facts.model_class,
            "model_kwargs": parse_model_kwargs(options.model_kwargs),
            "data": _describe(options.data),
            "loss": _describe(options.loss),
            "parameter_count": facts.parameter_count,
            "parameter_bytes": facts.parameter_bytes,
            "chain": None if facts.chain is None else facts.chain.to_dict(),
            "library_checkpointing": facts.library_checkpointing,
        },
        budget_bytes=target.budget_bytes,
        headroom=options.headroom,
        search={
            "strategy": options.strategy, "n_trials_limit": options.n_trials, "n_trials": len(result.measurements),
            "n_run": result.n_run, "n_reused": result.n_reused, "wall_s": round(result.wall_s, 3),
            "study": result.study_name, "storage": result.storage, "space": study.space.to_dict(),
            "warmup_steps": options.warmup_steps, "measure_steps": options.measure_steps,
            "settle_steps": options.settle_steps,
            "trial_timeout_s": options.trial_timeout, "memory_meter": target.backend.meter_name,
            "isolation": target.isolation, "partial": result.partial,
            # configurations by what their trials measured; those timed after a memory trial of their own
            "figures": {f: sum(m.figures == f for m in result.measurements) for f in ("memory+time", "memory", "none")},
            "timed_after_memory_trial": sum(m.memory_from is not None for m in result.measurements),
        },
        trials=result.measurements,
        notices=target.notices + study.notices,
        plan_checks=study.checks,
        data=target.data_profile,
        guard=options.guard,
        target_batch_size=options.target_batch_size,
        budgets=tuple(sorted(target.budgets)),
        distributed=None if target.job is None else {
            **target.job.describe(), "isolation": "each rank's trial in its own process (--isolation none)",
            "batch_size": "per rank (micro-batch); samples/s count every rank's"},
    )


# -- stage 6: the probe ------------------------------------------------------------------------------------------


def probe(report: Report, target: Target, study: Study, events: "_Events") -> Report:
    """Stage 6: the best candidates train an epoch over a slice of the data; return the report with their results."""
    options, settings = target.options, target.options.probe_settings
    if not options.probe:
        return report
    if study.workload.dataset is None:
        notice = ("no --data: the probe (an epoch over a slice of your data) was skipped; the recommendation comes from "
                  "the short trials alone")
        logger.info(notice)
        return dataclasses.replace(report, notices=report.notices + (notice,))
    candidates = probe_candidates(report.pareto, target.budget_bytes, options.headroom, settings.top)
    passes = 2 if target.venue.slows_steps else 1  # a slowing meter: metered, then timed
    results: list[ProbeResult] = []
    try:
        for i, candidate in enumerate(candidates, 1):
            events.call("probe_started", candidate.config, i, len(candidates))
            logger.debug("probe: %s over %.0f%% of the data, %d epoch(s)", candidate.config, 100 * settings.fraction,
                         settings.epochs)
            work = ProbeWork(candidate, target.budget_bytes, options.headroom, settings, options.guard, passes)
            results.append(target.venue.run(study.workload, work))
            events.probe_done(results[-1])
    except KeyboardInterrupt:  # the probe is incomplete: report what it did, marked partial
        raise Interrupted(dataclasses.replace(report, probe=tuple(results), probe_settings=settings.to_dict(),
                                              search={**report.search, "partial": True})) from None
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
    ours_config = Config(rec.precision, ALL, rec.batch_size)  # every block recomputed, as the library's switch does
    logger.info("comparing %s with plan %s at %s, batch %d", method, ALL, rec.precision, rec.batch_size)
    try:
        lib = Workload.from_specs(**{**study.workload.spec, "library_checkpointing": True})  # rebuilt so in a worker
        library = compare_library_trial(target, lib, Config(rec.precision, 0, rec.batch_size))
        ours = measured.get(ours_config)
        if ours is None or ours.memory_only:  # compared for speed too: a memory trial of the search is timed here
            ours = compare_library_trial(target, study.workload, ours_config)
    except Exception as exc:  # noqa: BLE001 - an extra measurement: its failure must not cost the report
        return _with_notice(report, f"the comparison with {method} could not be made ({type(exc).__name__}: "
                                    f"{first_line(exc)})")
    none = measured.get(Config(rec.precision, 0, rec.batch_size))
    return dataclasses.replace(report, library_checkpointing={
        "method": method, "precision": rec.precision, "batch_size": rec.batch_size, "library": _row(library),
        "autotune": {"segments": ALL, **_row(ours)}, "none": None if none is None else _row(none),
    })


def compare_library_trial(target: Target, workload: Workload, config: Config) -> Measurement:
    """One trial of the comparison, where the search's trials run and as they ran."""
    return target.venue.run(workload, TrialWork(config, target.options.trial_settings, target.enforced_bytes))


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
