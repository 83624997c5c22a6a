"""The options of one tuning run: one frozen object, built by the CLI and by ``autotune.tune`` alike.

Every flag of ``python -m autotune`` is a field here with the same meaning (``--trial-timeout``
is ``trial_timeout``). Values are checked and parsed when the object is made, so bad input fails
with one line before anything is built; sizes become bytes, lists become tuples. No torch: the
device is resolved by the first stage of :func:`autotune.tuner.run`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from autotune.errors import UsageError
from autotune.plans import parse_plans
from autotune.records import GuardRails, ProbeSettings, TrialSettings
from autotune.search.space import parse_batch_sizes, parse_precisions
from autotune.search.strategies import make_strategy
from autotune.units import parse_size

__all__ = ["Options", "ISOLATION_MODES", "PARALLEL_MODES"]

ISOLATION_MODES = ("auto", "process", "none")
PARALLEL_MODES = ("none", "ddp", "fsdp")  # autotune.execution.ranks


@dataclasses.dataclass(frozen=True)
class Options:
    """How to tune: what to train, within what budget, over which space, and how trials and the probe run."""

    model: str | type | Callable[..., Any]  # "MODULE:ATTR", or the class or factory itself
    model_kwargs: str | dict | None = None  # keyword arguments for the model ("d_model=256,n_layers=4" or a dict)
    data: Any = None  # "MODULE:ATTR", a Dataset or a factory of one: limits then hold for its batches
    loss: str | Callable | None = None  # "MODULE:ATTR" or loss(model, batch); default: the model's own
    device: Any = None  # "cpu", "cuda", "cuda:1", a torch.device; default: CUDA when available
    budget: str | int | None = None  # bytes or a size ("24GiB"); default: the largest of budgets, else the device
    headroom: float = 0.1  # the share of the budget a recommendation leaves free
    precisions: str | Sequence[str] | None = None  # "fp32,bf16"; None or "auto": what the device runs well
    segments: str | Sequence[Any] | None = "auto"  # checkpoint plans ("0,2,all,every2"); "auto": a spread
    batch_sizes: str | Sequence[int] = "1..512"  # a range of powers of two, or a list
    strategy: str = "auto"  # auto (bracket each limit with the memory model), grid, optuna
    n_trials: int | None = None  # the optuna strategy's trial budget (default: a quarter of the space)
    budgets: str | Sequence[str | int] | None = None  # more budgets to recommend for, from the same trials
    warmup_steps: int = 2  # untimed steps per trial
    measure_steps: int = 5  # at most this many timed steps per trial (fewer once they settle); the median is kept
    settle_steps: int = 3  # timing stops once this many last steps lie within 2% of their median (0: never early)
    trial_timeout: float | None = 300.0  # seconds before a trial is cut (status timeout)
    storage: str | None = None  # an Optuna storage URL; default: results/<study>.db
    study: str | None = None  # the study's name; default: MODEL[-hash of options]-DEVICE
    results_dir: str = "results"  # where the default storage lives
    isolation: str = "auto"  # process (each trial in a fresh worker), none, auto (process on CUDA)
    probe: bool = True  # with data: train the best candidates an epoch over a slice of it
    probe_top: int = 3  # candidates probed, fastest first
    probe_epochs: int = 1
    probe_fraction: float = 0.1  # the share of the data the probe trains on
    num_workers: int = 0  # the probe's DataLoader workers
    target_batch_size: int | None = None  # adds a gradient-accumulation plan reaching this batch
    clip_grad_norm: float | None = None  # guard rail: clip the global gradient norm (after unscaling fp16)
    fp32_modules: str | Sequence[str] = ()  # guard rail: module class names kept outside autocast
    compare_library: bool = True  # measure the library's own checkpointing switch beside autotune's plan
    parallel: str = "none"  # ddp or fsdp: every trial on every torchrun rank under that wrapper; none: independent

    def __post_init__(self) -> None:
        self._check_numbers()
        make_strategy(self.strategy, n_trials=self.n_trials)  # an unknown name or a misplaced --n-trials fails here
        if self.isolation not in ISOLATION_MODES:
            raise UsageError(f"unknown --isolation {self.isolation!r}: choose auto, process or none")
        if self.parallel not in PARALLEL_MODES:
            raise UsageError(f"unknown --parallel {self.parallel!r}: choose none, ddp or fsdp")
        if self.parallel != "none" and self.isolation == "process":
            raise UsageError(f"--parallel {self.parallel} runs each trial in every rank's own process (a worker per "
                             f"trial would have to join the job's process group): leave --isolation at auto or none")
        modules = self.fp32_modules
        if isinstance(modules, str):
            modules = [name.strip() for name in modules.split(",") if name.strip()]
        budgets = _budgets(self.budgets)
        budget = parse_size(self.budget) if self.budget is not None else (max(budgets) if budgets else None)
        for name, value in (("fp32_modules", tuple(modules)), ("budget", budget),
                            ("budgets", tuple(b for b in budgets if b != budget)),
                            ("batch_sizes", _as_tuple(self.batch_sizes, parse_batch_sizes)),
                            ("precisions", _as_tuple(self.precisions, parse_precisions)),
                            ("segments", _segments(self.segments))):
            object.__setattr__(self, name, value)

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
        if self.target_batch_size is not None and self.target_batch_size < 1:
            raise UsageError(f"--target-batch-size {self.target_batch_size} must be at least 1")

    @property
    def guard(self) -> GuardRails:
        return GuardRails(clip_grad_norm=self.clip_grad_norm, fp32_modules=self.fp32_modules)

    @property
    def trial_settings(self) -> TrialSettings:
        return TrialSettings(warmup_steps=self.warmup_steps, measure_steps=self.measure_steps,
                             settle_steps=self.settle_steps, timeout_s=self.trial_timeout, guard=self.guard)

    @property
    def probe_settings(self) -> ProbeSettings:
        return ProbeSettings(top=self.probe_top, epochs=self.probe_epochs, fraction=self.probe_fraction,
                             num_workers=self.num_workers, seed=0, timeout_s=self.trial_timeout)

    @property
    def all_budgets(self) -> tuple[int, ...]:
        """The budget and the extra budgets; trials run under the largest, the others are judged by their peaks."""
        return () if self.budget is None else (self.budget, *self.budgets)


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


def _budgets(value: str | Sequence[str | int] | None) -> tuple[int, ...]:
    """Parse ``--budgets 8GiB,24GiB,80GiB`` (or a list of sizes) into sorted bytes without repeats."""
    if value is None:
        return ()
    parts = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else list(value)
    if not parts and isinstance(value, str):
        raise UsageError(f"--budgets {value!r} is empty: write sizes such as 8GiB,24GiB")
    return tuple(sorted({parse_size(p) for p in parts}))
