"""Stage 1: the options resolved against this machine, and used up: :class:`Target` holds what they mean here.

The device's backend, the venue, the workload with the data's worst batch of every size, the budgets in bytes, the
precisions that run here, and how to search (:class:`Searching`) and what the study is of (:class:`WorkloadKey`):
no later stage reads a flag.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING, Any, Sequence

import torch

from autotune._log import logger
from autotune.device import Backend, available_ram_bytes, backend_for, batch_multiple, predictable, resolve_device
from autotune.errors import UsageError
from autotune.execution.venue import venue_for
from autotune.execution.work import Venue
from autotune.options import Options
from autotune.records import Budget, ProbeSettings, TrialSettings
from autotune.training.compiled import require_compiler
from autotune.training.data import scan_items, worst_indices
from autotune.training.lowbit import stand_in
from autotune.training.evaluation import EvalData, eval_workload
from autotune.training.workload import Workload, parse_model_kwargs
from autotune.vocabulary import EAGER, PRECISIONS, TRUE, Isolation, Offload, Parallel, Plan, rounding_notice, runs_where

if TYPE_CHECKING:
    from autotune.execution.job import Job

__all__ = ["Target", "Searching", "WorkloadKey", "resolve", "describe"]


@dataclasses.dataclass(frozen=True)
class WorkloadKey:
    """What a study's trials are trials of, as the options named it, and where the study lives: the study's key, and
    the report's workload (stage 3 and stage 5 read it; nothing after ``resolve`` reads the model's spec again)."""

    model_kwargs: dict[str, Any]  # the same kwargs as text or dict make the same study
    data: str | None  # a stable name for --data, --loss, --step (no memory addresses)
    loss: str | None
    step: str | None
    default_training: bool  # no --optimizer, --optimizer-kwargs or --step: the key of before
    study: str | None  # --study, else derived from the model and the device
    storage: str | None  # --storage, else a SQLite file in results_dir
    results_dir: str
    eval_data: str | None = None  # a stable name for --eval-data (not part of the study: trials train)

    @classmethod
    def of(cls, options: Options) -> "WorkloadKey":
        return cls(parse_model_kwargs(options.model_kwargs), describe(options.data), describe(options.loss),
                   describe(options.step), options.optimizer is None and options.optimizer_kwargs is None
                   and options.step is None, options.study, options.storage, options.results_dir,
                   describe(options.eval_data))


@dataclasses.dataclass(frozen=True)
class Searching:
    """How this run searches, every option resolved: the space asked for, the strategy, the exact limit, the probe."""

    batch_sizes: tuple[int, ...]
    plans: tuple[Plan, ...] | None  # --segments; None: auto, resolved against the model's blocks in stage 3
    offload: tuple[Offload, ...] | None  # --offload; None: auto, resolved against the device in stage 3
    compiles: tuple[str, ...]  # --compile: "none" (eager) and torch.compile's modes
    strategy: str
    n_trials: int | None  # --strategy optuna's trial budget
    batch_multiple: int  # exact limits in steps of this (--batch-multiple, else the device's)
    exact_limit: bool  # stage 5b: the recommended variant's limit made exact by real trials
    static_compile: bool  # stage 5c: a compiled recommendation timed again compiled static (--no-static-compile)
    probe: ProbeSettings | None  # None: --no-probe
    target_batch_size: int | None
    compare_library: bool
    dry_run: bool
    parallel: str  # none, ddp, fsdp
    world_size: int | None  # a dry run's ranks (--world-size): the job it predicts one rank of
    cuda_capability: tuple[int, int] | None = None  # --cuda-capability: the GPU a dry run plans for
    cuda_context_bytes: int | None = None  # --cuda-context: its CUDA context, as NVML counts it
    eval_limits: bool = True  # the stage after the probe: the largest evaluation batches (--no-eval-limits)
    card: str | None = None  # --card: the GPU a dry run plans for, by name (autotune.timing.cards): it prices time

    @property
    def sharding_ranks(self) -> int | None:
        """The ranks FSDP2 shards the state over in a dry run (--world-size); None where no dry run says."""
        return self.world_size if self.parallel == Parallel.FSDP else None


@dataclasses.dataclass(frozen=True)
class Target:
    """What the options mean here: the device's backend, the workload and the budgets, in bytes, and how to search.

    The options end here: every later stage reads these resolved values, never a flag."""

    backend: Backend
    workload: Workload
    budget: Budget  # --budget (else the largest of --budgets, else the device's memory), --budgets, --headroom
    precisions: tuple[str, ...]
    isolation: str  # Isolation.PROCESS or Isolation.NONE
    venue: Venue  # where trials, probe candidates and plan checks run: this process, a worker, every rank
    data_profile: dict[str, Any] | None  # the item sizes and how batches were chosen (with data)
    notices: tuple[str, ...]
    trial_settings: TrialSettings  # with the host budget resolved here
    searching: Searching
    key: WorkloadKey
    job: "Job | None" = None  # --parallel: this rank's place in the job (rank 0: the leader)
    host_budget_bytes: int | None = None  # what offloaded activations may hold: --host-budget, else half the available
    host_budget_source: str = ""
    eval_data: EvalData | None = None  # --eval-data, loaded and checked; None: --data's batches, else example_batch

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def here(self) -> torch.device:
        """Where this process's tensors live: the device, or the CPU where CUDA is planned for without a GPU."""
        return self.backend.here


def resolve(options: Options, job: "Job | None" = None) -> Target:
    """Stage 1: the device, the workload (with the data's worst batch of every size), budgets and precisions."""
    device = resolve_device(options.device, planned=options.dry_run)
    backend = backend_for(job.device(device) if job else device, planned=options.dry_run,
                          capability=options.cuda_capability)
    chosen = stand_in(options.optimizer, planned_cuda=options.dry_run and backend.device.type == "cuda")
    workload = Workload.from_specs(options.model, model_kwargs=options.model_kwargs, data=options.data, loss=options.loss,
                                   optimizer=chosen.optimizer, optimizer_kwargs=options.optimizer_kwargs,
                                   step=options.step)
    if chosen.notice:  # a CUDA plan naming bitsandbytes' 8-bit AdamW without bitsandbytes: its layout, named as asked
        workload = dataclasses.replace(workload, optimizer=dataclasses.replace(
            workload.optimizer, name=f"{options.optimizer} (its layout: {workload.optimizer.name})"),
            notes=(*workload.notes, chosen.notice))
    if options.budget is None and backend.total_bytes() is None and options.dry_run:
        raise UsageError(f"--device {options.device} --dry-run on a machine without a GPU: say the card's memory with "
                         f"--budget (e.g. --budget 24GiB)")
    budget = options.memory if options.budget is not None else Budget(backend.total_bytes(), (), options.headroom)
    isolation = backend.default_isolation if options.isolation == Isolation.AUTO else options.isolation
    if job is not None or options.dry_run:
        isolation = Isolation.NONE  # each rank runs its part of a trial in its own process (options refuse PROCESS); a
        # dry run's trials hold no memory: nothing to isolate
    if options.dry_run and not predictable(backend.device):
        raise UsageError(f"--dry-run predicts for the CPU and CUDA, not {backend.device.type}: run it with --device cpu "
                         f"or --device cuda")
    venue = venue_for(isolation, backend.device, job, trials_per_worker=options.trials_per_worker)
    venue.admit(workload)  # one clear line now, not every trial crashed later
    eval_data = EvalData.load(options.eval_data)  # bad --eval-data ends the run now, before any trial
    if eval_data is not None:
        venue.admit(eval_workload(workload, eval_data))  # a worker can build it too
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
    precisions = _precisions(options.precisions, backend)
    for name in (p for p in precisions if p in TRUE):  # the numeric cost, said where it is searched
        notices.append(rounding_notice(name, torchao=importlib.util.find_spec("torchao") is not None))
        logger.warning(notices[-1])
    host_budget, host_source = _host_budget(options.host_budget, job.local_world_size if job is not None else 1)
    return Target(backend, workload, budget, precisions, isolation, venue, profile,
                  tuple(notices), dataclasses.replace(options.trial_settings, host_budget_bytes=host_budget),
                  _searching(options, backend.device), WorkloadKey.of(options), job, host_budget, host_source,
                  eval_data)


def _searching(options: Options, device: torch.device) -> Searching:
    if any(mode != EAGER for mode in options.compile):
        require_compiler(device)
    return Searching(
        options.batch_sizes, options.segments, options.offload, options.compile, options.strategy, options.n_trials,
        batch_multiple(options.batch_multiple, device), options.exact_limit, options.static_compile,
        options.probe_settings if options.probe else None, options.target_batch_size, options.compare_library,
        options.dry_run, options.parallel, options.world_size, options.cuda_capability, options.cuda_context,
        options.eval_limits, options.card)


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
    return workload.with_worst_batches({b: worst_indices(items, b) for b in batch_sizes}, items), {
        **items.to_dict(), "memory_batch": "the worst batch of each size", "timed_batches": "random draws from the whole dataset"}


def _precisions(asked: Sequence[str] | None, backend: Backend) -> tuple[str, ...]:
    """The precisions to search: those asked for (each must run here), else the device's defaults (autocast modes:
    FSDP2's ``bf16-fsdp`` is searched where asked for, and runs where bf16 does)."""
    if asked is None:
        return tuple(backend.default_precisions())
    supported = runs_where(backend.supported_precisions())
    unsupported = [p for p in asked if p not in supported]
    if unsupported:
        bf16 = backend.device.type == "cuda" and any(PRECISIONS[p].compute_dtype == "bfloat16" for p in unsupported)
        why = " (bf16 needs a GPU of compute capability 8.0 or later)" if bf16 else ""
        raise UsageError(f"{', '.join(unsupported)} is not supported on {backend.device}{why}: use --precisions "
                         f"{','.join(supported)}")
    return tuple(asked)


def describe(obj: Any) -> str | None:
    """A stable name for a spec or object: the same across runs (no memory addresses)."""
    if obj is None or isinstance(obj, str):
        return obj
    name = f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"
    return f"{name}[{len(obj)}]" if hasattr(obj, "__len__") and not callable(obj) else name
