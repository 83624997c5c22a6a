"""Tune a Hugging Face ``transformers.Trainer`` as it is, and write the answer into its arguments.

    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds, data_collator=collator)
    report = tune_trainer(trainer, budget="24GiB")   # options as autotune.tune takes them
    trainer.train()                                   # trains the recommendation

Under ``torchrun`` (the trainer's world size above 1) every rank calls ``tune_trainer`` on its own
trainer, as it would call ``trainer.train()``: the trials run on every rank under DDP (FSDP2 when the
arguments ask for ``fsdp``), rank 0 runs the search, and every rank's trainer is set to the same answer.

What the trials train is what ``trainer.train()`` would:

* **the model** as it is now (each trial starts from an exact copy of its current weights; the
  trainer's own model waits on the CPU while trials have the device);
* **the data**: ``train_dataset`` with the trainer's column removal and ``data_collator``, so the
  worst-batch search meets the real padded batches;
* **the optimizer** the trainer would make: ``get_optimizer_cls_and_kwargs`` (``optim="adafactor"``,
  ``"sgd"``, ``"adamw_torch_fused"``, ...) over its weight-decay groups, or the class and settings of
  an optimizer passed as ``optimizers=``;
* **the loss**: ``trainer.compute_loss``, a subclass's override included;
* **clipping**: ``max_grad_norm``.

The global batch stays the user's: ``per_device_train_batch_size x gradient_accumulation_steps x
world size``. The micro batches tried divide it, and the accumulation steps rise as the micro batch
falls. The recommendation is written back: ``per_device_train_batch_size``,
``gradient_accumulation_steps``, ``bf16``/``fp16`` (the trainer's accelerator made again for the new
precision), and the checkpoint plan: the model's own ``gradient_checkpointing`` where the plan is
the one it makes (every block), else :func:`autotune.apply` on the trainer's model; and
``per_device_eval_batch_size``, the largest evaluation batch during training (the report's ``eval_limits``, sized on
``eval_dataset``'s worst batch as the trainer's collator pads it, ``compute_loss`` under ``no_grad``). One line says
what changed. When nothing fits, :class:`~autotune.errors.NothingFits` is raised with what to try,
and the trainer is left as it was.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from autotune.errors import UsageError
from autotune.integrations.common import (ModelCopy, distributed_job, eval_batch_of, on_host, recommendation_of,
                                          say_changes, trainer_options, trains_plan)
from autotune.export.context import ACCELERATE_PRECISION
from autotune.vocabulary import ALL, FSDP_ONLY, PRECISIONS, TRUE, Parallel, PrecisionName
from autotune.report import Report

__all__ = ["tune_trainer"]


def tune_trainer(trainer: Any, **options: Any) -> Report:
    """Tune ``trainer`` (a ``transformers.Trainer``) and set its arguments to the recommendation; return the report.

    ``options`` are :func:`autotune.tune`'s (``budget`` defaults to the device's memory). Trials run
    in this process (``isolation="none"``): the trainer's objects are not rebuilt in a worker.
    """
    from autotune.tuner import tune

    _check_precisions(options.get("precisions"))
    args = trainer.args
    dataset, collator = _training_data(trainer)
    defaults = trainer_options(args.per_device_train_batch_size * args.gradient_accumulation_steps,
                               getattr(args, "world_size", 1), _wrapper(args))
    if getattr(args, "use_cpu", False):
        defaults["device"] = "cpu"
    if args.max_grad_norm:
        defaults["clip_grad_norm"] = float(args.max_grad_norm)
    if "optimizer" not in options:  # tune_trainer(..., optimizer=...) trains the one given instead
        defaults["optimizer"] = _TrainerOptimizer(trainer)
    evaluation = _eval_data(trainer)
    if evaluation is not None:
        defaults["eval_data"] = evaluation
    model = trainer.model
    with on_host(model), distributed_job(defaults):
        report = tune(ModelCopy(model, _without_library_checkpointing),
                      data=torch.utils.data.DataLoader(dataset, batch_size=1, collate_fn=collator),
                      step=_ComputeLoss(trainer), **{**defaults, **options})
    said = _write_back(trainer, report)
    return dataclasses.replace(report, notices=(*report.notices, said))


def _check_precisions(asked: Any) -> None:
    """Refuse FSDP2's bf16-fsdp and bf16-true before any trial: the write-back of either would be TrainingArguments'
    bf16, which autocasts (and under FSDP2 reduces in bf16) over the model's own weights (the export's notes say how to
    train each by hand)."""
    names = asked.split(",") if isinstance(asked, str) else list(asked or ())
    fsdp = [n.strip().lower() for n in names if n.strip().lower() in FSDP_ONLY]
    if fsdp:
        raise UsageError(f"tune_trainer cannot write precision {fsdp[0]} back: TrainingArguments has no setting for "
                         f"FSDP2's {PRECISIONS[fsdp[0]].policy} (bf16=True autocasts and reduces in bf16); tune the "
                         f"trainer with bf16, or search {fsdp[0]} with python -m autotune --parallel fsdp and "
                         f"--export hf")
    true = [n.strip().lower() for n in names if n.strip().lower() in TRUE]
    if true:
        raise UsageError(f"tune_trainer cannot write precision {true[0]} back: TrainingArguments has no setting that "
                         f"casts the model (bf16=True autocasts over its weights); make the trainer with the model "
                         f"loaded in bf16 (from_pretrained(..., dtype=torch.bfloat16)) and tune it with fp32, which "
                         f"then trains the bf16 weights as they are, or search {true[0]} with python -m autotune and "
                         f"--export hf")


def _wrapper(args: Any) -> str:
    """The wrapper the trainer trains under when the job is distributed: FSDP2 for ``fsdp``, else DDP."""
    if getattr(args, "deepspeed", None):
        raise UsageError("tune_trainer does not measure DeepSpeed's engine: tune with the same arguments less "
                         "deepspeed (--parallel fsdp measures a sharded job), or use --export deepspeed")
    return Parallel.FSDP if getattr(args, "fsdp", None) else Parallel.DDP


def _training_data(trainer: Any) -> tuple[Any, Any]:
    """The train dataset and collator as the trainer's dataloader would use them (unused columns removed)."""
    dataset = trainer.train_dataset
    if dataset is None:
        raise UsageError("the trainer has no train_dataset: pass train_dataset=... to Trainer (autotune tunes on it)")
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise UsageError(f"the trainer's train_dataset is a {type(dataset).__name__} without a length: autotune needs a "
                         f"map-style dataset (with __getitem__ and __len__) to find its worst batch")
    if hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):  # a datasets.Dataset, as the trainer asks
        return trainer._remove_unused_columns(dataset, description="training"), trainer.data_collator
    return dataset, trainer._get_collator_with_removed_columns(trainer.data_collator, description="training")


def _eval_data(trainer: Any) -> Any:
    """The trainer's ``eval_dataset`` as its evaluation loader would batch it (unused columns removed, its collator):
    the evaluation batch is sized on its worst batch. Several (a dict) are sized together, on the worst batch of all
    their items; none, or one without a length, leaves it to the training data."""
    given = trainer.eval_dataset
    if given is None:
        return None
    named = given if isinstance(given, dict) else {"eval": given}
    if any(isinstance(d, torch.utils.data.IterableDataset) or not hasattr(d, "__len__") for d in named.values()):
        return None
    parts = [trainer._remove_unused_columns(d, description="evaluation")
             if hasattr(d, "column_names") and hasattr(d, "remove_columns") else d for d in named.values()]
    plain = not any(hasattr(d, "column_names") and hasattr(d, "remove_columns") for d in named.values())
    collator = (trainer._get_collator_with_removed_columns(trainer.data_collator, description="evaluation") if plain
                else trainer.data_collator)
    dataset = parts[0] if len(parts) == 1 else torch.utils.data.ConcatDataset(parts)
    return torch.utils.data.DataLoader(dataset, batch_size=1, collate_fn=collator)


def _without_library_checkpointing(model: nn.Module) -> None:
    """A trial's copy starts without the library's checkpointing: the plan under test decides what is recomputed.
    (Newer transformers call it activation checkpointing and warn on the old names.)"""
    for name in _SWITCHES:
        if hasattr(type(model), f"is_{name}"):
            if getattr(model, f"is_{name}"):
                getattr(model, f"{name}_disable")()
            return


class _ComputeLoss:
    """``--step``: the trainer's own ``compute_loss(model, inputs)`` (a subclass's override included)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.__qualname__ = f"{type(trainer).__name__}.compute_loss"

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        # compute_loss may pop the labels (label smoothing, compute_loss_func): a trial steps on one batch many times
        return self.trainer.compute_loss(model, dict(batch) if isinstance(batch, dict) else batch)


class _TrainerOptimizer:
    """The optimizer the trainer would create, over the trial's model (its weight-decay groups, by name).

    Its ``source`` (the report's) says where its class and settings came from: ``Trainer(optimizers=...)``,
    ``Trainer(optimizer_cls_and_kwargs=...)``, or ``TrainingArguments`` (``optim``, ``learning_rate``,
    ``weight_decay``, the Adam betas and epsilon, ``optim_args``: the ``optim`` named in ``described``).
    """

    takes_model = True

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        given = trainer.optimizer
        self.described: dict[str, Any] = {}
        if given is not None:  # optimizers=(optimizer, scheduler): its class and settings
            self.cls, self.kwargs = type(given), {k: v for k, v in given.defaults.items() if k != "params"}
            self.source = "Trainer(optimizers=...)"
        elif getattr(trainer, "optimizer_cls_and_kwargs", None) is not None:
            self.cls, self.kwargs = trainer.optimizer_cls_and_kwargs
            self.source = "Trainer(optimizer_cls_and_kwargs=...)"
        else:
            self.cls, self.kwargs = type(trainer).get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
            self.source, self.described = "TrainingArguments", {"optim": str(getattr(trainer.args.optim, "value",
                                                                                      trainer.args.optim))}
        unsupported = sorted(set(self.kwargs) & {"params", "model", "optimizer_dict"})
        if unsupported or not isinstance(self.cls, type):
            raise UsageError(f"the trainer's optimizer ({trainer.args.optim}) builds itself from the model "
                             f"({', '.join(unsupported) or 'a factory'}): autotune cannot make it for a trial; pass "
                             f"optimizer=... to tune_trainer")
        settings = ", ".join(f"{k}={v!r}" for k, v in sorted(self.kwargs.items()))
        self.__module__, self.__qualname__ = self.cls.__module__, f"{self.cls.__qualname__}({settings})"

    def __call__(self, model: nn.Module) -> torch.optim.Optimizer:
        decay = set(self.trainer.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.trainer.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        return self.cls([g for g in groups if g["params"]], **self.kwargs)


def _write_back(trainer: Any, report: Report) -> str:
    """Set the trainer to train the recommendation (raises NothingFits, the trainer unchanged, when none)."""
    recommended = recommendation_of(report)
    best, steps = recommended.trial, recommended.accumulation_steps
    args, model = trainer.args, trainer.model
    plan = best.config.plan
    before = (args.per_device_train_batch_size, args.gradient_accumulation_steps, bool(args.bf16), bool(args.fp16),
              _checkpointing(args))
    args.per_device_train_batch_size, args.gradient_accumulation_steps = best.batch_size, steps
    if hasattr(trainer, "_train_batch_size"):
        trainer._train_batch_size = args.train_batch_size  # train() reads it, set once when the trainer was made
    args.bf16, args.fp16 = best.precision == PrecisionName.BF16, best.precision == PrecisionName.FP16
    if (args.bf16, args.fp16) != before[2:4]:
        _new_accelerator(trainer, ACCELERATE_PRECISION[best.precision])
    library = plan == ALL and report.workload.get("library_checkpointing") is not None  # the switch makes plan all
    _set_checkpointing(args, library)
    _without_library_checkpointing(model)
    applied = trains_plan(plan, "the model's own gradient_checkpointing" if library
                          else "autotune.apply on the trainer's model")
    if not plan.off and not library:
        from autotune.training.applied import apply

        apply(model, report)  # the checkpoint plan (and fp32 modules) on the trainer's model, in place
    evaluation = eval_batch_of(report, best)
    before_eval = args.per_device_eval_batch_size
    if evaluation is not None:
        args.per_device_eval_batch_size = evaluation
    after = (best.batch_size, steps, args.bf16, args.fp16, _checkpointing(args), args.per_device_eval_batch_size)
    names = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "gradient_checkpointing",
             "per_device_eval_batch_size")
    return say_changes(f"the trainer now trains {best.precision}, batch {best.batch_size} x {steps} steps {applied}",
                       list(zip(names, (*before, before_eval), after)))


_SWITCHES = ("activation_checkpointing", "gradient_checkpointing")  # newer transformers' name first


def _checkpointing(args: Any) -> bool:
    return any(bool(getattr(args, name, False)) for name in _SWITCHES)


def _set_checkpointing(args: Any, on: bool) -> None:
    """The trainer's own per-layer checkpointing switch, under each name this transformers reads."""
    for name in _SWITCHES:
        if hasattr(args, name):
            setattr(args, name, on)
            if on:
                kwargs = getattr(args, f"{name}_kwargs", None) or {}
                setattr(args, f"{name}_kwargs", {**kwargs, "use_reentrant": False})  # autotune measured non-reentrant


def _new_accelerator(trainer: Any, mixed_precision: str) -> None:
    """The trainer's accelerator made again for another precision (accelerate keeps one state per process)."""
    from accelerate.state import AcceleratorState

    trainer.args.mixed_precision = mixed_precision
    AcceleratorState._reset_state(reset_partial_state=False)
    trainer.create_accelerator_and_postprocess()
