"""What the trainer integrations share: the model's copies, the batch sizes that keep the global batch, the summary."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
from typing import Any, Iterator

import torch
from torch import nn

from autotune._log import logger
from autotune.errors import NothingFits, UsageError
from autotune.report import Report
from autotune.vocabulary import Isolation, Parallel

__all__ = ["ModelCopy", "divisors", "trainer_options", "on_host", "distributed_job", "recommendation_of", "Recommended",
           "say_changes",
           "trains_plan", "eval_batch_of"]


class ModelCopy:
    """A model factory for trials: an exact copy of ``model`` (its current weights, on the CPU) each time.

    Its name is the model's class and a fingerprint of its parameters' names, shapes and dtypes,
    so that another configuration of the same class is another study.
    """

    def __init__(self, model: nn.Module, prepare: Any = None) -> None:
        self.model, self.prepare = model, prepare
        shapes = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters())
        self.__qualname__ = f"{type(model).__name__}-{hashlib.sha1(shapes.encode()).hexdigest()[:8]}"
        self.__module__ = type(model).__module__

    def __call__(self) -> nn.Module:
        made = copy.deepcopy(self.model)
        if self.prepare is not None:
            self.prepare(made)
        return made


def divisors(n: int) -> list[int]:
    """The micro batch sizes that make a batch of exactly ``n`` with whole accumulation steps."""
    if n < 1:
        raise UsageError(f"the trainer's batch per rank is {n}: it must be at least 1")
    return [d for d in range(1, n + 1) if n % d == 0]


def trainer_options(per_rank: int, world: Any, parallel: str | None = None) -> dict[str, Any]:
    """tune()'s options for a trainer whose batch per rank (micro batch x accumulation) is ``per_rank``: that
    global batch kept, trials in this process (the trainer's objects are not rebuilt in a worker) or, in a job of
    ``world`` ranks, on every rank under the trainer's ``parallel`` wrapper (each rank passes its own trainer)."""
    world = max(1, int(world or 1))
    options = {"isolation": Isolation.NONE, "batch_sizes": ",".join(map(str, divisors(per_rank))),
               "target_batch_size": per_rank * world}
    if world > 1:
        if parallel is None:
            raise UsageError("tune_trainer under a distributed launch is not supported for this trainer yet: tune on "
                             "one process (a world size of 1), then launch the training")
        options["parallel"] = parallel
    return options


@contextlib.contextmanager
def on_host(model: nn.Module) -> Iterator[torch.device]:
    """The trainer's model on the CPU while trials have the device, then back where it was."""
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    model.to("cpu")
    try:
        yield device
    finally:
        model.to(device)


@contextlib.contextmanager
def distributed_job(options: dict[str, Any]) -> Iterator[None]:
    """Under ``parallel``: the job's groups autotune made (its control group) are destroyed when tuning ends, so
    the trainer's training, and the process's exit, meet only the groups they made themselves."""
    try:
        yield
    finally:
        if options.get("parallel", Parallel.NONE) != Parallel.NONE:
            from autotune.execution.job import leave

            leave()


@dataclasses.dataclass(frozen=True)
class Recommended:
    """What a trainer is set to: the recommended ``trial`` and its gradient ``accumulation_steps`` (1: none)."""

    trial: Any
    accumulation_steps: int = 1


def recommendation_of(report: Report) -> Recommended:
    """The recommended trial and its accumulation steps; :class:`NothingFits` (the trainer left as it was) if none."""
    best = report.recommendation
    if report.dry_run:
        raise UsageError("a dry run recommends nothing to write back (its figures are predicted: an estimate, not measured): tune the trainer "
                         "without dry_run; its report is the one that predicts (autotune.tune(..., dry_run=True))")
    if best is None:
        raise NothingFits(f"autotune: {report.shortfall().why()}; the trainer is unchanged", report)
    return Recommended(best, int((report.accumulation or {}).get("accumulation_steps") or 1))


def eval_batch_of(report: Report, best: Any) -> int | None:
    """The largest evaluation batch during training for the recommendation's precision and plan (the report's
    eval_limits), or None where the report has none or none fits: the trainer's own setting then stays."""
    row = report.eval_limit(best.precision, best.config.plan)
    return None if row is None else row["during_training_max_batch_size"]


def trains_plan(plan: Any, how: str) -> str:
    """How the trainer now trains the checkpoint plan ``plan``, as the end of a sentence: ``without checkpointing``,
    or ``with checkpoint plan 2 (segments 2, HOW)``, ``how`` saying what applied it."""
    if plan.off:
        return "without checkpointing"
    return f"with checkpoint plan {plan} ({plan.label}, {how})"


def say_changes(what: str, changes: list[tuple[str, Any, Any]], after: str = "") -> str:
    """One line of what the integration set on the trainer: ``name old -> new`` for each value that changed, then
    ``after``."""
    changed = [f"{name} {old!r} -> {new!r}" for name, old, new in changes if old != new]
    line = f"autotune: {what}: " + (", ".join(changed) if changed else "nothing changed (it already trains the recommendation)") + after
    logger.warning(line)
    return line
