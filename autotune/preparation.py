"""The tuner's first three stages: the options resolved on this machine, the model looked at once, the study.

    Options -> resolve -> Target          the device's backend, the venue, the workload, budgets, the data's worst batches
            -> preflight -> ModelFacts    the model built once: its size, its optimizer's state, its blocks, its library's switch
            -> plan_study -> Study        the plans checked on the model, the space, the study's identity

:mod:`autotune.tuner` runs them, then the search, the analysis, the probe and the comparison.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake  # private, and in every torch autotune supports

from autotune._log import logger
from autotune.plans.checkpointing import Chain, find_chain, order_chain
from autotune.plans.floor import Floor, measure_floor, state_levers
from autotune.training.data import scan_items, worst_indices
from autotune.device import (Backend, autocast_type, available_ram_bytes, backend_for, host_memory_apart, predictable,
                             resolve_device)
from autotune.errors import StateDoesNotFit, UsageError, first_line
from autotune.options import Options
from autotune.execution.plan_check import run_checks
from autotune.vocabulary import ALL, Offload, Plan, auto_plans, with_offload
from autotune.training.optimizer import UNPRIMED_NOTICE, measure_optimizer
from autotune.training.precision import PRECISIONS, keep_in_fp32
from autotune.execution.venue import venue_for
from autotune.execution.work import Venue
from autotune.records import Budget, PlanCheck, TrialSettings, usable_bytes
from autotune.search.space import SearchSpace
from autotune.search.store import default_storage, default_study_name, fingerprint, store_plan_checks, stored_plan_checks
from autotune.thirdparty import library_checkpointing
from autotune.training.workload import Workload, move_model, parse_model_kwargs, to_device

if TYPE_CHECKING:
    from autotune.execution.job import Job

__all__ = ["Target", "ModelFacts", "Study", "resolve", "preflight", "plan_study", "describe"]


# -- stage 1: the options, resolved against this machine ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """What the options mean here: the device's backend, the workload and the budgets, in bytes."""

    options: Options
    backend: Backend
    workload: Workload
    budget: Budget  # --budget (else the largest of --budgets, else the device's memory), --budgets, --headroom
    precisions: tuple[str, ...]
    isolation: str  # "process" or "none"
    venue: Venue  # where trials, probe candidates and plan checks run: this process, a worker, every rank
    data_profile: dict[str, Any] | None  # the item sizes and how batches were chosen (with data)
    notices: tuple[str, ...]
    job: "Job | None" = None  # --parallel: this rank's place in the job (rank 0: the leader)
    host_budget_bytes: int | None = None  # what offloaded activations may hold: --host-budget, else half the available
    host_budget_source: str = ""

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def trial_settings(self) -> TrialSettings:
        """The options' trial settings with the host budget resolved here."""
        return dataclasses.replace(self.options.trial_settings, host_budget_bytes=self.host_budget_bytes)


def resolve(options: Options, job: "Job | None" = None) -> Target:
    """Stage 1: the device, the workload (with the data's worst batch of every size), budgets and precisions."""
    device = resolve_device(options.device)
    backend = backend_for(job.device(device) if job else device)
    workload = Workload.from_specs(options.model, model_kwargs=options.model_kwargs, data=options.data, loss=options.loss,
                                   optimizer=options.optimizer, optimizer_kwargs=options.optimizer_kwargs,
                                   step=options.step)
    budget = options.memory if options.budget is not None else Budget(backend.total_bytes(), (), options.headroom)
    isolation = backend.default_isolation if options.isolation == "auto" else options.isolation
    if job is not None or options.dry_run:
        isolation = "none"  # each rank runs its part of a trial in its own process (options refuse "process"); a
        # dry run's trials hold no memory: nothing to isolate
    if options.dry_run and not predictable(backend.device):
        raise UsageError(f"--dry-run predicts for the CPU's rules only so far (CUDA's allocator, autocast lists and "
                         f"attention kernels are not modelled yet): run it with --device cpu")
    venue = venue_for(isolation, backend.device, job, trials_per_worker=options.trials_per_worker)
    venue.admit(workload)  # one clear line now, not every trial crashed later
    workload, profile = _with_data(workload, options.batch_sizes)
    notices = list(workload.notes)
    for notice in notices:
        logger.warning(notice)
    if workload.dataset is None:  # said once, as information (--quiet keeps it to the JSON)
        notices.append("no --data: the limits hold for the shapes of the model's example_batch; pass --data for limits "
                       "that hold over your dataset's batches")
        logger.info(notices[-1])
    if venue.slows_steps and options.warmup_steps != TrialSettings.warmup_steps:
        notices.append(f"--warmup-steps {options.warmup_steps} is not used with the {backend.meter_name} meter: each trial's "
                       f"warm-up is one metered step, the optimizer's state primed before it")
        logger.warning(notices[-1])
    host_budget, host_source = _host_budget(options.host_budget, job.local_world_size if job is not None else 1)
    return Target(options, backend, workload, budget, _precisions(options.precisions, backend), isolation, venue,
                  profile, tuple(notices), job, host_budget, host_source)


def _host_budget(given: int | None, local_ranks: int = 1) -> tuple[int | None, str]:
    """What offloaded activations and state may hold in host memory (each rank's), and where that figure comes from:
    by default half the host's available memory, shared by the ranks of a --parallel job on this machine."""
    if given is not None:
        return given, "--host-budget"
    available = available_ram_bytes()
    if available is None:
        return None, "none: the host's available memory is unknown here"
    if local_ranks > 1:
        return available // (2 * local_ranks), f"half the host memory available when the search started, shared by " \
                                               f"the {local_ranks} ranks on this machine"
    return available // 2, "half the host memory available when the search started"


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
    optimizer_state_bytes: int | None = None  # the optimizer's state for these parameters (None: not measurable)
    unprimed: str | None = None  # why the optimizer could not be primed (autotune.training.optimizer)
    gradient_bytes: int | None = None  # the parameters that require gradients (None: all of them)
    optimizer: dict[str, Any] | None = None  # the optimizer made here: its class, settings and source (the report's)

    def state(self) -> dict[str, int]:
        """What a step holds whatever the batch, by part: the weights, the gradients of the parameters that train,
        and the optimizer's state (measured; where it could not be, AdamW's two moments of the trained ones)."""
        gradients = self.parameter_bytes if self.gradient_bytes is None else self.gradient_bytes
        optimizer = 2 * gradients if self.optimizer_state_bytes is None else self.optimizer_state_bytes
        return {"weights": self.parameter_bytes, "gradients": gradients, "optimizer_state": optimizer}

    @property
    def fixed_bytes(self) -> int:
        """The sum of :meth:`state`: the one definition the search's memory line and the state check share."""
        return sum(self.state().values())


def preflight(target: Target) -> ModelFacts:
    """Stage 2: build the model and run one forward pass: bad input fails here, before any trial.

    The model is dropped and its memory handed back (reference cycles collected first: every
    Hugging Face model and any model after ``--fp32-modules`` holds its weights in one) before the
    trials measure.
    """
    workload, device, batch_size = target.workload, target.device, min(target.options.batch_sizes)
    model = workload.build_model()
    keep_in_fp32(model, target.options.fp32_modules, autocast_type(device))  # --fp32-modules names the model lacks fail here
    params = list(model.parameters())
    facts = ModelFacts(type(model).__name__, sum(p.numel() for p in params),
                       sum(p.numel() * p.element_size() for p in params), find_chain(model), None,
                       gradient_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad))
    del params
    try:
        # The optimizer's state is measured on the CPU, before the model goes to the device: a model whose state
        # does not fit is told so with figures, not met by an out-of-memory error in its first forward pass.
        state, unprimed, made = measure_optimizer(workload.optimizer, model, target.options.trial_settings.lr)
        # A closure over this frame's ``model``, not an argument: ``del model`` below then frees the model even
        # while the StateDoesNotFit raised through here, and its traceback's frames, live on in the caller
        _check_state_fits(dataclasses.replace(facts, optimizer_state_bytes=state), workload.optimizer.name, target,
                          lambda: _floor_of(workload, facts.chain, target.precisions, target.options.fp32_modules, model))
        chain = _forward(model, workload, device, batch_size, facts)
        library = _library_switch(model)
    finally:
        del model
        target.backend.release()  # gc.collect, then the allocator's cache: nothing of the preflight stays
    if unprimed is not None:
        logger.warning(UNPRIMED_NOTICE.format(name=workload.optimizer.name, why=unprimed))
    return dataclasses.replace(facts, chain=chain, library_checkpointing=library, optimizer_state_bytes=state,
                               unprimed=unprimed, optimizer=made)


def _check_state_fits(facts: ModelFacts, optimizer: str, target: Target, floor: Callable[[], Floor]) -> None:
    """Raise :class:`StateDoesNotFit` when the training state alone exceeds the usable budget (no trial could fit),
    with the levers that would fit: FSDP ranks, the state offloaded to host memory, an optimizer with less state.
    ``floor()`` measures the smallest plan's activations at batch 1 (only then: it costs forward passes)."""
    budget, options = target.budget, target.options
    # FSDP2 shards the state over its ranks: a torchrun job's, or those a dry run predicts (--world-size); DDP does not
    shards = (target.job.world_size if target.job else options.world_size or 1) if options.parallel == "fsdp" else 1
    if budget.bytes is None:
        return
    if facts.fixed_bytes / shards < usable_bytes(budget.bytes, budget.headroom):
        return
    if any(Offload.STATE in mode for mode in options.offload or ()):
        return  # the state is searched in host memory (+state plans): the device holds none of it
    guessed = facts.optimizer_state_bytes is None  # an optimizer that could not be primed: AdamW's moments guessed
    parts = facts.state()
    name = optimizer.rsplit(":", 1)[-1].rsplit(".", 1)[-1]  # torch.optim:AdamW -> AdamW
    try:
        measured: Floor | str = floor()
    except Exception as exc:  # noqa: BLE001 - the levers are still named, with the activations unmeasured
        measured = f"{type(exc).__name__}: {first_line(exc)}"
    raise StateDoesNotFit(state_levers(parts, name, guessed, budget.bytes, budget.headroom, available_ram_bytes(),
                                       measured, shards=shards), parts, measured if isinstance(measured, Floor) else None)


def _floor_of(workload: Workload, chain: Chain | None, precisions: Sequence[str], fp32_modules: Sequence[str],
              model: nn.Module | None = None) -> Floor:
    """The smallest plan's activations at batch 1 (:mod:`autotune.plans.floor`), at the searched precision that saves
    the least (bf16 stands in for fp16: the same bytes, without fp16's slow CPU kernels).

    Measured with PyTorch's fake tensors (torch.compile's: shapes and dtypes, no memory, no arithmetic, so a large
    model's takes seconds) on a model built under them; where the model cannot build or run so (a shape that
    depends on values), on the CPU, on ``model`` or a build of it.
    """
    half = "bf16" if {"bf16", "fp16"} & set(precisions) else "fp32"
    if model is not None and is_fake(next(model.parameters(), None)):  # a dry run's model: fake already
        return _floor_measured(model, workload, chain, half, contextlib.nullcontext())
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode  # private, and in every torch autotune supports

        mode = FakeTensorMode(allow_non_fake_inputs=True)  # the batch stays real: its own bytes are real
        with mode:
            fake = workload.build_model()
            keep_in_fp32(fake, fp32_modules, "cpu")
        return _floor_measured(fake, workload, chain, half, mode)
    except Exception as exc:  # noqa: BLE001 - measured for real instead
        logger.info("batch 1's activations are measured on the CPU (fake tensors could not run the model: %s: %s)",
                    type(exc).__name__, first_line(exc))
    if model is None:
        model = workload.build_model()
        keep_in_fp32(model, fp32_modules, "cpu")
    return _floor_measured(model, workload, chain, half, contextlib.nullcontext())


def _floor_measured(model: nn.Module, workload: Workload, chain: Chain | None, half: str,
                    mode: contextlib.AbstractContextManager) -> Floor:
    batch = workload.make_batch(model, 1)
    with mode, PRECISIONS[half].autocast("cpu"):
        measured = measure_floor(model, chain, lambda: workload.loss(model, batch))
    return dataclasses.replace(measured, precision=half)


def floor_facts(target: Target, chain: Chain | None) -> dict[str, Any] | None:
    """When nothing fits: the smallest plan's activations at batch 1 (:func:`_floor_of`), as the report's
    ``workload.floor``; None where they cannot be measured (said in the log)."""
    try:
        floor = _floor_of(target.workload, chain, target.precisions, target.options.fp32_modules)
    except Exception as exc:  # noqa: BLE001 - the answer is given without the figure
        logger.info("the activations at batch 1 could not be measured: %s: %s", type(exc).__name__, first_line(exc))
        return None
    finally:
        target.backend.release()
    return {**dataclasses.asdict(floor), "activations": floor.activations}


def _forward(model: nn.Module, workload: Workload, device: torch.device, batch_size: int, facts: ModelFacts) -> Chain | None:
    """One forward pass without gradients on a batch of ``batch_size``; return the chain in forward order."""
    try:
        move_model(model, device)
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
    described = {"model_kwargs": kwargs, "data": describe(options.data), "loss": describe(options.loss)}
    default_training = options.optimizer is None and options.optimizer_kwargs is None and options.step is None
    if not default_training:  # another optimizer or step is another study; the default keeps the key of before
        described.update(optimizer=workload.optimizer.to_dict(), step=describe(options.step))
    # Workers on several GPUs of one kind share a study: the key names the kind of device, not its index.
    # A distributed job's trials are another job's: the wrapper and world size are part of what they measure.
    job = target.job
    ranks = f"{job.wrapper}{job.world_size}" if job else (  # a dry run's --world-size: the job it predicts
        f"{options.parallel}{options.world_size}" if options.world_size else None)
    parallel = {"parallel": f"{job.wrapper}x{job.world_size}"} if job else {}
    workload_key = fingerprint(model=workload.name, **described, device=target.backend.kind, **parallel)
    plain = not (kwargs or options.data or options.loss) and default_training
    options_key = None if plain else fingerprint(**described)
    name = options.study or default_study_name(workload.name, autocast_type(target.device), options_key) + (
        f"-{ranks}" if ranks else "") + ("-dry-run" if options.dry_run else "")  # beside the search's, not over it
    storage = options.storage or default_storage(name, options.results_dir)
    notices: list[str] = []
    plans = with_offload(_plans(options.segments, facts.chain, facts.model_class, notices),
                         _offload_modes(options.offload, target.device, notices))
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
        if segments and not all(Plan(n).base.off for n in segments):
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


def _offload_modes(modes: tuple[Offload, ...] | None, device: torch.device, notices: list[str]) -> tuple[Offload, ...]:
    """Resolve ``--offload`` (None: auto) against the device: activations where its memory is not the host's."""
    if modes is None:
        return (Offload.NONE, Offload.ACTIVATIONS) if host_memory_apart(device) else (Offload.NONE,)
    if any(Offload.ACTIVATIONS in m for m in modes) and not host_memory_apart(device):
        notices.append("activation offload on the CPU is emulated (device and host are one memory): offloaded "
                       "trials' host copies are counted apart from the budget, and their step times include a memory "
                       "copy where a GPU transfers over PCIe, so they understate offload's cost")
        logger.warning(notices[-1])
    if any(Offload.STATE in m for m in modes):
        notices.append("plans +state keep the training state in host memory (FSDP2's CPUOffloadPolicy) and run the "
                       "optimizer's step on the CPU: its arithmetic is the CPU's, equal to the device's within float "
                       "rounding, not bitwise" + (
                           "; on the CPU it is emulated (the state's bytes counted apart from the budget, no transfers "
                           "in the step times, which understate its cost)" if not host_memory_apart(device) else ""))
        logger.warning(notices[-1])
    return modes


def _checked_plans(workload: Workload, plans: Sequence[str], target: Target, *, study_name: str, storage: str,
                   workload_key: str) -> list[PlanCheck]:
    """Check every plan on the model (one step with and without it), or reuse the checks stored in the study."""
    to_check = [p for p in dict.fromkeys(map(Plan, plans)) if not p.off]
    if not to_check:
        return []
    if target.options.dry_run:  # a check compares real losses and gradients: the search checks before it trusts
        logger.info("the checkpoint plans are not checked in a dry run: a search checks each before it trusts it")
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


def describe(obj: Any) -> str | None:
    """A stable name for a spec or object: the same across runs (no memory addresses)."""
    if obj is None or isinstance(obj, str):
        return obj
    name = f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"
    return f"{name}[{len(obj)}]" if hasattr(obj, "__len__") and not callable(obj) else name
