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
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake  # private, and in every torch autotune supports

from autotune._log import logger
from autotune.plans.checkpointing import Chain, apply_plan
from autotune.errors import UsageError
from autotune.meters.tensor import meter_aside
from autotune.training.compiled import compile_model
from autotune.vocabulary import EAGER, PRECISIONS, CheckStatus, Plan, compile_mode
from autotune.training.precision import get_mode, keep_in_fp32
from autotune.records import GuardRails, Measurement, accumulation_plan
from autotune.device import autocast_type

__all__ = ["Applied", "apply", "prepare", "accumulation_plan"]


@dataclasses.dataclass
class Applied:
    """What a training loop needs to train with a recommendation."""

    model: nn.Module  # with the checkpoint plan and fp32 modules applied, bf16-true: cast (the same parameters)
    precision: str
    segments: str  # the checkpoint plan's name
    micro_batch_size: int
    accumulation_steps: int
    scaler: "torch.amp.GradScaler | None"  # fp16 only
    clip_grad_norm: float | None
    device_type: str
    plan: dict[str, Any]  # the checkpoint plan applied: name and recomputed blocks
    record_loss_scale: bool = False  # fp16: keep the scale after each step and count skipped steps (trials, probe)
    record_grad_norm: bool = False  # keep each step's gradient norm, computed even without clipping (the probe)
    loss_scales: list[float] = dataclasses.field(default_factory=list)
    skipped_steps: int = 0  # steps the GradScaler skipped because gradients held inf/NaN
    grad_norms: list[float] = dataclasses.field(default_factory=list)  # after unscaling, before clipping
    compile: str = EAGER  # the torch.compile mode ``model`` is compiled in ("none": eager)
    # bf16-true: count, over a fixed sample of each parameter's entries, those whose nonzero gradient the step left
    # unchanged (the update rounded away, where an fp32 master weight would have moved: the probe's)
    record_lost_updates: bool = False
    updates_sampled: int = 0  # sampled entries with a nonzero gradient, over the steps
    updates_lost: int = 0  # ... whose weight the step did not change
    # The report's largest evaluation batches for this precision and plan (eval_limits): a forward pass and the loss
    # under torch.no_grad() with the training state resident (evaluate between steps with loaders of this size), and
    # for inference alone; None where the report has none (or none fits)
    eval_batch_size: int | None = None
    inference_batch_size: int | None = None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context for the forward pass and the loss (a no-op for fp32, for bf16-fsdp: FSDP2 casts, and
        for bf16-true: the model is bf16)."""
        return get_mode(self.precision).autocast(self.device_type)

    @property
    def mp_policy(self) -> Any:
        """bf16-fsdp: FSDP2's ``MixedPrecisionPolicy`` to wrap the model with (``fully_shard(block,
        mp_policy=run.mp_policy)`` on each block, then the root); None for the other precisions (autocast)."""
        return get_mode(self.precision).mp_policy()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``, through the GradScaler when there is one."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> float | None:
        """Unscale, clip, step and zero the gradients; return the gradient norm when clipping (or recording).

        This is the step trials and the probe time too: what they measure is this loop.
        """
        norm = None
        measure_norm = self.clip_grad_norm is not None or self.record_grad_norm
        if self.scaler is not None and measure_norm:
            self.scaler.unscale_(optimizer)  # clip and report the true gradients, not scaled ones
        if measure_norm:
            max_norm = self.clip_grad_norm if self.clip_grad_norm is not None else float("inf")
            total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            norm = None if is_fake(total) else float(total)  # a dry run's norm has no value
            if self.record_grad_norm and norm is not None:
                self.grad_norms.append(norm)
        sample = _sample_updates(optimizer) if self.record_lost_updates else None
        if self.scaler is not None:
            before = self.scaler.get_scale() if self.record_loss_scale else None
            self.scaler.step(optimizer)
            self.scaler.update()
            if self.record_loss_scale:
                self.loss_scales.append(self.scaler.get_scale())
                self.skipped_steps += self.loss_scales[-1] < before  # the scaler halves its scale exactly when it skips
        else:
            optimizer.step()
        if sample is not None:
            self._count_lost(sample)
        optimizer.zero_grad(set_to_none=True)
        return norm

    def _count_lost(self, sample: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]]) -> None:
        """After the step: of the sampled entries with a nonzero gradient, those whose weight it did not change."""
        with meter_aside():
            for param, stride, before, moved in sample:
                after = _sampled(param.detach(), stride).to("cpu", copy=True)
                self.updates_sampled += int(moved.sum())
                self.updates_lost += int((moved & (after == before)).sum())


_SAMPLED = 1024  # entries of each parameter whose updates bf16-true's probe follows: evenly spaced, no RNG drawn


def _sampled(t: torch.Tensor, stride: int) -> torch.Tensor:
    """Every ``stride``-th entry of ``t`` (this rank's shard of a DTensor), ``_SAMPLED`` at most: a view."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.view(-1)[::stride][:_SAMPLED]


def _sample_updates(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]]:
    """Before the step: for each parameter with a gradient, up to ``_SAMPLED`` evenly spaced entries (the stride, their
    values and whether their gradient is nonzero), copied to the host where no meter counts them. A dry run's fake
    tensors have no values, and a parameter or gradient not laid out contiguously is left out: nothing is sampled."""
    sample = []
    with meter_aside():
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None or is_fake(param) or not param.is_contiguous() or not grad.is_contiguous():
                    continue
                numel = (param.to_local() if hasattr(param, "to_local") else param).numel()
                if numel:
                    stride = max(1, numel // _SAMPLED)
                    sample.append((param, stride, _sampled(param.detach(), stride).to("cpu", copy=True),
                                   (_sampled(grad, stride) != 0).cpu()))
    return sample


@dataclasses.dataclass(frozen=True)
class _Recommended:
    """What ``apply`` reads from a report, a trial or their JSON."""

    trial: dict[str, Any]  # the recommended trial's fields
    accumulation: dict[str, Any] = dataclasses.field(default_factory=dict)  # the gradient-accumulation plan
    guard: dict[str, Any] = dataclasses.field(default_factory=dict)
    checks: list | None = None  # the plan checks; None where there were none (a bare trial, a version 1 report)
    chain: dict[str, Any] | None = None  # the model's blocks in forward order, as the tuner found them
    eval_limits: list | None = None  # the report's eval_limits, where it has them


def _recommendation_fields(recommendation: Any) -> _Recommended:
    """Read a Report, a Measurement or the JSON dict of either. A Report is known by its attributes: this floor does
    not import the report's (and reads the few fields it needs, not the whole JSON with its derived analyses)."""
    if isinstance(recommendation, Measurement):
        return _Recommended(recommendation.to_dict())
    if not isinstance(recommendation, dict) and hasattr(recommendation, "plan_checks"):  # a Report
        if recommendation.dry_run:
            raise UsageError(_DRY_RUN)
        rec = recommendation.recommendation
        if rec is None:
            raise UsageError(_NOTHING)
        return _Recommended(rec.to_dict(), recommendation.accumulation or {}, recommendation.guard.to_dict(),
                            [c.to_dict() for c in recommendation.plan_checks], recommendation.workload.get("chain"),
                            list(recommendation.eval_limits or ()) or None)
    if isinstance(recommendation, dict) and (recommendation.get("search") or {}).get("dry_run"):
        raise UsageError(_DRY_RUN)
    if isinstance(recommendation, dict):
        if "recommendation" in recommendation:  # a whole report, as loaded from JSON
            if recommendation["recommendation"] is None:
                raise UsageError(_NOTHING)
            return _Recommended(recommendation["recommendation"],
                                recommendation.get("accumulation", recommendation.get("plan")) or {},  # "plan" in v1-2
                                recommendation.get("guard") or {}, recommendation.get("plan_checks"),
                                (recommendation.get("workload") or {}).get("chain"), recommendation.get("eval_limits"))
        return _Recommended(recommendation)
    raise UsageError(f"cannot apply a {type(recommendation).__name__}: pass a Report, its recommendation or its JSON dict")


_DRY_RUN = ("a dry run's report has no recommendation to apply (its figures are predicted: an estimate, not measured): "
            "apply a search's")
_NOTHING = "the report has no recommendation: nothing fitted the budget"


def _require_checked(plan: str, checks: list | None, compile: str = EAGER) -> None:
    """Refuse a plan whose check on the model failed (compiled: its check under that compile mode); say so when there
    is no check to go by."""
    if Plan(plan).off:
        return
    check = next((c for c in checks or () if c.get("plan") == plan and (c.get("compile") or EAGER) == compile), None)
    if check is None:
        logger.warning("checkpoint plan %s was not checked on this model (a report from before the checks, or a bare "
                       "trial): autotune cannot vouch that it trains the same model", plan)
    elif check.get("status") not in {s.value for s in CheckStatus if s.kept}:
        raise UsageError(f"checkpoint plan {plan} failed its check on this model ({check.get('status')}: "
                         f"{check.get('error') or check.get('worst')}): it would train a different model; "
                         f"use another configuration of the report")


def _has_submodule(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def apply(model: nn.Module, recommendation: Any, *, device_type: str | None = None) -> Applied:
    """Prepare ``model`` to train as ``recommendation`` says, in place.

    ``recommendation`` is a :class:`~autotune.report.Report` (its recommendation, accumulation
    plan and guard rails are used), a :class:`~autotune.execution.trial.Measurement`, or the JSON dict of
    either. ``device_type`` defaults to where the model's parameters are. A recommendation measured compiled
    (``compile`` not ``none``) returns ``run.model`` compiled so (``torch.compile`` of the prepared ``model``).
    """
    source = _recommendation_fields(recommendation)
    fields, accumulation = source.trial, source.accumulation
    guard = GuardRails.from_dict(source.guard)
    if device_type is None:
        first = next(model.parameters(), None)
        device_type = autocast_type(first.device) if first is not None else "cpu"
    plan = Plan(fields["segments"])
    _require_checked(plan, source.checks, compile_mode(fields.get("compile") or EAGER))  # +static: its mode's check
    chain = Chain.from_dict(source.chain) if source.chain else None
    missing = [path for path in (chain.blocks if chain else ()) if not _has_submodule(model, path)]
    if missing:
        raise UsageError(f"the report's blocks are not in this {type(model).__name__} (no {missing[0]}): apply a report "
                         f"made for this model")
    micro = int(accumulation.get("micro_batch_size") or fields["batch_size"])
    if plan.state:  # the wrapper's part of the plan: apply() cannot do it for the caller
        logger.warning("plan %s was measured with the training state in host memory: wrap the model as it was, FSDP2's "
                       "fully_shard on each block and the root with offload_policy=CPUOffloadPolicy()", plan)
    if PRECISIONS[fields["precision"]].fsdp_only:  # the wrapper's precision: apply() cannot wrap for the caller
        logger.warning("precision %s was measured under FSDP2's %s: wrap the model as it was, fully_shard on each "
                       "block and the root with mp_policy=run.mp_policy, and train without autocast (run.autocast() "
                       "does nothing for it)", fields["precision"], PRECISIONS[fields["precision"]].policy)
    applied = prepare(model, precision=fields["precision"], plan=plan, chain=chain, guard=guard,
                      device_type=device_type, micro_batch_size=micro,
                      accumulation_steps=int(accumulation.get("accumulation_steps") or 1))
    row = next((r for r in source.eval_limits or () if (r["precision"], r["segments"]) == (fields["precision"], plan)), {})
    applied.eval_batch_size = row.get("during_training_max_batch_size")
    applied.inference_batch_size = row.get("inference_max_batch_size")
    mode = fields.get("compile") or EAGER
    if mode != EAGER:  # measured compiled: train the compiled model, the plan inside it (run.model; same parameters)
        # MODE+static: plain torch.compile, whose graph at a fixed batch size is the static one measured, and which
        # compiles one dynamic graph where another size comes, not one graph per size (export.STATIC_NOTE)
        applied.model, applied.compile = compile_model(model, compile_mode(mode)), mode
    return applied


def prepare(model: nn.Module, *, precision: str, plan: str, chain: Chain | None, guard: GuardRails,
            device_type: str, micro_batch_size: int, accumulation_steps: int = 1, record_loss_scale: bool = False,
            record_grad_norm: bool = False, host_budget_bytes: int | None = None,
            record_lost_updates: bool = False) -> Applied:
    """Apply the guard rails' fp32 modules, a true precision's dtype (bf16-true casts the model's floating parameters
    and buffers, and its inputs at each call) and the checkpoint plan to ``model`` in place; return its
    :class:`Applied`. ``host_budget_bytes`` bounds what an offloading plan (``PLAN+offload``) holds in host memory. A plan ``PLAN+state``
    prepares the model as ``PLAN`` does: the state's place is the wrapper's (FSDP2's ``CPUOffloadPolicy``).

    The one way a model is prepared for training: :func:`apply` for users, and every trial and
    probe candidate (recording loss scales, and for the probe gradient norms).
    """
    mode = get_mode(precision)
    keep_in_fp32(model, guard.fp32_modules, device_type)
    mode.hold(model)  # bf16-true: the model cast to bf16, and its inputs at each call
    applied_plan = apply_plan(model, plan, chain, host_budget_bytes=host_budget_bytes)
    return Applied(
        model=model,
        precision=mode.name,
        segments=Plan(plan),  # the JSON's and the API's name for the plan
        micro_batch_size=micro_batch_size,
        accumulation_steps=accumulation_steps,
        scaler=mode.grad_scaler(device_type),
        clip_grad_norm=guard.clip_grad_norm,
        device_type=device_type,
        plan=applied_plan.to_dict(),
        record_loss_scale=record_loss_scale,
        record_grad_norm=record_grad_norm,
        record_lost_updates=record_lost_updates and mode.weight_dtype is not None,
    )
