"""Check each checkpoint plan on the user's own model before the search trusts it.

A plan must only trade time for memory. :mod:`autotune.plans.checkpointing` is exact by construction
for what it can see (each block call recomputed with its own arguments, buffers restored, RNG
replayed), but a model can read state that its own loop changes between the forward and the
backward pass, or a block can write a cache, and no wrapper can see that. So before the search,
each plan trains one step on the user's model and data, at the space's smallest batch size, in
fp32, with the same seed and batch as a step without any plan, and the two are compared: the
loss, every parameter's gradient and every buffer.

A transformers model's key/value cache is one such cache, known and turned off in training while a plan
recomputes, as transformers does under its own checkpointing (:mod:`autotune.plans.cache`): the step without a plan
that such a plan is held against has its cache off too. The cache changes no value, only where keys and values
are laid out in memory (a copy into the cache), which can round a matmul otherwise: the zoo's GPT-2 and T5 gradients
moved by 2.8e-7 and 5.5e-7 of their size with it on.

The comparison is bitwise where the plan-free step is deterministic (two runs of it agree
bitwise, as they do on the CPU). Where they do not (some GPU kernels, a mixture of experts'
scatter), a plan may differ by at most ``NOISE_MULTIPLE`` times the largest relative difference
between those two plan-free runs. A plan that differs more, or whose step fails, is dropped.

Under ``torch.compile`` (``--compile``) a plan is checked compiled against compiled: the reference is the compiled
step without a plan. Inductor fuses a recomputed block's kernels otherwise than a kept one's, so a compiled plan is
not always bitwise equal to the compiled plan-free step; it may differ by ``COMPILED_TOLERANCE`` (or
``NOISE_MULTIPLE`` times the run-to-run noise, where that is larger). What compile itself changes (the compiled
plan-free step against the eager one) is recorded as ``compile_diff`` but sets no tolerance: compiled dropout draws
other random numbers than eager dropout (``compile_diff`` 2.33 on ``tests.models:BatchNormDropout``), and a
tolerance scaled by that would let any plan pass. A plan's real faults are large: masks drawn again otherwise
(differences of the order of the values), batch norm statistics moved twice (an integer counter off by one). The
compiled plan-free step is also the compile check: where it fails, the model does not compile in that mode (its
check, plan ``0``, says why) and the search keeps eager only.

A difference is relative to the value's own largest entry, or to ``SCALE_FLOOR`` times the largest entry of its kind
(every gradient, every buffer) where that is larger. Some gradients are rounding noise by the model's mathematics: a
convolution's weight followed by a batch norm is scale-invariant, its gradient about 1e-6 of the model's largest
(ResNetish), and compiling changes it by a quarter of its own size; measured against the model's gradients, compile
changes ResNetish's by 0.4% at most (fp32, batch 8).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import torch

from autotune.plans import cache
from autotune.plans.checkpointing import apply_plan
from autotune.device import autocast_type, backend_for
from autotune.errors import UsageError, first_line
from autotune.execution.work import Place, Venue, Work
from autotune.training.compiled import CompileCount, compile_failure, compile_model, compiling, mark_batch_dynamic
from autotune.vocabulary import EAGER, CheckStatus, Plan
from autotune.training.precision import keep_in_fp32
from autotune.records import GuardRails, PlanCheck
from autotune.training.workload import Workload, to_device

__all__ = ["PlanCheck", "NOISE_MULTIPLE", "COMPILED_TOLERANCE", "CheckWork", "check_plans", "run_checks", "compare_steps"]

NOISE_MULTIPLE = 8.0  # a plan may differ by this many times the plan-free step's own run-to-run noise
COMPILED_TOLERANCE = 1e-2  # compiled against compiled: what another fusion of the same arithmetic may change
SCALE_FLOOR = 1e-3  # a difference is relative to at least this share of the largest value of its kind (see above)


def _step(workload: Workload, plan: str, batch_size: int, device: torch.device, seed: int,
          guard: GuardRails, blocks: dict[str, tuple[str, ...]] | None = None,
          compile: str = EAGER, caches: list[str] | None = None) -> dict[str, torch.Tensor]:
    """One fp32 training step's loss, gradients and buffers (copied to the CPU), with ``plan`` applied and the model
    compiled in ``compile`` mode (``none``: eager). The paths of the blocks the plan recomputes go to ``blocks[plan]``.
    ``caches``: the step without a plan turns the model's key/value cache off in training, as a plan that recomputes
    does (:mod:`autotune.plans.cache`), and the list gets the modules it turned off.
    """
    model = workload.build_model(seed=seed)
    keep_in_fp32(model, guard.fp32_modules, autocast_type(device))
    applied = apply_plan(model, plan, workload.chain)
    if caches is not None:
        caches.extend(cache.turn_off(model))
    if blocks is not None and applied.chain is not None:
        blocks[plan] = tuple(applied.chain.blocks[i] for i in applied.recomputed)
    model.to(device)
    batch = to_device(workload.make_batch(model, batch_size), device)
    mark_batch_dynamic(batch, batch_size, compile)  # as a trial marks it: this graph serves the search's trials
    try:
        with compiling():
            loss = workload.loss(compile_model(model, compile), batch)
            loss.backward()
    except Exception as exc:  # a dynamo or inductor error is the compile's, said so
        raise (compile_failure(exc) or exc) from exc
    values = {"loss": loss.detach().float().cpu()}
    for name, p in model.named_parameters():
        if p.grad is not None:
            values[f"grad:{name}"] = p.grad.detach().cpu().clone()
    for name, b in model.named_buffers():
        values[f"buffer:{name}"] = b.detach().cpu().clone()
    return values


@dataclasses.dataclass(frozen=True)
class Difference:
    """The largest difference between two steps' values: ``relative`` (to the value's scale), its ``absolute`` size,
    and ``where`` ("loss", "grad:NAME", "buffer:NAME"; None where the steps are equal)."""

    relative: float = 0.0
    absolute: float = 0.0
    where: str | None = None


def compare_steps(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> Difference:
    """The largest relative difference between two steps' values, its absolute size and where it is.

    Relative to the larger of the value's own largest entry in ``a`` and ``SCALE_FLOOR`` times the largest entry of
    its kind (the part of its key before ``:``: every gradient, every buffer). A value present in one step only (a
    gradient that is None in the other) counts as a difference of 1 (inf absolute); NaN in the same places counts as
    equal.
    """
    largest = {k: _largest(x) for k, x in a.items() if x.is_floating_point()}
    floor = {}
    for key, value in largest.items():
        kind = key.split(":")[0]
        floor[kind] = max(floor.get(kind, 0.0), SCALE_FLOOR * value)
    worst = Difference()
    for key in dict.fromkeys([*a, *b]):
        x, y = a.get(key), b.get(key)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            return Difference(1.0, math.inf, key)
        if torch.equal(x, y):
            continue
        if not x.is_floating_point():
            diff = float((x != y).sum())  # a count of differing entries: anything above 0 is a difference
            rel = 1.0
        else:
            same_nan = torch.isnan(x) & torch.isnan(y)
            delta = torch.where(same_nan, torch.zeros_like(x), (x.double() - y.double()).abs())
            diff = float(delta.max())
            if diff == 0.0:
                continue
            scale = max(largest[key], floor[key.split(":")[0]])
            rel = diff / scale if scale > 0 else math.inf
            if math.isnan(diff):  # NaN in one step only
                rel, diff = math.inf, math.inf
        if rel > worst.relative:
            worst = Difference(rel, diff, key)
    return worst


def _largest(x: torch.Tensor) -> float:
    """The largest magnitude among ``x``'s entries, NaN and inf left out (0.0 where none is finite)."""
    finite = x[torch.isfinite(x)]
    return float(finite.double().abs().max()) if finite.numel() else 0.0


def check_plans(workload: Workload, plans: Iterable[str], *, batch_size: int, device: torch.device | str,
                seed: int = 0, guard: GuardRails = GuardRails(), compile: str = EAGER) -> list[PlanCheck]:
    """Check every plan in ``plans`` that recomputes something; return one :class:`PlanCheck` per plan.

    Costs two plan-free steps (the reference and its noise) and one step per plan, all at
    ``batch_size`` in fp32. A reference step that fails fails every plan's check. Compiled (``compile`` not
    ``none``): the steps run compiled, one eager plan-free step more says what compile itself changes, and the
    first check is plan ``0``'s, the compile check (see the module's docstring).
    """
    device = torch.device(device)
    plans = [p for p in dict.fromkeys(map(Plan, plans)) if not p.off]
    compiled = compile != EAGER
    if not plans and not compiled:
        return []
    blocks: dict[str, tuple[str, ...]] = dict.fromkeys(plans, ())
    caches: list[str] = []  # the modules whose cache the plans that recompute turn off: their reference does too
    try:
        count = CompileCount().start()
        reference = _step(workload, "0", batch_size, device, seed, guard, compile=compile, caches=caches)
        noise = compare_steps(reference, _step(workload, "0", batch_size, device, seed, guard, compile=compile,
                                               caches=[])).relative
        graphs = count.graphs if compiled else None
        by_compile = (compare_steps(_step(workload, "0", batch_size, device, seed, guard, caches=[]), reference)
                      if compiled else None)
        # a plan that recomputes nothing (0+offload) keeps the cache, as its reference does
        as_configured = (_step(workload, "0", batch_size, device, seed, guard, compile=compile)
                         if caches and any(p.base.off for p in plans) else reference)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - without a reference nothing can be checked
        error = f"the step without a plan failed: {type(exc).__name__}: {first_line(exc)}"
        return [PlanCheck(p, CheckStatus.FAILED, batch_size, blocks.get(p, ()), error=error, compile=compile)
                for p in ([Plan("0")] if compiled else []) + plans]
    finally:
        backend_for(device).release()
    compile_diff = by_compile.relative if by_compile else None
    tolerance = max(NOISE_MULTIPLE * noise, COMPILED_TOLERANCE if compiled else 0.0)
    checks = [] if not compiled else [PlanCheck(  # the compile check: compile's own difference, accepted
        Plan("0"), CheckStatus.EXACT if compile_diff == 0.0 else CheckStatus.WITHIN_NOISE, batch_size, (),
        max_rel_diff=compile_diff, max_abs_diff=by_compile.absolute, worst=by_compile.where, noise=noise,
        tolerance=tolerance, compile=compile, compile_diff=compile_diff, compiles=graphs)]
    for plan in plans:
        checks.append(_checked(workload, plan, as_configured if plan.base.off else reference, batch_size, device, seed,
                               guard, blocks, noise, tolerance, compile, compile_diff))
    return checks


def _checked(workload: Workload, plan: Plan, reference: dict[str, torch.Tensor], batch_size: int,
             device: torch.device, seed: int, guard: GuardRails, blocks: dict[str, tuple[str, ...]], noise: float,
             tolerance: float, compile: str, compile_diff: float | None) -> PlanCheck:
    """One plan's step against the reference: its :class:`PlanCheck`."""
    extra: dict = dict(compile=compile, compile_diff=compile_diff)
    count = CompileCount().start()
    try:
        step = _step(workload, plan, batch_size, device, seed, guard, blocks, compile=compile)
        extra["compiles"] = count.graphs if compile != EAGER else None
        difference = compare_steps(reference, step)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - a plan whose step fails is dropped, with the reason
        return PlanCheck(plan, CheckStatus.FAILED, batch_size, blocks[plan], noise=noise, tolerance=tolerance,
                         error=f"{type(exc).__name__}: {first_line(exc)}", **extra)
    finally:
        backend_for(device).release()
    rel = difference.relative
    status = CheckStatus.EXACT if rel == 0.0 else CheckStatus.WITHIN_NOISE if rel <= tolerance else CheckStatus.DIFFERS
    return PlanCheck(plan, status, batch_size, blocks[plan], max_rel_diff=rel, max_abs_diff=difference.absolute,
                     worst=difference.where, noise=noise, tolerance=tolerance, **extra)


@dataclasses.dataclass(frozen=True)
class CheckWork(Work):
    """The plan checks as one piece of work (see :func:`check_plans`). In a ``--parallel`` job the leader runs
    them alone: a plan's exactness does not depend on the wrapper (the tests check it under DDP and FSDP2)."""

    plans: tuple[str, ...]
    batch_size: int
    seed: int
    guard: GuardRails
    limit_s: float | None = None
    compile: str = EAGER
    name = "autotune-plan-check"
    every_rank = False

    @property
    def timeout_s(self) -> float | None:
        return self.limit_s

    def run(self, workload: Workload, place: Place) -> list[PlanCheck]:
        return check_plans(workload, self.plans, batch_size=self.batch_size, device=place.device, seed=self.seed,
                           guard=self.guard, compile=self.compile)

    def failed(self, status: str, error: str, seconds: float) -> list[PlanCheck]:
        plans = ((Plan("0"),) if self.compile != EAGER else ()) + self.plans  # compiled: the compile check first
        return [PlanCheck(p, CheckStatus.FAILED, self.batch_size, error=f"the check's {error}", compile=self.compile)
                for p in plans]

    def encode(self, result: list[PlanCheck]) -> list[dict[str, Any]]:
        return [c.to_dict() for c in result]

    def decode(self, data: list[dict[str, Any]]) -> list[PlanCheck]:
        return [PlanCheck.from_dict(c) for c in data]


def run_checks(workload: Workload, plans: Iterable[str], *, venue: Venue, batch_size: int, seed: int,
               guard: GuardRails, timeout_s: float | None, compile: str = EAGER) -> list[PlanCheck]:
    """:func:`check_plans` where the search's trials run (``venue``)."""
    plans = tuple(p for p in dict.fromkeys(map(Plan, plans)) if not p.off)
    if not plans and compile == EAGER:
        return []
    return venue.run(workload, CheckWork(plans, batch_size, seed, guard, timeout_s, compile))
