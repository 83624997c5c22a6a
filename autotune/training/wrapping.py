"""How a model trains on one trial's process group: DDP, or FSDP2 on each repeated block and the root.

Mixed precision is autocast under both wrappers, as in a single process: FSDP2's
``MixedPrecisionPolicy`` (parameters cast for the all-gather) is not searched, and each trial's
``distributed.mixed_precision`` says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autotune.errors import UsageError
from autotune.training.host_state import offload_policy
from autotune.device import autocast_type, device_ids

__all__ = ["Wrapping"]


class Wrapping:
    """One trial's process group, and how a model trains on it: the wrapper, and agreed step times."""

    def __init__(self, job: Any, group: Any, device: torch.device) -> None:
        """``job``: the torchrun job (:class:`autotune.execution.job.Job`, a floor above: its ``wrapper``, ranks and
        control group); ``group``: the trial's own process group."""
        self.job, self.group, self.device = job, group, device

    def wrap(self, model: nn.Module, blocks: tuple[str, ...], *, offload_state: bool = False) -> nn.Module:
        """``model`` (on its device, plan applied) under DDP, or FSDP2 on each of ``blocks`` and the root.

        ``offload_state`` (a ``PLAN+state``, FSDP2 only): the state in host memory under FSDP2's ``CPUOffloadPolicy``
        (:mod:`autotune.training.host_state`); the model may then still be on the CPU: FSDP2 moves and shards one
        block at a time."""
        if offload_state and self.job.wrapper != "fsdp":
            raise UsageError(f"a plan with +state keeps FSDP2's sharded state in host memory: it needs --parallel fsdp, "
                             f"not {self.job.wrapper}")
        if self.job.wrapper == "ddp":
            return self._ddp(model)
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        mesh = self._mesh()
        policy = {"offload_policy": offload_policy(self.device)} if offload_state else {}
        for path in blocks:
            fully_shard(model.get_submodule(path), mesh=mesh, **policy)
        fully_shard(model, mesh=mesh, **policy)
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

    def slowest(self, seconds: float, late: bool) -> tuple[float, bool]:
        """The slowest rank's time of this step, and whether any rank would run past its time limit next."""
        on = self.device if self.job.backend == "nccl" else torch.device("cpu")
        both = torch.tensor([seconds, float(late)], dtype=torch.float64, device=on)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return float(both[0]), bool(both[1])
