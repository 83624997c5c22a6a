"""Use a recommendation in your own training loop: ``autotune.apply`` and the accumulation plan.

    run = autotune.apply(model, autotune.load("results/TinyGPT-cpu.json"))
    optimizer = torch.optim.AdamW(run.model.parameters(), lr=3e-4)
    for i, batch in enumerate(loader):                      # batches of run.micro_batch_size
        with run.autocast():
            loss = run.model(**batch).loss / run.accumulation_steps
        run.backward(loss)
        if (i + 1) % run.accumulation_steps == 0:
            run.step(optimizer)                             # unscale, clip, step, update, zero_grad
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import torch
from torch import nn

from autotune.checkpointing import apply_plan
from autotune.errors import UsageError
from autotune.precision import get_mode
from autotune.trial import GuardRails, Measurement, keep_in_fp32

__all__ = ["Applied", "apply", "accumulation_plan"]


def accumulation_plan(micro_batch_size: int, target_batch_size: int | None) -> dict[str, Any]:
    """Return gradient-accumulation steps so that micro x steps reaches ``target_batch_size``."""
    if target_batch_size is None:
        return {"target_batch_size": None, "micro_batch_size": micro_batch_size, "accumulation_steps": 1,
                "effective_batch_size": micro_batch_size, "lr_note": None}
    if target_batch_size < 1:
        raise UsageError(f"--target-batch-size {target_batch_size} must be at least 1")
    steps = max(1, math.ceil(target_batch_size / micro_batch_size))
    effective = micro_batch_size * steps
    if effective == target_batch_size:
        note = (f"keep the learning rate you tuned for batch {target_batch_size}: {steps} micro-batches of "
                f"{micro_batch_size} make one optimizer step of exactly that batch")
    else:
        note = (f"the effective batch is {effective}, not {target_batch_size}: keep the learning rate of batch "
                f"{target_batch_size} scaled linearly by {effective}/{target_batch_size} = "
                f"{effective / target_batch_size:.3f}, or train with micro-batches of "
                f"{math.ceil(target_batch_size / steps)} to hit the target")
    if micro_batch_size > target_batch_size:
        note = (f"the recommended micro-batch ({micro_batch_size}) is larger than the target: train with batch "
                f"{target_batch_size} at your tuned learning rate, or with batch {micro_batch_size} and the learning "
                f"rate scaled linearly by {micro_batch_size / target_batch_size:.3f}")
        steps, effective = 1, micro_batch_size
    return {"target_batch_size": target_batch_size, "micro_batch_size": micro_batch_size, "accumulation_steps": steps,
            "effective_batch_size": effective, "lr_note": note}


@dataclasses.dataclass
class Applied:
    """What a training loop needs to train with a recommendation."""

    model: nn.Module  # with the checkpoint plan and fp32 modules applied (same parameters)
    precision: str
    segments: int
    micro_batch_size: int
    accumulation_steps: int
    scaler: "torch.amp.GradScaler | None"  # fp16 only
    clip_grad_norm: float | None
    device_type: str
    plan: dict[str, Any]

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context for the forward pass and the loss (a no-op for fp32)."""
        return get_mode(self.precision).autocast(self.device_type)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``, through the GradScaler when there is one."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> float | None:
        """Unscale, clip, step and zero the gradients; return the gradient norm when clipping."""
        norm = None
        if self.scaler is not None and self.clip_grad_norm is not None:
            self.scaler.unscale_(optimizer)
        if self.clip_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm))
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm


def _recommendation_fields(recommendation: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Return (trial fields, plan, guard rails) from a Report, a Measurement or a report/trial dict."""
    from autotune.report import Report

    if isinstance(recommendation, Report):
        rec = recommendation.recommendation
        if rec is None:
            raise UsageError("the report has no recommendation: nothing fitted the budget")
        return rec.to_dict(), recommendation.plan or {}, recommendation.guard.to_dict()
    if isinstance(recommendation, Measurement):
        return recommendation.to_dict(), {}, {}
    if isinstance(recommendation, dict):
        if "recommendation" in recommendation:  # a whole report, as loaded from JSON
            if recommendation["recommendation"] is None:
                raise UsageError("the report has no recommendation: nothing fitted the budget")
            return recommendation["recommendation"], recommendation.get("plan") or {}, recommendation.get("guard") or {}
        return recommendation, {}, {}
    raise UsageError(f"cannot apply a {type(recommendation).__name__}: pass a Report, its recommendation or its JSON dict")


def apply(model: nn.Module, recommendation: Any, *, device_type: str | None = None) -> Applied:
    """Prepare ``model`` to train as ``recommendation`` says, in place.

    ``recommendation`` is a :class:`~autotune.report.Report` (its recommendation, accumulation
    plan and guard rails are used), a :class:`~autotune.trial.Measurement`, or the JSON dict of
    either. ``device_type`` defaults to where the model's parameters are.
    """
    fields, plan, guard_dict = _recommendation_fields(recommendation)
    guard = GuardRails(clip_grad_norm=guard_dict.get("clip_grad_norm"), fp32_modules=tuple(guard_dict.get("fp32_modules", ())))
    if device_type is None:
        first = next(model.parameters(), None)
        device_type = first.device.type if first is not None else "cpu"
    applied_plan = apply_plan(model, int(fields["segments"]))
    keep_in_fp32(model, guard.fp32_modules, device_type)
    mode = get_mode(fields["precision"])
    micro = int(plan.get("micro_batch_size") or fields["batch_size"])
    return Applied(
        model=model,
        precision=mode.name,
        segments=int(fields["segments"]),
        micro_batch_size=micro,
        accumulation_steps=int(plan.get("accumulation_steps") or 1),
        scaler=mode.grad_scaler(device_type),
        clip_grad_norm=guard.clip_grad_norm,
        device_type=device_type,
        plan=applied_plan.to_dict(),
    )
