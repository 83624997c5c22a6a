"""Tune a Lightning ``Trainer`` and ``LightningModule`` as they are, and write the answer where Lightning reads it.

    report = tune_trainer(trainer, model, datamodule=dm, budget="24GiB")   # options as autotune.tune takes them
    trainer.fit(model, datamodule=dm)                                     # trains the recommendation

What the trials train is what ``trainer.fit`` would: the module as it is now (each trial starts from
an exact copy), its ``training_step`` as the step (an auxiliary loss included), the first optimizer
of its ``configure_optimizers()`` (which may read ``self.trainer``: :class:`_FitView`; the schedulers
it returns are accepted and not stepped: :class:`_FirstOptimizer`), the training dataloader of the
datamodule (or of the module) with its collate function, and the trainer's gradient clipping (by norm).
The report names the optimizer that ``configure_optimizers()`` built (its class and settings).

The global batch stays the user's: the dataloader's batch size x ``accumulate_grad_batches`` x
the world size; the micro batches tried divide it. The recommendation is written back where
Lightning's own batch-size finder writes it (``model.batch_size``, ``model.hparams.batch_size``,
``datamodule.batch_size``, ``datamodule.hparams.batch_size``), ``trainer.accumulate_grad_batches``,
and the checkpoint plan (:func:`autotune.apply` on the module, in place). The evaluation batch (the report's
``eval_limits``, sized on the validation dataloader's worst batch, its ``training_step`` run under ``no_grad``) is
written to a ``val_batch_size`` or ``eval_batch_size`` attribute or hparam of the module or datamodule, where one
is; else the line says what to build ``val_dataloader`` with. A trainer's precision
plugin is made with the trainer: when the recommendation's precision is another, one line says so
and ``autotune.export.lightning_trainer_kwargs(report)`` gives the keyword arguments of a trainer that trains it.
When nothing fits, :class:`~autotune.errors.NothingFits` is raised and nothing is changed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from autotune.errors import UsageError
from autotune.export import LIGHTNING_PRECISION
from autotune.integrations.common import (ModelCopy, eval_batch_of, on_host, recommendation_of, say_changes,
                                          trainer_options, trains_plan)
from autotune.report import Report

__all__ = ["tune_trainer"]


def tune_trainer(trainer: Any, model: Any, datamodule: Any = None, **options: Any) -> Report:
    """Tune ``model`` as ``trainer`` would fit it; set the batch size, accumulation and plan; return the report.

    ``options`` are :func:`autotune.tune`'s (``budget`` defaults to the device's memory). Trials run
    in this process (``isolation="none"``).
    """
    from autotune.tuner import tune

    loader = _train_loader(model, datamodule)
    holders = _batch_size_holders(model, datamodule)
    defaults = trainer_options(loader.batch_size * trainer.accumulate_grad_batches, getattr(trainer, "world_size", 1))
    if getattr(trainer, "gradient_clip_val", None) and getattr(trainer, "gradient_clip_algorithm", "norm") == "norm":
        defaults["clip_grad_norm"] = float(trainer.gradient_clip_val)
    if not isinstance(getattr(trainer, "accelerator", None), _cuda_accelerator()):
        defaults["device"] = "cpu"  # a CPU trainer's module is tuned where it trains
    # the module's configure_optimizers(), unless tune_trainer(..., optimizer=...) names another
    defaults["optimizer"] = _FirstOptimizer(type(model), _FitView.of(trainer, loader, datamodule))
    validation = _val_loader(model, datamodule)
    if validation is not None:  # the evaluation batch is sized on the validation data's worst batch
        defaults["eval_data"] = torch.utils.data.DataLoader(validation.dataset, batch_size=1,
                                                            collate_fn=validation.collate_fn)
    with on_host(model):
        report = tune(ModelCopy(model), data=torch.utils.data.DataLoader(loader.dataset, batch_size=1,
                                                                          collate_fn=loader.collate_fn),
                      step=_TrainingStep(type(model)), **{**defaults, **options})
    said = _write_back(trainer, model, holders, report, datamodule)
    return dataclasses.replace(report, notices=(*report.notices, said))


def _cuda_accelerator() -> type:
    from lightning.pytorch.accelerators import CUDAAccelerator

    return CUDAAccelerator


def _train_loader(model: Any, datamodule: Any) -> torch.utils.data.DataLoader:
    """The training dataloader, from the datamodule (set up for fitting) or the module."""
    source = datamodule if datamodule is not None else model
    if datamodule is not None and hasattr(datamodule, "setup"):
        datamodule.setup("fit")
    make = getattr(source, "train_dataloader", None)
    try:
        loader = make() if callable(make) else None
    except NotImplementedError:
        loader = None
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise UsageError(f"{type(source).__name__}.train_dataloader() gave {type(loader).__name__}: autotune needs one "
                         f"DataLoader of a map-style dataset (pass datamodule=... or define train_dataloader)")
    if loader.batch_size is None:
        raise UsageError("the training DataLoader has a batch_sampler and no batch_size: autotune sets the batch size, "
                         "as Lightning's batch-size finder does, so give the loader batch_size=...")
    if isinstance(loader.dataset, torch.utils.data.IterableDataset) or not hasattr(loader.dataset, "__len__"):
        raise UsageError(f"the training data is a {type(loader.dataset).__name__} without a length: autotune needs a "
                         f"map-style dataset (with __getitem__ and __len__) to find its worst batch")
    return loader


def _val_loader(model: Any, datamodule: Any) -> torch.utils.data.DataLoader | None:
    """The validation DataLoader of the datamodule (or the module), where one defines it as one loader of a map-style
    dataset (Lightning's own ``val_dataloader`` raises: none is defined)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    source = next((s for s in (datamodule, model) if s is not None and is_overridden("val_dataloader", s)), None)
    if source is None:
        return None
    loader = source.val_dataloader()
    dataset = getattr(loader, "dataset", None)
    if not isinstance(loader, torch.utils.data.DataLoader) or isinstance(dataset, torch.utils.data.IterableDataset) \
            or not hasattr(dataset, "__len__"):
        return None
    return loader


EVAL_NAMES = ("val_batch_size", "eval_batch_size")  # where a module or datamodule may keep its validation batch


def _write_eval_batch(model: Any, datamodule: Any, report: Report, best: Any) -> tuple[list[tuple[str, Any, Any]], str]:
    """The evaluation batch written where the module or datamodule keeps one (an attribute or hparam named in
    ``EVAL_NAMES``): the changes, and what to do where none keeps one (the end of a sentence)."""
    size = eval_batch_of(report, best)
    if size is None:
        return [], ""
    changes: list[tuple[str, Any, Any]] = []
    for owner in (model, datamodule):
        for holder in (owner, getattr(owner, "hparams", None)):
            for name in EVAL_NAMES:
                mapping = isinstance(holder, Mapping)
                if holder is None or name not in (holder if mapping else vars(holder)):
                    continue
                old = holder[name] if mapping else getattr(holder, name)
                if mapping:
                    holder[name] = size
                else:
                    setattr(holder, name, size)
                changes.append((f"{'hparams.' if holder is not owner else ''}{name}", old, size))
    if changes:
        return changes, ""
    return [], (f"; the largest evaluation batch during training is {size}: no {' or '.join(EVAL_NAMES)} keeps it, so "
                f"build val_dataloader with batch_size={size}")


def _batch_size_holders(model: Any, datamodule: Any) -> list[Any]:
    """Where the batch size lives, as Lightning's batch-size finder looks for it (checked before any trial)."""
    holders: list[Any] = []
    for owner in (model, datamodule):
        if owner is None:
            continue
        if "batch_size" in vars(owner) or isinstance(getattr(type(owner), "batch_size", None), property):
            holders.append(owner)
        hparams = getattr(owner, "hparams", None)
        if hparams is not None and "batch_size" in hparams:
            holders.append(hparams)
    if not holders:
        raise UsageError(f"{type(model).__name__} (and its datamodule) keep no batch_size attribute or hparam: autotune "
                         f"writes the batch size where Lightning's batch-size finder does, so store it as "
                         f"self.batch_size or in self.hparams and build the train_dataloader from it")
    return holders


class _TrainingStep:
    """``--step``: the module's own ``training_step(batch, batch_idx)``; its loss (a tensor, or ``["loss"]``)."""

    def __init__(self, cls: type) -> None:
        self.__qualname__ = f"{cls.__qualname__}.training_step"
        self.__module__ = cls.__module__

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        out = model.training_step(batch, 0)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise UsageError(f"{type(model).__name__}.training_step returned {type(out).__name__}: return the scalar "
                             f"loss, or a dict with it under 'loss' (autotune trains on it)")
        return loss


class _FitView:
    """``self.trainer`` for the trial's copy while its ``configure_optimizers()`` runs: the user's Trainer as
    ``trainer.fit`` shows it to that hook, so that code which sizes a schedule from it (``estimated_stepping_batches``
    for OneCycleLR or a linear warm-up, ``max_epochs``, ``max_steps``) configures what it would configure in fit.

    Not the Trainer itself: outside ``fit`` it has no data (its ``estimated_stepping_batches`` would load the
    dataloader through a fit it is not in) and no module, and a module attached to it would ``self.log`` into a
    fit that is not running. Every attribute is read from the user's trainer (``accumulate_grad_batches``,
    ``max_steps``, ``num_devices``, ``world_size``, ``precision``, ``strategy``, ...: as it is before tuning
    writes anything back; none is set on it), except those ``fit`` makes, computed here as fit computes them:

    * ``max_epochs``: fit's default when unset: 1000, or -1 where ``max_steps`` is set or a ``Timer`` runs;
    * ``num_training_batches``: the training dataloader's length under ``limit_train_batches``;
    * ``estimated_stepping_batches``: Lightning's formula, ``ceil(num_training_batches / accumulate_grad_batches)
      x max(max_epochs, 1)``, capped by ``max_steps`` (``max_steps``, or infinity, for ``max_epochs=-1``);
    * ``lightning_module`` and ``model``: the module being configured (the trial's copy);
    * ``datamodule``: the datamodule given to ``tune_trainer``.
    """

    def __init__(self, trainer: Any, batches: int, datamodule: Any, module: Any = None) -> None:
        self._trainer, self._batches, self.datamodule = trainer, batches, datamodule
        self.lightning_module = self.model = module

    @classmethod
    def of(cls, trainer: Any, loader: torch.utils.data.DataLoader, datamodule: Any) -> "_FitView":
        return cls(trainer, len(loader), datamodule)

    def __getattr__(self, name: str) -> Any:
        trainer = self.__dict__.get("_trainer")  # absent while a copy or pickle rebuilds the view
        if trainer is None:
            raise AttributeError(name)
        return getattr(trainer, name)

    def attached_to(self, module: Any) -> "_FitView":
        return _FitView(self._trainer, self._batches, self.datamodule, module)

    @property
    def max_epochs(self) -> int:
        epochs = self._trainer.max_epochs
        if epochs is not None:
            return epochs
        from lightning.pytorch.callbacks import Timer

        timed = any(isinstance(c, Timer) for c in getattr(self._trainer, "callbacks", ()))
        return 1000 if self._trainer.max_steps == -1 and not timed else -1

    @property
    def num_training_batches(self) -> int:
        limit = getattr(self._trainer, "limit_train_batches", 1.0)
        limit = 1.0 if limit is None else limit
        return min(self._batches, limit) if isinstance(limit, int) else int(self._batches * limit)

    @property
    def estimated_stepping_batches(self) -> int | float:
        max_steps = self._trainer.max_steps
        if self.max_epochs == -1:
            return float("inf") if max_steps == -1 else max_steps
        steps = math.ceil(self.num_training_batches / self._trainer.accumulate_grad_batches) * max(self.max_epochs, 1)
        return min(steps, max_steps) if max_steps != -1 else steps


class _FirstOptimizer:
    """The module's ``configure_optimizers()`` on the trial's copy, with ``self.trainer`` a :class:`_FitView` for
    the call: its (first) optimizer.

    The learning-rate schedulers it returns (``([optimizer], [scheduler])``, ``{"lr_scheduler": ...}``) are
    accepted and not stepped. A trial trains a handful of steps to measure memory and time; a scheduler's step
    changes the next step's learning rate (OneCycleLR's momentum too), which changes neither the memory a step
    holds nor its time, so each trial trains at the scheduler's first values, as fit's first step does. The
    report names them (``schedulers``) beside the optimizer.
    """

    takes_model = True
    source = "configure_optimizers"

    def __init__(self, cls: type, view: _FitView) -> None:
        self.__qualname__ = f"{cls.__qualname__}.configure_optimizers"
        self.__module__ = cls.__module__
        self.view = view
        self.described: dict[str, Any] = {}  # the last call's schedulers, for the report (OptimizerSpec.describe)

    def __call__(self, model: nn.Module) -> torch.optim.Optimizer:
        attached = getattr(model, "_trainer", None)
        model.trainer = self.view.attached_to(model)
        try:
            found = model.configure_optimizers()
        finally:
            model.trainer = attached
        schedulers = _schedulers(found)
        self.described = {"schedulers": schedulers} if schedulers else {}
        while not isinstance(found, torch.optim.Optimizer):
            if isinstance(found, Mapping) and "optimizer" in found:
                found = found["optimizer"]
            elif isinstance(found, (list, tuple)) and found:
                found = found[0]  # [optimizers], ([optimizers], [schedulers]) or (optimizer, ...)
            else:
                raise UsageError(f"{type(model).__name__}.configure_optimizers() gave no optimizer "
                                 f"({type(found).__name__}): return one, as Lightning expects")
        return found


def _schedulers(found: Any) -> list[str]:
    """The classes of the learning-rate schedulers in what ``configure_optimizers()`` returned, in order."""
    from autotune.training.optimizer import class_name

    if isinstance(found, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return [class_name(type(found))]
    inner = found.values() if isinstance(found, Mapping) else found if isinstance(found, (list, tuple)) else ()
    return [name for item in inner for name in _schedulers(item)]


def _write_back(trainer: Any, model: Any, holders: list[Any], report: Report, datamodule: Any = None) -> str:
    """Set the batch size, accumulation and plan (raises NothingFits, nothing changed, when none)."""
    recommended = recommendation_of(report)
    best, steps = recommended.trial, recommended.accumulation_steps
    old_batch = _batch_size(holders[0])
    for holder in holders:
        if isinstance(holder, Mapping):
            holder["batch_size"] = best.batch_size
        else:
            holder.batch_size = best.batch_size
    old_steps, trainer.accumulate_grad_batches = trainer.accumulate_grad_batches, steps
    plan = best.config.plan
    if not plan.off:
        from autotune.training.applied import apply

        apply(model, report)  # the checkpoint plan (and fp32 modules) on the module, in place
    wanted = LIGHTNING_PRECISION[best.precision]
    current = str(getattr(trainer, "precision", wanted))
    precision = ("" if current == wanted else
                 f"; the trainer's precision is {current!r} and Lightning fixes it when the Trainer is made: build "
                 f"one with Trainer(**autotune.export.lightning_trainer_kwargs(report)) to train {wanted!r}")
    evaluation, after = _write_eval_batch(model, datamodule, report, best)
    return say_changes(f"the module now trains batch {best.batch_size} x {steps} steps "
                       f"{trains_plan(plan, 'autotune.apply on the module')}{precision}",
                       [("batch_size", old_batch, best.batch_size), ("accumulate_grad_batches", old_steps, steps),
                        *evaluation], after)


def _batch_size(holder: Any) -> Any:
    return holder["batch_size"] if isinstance(holder, Mapping) else holder.batch_size
