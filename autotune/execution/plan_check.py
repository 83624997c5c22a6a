"""Check each checkpoint plan on the user's own model before the search trusts it.

A plan must only trade time for memory. :mod:`autotune.plans.checkpointing` is exact by construction
for what it can see (each block call recomputed with its own arguments, buffers restored, RNG
replayed), but a model can read state that its own loop changes between the forward and the
backward pass, or a block can write a cache, and no wrapper can see that. So before the search,
each plan trains one step on the user's model and data, at the space's smallest batch size, in
fp32, with the same seed and batch as a step without any plan, and the two are compared: the
loss, every parameter's gradient and every buffer.

The comparison is bitwise where the plan-free step is deterministic (two runs of it agree
bitwise, as they do on the CPU). Where they do not (some GPU kernels, a mixture of experts'
scatter), a plan may differ by at most ``NOISE_MULTIPLE`` times the largest relative difference
between those two plan-free runs. A plan that differs more, or whose step fails, is dropped.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import torch

from autotune.plans.checkpointing import apply_plan
from autotune.device import autocast_type, backend_for
from autotune.errors import UsageError, first_line
from autotune.execution.work import Place, Venue, Work
from autotune.vocabulary import CheckStatus, Plan
from autotune.training.precision import keep_in_fp32
from autotune.records import GuardRails, PlanCheck
from autotune.training.workload import Workload, to_device

__all__ = ["PlanCheck", "NOISE_MULTIPLE", "CheckWork", "check_plans", "run_checks", "compare_steps"]

NOISE_MULTIPLE = 8.0  # a plan may differ by this many times the plan-free step's own run-to-run noise


def _step(workload: Workload, plan: str, batch_size: int, device: torch.device, seed: int,
          guard: GuardRails, blocks: dict[str, tuple[str, ...]] | None = None) -> dict[str, torch.Tensor]:
    """One fp32 training step's loss, gradients and buffers (copied to the CPU), with ``plan`` applied.

    The paths of the blocks the plan recomputes go to ``blocks[plan]``.
    """
    model = workload.build_model(seed=seed)
    keep_in_fp32(model, guard.fp32_modules, autocast_type(device))
    applied = apply_plan(model, plan, workload.chain)
    if blocks is not None and applied.chain is not None:
        blocks[plan] = tuple(applied.chain.blocks[i] for i in applied.recomputed)
    model.to(device)
    batch = to_device(workload.make_batch(model, batch_size), device)
    loss = workload.loss(model, batch)
    loss.backward()
    values = {"loss": loss.detach().float().cpu()}
    for name, p in model.named_parameters():
        if p.grad is not None:
            values[f"grad:{name}"] = p.grad.detach().cpu().clone()
    for name, b in model.named_buffers():
        values[f"buffer:{name}"] = b.detach().cpu().clone()
    return values


def compare_steps(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float, str | None]:
    """Return (largest relative difference, its absolute difference, where) between two steps' values.

    A value present in one step only (a gradient that is None in the other) counts as a difference
    of 1 (inf absolute); NaN in the same places counts as equal.
    """
    worst = (0.0, 0.0, None)
    for key in dict.fromkeys([*a, *b]):
        x, y = a.get(key), b.get(key)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            return 1.0, math.inf, key
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
            scale = float(torch.where(torch.isnan(x), torch.zeros_like(x), x).double().abs().max())
            rel = diff / scale if scale > 0 else math.inf
            if math.isnan(diff):  # NaN in one step only
                rel, diff = math.inf, math.inf
        if rel > worst[0]:
            worst = (rel, diff, key)
    return worst


def check_plans(workload: Workload, plans: Iterable[str], *, batch_size: int, device: torch.device | str,
                seed: int = 0, guard: GuardRails = GuardRails()) -> list[PlanCheck]:
    """Check every plan in ``plans`` that recomputes something; return one :class:`PlanCheck` per plan.

    Costs two plan-free steps (the reference and its noise) and one step per plan, all at
    ``batch_size`` in fp32. A reference step that fails fails every plan's check.
    """
    device = torch.device(device)
    plans = [p for p in dict.fromkeys(map(Plan, plans)) if not p.off]
    if not plans:
        return []
    blocks: dict[str, tuple[str, ...]] = dict.fromkeys(plans, ())
    try:
        reference = _step(workload, "0", batch_size, device, seed, guard)
        noise = compare_steps(reference, _step(workload, "0", batch_size, device, seed, guard))[0]
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - without a reference nothing can be checked
        error = f"the step without a plan failed: {type(exc).__name__}: {first_line(exc)}"
        return [PlanCheck(p, CheckStatus.FAILED, batch_size, blocks[p], error=error) for p in plans]
    finally:
        backend_for(device).release()
    tolerance = NOISE_MULTIPLE * noise
    checks = []
    for plan in plans:
        try:
            rel, diff, where = compare_steps(reference, _step(workload, plan, batch_size, device, seed, guard, blocks))
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plan whose step fails is dropped, with the reason
            checks.append(PlanCheck(plan, CheckStatus.FAILED, batch_size, blocks[plan], noise=noise, tolerance=tolerance,
                                    error=f"{type(exc).__name__}: {first_line(exc)}"))
            continue
        finally:
            backend_for(device).release()
        status = CheckStatus.EXACT if rel == 0.0 else CheckStatus.WITHIN_NOISE if rel <= tolerance else CheckStatus.DIFFERS
        checks.append(PlanCheck(plan, status, batch_size, blocks[plan], rel, diff, where, noise, tolerance))
    return checks


@dataclasses.dataclass(frozen=True)
class CheckWork(Work):
    """The plan checks as one piece of work (see :func:`check_plans`). In a ``--parallel`` job the leader runs
    them alone: a plan's exactness does not depend on the wrapper (the tests check it under DDP and FSDP2)."""

    plans: tuple[str, ...]
    batch_size: int
    seed: int
    guard: GuardRails
    limit_s: float | None = None
    name = "autotune-plan-check"
    every_rank = False

    @property
    def timeout_s(self) -> float | None:
        return self.limit_s

    def run(self, workload: Workload, place: Place) -> list[PlanCheck]:
        return check_plans(workload, self.plans, batch_size=self.batch_size, device=place.device, seed=self.seed,
                           guard=self.guard)

    def failed(self, status: str, error: str, seconds: float) -> list[PlanCheck]:
        return [PlanCheck(p, CheckStatus.FAILED, self.batch_size, error=f"the check's {error}") for p in self.plans]

    def encode(self, result: list[PlanCheck]) -> list[dict[str, Any]]:
        return [c.to_dict() for c in result]

    def decode(self, data: list[dict[str, Any]]) -> list[PlanCheck]:
        return [PlanCheck.from_dict(c) for c in data]


def run_checks(workload: Workload, plans: Iterable[str], *, venue: Venue, batch_size: int, seed: int,
               guard: GuardRails, timeout_s: float | None) -> list[PlanCheck]:
    """:func:`check_plans` where the search's trials run (``venue``)."""
    plans = tuple(p for p in dict.fromkeys(map(Plan, plans)) if not p.off)
    if not plans:
        return []
    return venue.run(workload, CheckWork(plans, batch_size, seed, guard, timeout_s))
