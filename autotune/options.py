"""The options of one tuning run: one frozen object, built by the CLI and by ``autotune.tune`` alike.

Every flag of ``python -m autotune`` is a field here with the same meaning (``--trial-timeout``
is ``trial_timeout``): its default, help, choices and group are stated once, on the field
(:func:`option`), and the parser is built from them. Values are checked and parsed when the object is made, so bad input fails
with one line before anything is built; sizes become bytes, lists become tuples. No torch: the
device is resolved by the first stage of :func:`autotune.tuner.run`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from autotune.errors import UsageError
from autotune.vocabulary import (FSDP_ONLY, HEADROOM, PRECISIONS, TRUE, Isolation, Offload, Parallel, parse_compile,
                                 parse_offload, parse_plans)
from autotune.records import Budget, GuardRails, ProbeSettings, TrialSettings
from autotune.search.space import parse_batch_sizes, parse_precisions
from autotune.search.strategies import make_strategy
from autotune.timing.cards import card
from autotune.units import parse_size

__all__ = ["Options", "Flag", "option", "ISOLATION_MODES", "PARALLEL_MODES"]

ISOLATION_MODES = tuple(m.value for m in Isolation)
PARALLEL_MODES = tuple(m.value for m in Parallel)  # autotune.execution.ranks


@dataclasses.dataclass(frozen=True)
class Flag:
    """How an option is spelled on the command line (the flag, its help, its group); the default is the field's."""

    help: str
    group: str
    metavar: str | None = None
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    negate: str | None = None  # a bool option set off by this flag ("--no-probe"), else --NAME
    switch: bool = False  # a bool option (default False) set on by --NAME ("--dry-run")
    default_text: str | None = None  # how --help shows a None default ("auto: ...")
    required: bool = False

    def flag(self, name: str) -> str:
        return self.negate or "--" + name.replace("_", "-")


def option(default: Any, help: str, *, group: str, **flag: Any) -> Any:
    """A field of :class:`Options` with its default and its flag: the one place both are stated."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, group, **flag)})


WORKLOAD, SPACE, TRIALS, PROBE = "workload", "search space and budget", "search and trials", \
    "probe, training plan and guard rails"
_TRIAL, _PROBE = TrialSettings(), ProbeSettings()  # the settings' defaults are the flags' defaults


@dataclasses.dataclass(frozen=True)
class Options:
    """How to tune: what to train, within what budget, over which space, and how trials and the probe run.

    Each field is a flag of ``python -m autotune`` (:func:`autotune.cli.parser.build_parser` reads them).
    """

    model: str | type | Callable[..., Any] = option(
        None, "an nn.Module class or a factory returning one, e.g. autotune.examples:TinyGPT", group=WORKLOAD,
        metavar="MODULE:ATTR", required=True)
    model_kwargs: str | dict | None = option(
        None, "keyword arguments for the model, as a JSON object (or a dict)", group=WORKLOAD, metavar="JSON")
    data: Any = option(
        None, "a map-style Dataset (or a factory for one) of (input, target) tuples or dicts; limits then hold for its "
        "batches", group=WORKLOAD, metavar="MODULE:ATTR", default_text="the model's example_batch(batch_size) method")
    eval_data: Any = option(
        None, "a map-style Dataset (or a factory for one, or a DataLoader) of the evaluation batches: the evaluation "
        "limits (eval_limits) hold for its worst batch of each size", group=WORKLOAD, metavar="MODULE:ATTR",
        default_text="--data, else the model's example_batch")
    loss: str | Callable | None = option(
        None, "loss(output, target) for models whose output holds no loss", group=WORKLOAD, metavar="MODULE:ATTR",
        default_text="the output itself, its .loss or ['loss'], or the model's loss(output, target)")
    step: str | Callable | None = option(
        None, "step(model, batch) -> loss: your forward pass and loss, for losses computed outside the model "
        "(several outputs, auxiliary losses, a teacher); replaces the call and --loss rules", group=WORKLOAD,
        metavar="MODULE:ATTR", default_text="model(batch) and the loss rules above")
    optimizer: Any = option(
        None, "the optimizer trials train with: a class or a factory taking the parameters, e.g. torch.optim:SGD "
        "(its state is part of every step's memory)", group=WORKLOAD, metavar="MODULE:ATTR",
        default_text="torch.optim:AdamW")
    optimizer_kwargs: str | dict | None = option(
        None, "keyword arguments for the optimizer, as a JSON object (or a dict), e.g. '{\"momentum\": 0.9}'",
        group=WORKLOAD, metavar="JSON")
    device: Any = option(None, "cpu, cuda or cuda:N", group=SPACE, default_text="cuda if available, else cpu")
    budget: str | int | None = option(
        None, "memory budget such as 24GiB or 512MiB", group=SPACE, metavar="SIZE",
        default_text="the largest of --budgets, else the device's total memory")
    budgets: str | Sequence[str | int] | None = option(
        None, "more budgets, e.g. 8GiB,24GiB,80GiB: a recommendation for each from the same trials (trials run under "
        "the largest)", group=SPACE, metavar="SIZE,SIZE")
    headroom: float = option(HEADROOM, "share of the budget the recommendation leaves free", group=SPACE, type=float)
    precisions: str | Sequence[str] | None = option(
        None, "comma-separated fp32,fp16,bf16 (autocast); bf16-true: weights, gradients and optimizer state in bf16, "
        "no autocast; bf16-fsdp under --parallel fsdp: FSDP2's MixedPrecisionPolicy, bf16 parameters gathered and "
        "computed with, fp32 gradient reduction", group=SPACE,
        default_text="auto: the modes the device runs well (autocast)")
    segments: str | Sequence[Any] | None = option(
        "auto", "checkpoint plans, e.g. 0,2,every2,all,sac-linear: 0 is off, N recomputes the blocks of the first N-1 "
        "of N segments, everyN every N-th block, all every block, sac-* per operation; auto: a spread from 0 to all",
        group=SPACE, metavar="PLANS")
    offload: str | Sequence[str] | None = option(
        "auto", "none,activations: also search every plan with what it keeps for the backward pass held in host "
        "memory (PLAN+offload); state (under --parallel fsdp): with the training state in host memory, FSDP2's "
        "CPUOffloadPolicy (PLAN+state); activations+state: both; auto: activations where the device's memory is not "
        "the host's (CUDA), none on the CPU",
        group=SPACE, metavar="MODES")
    compile: str | Sequence[str] = option(
        "none", "none,default: also search every configuration trained under torch.compile (a mode: default, "
        "reduce-overhead, max-autotune, max-autotune-no-cudagraphs; MODE+static compiles for each batch size alone, "
        "dynamic=False); none: eager only", group=SPACE, metavar="MODES")
    static_compile: bool = option(
        True, "skip timing a compiled recommendation again compiled static at its batch size (torch.compile(model, "
        "dynamic=False), the graph plain torch.compile builds for a fixed batch size), beside the search's dynamic "
        "one; the faster that fits is recommended", group=SPACE, negate="--no-static-compile")
    host_budget: str | int | None = option(
        None, "host memory offloaded activations and state may hold, such as 64GiB; a trial past it is the host's out-of-memory",
        group=SPACE, metavar="SIZE", default_text="half the host memory available when the search starts")
    batch_sizes: str | Sequence[int] = option(
        "1..512", "a range A..B (the powers of two in it) or a list such as 8,16,24", group=SPACE)
    strategy: str = option(
        "auto", "auto: fit each plan's memory line, bracket its largest batch, climb throughput; grid: every point of "
        "the space; optuna: NSGA-II within --n-trials", group=TRIALS)
    n_trials: int | None = option(None, "trial budget of --strategy optuna", group=TRIALS, metavar="N", type=int,
                                  default_text="a quarter of the space")
    warmup_steps: int = option(
        _TRIAL.warmup_steps, "untimed steps per trial on CUDA (on the CPU one metered step, the optimizer's state "
        "primed before it, whatever this says)", group=TRIALS, type=int)
    measure_steps: int = option(
        _TRIAL.measure_steps, "at most this many timed steps per trial (fewer once they settle); the median is "
        "reported with the spread", group=TRIALS, type=int)
    settle_steps: int = option(
        _TRIAL.settle_steps, "timing stops early once the last N steps lie within 2%% of their median; 0 times all "
        "--measure-steps steps", group=TRIALS, metavar="N", type=int)
    trial_timeout: float | None = option(
        _TRIAL.timeout_s, "stop a trial running longer than this (status timeout)", group=TRIALS, metavar="SECONDS",
        type=float)
    isolation: str = option(
        "auto", "process: trials in a worker process (a crash or a sticky CUDA error stays there), kept warm from trial "
        "to trial while it stays clean; none: in this process; auto: process on CUDA, none on CPU", group=TRIALS, choices=ISOLATION_MODES)
    trials_per_worker: int | None = option(
        None, "with --isolation process: the trials one worker process serves before a new one starts (1: a fresh "
        "worker per trial); a worker is replaced anyway after a crash, a time-out, or when it holds more device memory "
        "than before its first trial", group=TRIALS, metavar="N", type=int, default_text="as many as stay clean")
    parallel: str = option(
        "none", "under torchrun: ddp or fsdp runs every trial on every rank under DistributedDataParallel or FSDP2 "
        "(fully_shard on each repeated block), batch sizes per rank; none: the ranks are independent workers sharing "
        "the study", group=TRIALS, choices=PARALLEL_MODES)
    storage: str | None = option(None, "Optuna storage URL for the trial store", group=TRIALS, metavar="URL",
                                 default_text="sqlite:///results/<study>.db")
    study: str | None = option(None, "study name", group=TRIALS, default_text="derived from the model and device")
    results_dir: str = "results"  # where the default storage lives (Python only: the CLI's --out says where the JSON goes)
    dry_run: bool = option(
        False, "predict instead of measuring: every configuration's trial runs under PyTorch's fake tensors (shapes, "
        "no memory, no arithmetic), counted by the tensor meter with the budget's rules; seconds for a model of any "
        "size, no step times, no recommendation; each variant's limit found exactly (--batch-multiple); with --device "
        "cuda, CUDA's autocast lists and caching allocator, also on a machine without a GPU (say the card's --budget)",
        group=TRIALS, switch=True)
    world_size: int | None = option(
        None, "with --dry-run and --parallel ddp|fsdp (no torchrun): predict one rank of a job of N ranks in this "
        "process, on PyTorch's fake process group", group=TRIALS, metavar="N", type=int,
        default_text="none: --parallel runs under torchrun")
    batch_multiple: int | None = option(
        None, "exact limits are found in steps of N: the largest multiple of N that fits, and the next one (a dry run "
        "bisects up to the top of --batch-sizes)", group=TRIALS, metavar="N", type=int,
        default_text="1 on the CPU, 8 on CUDA")
    cuda_capability: str | tuple[int, int] | None = option(
        None, "with --device cuda --dry-run: the compute capability of the GPU planned for, e.g. 7.0 (V100), 8.0 "
        "(A100), 8.9 (L4, RTX 4090), 9.0 (H100): its cuBLAS workspaces, whether it has bf16, which attention kernels "
        "it runs; planned on the CPU with CUDA's rules, also where this machine has a GPU", group=TRIALS,
        metavar="MAJOR.MINOR", default_text="this machine's GPU, else 9.0 (assumed)")
    cuda_context: str | int | None = option(
        None, "with --device cuda --dry-run: the CUDA context of the GPU planned for, which NVML counts beside the "
        "caching allocator's reserved bytes (measure it on the card: NVML's used memory after torch.ones(1, "
        "device='cuda'))", group=TRIALS, metavar="SIZE", default_text="512MiB (assumed)")
    card: str | None = option(
        None, "with --device cuda --dry-run: the GPU planned for, by name (h100-sxm, h100-pcie, h200, a100-40gb, "
        "a100-80gb, l4, l40s, a10g, rtx3090, rtx4090, v100, mi300x): its compute capability (--cuda-capability), its "
        "memory (the default --budget) and its data sheet's peaks, which price every configuration's step time",
        group=TRIALS, metavar="NAME", default_text="none: no step time predicted for CUDA")
    exact_limit: bool = option(
        False, "after the search, make the recommended variant's limit exact with real trials (bisecting between the "
        "space's sizes in steps of --batch-multiple) and time the largest size within the headroom, also where the "
        "search's predictions made every limit exact already (on the CPU; two trials then confirm the recommended "
        "one's without it); these trials are the report's, not the study's: workers sharing a study each run them, a "
        "resumed search runs them again",
        group=TRIALS, switch=True)
    eval_limits: bool = option(
        True, "skip finding the largest evaluation batch per precision and plan (while training, the training state "
        "resident, and for inference alone: a forward pass and the loss under torch.no_grad())", group=TRIALS,
        negate="--no-eval-limits")
    probe: bool = option(True, "skip the probe (the top candidates training an epoch over a slice of --data)",
                         group=PROBE, negate="--no-probe")
    probe_top: int = option(_PROBE.top, "Pareto candidates to probe, fastest first", group=PROBE, type=int)
    probe_epochs: int = option(_PROBE.epochs, "epochs each candidate trains in the probe", group=PROBE, type=int)
    probe_fraction: float = option(_PROBE.fraction, "share of --data (drawn at random) the probe trains on",
                                   group=PROBE, type=float)
    num_workers: int = option(_PROBE.num_workers, "DataLoader worker processes in the probe", group=PROBE, type=int)
    target_batch_size: int | None = option(
        None, "batch size to train with: adds gradient-accumulation steps so micro x steps >= N", group=PROBE,
        metavar="N", type=int)
    clip_grad_norm: float | None = option(
        _TRIAL.guard.clip_grad_norm, "clip the global gradient norm (after unscaling fp16) in trials, probe and apply",
        group=PROBE, metavar="NORM", type=float)
    fp32_modules: str | Sequence[str] = option(
        _TRIAL.guard.fp32_modules, "module class names kept outside autocast, e.g. LayerNorm,Softmax", group=PROBE,
        metavar="NAME,NAME")
    compare_library: bool = option(
        True, "skip measuring the model library's own per-layer checkpointing (Hugging Face, timm) beside autotune's "
        "plan", group=PROBE, negate="--no-library-compare")

    def __post_init__(self) -> None:
        if self.model is None:
            raise UsageError("no model: pass --model MODULE:ATTR (or autotune.tune(model))")
        self._check_numbers()
        make_strategy(self.strategy, n_trials=self.n_trials)  # an unknown name or a misplaced --n-trials fails here
        if self.isolation not in ISOLATION_MODES:
            raise UsageError(f"unknown --isolation {self.isolation!r}: choose {_one_of(ISOLATION_MODES)}")
        if self.parallel not in PARALLEL_MODES:
            raise UsageError(f"unknown --parallel {self.parallel!r}: choose {_one_of(PARALLEL_MODES)}")
        if self.parallel != Parallel.NONE and self.isolation == Isolation.PROCESS:
            raise UsageError(f"--parallel {self.parallel} runs each trial in every rank's own process (a worker per "
                             f"trial would have to join the job's process group): leave --isolation at auto or none")
        modules = self.fp32_modules
        if isinstance(modules, str):
            modules = [name.strip() for name in modules.split(",") if name.strip()]
        budgets = _budgets(self.budgets)
        planned = self._check_card()
        budget = parse_size(self.budget) if self.budget is not None else (
            max(budgets) if budgets else (planned.memory_bytes if planned is not None else None))
        for name, value in (("fp32_modules", tuple(modules)), ("budget", budget),
                            ("budgets", tuple(b for b in budgets if b != budget)),
                            ("batch_sizes", _as_tuple(self.batch_sizes, parse_batch_sizes)),
                            ("precisions", _as_tuple(self.precisions, parse_precisions)),
                            ("segments", _segments(self.segments)), ("offload", parse_offload(self.offload)),
                            ("compile", parse_compile(self.compile)),
                            # None: the default, half the host memory available when the search starts (Target)
                            ("host_budget", None if self.host_budget is None else parse_size(self.host_budget))):
            object.__setattr__(self, name, value)
        _check_state_offload(self)
        self._check_planned_gpu()
        _check_fsdp_precision(self)
        _check_true_precision(self)
        if self.dry_run and any(mode != "none" for mode in self.compile):
            raise UsageError("--dry-run predicts eager training under fake tensors; what inductor's kernels hold is "
                             "known only by running them: drop --compile from the dry run, or search without --dry-run")

    def _check_numbers(self) -> None:
        for flag, value in (("--headroom", self.headroom), ("--trial-timeout", self.trial_timeout),
                            ("--probe-fraction", self.probe_fraction), ("--clip-grad-norm", self.clip_grad_norm)):
            if value is not None and not math.isfinite(value):
                raise UsageError(f"{flag} {value} must be a finite number")
        if not 0.0 <= self.headroom < 1.0:
            raise UsageError(f"--headroom {self.headroom} must be at least 0 and below 1, e.g. 0.1 for 10%")
        if self.warmup_steps < 0 or self.measure_steps < 1 or self.settle_steps < 0:
            raise UsageError("--warmup-steps and --settle-steps must be 0 or more and --measure-steps 1 or more")
        if self.trial_timeout is not None and self.trial_timeout <= 0:
            raise UsageError(f"--trial-timeout {self.trial_timeout} must be a positive number of seconds")
        if self.probe_top < 1 or self.probe_epochs < 1 or not 0.0 < self.probe_fraction <= 1.0 or self.num_workers < 0:
            raise UsageError("--probe-top and --probe-epochs must be at least 1, --probe-fraction in (0, 1], "
                             "--num-workers 0 or more")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise UsageError(f"--clip-grad-norm {self.clip_grad_norm} must be positive")
        if self.trials_per_worker is not None and self.trials_per_worker < 1:
            raise UsageError(f"--trials-per-worker {self.trials_per_worker} must be at least 1 (1: a fresh worker per trial)")
        if self.batch_multiple is not None and self.batch_multiple < 1:
            raise UsageError(f"--batch-multiple {self.batch_multiple} must be at least 1 (limits are found in steps of it)")
        self._check_world_size()
        if self.target_batch_size is not None and self.target_batch_size < 1:
            raise UsageError(f"--target-batch-size {self.target_batch_size} must be at least 1")

    def _check_world_size(self) -> None:
        """``--world-size N`` predicts one rank of a ``--parallel`` job (``--dry-run``); a dry run of ``--parallel``
        needs it (no torchrun: the ranks are predicted, not started)."""
        n = self.world_size
        if n is not None and n < 1:
            raise UsageError(f"--world-size {n} must be at least 1: the number of ranks of the job to predict")
        if n is not None and self.parallel == Parallel.NONE:
            raise UsageError(f"--world-size {n} predicts one rank of a distributed job: add --parallel fsdp (or ddp) "
                             f"and --dry-run")
        if n is not None and not self.dry_run:
            raise UsageError(f"--world-size {n} is for --dry-run: a job that trains has torchrun's world size "
                             f"(torchrun --nproc-per-node {n} ... --parallel {self.parallel})")
        if self.dry_run and self.parallel != Parallel.NONE and n is None:
            raise UsageError(f"--dry-run --parallel {self.parallel} predicts one rank of a job: say how many ranks "
                             f"with --world-size N (and run it without torchrun)")

    def _check_card(self) -> Any:
        """``--card NAME``: the card of :mod:`autotune.timing.cards` a ``--device cuda --dry-run`` plans for (its
        capability, unless ``--cuda-capability`` says another); None without it."""
        if self.card is None:
            return None
        if not (self.dry_run and str(self.device or "").startswith("cuda")):
            raise UsageError(f"--card {self.card} names the GPU a plan is made for: use it with --device cuda --dry-run")
        planned = card(self.card)
        object.__setattr__(self, "card", planned.name)
        if self.cuda_capability is None and planned.capability is not None:
            object.__setattr__(self, "cuda_capability", planned.capability)
        return planned

    def _check_planned_gpu(self) -> None:
        """``--cuda-capability`` and ``--cuda-context`` describe a GPU a ``--device cuda --dry-run`` plans for."""
        given = [f for f, v in (("--cuda-capability", self.cuda_capability), ("--cuda-context", self.cuda_context))
                 if v is not None]
        if given and not (self.dry_run and str(self.device or "").startswith("cuda")):
            raise UsageError(f"{given[0]} describes the GPU a plan is made for: use it with --device cuda --dry-run")
        if self.cuda_capability is not None:
            object.__setattr__(self, "cuda_capability", parse_capability(self.cuda_capability))
        if self.cuda_context is not None:
            object.__setattr__(self, "cuda_context", parse_size(self.cuda_context))

    @property
    def guard(self) -> GuardRails:
        return GuardRails(clip_grad_norm=self.clip_grad_norm, fp32_modules=self.fp32_modules)

    @property
    def memory(self) -> Budget:
        """The budgets as one value (no limit without --budget or --budgets)."""
        return Budget(self.budget, self.budgets, self.headroom)

    @property
    def trial_settings(self) -> TrialSettings:
        return TrialSettings(warmup_steps=self.warmup_steps, measure_steps=self.measure_steps,
                             settle_steps=self.settle_steps, timeout_s=self.trial_timeout, guard=self.guard,
                             host_budget_bytes=self.host_budget,  # the search's: Target.trial_settings
                             target_batch_size=self.target_batch_size)

    @property
    def probe_settings(self) -> ProbeSettings:
        return ProbeSettings(top=self.probe_top, epochs=self.probe_epochs, fraction=self.probe_fraction,
                             num_workers=self.num_workers, seed=0, timeout_s=self.trial_timeout,
                             target_batch_size=self.target_batch_size)



def parse_capability(value: str | Sequence[int]) -> tuple[int, int]:
    """``"8.0"`` (or ``(8, 0)``) as ``(8, 0)``: a CUDA compute capability, from 3.0 (Kepler) to 12.x (Blackwell)."""
    text = value if isinstance(value, str) else ".".join(map(str, value))
    major, dot, minor = text.strip().partition(".")
    if not (dot and major.isdigit() and minor.isdigit() and 3 <= int(major) <= 12):
        raise UsageError(f"--cuda-capability {text!r} is not a compute capability: write MAJOR.MINOR, e.g. 8.0 for an "
                         f"A100 or 7.0 for a V100")
    return int(major), int(minor)


def _one_of(names: Sequence[str]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}"


def _as_tuple(value: str | Sequence | None, parse: Callable[[str], tuple | None]) -> tuple | None:
    if value is None:
        return None
    if isinstance(value, str):
        return parse(value)
    return tuple(value)


def _segments(value: str | Sequence | None) -> tuple[str, ...] | None:
    """``--segments`` as plan names, or None for ``auto`` (resolved against the model's blocks)."""
    if value is None or (isinstance(value, str) and value.strip() == "auto"):
        return None
    return parse_plans(value if isinstance(value, str) else ",".join(map(str, value)))


def _check_state_offload(options: "Options") -> None:
    """The state in host memory (``--offload state``, a plan ``+state``) is FSDP2's ``CPUOffloadPolicy``: it needs
    ``--parallel fsdp``."""
    asked = [m for m in options.offload or () if Offload.STATE in m] + [p for p in options.segments or () if p.state]
    if asked and options.parallel != Parallel.FSDP:
        raise UsageError(f"--offload state (and plans +state) keep the training state in host memory with FSDP2's "
                         f"CPUOffloadPolicy: run under torchrun with --parallel fsdp (one rank is enough: torchrun "
                         f"--nproc-per-node 1), not --parallel {options.parallel}")


def _check_fsdp_precision(options: "Options") -> None:
    """``bf16-fsdp`` is FSDP2's ``MixedPrecisionPolicy``: it needs ``--parallel fsdp``, and it has no autocast for
    ``--fp32-modules`` to step out of."""
    asked = [p for p in options.precisions or () if p in FSDP_ONLY]
    if not asked:
        return
    policy = PRECISIONS[asked[0]].policy
    if options.parallel != Parallel.FSDP:
        raise UsageError(f"--precisions {asked[0]} is FSDP2's {policy}: it trains under --parallel fsdp (torchrun "
                         f"--nproc-per-node N ... --parallel fsdp, or --dry-run --parallel fsdp --world-size N), not "
                         f"--parallel {options.parallel}; search bf16 (autocast) without it")
    if options.fp32_modules:
        raise UsageError(f"--fp32-modules keeps modules outside autocast, and {asked[0]} does not autocast (FSDP2 "
                         f"gathers every parameter in {PRECISIONS[asked[0]].param_dtype}): search bf16 for "
                         f"--fp32-modules {','.join(options.fp32_modules)}, or drop it")


def _check_true_precision(options: "Options") -> None:
    """``bf16-true`` holds every floating parameter in bf16 and does not autocast: ``--fp32-modules`` has neither an
    autocast region to step out of nor fp32 weights to run on."""
    asked = [p for p in options.precisions or () if p in TRUE]
    if asked and options.fp32_modules:
        raise UsageError(f"--fp32-modules keeps modules outside autocast on fp32 weights, and {asked[0]} holds every "
                         f"weight in {PRECISIONS[asked[0]].weight_dtype} without autocast: search bf16 for "
                         f"--fp32-modules {','.join(options.fp32_modules)}, or drop it")


def _budgets(value: str | Sequence[str | int] | None) -> tuple[int, ...]:
    """Parse ``--budgets 8GiB,24GiB,80GiB`` (or a list of sizes) into sorted bytes without repeats."""
    if value is None:
        return ()
    parts = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else list(value)
    if not parts and isinstance(value, str):
        raise UsageError(f"--budgets {value!r} is empty: write sizes such as 8GiB,24GiB")
    return tuple(sorted({parse_size(p) for p in parts}))
