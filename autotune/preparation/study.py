"""Stage 3: every plan checked on the model (or the checks its study stored), the space, and the study's identity."""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

from autotune._log import logger
from autotune.device import autocast_type, host_memory_apart
from autotune.errors import UsageError
from autotune.execution.plan_check import run_checks
from autotune.plans.checkpointing import Chain
from autotune.preparation.model import ModelFacts
from autotune.preparation.target import Target, describe
from autotune.records import PlanCheck
from autotune.search.space import SearchSpace
from autotune.search.store import default_storage, default_study_name, fingerprint, store_plan_checks, stored_plan_checks
from autotune.training.workload import Workload
from autotune.vocabulary import ALL, EAGER, Offload, Plan, auto_plans, with_offload

__all__ = ["Study", "plan_study", "describe"]


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
    key, searching, workload = target.key, target.searching, target.workload.with_chain(facts.chain)
    described = {"model_kwargs": key.model_kwargs, "data": key.data, "loss": key.loss}
    if not key.default_training:  # another optimizer or step is another study; the default keeps the key of before
        described.update(optimizer=workload.optimizer.to_dict(), step=key.step)
    if searching.target_batch_size is not None:  # a trial under it accumulates (two micro-steps): another peak
        described.update(accumulates_to=searching.target_batch_size)
    # Workers on several GPUs of one kind share a study: the key names the kind of device, not its index.
    # A distributed job's trials are another job's: the wrapper and world size are part of what they measure.
    job = target.job
    ranks = f"{job.wrapper}{job.world_size}" if job else (  # a dry run's --world-size: the job it predicts
        f"{searching.parallel}{searching.world_size}" if searching.world_size else None)
    parallel = {"parallel": f"{job.wrapper}x{job.world_size}"} if job else {}
    workload_key = fingerprint(model=workload.name, **described, device=target.backend.kind, **parallel)
    plain = not (key.model_kwargs or key.data or key.loss) and key.default_training and "accumulates_to" not in described
    options_key = None if plain else fingerprint(**described)
    name = key.study or default_study_name(workload.name, autocast_type(target.device), options_key) + (
        f"-{ranks}" if ranks else "") + ("-dry-run" if searching.dry_run else "")  # beside the search's, not over it
    storage = key.storage or default_storage(name, key.results_dir)
    notices: list[str] = []
    plans = with_offload(_plans(searching.plans, facts.chain, facts.model_class, notices),
                         _offload_modes(searching.offload, target.here, notices))
    _say_cache_off(facts, plans, notices)
    compared = searching.compare_library and facts.library_checkpointing is not None and facts.chain is not None
    # The library comparison measures plan all beside the library's switch: it is checked too.
    checks = [check for mode in searching.compiles
              for check in _checked_plans(workload, (*plans, *((ALL,) if compared else ())), target, study_name=name,
                                          storage=storage, workload_key=workload_key, compile=mode)]
    space = SearchSpace(target.precisions, _surviving_plans(plans, checks, notices), searching.batch_sizes,
                        blocks=facts.chain.length if facts.chain else None,
                        compiles=_compiling(searching.compiles, checks, facts.model_class, notices))
    return Study(workload, space, name, storage, workload_key, tuple(checks), tuple(notices), compared)


def _plans(asked: tuple[Plan, ...] | None, chain: Chain | None, model_class: str, notices: list[str]) -> tuple[Plan, ...]:
    """Resolve ``--segments`` (None: auto) against the model's blocks: the plan names to search."""
    if chain is None:
        if asked and not all(p.base.off for p in asked):
            raise UsageError(f"{model_class} has no repeated blocks to checkpoint: use --segments 0")
        if asked is None:
            notices.append(f"{model_class} has no repeated blocks: checkpointing is not tried (segments 0 only)")
            logger.warning(notices[-1])
        return asked or (Plan("0"),)
    if asked is None:
        return tuple(auto_plans(chain.length))
    for plan in asked:
        plan.fits(chain.length, chain.describe())
    return asked


def _say_cache_off(facts: ModelFacts, plans: Sequence[Plan], notices: list[str]) -> None:
    """A notice where a plan that recomputes turns the model's key/value cache off in training (plans.cache)."""
    if facts.training_cache and any(not plan.base.off for plan in plans):
        notices.append(f"{', '.join(dict.fromkeys(facts.training_cache))}: its key/value cache (config.use_cache) is "
                       f"off in training under every plan that recomputes, as transformers turns it off under its own "
                       f"gradient checkpointing (a recompute would write the cache again); plans that recompute "
                       f"nothing train with it as configured, and autotune.apply does the same")
        logger.warning(notices[-1])


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
                   workload_key: str, compile: str = EAGER) -> list[PlanCheck]:
    """Check every plan on the model (one step with and without it), or reuse the checks stored in the study.
    Compiled (``compile`` not ``none``): compiled against compiled, the compile check (plan 0's) first."""
    to_check = [p for p in dict.fromkeys(map(Plan, plans)) if not p.off]
    if not to_check and compile == EAGER:
        return []
    if target.searching.dry_run:  # a check compares real losses and gradients: the search checks before it trusts
        logger.info("the checkpoint plans are not checked in a dry run: a search checks each before it trusts it")
        return []
    settings, batch_size = target.trial_settings, min(target.searching.batch_sizes)
    key = fingerprint(plans=to_check, batch_size=batch_size, seed=settings.seed, guard=settings.guard,
                      chain=workload.chain.to_dict() if workload.chain else None,
                      **({"compile": compile} if compile != EAGER else {}))  # eager: the key of before
    stored = stored_plan_checks(study_name, storage, workload_key=workload_key, key=key)
    if stored is not None:
        return [PlanCheck.from_dict(c) for c in stored]
    logger.info("checking %d checkpoint plan(s) on %s: one step with and without each, batch %d, fp32%s",
                len(to_check), workload.name, batch_size, "" if compile == EAGER else f", compiled ({compile})")
    started = time.monotonic()
    checks = run_checks(workload, to_check, venue=target.venue, batch_size=batch_size, seed=settings.seed,
                        guard=settings.guard, timeout_s=settings.timeout_s, compile=compile)
    logger.info("checked in %.1f s: %s", time.monotonic() - started, ", ".join(f"{c.plan} {c.status}" for c in checks))
    store_plan_checks(study_name, storage, workload_key=workload_key, key=key, checks=[c.to_dict() for c in checks])
    return checks


def _compiling(modes: tuple[str, ...], checks: Sequence[PlanCheck], model_class: str, notices: list[str]) -> tuple[str, ...]:
    """The compile modes to search: eager, and each mode whose compile check passed (a notice for each that failed)."""
    failed = {c.compile: c for c in checks if c.plan.off and c.compile != EAGER and not c.ok}
    for mode, check in failed.items():
        notices.append(f"{model_class} does not compile under torch.compile (mode {mode}): {check.error}; its compiled "
                       f"configurations are not searched, the eager ones are")
        logger.warning(notices[-1])
    kept = tuple(m for m in modes if m not in failed)
    return kept or (EAGER,)


def _surviving_plans(plans: Sequence[str], checks: Sequence[PlanCheck], notices: list[str]) -> tuple[str, ...]:
    """The plans to search: those that recompute nothing or passed their check (eager and under each compile mode
    whose compile check passed). Each dropped plan is a notice."""
    no_compile = {c.compile for c in checks if c.plan.off and not c.ok}  # said once, by _compiling
    failed = {c.plan: c for c in checks if not c.ok and c.plan in plans and c.compile not in no_compile}
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
