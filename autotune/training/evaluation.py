"""An evaluation pass as a trainer runs one: the model in eval mode, its forward pass and loss under ``torch.no_grad()``
and the precision's autocast, on a batch of the evaluation data.

Two passes are sized (:class:`EvalKind`):

* **during training**: the training state resident, as a Trainer evaluates between optimizer steps. Hugging Face's
  Trainer calls ``model.zero_grad()`` after each optimizer step, before it evaluates, and Lightning releases the
  gradients before validation (``on_validation_model_zero_grad``): both set them to ``None``. So what stays
  resident is the weights and the optimizer's state (primed as trials prime it: :func:`autotune.training.optimizer.prime`),
  and no gradients; the GradScaler's two scalars (fp16) are left out.
* **inference**: the prepared model alone, no optimizer.

The loss is computed (a Trainer's evaluation computes it where the batch has labels), by the workload's own rule or
its ``--step`` (a Lightning module's ``training_step``, run under ``no_grad``). An evaluation that generates
(``model.generate``, token by token with a key/value cache) is not this pass, and is not sized.

``--eval-data`` is resolved here (:class:`EvalData`), with ``--data``'s checks: a map-style dataset, or bad input.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any

import torch

from autotune.training.trainer import Trainer
from autotune.training.data import ItemSizes, scan_items
from autotune.training.workload import Workload, dataset_of, to_device

__all__ = ["EvalKind", "EvalData", "Evaluation", "eval_workload"]


class EvalKind(str, enum.Enum):
    """Which evaluation pass: the JSON's keys are ``{kind}_max_batch_size``."""

    DURING_TRAINING = "during_training"  # the training state resident: weights and optimizer state, no gradients
    INFERENCE = "inference"  # the model alone

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class EvalData:
    """``--eval-data`` resolved once: the map-style dataset, its loader's ``collate_fn``, what the flag named."""

    dataset: Any
    collate_fn: Any
    spec: Any  # the flag's value (a worker process loads it again from this)
    notes: tuple[str, ...] = ()

    @classmethod
    def load(cls, data: Any) -> "EvalData | None":
        """``--eval-data``'s value as a dataset (None for none); bad input is one line naming the flag."""
        loaded = dataset_of(data, flag="--eval-data")
        return None if loaded.dataset is None else cls(loaded.dataset, loaded.collate_fn, data, loaded.notes)

    @functools.cached_property
    def items(self) -> ItemSizes:
        """The sizes of the data's items, read once (every evaluation batch size's worst batch is found from them)."""
        return scan_items(self.dataset)


def eval_workload(workload: Workload, data: EvalData | None) -> Workload:
    """The workload whose batches are the evaluation data's (``workload`` itself without ``--eval-data``): the same
    model, optimizer, loss and blocks."""
    if data is None:
        return workload
    spec = None if workload.spec is None else {**workload.spec, "data": data.spec, "worst_batches": {}}
    return dataclasses.replace(workload, dataset=data.dataset, collate_fn=data.collate_fn, worst_batches={},
                               items=data.items, notes=data.notes, spec=spec)


class Evaluation(Trainer):
    """One configuration's evaluation: the model prepared as training prepares it (precision, plan, fp32 modules),
    with the training state resident or alone (:meth:`build_for`), then a pass (:meth:`evaluate`)."""

    def build_for(self, kind: EvalKind) -> None:
        """Build what stays resident while a ``kind`` pass runs."""
        if kind is EvalKind.INFERENCE:
            self._prepared(None)
            return
        self.build(prime=True)
        for _ in range(8):  # an optimizer that could not be primed: steps on one item until it holds state
            if self.holds_state:
                break
            self.step(to_device(self.workload.make_batch(self.module, 1), self.device))  # gradients set to None

    def eval_batch(self, batch_size: int) -> Any:
        """The evaluation data's worst batch of ``batch_size`` (or ``example_batch``), on the device."""
        return to_device(self.workload.make_batch(self.module, batch_size), self.device)

    def evaluate(self, batch: Any) -> None:
        """One pass over ``batch``: eval mode, ``torch.no_grad()``, the precision's autocast, forward and loss."""
        model = self.run.model
        model.eval()  # dropout off, normalisation from running statistics, as a trainer evaluates
        try:
            with torch.no_grad(), self.run.autocast():
                loss = self.workload.loss(model, batch)
            del loss
        finally:
            model.train()
