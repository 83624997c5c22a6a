"""``tune()``: the whole pipeline behind one call, shared by the CLI and the Python API."""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from autotune._log import logger, notice_once
from autotune.checkpointing import Chain, find_chain, order_chain
from autotune.data import scan_items, worst_indices
from autotune.errors import Interrupted, UsageError, first_line
from autotune.meters import make_meter
from autotune.precision import default_precisions, supported_precisions
from autotune.report import Report, environment, ram_bytes
from autotune.plan_check import PlanCheck, run_checks
from autotune.plans import ALL, auto_plans, check_plan_fits, is_off, parse_plans
from autotune.search import (SearchInterrupted, default_storage, default_study_name, fingerprint, run_one, run_search,
                             store_plan_checks, stored_plan_checks)
from autotune.space import Config, SearchSpace, parse_batch_sizes, parse_precisions
from autotune.strategies import make_strategy
from autotune.probe import ProbeResult, ProbeSettings, probe_candidates, run_probe
from autotune.thirdparty import library_checkpointing
from autotune.trial import GuardRails, Measurement, TrialSettings, keep_in_fp32
from autotune.units import format_bytes, parse_size
from autotune.workload import Workload, parse_model_kwargs, to_device

__all__ = ["tune", "resolve_device", "device_total_bytes"]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """Return ``device`` as a ``torch.device`` (default: CUDA when available, else the CPU)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"--device {device!r} is not a device: use cpu, cuda or cuda:N ({exc})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: this torch sees no CUDA GPU (install a CUDA build of torch, or use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif device.type != "cpu":
        notice_once(f"device type {device.type!r}: memory is measured with the tensor meter")
    return device


def device_total_bytes(device: torch.device) -> int | None:
    """Return the device's total memory in bytes (the machine's RAM for the CPU), or None if unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return ram_bytes()


def _as_list(value: str | Sequence | None, parse: Callable) -> tuple | None:
    if value is None:
        return None
    if isinstance(value, str):
        return parse(value)
    return tuple(value)


def tune(
    model: str | type | Callable[[], nn.Module],
    *,
    model_kwargs: str | dict | None = None,
    data: Any = None,
    loss: str | Callable | None = None,
    device: str | torch.device | None = None,
    budget: str | int | None = None,
    headroom: float = 0.1,
    precisions: str | Sequence[str] | None = None,
    segments: str | Sequence[int] | None = "auto",
    batch_sizes: str | Sequence[int] = "1..512",
    strategy: str = "auto",
    n_trials: int | None = None,
    budgets: str | Sequence[str | int] | None = None,
    warmup_steps: int = 2,
    measure_steps: int = 5,
    trial_timeout: float | None = 300.0,
    storage: str | None = None,
    study: str | None = None,
    results_dir: str = "results",
    isolation: str = "auto",
    probe: bool = True,
    probe_top: int = 3,
    probe_epochs: int = 1,
    probe_fraction: float = 0.1,
    num_workers: int = 0,
    target_batch_size: int | None = None,
    clip_grad_norm: float | None = None,
    fp32_modules: str | Sequence[str] = (),
    compare_library: bool = True,
    on_trial: Callable[[Measurement, bool], None] | None = None,
    on_probe: Callable[[ProbeResult], None] | None = None,
    progress: Any = None,
) -> Report:
    """Measure training configurations of ``model`` and return the :class:`Report`.

    ``model`` is ``"MODULE:ATTR"`` or the class or factory itself; ``data``, ``loss`` likewise
    (see :mod:`autotune.workload` for the protocol). ``budget`` is a size such as ``"24GiB"``
    or bytes (default: the device's memory). ``precisions`` defaults to the modes the device runs
    well, ``segments="auto"`` to a spread up to the model's chain length. Trials are stored in
    the Optuna study ``study`` in ``storage`` (default ``results/<study>.db``): running the same
    call again reuses them. ``isolation="process"`` runs each trial in a fresh worker process
    (``auto``: on CUDA only). With ``data``, the ``probe_top`` fastest candidates then train
    ``probe_epochs`` epochs over ``probe_fraction`` of it and the recommendation comes from that
    probe (``probe=False`` skips it). ``target_batch_size`` adds a gradient-accumulation plan;
    ``clip_grad_norm`` and ``fp32_modules`` are guard rails used in trials, probe and ``apply``.
    For a model whose library has its own per-layer checkpointing (Hugging Face, timm), two more
    trials at the recommendation's precision and batch size compare it with autotune's plan of
    one segment per block (``compare_library=False`` skips them). ``progress`` receives the
    events of :class:`autotune.progress.Progress` (search and trial started and done, probe
    candidates); ``on_trial`` and ``on_probe`` are the plain callbacks. Raises :class:`~autotune.errors.UsageError` for bad input and
    :class:`~autotune.errors.Interrupted` (holding the partial report) on Ctrl-C.
    """
    for flag, value in (("--headroom", headroom), ("--trial-timeout", trial_timeout), ("--probe-fraction", probe_fraction),
                        ("--clip-grad-norm", clip_grad_norm)):
        if value is not None and not math.isfinite(value):
            raise UsageError(f"{flag} {value} must be a finite number")
    if not 0.0 <= headroom < 1.0:
        raise UsageError(f"--headroom {headroom} must be at least 0 and below 1, e.g. 0.1 for 10%")
    if warmup_steps < 0 or measure_steps < 1:
        raise UsageError("--warmup-steps must be 0 or more and --measure-steps 1 or more")
    if trial_timeout is not None and trial_timeout <= 0:
        raise UsageError(f"--trial-timeout {trial_timeout} must be a positive number of seconds")
    if probe_top < 1 or probe_epochs < 1 or not 0.0 < probe_fraction <= 1.0 or num_workers < 0:
        raise UsageError("--probe-top and --probe-epochs must be at least 1, --probe-fraction in (0, 1], "
                         "--num-workers 0 or more")
    if clip_grad_norm is not None and clip_grad_norm <= 0:
        raise UsageError(f"--clip-grad-norm {clip_grad_norm} must be positive")
    if target_batch_size is not None and target_batch_size < 1:
        raise UsageError(f"--target-batch-size {target_batch_size} must be at least 1")
    if isinstance(fp32_modules, str):
        fp32_modules = [name.strip() for name in fp32_modules.split(",") if name.strip()]
    guard = GuardRails(clip_grad_norm=clip_grad_norm, fp32_modules=tuple(fp32_modules))
    dev = resolve_device(device)
    workload = Workload.from_specs(model, model_kwargs=model_kwargs, data=data, loss=loss)
    extra_budgets = _budgets(budgets)
    if budget is not None:
        budget_bytes = parse_size(budget)
    else:  # the largest of --budgets, else the whole device
        budget_bytes = max(extra_budgets) if extra_budgets else device_total_bytes(dev)
    extra_budgets = tuple(b for b in extra_budgets if b != budget_bytes)
    # Trials run under the largest budget; a smaller one is judged by the peaks they measured.
    enforced = None if budget_bytes is None else max((budget_bytes, *extra_budgets))
    batch_list = _as_list(batch_sizes, parse_batch_sizes)

    if workload.dataset is not None and max(batch_list) > len(workload.dataset):
        too_big = [b for b in batch_list if b > len(workload.dataset)]
        raise UsageError(
            f"--data has {len(workload.dataset)} items, fewer than the batch sizes {','.join(map(str, too_big))}: "
            f"pass --batch-sizes up to {len(workload.dataset)}, or more data"
        )
    data_profile = None
    if workload.dataset is not None:  # the worst batch of every size, found once for every trial
        items = scan_items(workload.dataset)
        workload = workload.with_worst_batches({b: worst_indices(items, b) for b in batch_list})
        data_profile = {**items.to_dict(), "memory_batch": "the worst batch of each size",
                        "timed_batches": "random draws from the whole dataset"}
    info = _preflight(workload, dev, budget_bytes, min(batch_list), guard)
    strategy_obj = make_strategy(strategy, headroom=headroom, budgets=(budget_bytes, *extra_budgets) if enforced else (),
                                 fixed_bytes_hint=4 * info["parameter_bytes"], n_trials=n_trials)
    chain: Chain | None = info["chain"]
    workload = workload.with_chain(chain)  # plans count in the blocks' forward order, in workers too
    notices: list[str] = list(workload.notes)
    for notice in notices:
        logger.warning(notice)
    if workload.dataset is None:  # said once, as information (--quiet keeps it to the JSON)
        notices.append("no --data: the limits hold for the shapes of the model's example_batch; pass --data for limits "
                       "that hold over your dataset's batches")
        logger.info(notices[-1])

    precision_list = _as_list(precisions, parse_precisions) or tuple(default_precisions(dev))
    supported = supported_precisions(dev)
    unsupported = [p for p in precision_list if p not in supported]
    if unsupported:
        raise UsageError(f"{', '.join(unsupported)} is not supported on {dev}: use --precisions {','.join(supported)}")
    plan_list = _plans(segments, chain, info["model_class"], notices)

    settings = TrialSettings(warmup_steps=warmup_steps, measure_steps=measure_steps, timeout_s=trial_timeout,
                             guard=guard)
    kwargs = parse_model_kwargs(model_kwargs)  # the same kwargs as text or dict make the same study
    # Workers on several GPUs of one kind share a study: the key names the kind of device, not its index.
    device_kind = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    workload_key = fingerprint(model=workload.name, model_kwargs=kwargs, data=_describe(data), loss=_describe(loss),
                               device=device_kind)
    options_key = (fingerprint(model_kwargs=kwargs, data=_describe(data), loss=_describe(loss))
                   if (kwargs or data or loss) else None)
    study_name = study or default_study_name(workload, dev, options_key)
    storage_url = storage or default_storage(study_name, results_dir)
    isolation_mode = _isolation(isolation, dev)
    compared = compare_library and info["library_checkpointing"] is not None and chain is not None
    # The library comparison measures plan all beside the library's switch: it is checked too.
    checks = _checked_plans(workload, (*plan_list, *((ALL,) if compared else ())), dev, min(batch_list), settings,
                            isolation_mode, study_name=study_name, storage=storage_url, workload_key=workload_key)
    plan_list = _surviving_plans(plan_list, checks, notices)
    space = SearchSpace(precision_list, plan_list, batch_list, blocks=chain.length if chain else None)
    # With process isolation each worker makes its own meter; this one stays unused (and sets nothing).
    meter = make_meter(dev, budget_bytes=enforced if isolation_mode == "none" else None)
    interrupted = None
    events = _Events(progress, on_trial, on_probe)
    planned = {"grid": len(space), "optuna": min(len(space), n_trials or max(1, len(space) // 4))}.get(strategy_obj.name)
    events.call("search_started", space_size=len(space), planned=planned, strategy=strategy_obj.name,
                budget_bytes=budget_bytes)
    try:
        result = run_search(
            workload, space, strategy_obj, device=dev, meter=meter, budget_bytes=enforced, settings=settings,
            study_name=study_name, storage=storage_url, workload_key=workload_key, isolation=isolation_mode,
            on_trial=events.trial_done, on_trial_start=events.trial_started,
        )
    except SearchInterrupted as exc:
        result, interrupted = exc.result, exc
    finally:
        meter.close()
        events.call("search_done")
    report = Report(
        environment=environment(dev),
        workload={
            "model": workload.name,
            "model_class": info["model_class"],
            "model_kwargs": kwargs,
            "data": _describe(data),
            "loss": _describe(loss),
            "parameter_count": info["parameter_count"],
            "parameter_bytes": info["parameter_bytes"],
            "chain": None if chain is None else chain.to_dict(),
            "library_checkpointing": info["library_checkpointing"],
        },
        budget_bytes=budget_bytes,
        headroom=headroom,
        search={
            "strategy": strategy_obj.name,
            "n_trials_limit": n_trials,
            "n_trials": len(result.measurements),
            "n_run": result.n_run,
            "n_reused": result.n_reused,
            "wall_s": round(result.wall_s, 3),
            "study": result.study_name,
            "storage": result.storage,
            "space": space.to_dict(),
            "warmup_steps": warmup_steps,
            "measure_steps": measure_steps,
            "trial_timeout_s": trial_timeout,
            "memory_meter": "CudaMeter" if dev.type == "cuda" else "TensorMeter",
            "isolation": isolation_mode,
            "partial": result.partial,
        },
        trials=result.measurements,
        notices=tuple(notices),
        plan_checks=tuple(checks),
        data=data_profile,
        guard=guard,
        target_batch_size=target_batch_size,
        budgets=tuple(sorted(extra_budgets)),
    )
    if interrupted is not None:
        raise Interrupted(report) from None
    try:
        report = _probe(report, workload, dev, budget_bytes=budget_bytes, headroom=headroom, guard=guard, probe=probe,
                        settings=ProbeSettings(top=probe_top, epochs=probe_epochs, fraction=probe_fraction,
                                               num_workers=num_workers, seed=0, timeout_s=trial_timeout),
                        events=events)
        if compared:
            report = _compare_library(report, workload, info["library_checkpointing"], dev, enforced, settings,
                                      isolation_mode)
        return report
    except KeyboardInterrupt:
        raise Interrupted(dataclasses.replace(report, search={**report.search, "partial": True})) from None


def _probe(report: Report, workload: Workload, dev: torch.device, *, budget_bytes: int | None, headroom: float,
           guard: GuardRails, probe: bool, settings: ProbeSettings, events: "_Events") -> Report:
    """Run the probe on the report's best candidates; return the report with its results."""
    if probe and workload.dataset is None:
        report = dataclasses.replace(report, notices=report.notices + (
            "no --data: the probe (an epoch over a slice of your data) was skipped; the recommendation "
            "comes from the short trials alone",))
        logger.info(report.notices[-1])
    elif probe:
        candidates = probe_candidates(report.pareto, budget_bytes, headroom, settings.top)
        results: list[ProbeResult] = []
        probe_meter = make_meter(dev, budget_bytes=budget_bytes)
        try:
            for i, candidate in enumerate(candidates, 1):
                events.call("probe_started", candidate.config, i, len(candidates))
                logger.debug("probe: %s over %.0f%% of the data, %d epoch(s)", candidate.config,
                            100 * settings.fraction, settings.epochs)
                results.append(run_probe(workload, candidate, device=dev, meter=probe_meter, budget_bytes=budget_bytes,
                                         headroom=headroom, settings=settings, guard=guard))
                events.probe_done(results[-1])
        except KeyboardInterrupt:  # the probe is incomplete: report what it did, marked partial
            raise Interrupted(dataclasses.replace(report, probe=tuple(results), probe_settings=settings.to_dict(),
                                                  search={**report.search, "partial": True})) from None
        finally:
            probe_meter.close()
        report = dataclasses.replace(report, probe=tuple(results), probe_settings=settings.to_dict())
    return report


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


def _compare_library(report: Report, workload: Workload, method: str, dev: torch.device, budget_bytes: int | None,
                     settings: TrialSettings, isolation: str) -> Report:
    """Measure the library's per-layer checkpointing beside autotune's one-segment-per-block plan.

    Both at the recommendation's precision and batch size, as the search ran its trials (in this
    process, or each in a fresh worker); the plan's trial is taken from the search when it was
    measured there. The trials are not part of the search space, so they are reported, not
    stored. A comparison that cannot be made is a notice: the search and probe are kept.
    """
    rec = report.recommendation
    if rec is None:
        return report
    ours_config = Config(rec.precision, ALL, rec.batch_size)  # every block recomputed, as the library's switch does
    if not any(c.plan == ALL and c.ok for c in report.plan_checks):
        notice = f"the comparison with {method} was not made: autotune's plan {ALL} did not pass its check on this model"
        logger.warning(notice)
        return dataclasses.replace(report, notices=report.notices + (notice,))
    measured = {m.config: m for m in report.trials}
    logger.info("comparing %s with plan %s at %s, batch %d", method, ALL, rec.precision, rec.batch_size)
    meter = make_meter(dev, budget_bytes=budget_bytes if isolation == "none" else None)
    try:
        lib = Workload.from_specs(**{**workload.spec, "library_checkpointing": True})  # rebuilt the same way in a worker
        run = functools.partial(run_one, device=dev, meter=meter, budget_bytes=budget_bytes, settings=settings,
                                isolation=isolation)
        library = run(lib, Config(rec.precision, 0, rec.batch_size))
        ours = measured.get(ours_config) or run(workload, ours_config)
    except Exception as exc:  # noqa: BLE001 - an extra measurement: its failure must not cost the report
        notice = f"the comparison with {method} could not be made ({type(exc).__name__}: {first_line(exc)})"
        logger.warning(notice)
        return dataclasses.replace(report, notices=report.notices + (notice,))
    finally:
        meter.close()
    none = measured.get(Config(rec.precision, 0, rec.batch_size))

    def row(m: Measurement) -> dict[str, Any]:
        return {"status": m.status, "peak_bytes": m.peak_bytes, "step_s": m.step_s, "samples_per_s": m.samples_per_s, "error": m.error}

    return dataclasses.replace(report, library_checkpointing={
        "method": method, "precision": rec.precision, "batch_size": rec.batch_size,
        "library": row(library), "autotune": {"segments": ALL, **row(ours)}, "none": None if none is None else row(none),
    })


def _plans(segments: str | Sequence | None, chain: Chain | None, model_class: str, notices: list[str]) -> tuple[str, ...]:
    """Resolve ``--segments`` against the model's blocks: the plan names to search."""
    if segments is None or (isinstance(segments, str) and segments.strip() == "auto"):
        names = None
    elif isinstance(segments, str):
        names = parse_plans(segments)
    else:
        names = parse_plans(",".join(map(str, segments)))
    if chain is None:
        if names and not all(is_off(n) for n in names):
            raise UsageError(f"{model_class} has no repeated blocks to checkpoint: use --segments 0")
        if names is None:
            notices.append(f"{model_class} has no repeated blocks: checkpointing is not tried (segments 0 only)")
            logger.warning(notices[-1])
        return names or ("0",)
    if names is None:
        return tuple(auto_plans(chain.length))
    for name in names:
        check_plan_fits(name, chain.length, chain.describe())
    return names


def _checked_plans(workload: Workload, plans: Sequence[str], dev: torch.device, batch_size: int, settings: TrialSettings,
                   isolation: str, *, study_name: str, storage: str, workload_key: str) -> list[PlanCheck]:
    """Check every plan on the model (one step with and without it), or reuse the checks stored in the study."""
    to_check = [p for p in dict.fromkeys(plans) if not is_off(p)]
    if not to_check:
        return []
    key = fingerprint(plans=to_check, batch_size=batch_size, seed=settings.seed, guard=settings.guard,
                      chain=workload.chain.to_dict() if workload.chain else None)
    stored = stored_plan_checks(study_name, storage, workload_key=workload_key, key=key)
    if stored is not None:
        return [PlanCheck.from_dict(c) for c in stored]
    logger.info("checking %d checkpoint plan(s) on %s: one step with and without each, batch %d, fp32",
                len(to_check), workload.name, batch_size)
    started = time.monotonic()
    checks = run_checks(workload, to_check, batch_size=batch_size, device=dev, seed=settings.seed, guard=settings.guard,
                        isolation=isolation, timeout_s=settings.timeout_s)
    logger.info("checked in %.1f s: %s", time.monotonic() - started,
                ", ".join(f"{c.plan} {c.status}" for c in checks))
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


def _budgets(value: str | Sequence[str | int] | None) -> tuple[int, ...]:
    """Parse ``--budgets 8GiB,24GiB,80GiB`` (or a list of sizes) into sorted bytes without repeats."""
    if value is None:
        return ()
    parts = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else list(value)
    if not parts:
        raise UsageError(f"--budgets {value!r} is empty: write sizes such as 8GiB,24GiB")
    return tuple(sorted({parse_size(p) for p in parts}))


def _describe(obj: Any) -> str | None:
    """A stable name for a spec or object: the same across runs (no memory addresses)."""
    if obj is None or isinstance(obj, str):
        return obj
    name = f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"
    return f"{name}[{len(obj)}]" if hasattr(obj, "__len__") and not callable(obj) else name


def _isolation(name: str, device: torch.device) -> str:
    """Resolve ``--isolation``: ``auto`` is ``process`` on CUDA and ``none`` elsewhere."""
    if name not in ("auto", "process", "none"):
        raise UsageError(f"unknown --isolation {name!r}: choose auto, process or none")
    if name == "auto":
        return "process" if device.type == "cuda" else "none"
    return name


def _preflight(workload: Workload, device: torch.device, budget_bytes: int | None, batch_size: int,
               guard: GuardRails) -> dict[str, Any]:
    """Build the model once and run one forward pass: bad input fails here, before any trial."""
    model = workload.build_model()
    keep_in_fp32(model, guard.fp32_modules, device.type)  # --fp32-modules names the model lacks fail here
    model_class = type(model).__name__
    params = list(model.parameters())
    parameter_count = sum(p.numel() for p in params)
    parameter_bytes = sum(p.numel() * p.element_size() for p in params)
    if budget_bytes is not None and parameter_bytes >= budget_bytes:
        raise UsageError(
            f"--budget {format_bytes(budget_bytes)} is smaller than the model's parameters alone "
            f"({parameter_count:,} parameters, {format_bytes(parameter_bytes)}); training needs about 4x that "
            f"with AdamW: raise --budget"
        )
    chain = find_chain(model)
    batch = None
    try:
        try:
            model.to(device)
            batch = to_device(workload.make_batch(model, batch_size), device)
            with torch.no_grad():
                if chain is None:
                    workload.loss(model, batch)
                else:  # the forward pass also says in which order the blocks run
                    chain = order_chain(model, chain, lambda: workload.loss(model, batch))
        except UsageError:
            raise
        except Exception as exc:
            raise UsageError(
                f"{model_class} failed on a batch of {batch_size}: {type(exc).__name__}: {first_line(exc)} "
                f"(check --data, --loss and the model's example_batch)"
            ) from None
        try:  # on this throwaway model: has its library a per-layer checkpointing switch of its own?
            library = library_checkpointing(model)
        except Exception as exc:  # noqa: BLE001 - a switch that fails is one not compared with
            library = None
            logger.info("the model's own checkpointing switch failed (%s: %s): not compared", type(exc).__name__,
                        first_line(exc))
    finally:
        model = params = batch = None
        gc.collect()  # models with reference cycles (the --fp32-modules wrappers, Hugging Face's) go now, not later
        if device.type == "cuda":
            torch.cuda.empty_cache()  # hand the preflight's memory back before the trials measure
    return {
        "model_class": model_class,
        "parameter_count": parameter_count,
        "parameter_bytes": parameter_bytes,
        "library_checkpointing": library,
        "chain": chain,
    }
