"""How a model trains on one trial's process group: DDP, or FSDP2 on each repeated block and the root.

Mixed precision is autocast under both wrappers (fp16, bf16), as in a single process, except the precision
``bf16-fsdp``: FSDP2's own ``MixedPrecisionPolicy`` on every unit (each block and the root), parameters gathered and
computed with in bf16, gradients reduced in fp32, the shards and the optimizer's state in fp32, no autocast
(torchtitan's). Each trial's ``distributed.mixed_precision`` says which.

**An FSDP2 rank never holds the whole model on its device**, as torchtitan's ranks do not: the model is
copied to the meta device (shapes, no memory), prepared and sharded there, and then only the rank's
shards and the buffers are made on the device (``to_empty``, FSDP2 re-padding each shard) and given
their values (:class:`MetaBuild`). The values are those of the model the workload keeps on the host
(:meth:`Workload.warm <autotune.training.workload.Workload.warm>`: built once per process, seeded, as
every rank built it before), each rank copying its own rows of each parameter: the model trained is
the one a build on the device would give, bitwise, buffers (BatchNorm's statistics) and tied weights
included. Unlike torchtitan's ``init_weights`` on the device, a user's own initialisation is kept.
On the CPU device and host are one memory: the tensor meter counts the kept model as the host's (it
is built with the meter aside, as a trial's own :func:`autotune.execution.trial.run_trial` builds it
before its meter starts), and it stays kept between trials, as on CUDA. A model that is not kept (its
deep copy fails, or its build places it on a device) is built whole on the device and sharded there,
as before, with a notice; so is a ``PLAN+state`` (FSDP2 shards it from the host one block at a time:
:mod:`autotune.training.host_state`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake  # private, and in every torch autotune supports

from autotune._log import notice_once
from autotune.errors import AutotuneError, UsageError
from autotune.meters.tensor import meter_aside
from autotune.training.host_state import offload_policy
from autotune.training.precision import get_mode
from autotune.vocabulary import PRECISIONS, Parallel, PrecisionName
from autotune.device import autocast_type, device_ids

if TYPE_CHECKING:
    from autotune.training.workload import Workload

__all__ = ["Wrapping", "RankBuild", "MetaBuild", "SlowestRank"]


class Wrapping:
    """One trial's process group, and how a model trains on it: the wrapper, and agreed step times."""

    def __init__(self, job: Any, group: Any, device: torch.device) -> None:
        """``job``: the torchrun job (:class:`autotune.execution.job.Job`, a floor above: its ``wrapper``, ranks and
        control group); ``group``: the trial's own process group."""
        self.job, self.group, self.device = job, group, device

    def build(self, workload: "Workload", seed: int, *, offload_state: bool = False) -> "RankBuild":
        """The model a trial prepares and wraps, and under FSDP2 its :class:`MetaBuild` (``wrap`` materialises it): a
        copy on the meta device of the model the workload keeps on the host (module docstring). Under DDP, for a
        ``PLAN+state`` and for a model not kept: the workload's build, whole, on the host (no meta build)."""
        if self.job.wrapper != Parallel.FSDP or offload_state:
            return RankBuild(workload.build_model(seed=seed))
        source = self._host_model(workload, seed)
        why = "autotune keeps no copy of it on the host (its deep copy fails, or its build places it on a device)"
        if source is not None:
            try:
                model = _on_meta(source).train()
                return RankBuild(model, MetaBuild(model, source))
            except Exception as exc:  # noqa: BLE001 - whatever stops the copy, the model is built as before
                why = f"its copy on the meta device failed ({type(exc).__name__}: {exc})"
        notice_once(f"{workload.name} is built whole on each rank's device before FSDP2 shards it: {why}; a rank's "
                    f"peak may include the whole model")
        return RankBuild(workload.build_model(seed=seed))

    def _host_model(self, workload: "Workload", seed: int) -> nn.Module | None:
        """The model on the host whose values the rank's shards copy: the one the workload keeps (built here where a
        trial did not build it before its meter: the CPU's tensor meter steps aside, the host's memory is not the
        device's); None where it keeps none."""
        with meter_aside():
            workload.warm(seed)
        return workload.kept_model(seed)

    def wrap(self, model: nn.Module, blocks: tuple[str, ...], *, offload_state: bool = False,
             meta: "MetaBuild | None" = None, precision: str = PrecisionName.FP32) -> nn.Module:
        """``model`` (on its device, plan applied) under DDP, or FSDP2 on each of ``blocks`` and the root.

        ``offload_state`` (a ``PLAN+state``, FSDP2 only): the state in host memory under FSDP2's ``CPUOffloadPolicy``
        (:mod:`autotune.training.host_state`); the model may then still be on the CPU: FSDP2 moves and shards one
        block at a time. ``meta``: ``model`` is on the meta device (:meth:`build`): sharded there, then this rank's
        shards made on the device and filled. ``precision``: the trial's; ``bf16-fsdp`` (FSDP2 only) is FSDP2's
        ``MixedPrecisionPolicy`` on every unit."""
        if offload_state and self.job.wrapper != Parallel.FSDP:
            raise UsageError(f"a plan with +state keeps FSDP2's sharded state in host memory: it needs --parallel fsdp, "
                             f"not {self.job.wrapper}")
        mp_policy = get_mode(precision).mp_policy()
        if mp_policy is not None and self.job.wrapper != Parallel.FSDP:
            raise UsageError(f"precision {precision} is FSDP2's {PRECISIONS[precision].policy}: it needs --parallel "
                             f"fsdp, not {self.job.wrapper}")
        if self.job.wrapper == Parallel.DDP:
            return self._ddp(model)
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        mesh = self._mesh()
        policy = {"offload_policy": offload_policy(self.device)} if offload_state else {}
        if mp_policy is not None:
            policy["mp_policy"] = mp_policy
        for path in blocks:
            fully_shard(model.get_submodule(path), mesh=mesh, **policy)
        fully_shard(model, mesh=mesh, **policy)
        if meta is not None:
            meta.materialise(self.device)
        return model

    def _ddp(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=device_ids(self.device), process_group=self.group)

    def _mesh(self) -> Any:
        """The trial's one-dimensional device mesh over its group."""
        from torch.distributed.device_mesh import DeviceMesh

        # A mesh named for this trial: meshes of equal ranks and names are equal, and DTensor's caches (the
        # sharding plans of clip_grad_norm_, of the GradScaler's unscale_) would hand a later trial the group
        # of an earlier one, destroyed by then ("Could not resolve the process group registered under ...").
        return DeviceMesh.from_group(self.group, autocast_type(self.device), mesh_dim_names=(f"trial{self.job.trials}",))

    def slowest(self, seconds: float, late: bool) -> "SlowestRank":
        """The slowest rank's time of this step, and whether any rank would run past its time limit next."""
        on = self.device if self.job.backend == "nccl" else torch.device("cpu")
        both = torch.tensor([seconds, float(late)], dtype=torch.float64, device=on)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return SlowestRank(float(both[0]), bool(both[1]))


@dataclasses.dataclass(frozen=True)
class SlowestRank:
    """A step across the ranks: the slowest rank's ``seconds``, and whether any would run past its time limit next
    (``late``)."""

    seconds: float
    late: bool


@dataclasses.dataclass(frozen=True)
class RankBuild:
    """The model a rank's trial prepares and wraps, and its :class:`MetaBuild` where it is on the meta device (FSDP2's,
    materialised by the wrap; None: a whole model on the host)."""

    model: nn.Module
    meta: "MetaBuild | None" = None


class MetaBuild:
    """A model on the meta device, and for each of its parameters and buffers the tensor on the host that holds its
    value (paired before the plan and the wrap, by module and name: FSDP2 replaces a module's parameters, not the
    module)."""

    def __init__(self, model: nn.Module, source: nn.Module) -> None:
        self.model = model
        self._values = [(mine, table, name, value) for theirs, mine in zip(source.modules(), model.modules())
                        for table in ("_parameters", "_buffers") for name, value in getattr(theirs, table).items()
                        if value is not None]

    def materialise(self, device: torch.device) -> None:
        """Make the sharded model's tensors on ``device`` (FSDP2's shards, the buffers whole) and give each its value:
        a shard the rows of its parameter that this rank holds. The host's tensors are let go."""
        self.model.to_empty(device=device)  # FSDP2's own _apply re-pads each shard as its all-gather needs
        with torch.no_grad(), meter_aside():  # no allocation; a view of a host tensor would count its storage
            for module, table, name, value in self._values:
                _fill(getattr(module, table)[name], value)
        self._values = []


def _fill(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` (a whole parameter or buffer) into ``tensor``: a DTensor's own shard gets its rows of it."""
    if not hasattr(tensor, "device_mesh"):
        tensor.copy_(value)
        return
    from torch.distributed.tensor import Shard

    mesh, local = tensor.device_mesh, tensor.to_local()
    if tuple(tensor.placements) != (Shard(0),) or mesh.ndim != 1:
        raise AutotuneError(f"cannot fill a parameter sharded as {tensor.placements} (FSDP2's is Shard(0))")
    rows = -(-value.shape[0] // mesh.size())  # torch.chunk's, FSDP2's: the last ranks' shards may be short or empty
    start = min(mesh.get_local_rank() * rows, value.shape[0])
    local.copy_(value.narrow(0, start, local.shape[0]))


def _on_meta(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on the meta device (tied ones stay tied)."""
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in memo:
            empty = torch.empty_like(t, device="meta")
            kind = nn.Parameter if is_fake(t) else type(t)  # a fake parameter's type is FakeTensor (a dry run's)
            memo[id(t)] = kind(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)
