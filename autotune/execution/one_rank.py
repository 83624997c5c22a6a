"""One rank of a ``--parallel ddp|fsdp`` job, predicted in this process (``--dry-run --world-size N``).

PyTorch's fake process group (``torch.testing._internal.distributed.fake_pg``, backend ``fake``: what PyTorch's own
memory-tracker tests and torchtitan's memory estimate use) is a group of N ranks that this process joins as rank 0.
Its collectives return at once and move nothing. Under it and the dry run's fake tensors the trial's own wrapper
(:mod:`autotune.training.wrapping`) runs as it runs on a real rank, and the tensor meter counts what it allocates:

* **FSDP2** shards the model on the meta device and makes only rank 0's shards and the buffers, as a real rank does
  (:mod:`autotune.training.wrapping`; the model on the host is built under the fake tensors with the meter aside):
  each parameter's 1/N (a DTensor: the meter counts its local shard). It gathers each block's
  parameters whole for its forward and again for its backward and frees them after (``resize_(0)``), and
  reduce-scatters the gradients into 1/N shards; the optimizer's state is the shards'. Every one of those buffers
  is FSDP2's own, made before its collective writes into it: the same bytes as on a real rank. The mesh is made
  outside the fake tensors, as torchtitan makes it: it reads its ranks (``tolist``).
* **DDP** builds its Reducer's gradient buckets under the fake tensors (flat buffers, as many bytes as the
  gradients; with ``gradient_as_bucket_view=False``, the default, the gradients stay separate and are copied in and
  out): the meter counts them. The construction's broadcast of the weights runs as on a real rank (torch's own
  ``_sync_module_states`` on the fake group: every weight and buffer flattened into buckets of up to 250 MiB, two in
  flight, the weights twice over for a moment; a model whose weights are frozen, an adapter's, peaks there at a
  small batch). Two things are not a real rank's. The construction's shape check is skipped (``init_sync=False``: it
  reads the parameters' values). And the fake group's all-reduce hands the Reducer no tensor, so the buckets are
  all-reduced by PyTorch's ``noop_hook`` (the bucket as it is; a real all-reduce also works in place). DDP rebuilds its buckets in the second forward pass, reading the order it
  broadcast: a prediction steps once, as a memory trial's metered step does.

What a backend allocates inside a collective (gloo's or NCCL's own buffers, NCCL's communicators) is invisible here,
as it is to the tensor meter on a real rank.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from autotune.errors import UsageError
from autotune.execution.job import Job, under_torchrun
from autotune.training.wrapping import Wrapping

__all__ = ["OneRank", "one_rank"]

BACKEND = "fake"  # the backend torch.testing._internal.distributed.fake_pg registers
BROADCAST_BUCKET_BYTES = 250 * 2**20  # DistributedDataParallel's broadcast_bucket_size, fixed in its constructor


class OneRank:
    """Rank 0 of a ``wrapper`` job of ``world_size`` ranks, in this process (made by :func:`one_rank`)."""

    def __init__(self, wrapper: str, world_size: int, device: torch.device) -> None:
        self.job = Job(wrapper, rank=0, world_size=world_size, local_rank=0, backend=BACKEND)
        self.device = device

    def wrapping(self) -> Wrapping:
        """One prediction's wrapping: the job's group, a mesh named for this trial."""
        import torch.distributed as dist

        self.job.trials += 1
        return _FakeRankWrapping(self.job, dist.group.WORLD, self.device)

    def describe(self, precisions: Iterable[str] = ()) -> dict[str, Any]:
        """What the report's ``distributed`` says: a prediction of rank 0, no job run (``precisions``: the search's)."""
        return {**self.job.describe(precisions), "rank": 0, "predicted": True,
                "process_group": "PyTorch's fake process group in this process (no communication): one rank's "
                                 "training predicted under fake tensors",
                "batch_size": "per rank (micro-batch)"}


@contextlib.contextmanager
def one_rank(wrapper: str, world_size: int, device: torch.device) -> Iterator[OneRank]:
    """This process as rank 0 of ``world_size`` on the fake process group, destroyed on the way out."""
    import torch.distributed as dist

    if not dist.is_available():
        raise UsageError(f"--world-size predicts a --parallel {wrapper} rank: this build of torch has no "
                         f"torch.distributed")
    if under_torchrun() or dist.is_initialized():
        raise UsageError(f"--dry-run --parallel {wrapper} --world-size {world_size} predicts one rank in this one "
                         f"process: run it without torchrun (and outside a script that made a process group)")
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # private; it registers the backend
    except ImportError as exc:
        raise UsageError(f"--world-size needs PyTorch's fake process group ({exc}): this torch has none; run the "
                         f"job under torchrun without --dry-run") from None
    dist.init_process_group(BACKEND, store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield OneRank(wrapper, world_size, device)
    finally:
        dist.destroy_process_group()


class _FakeRankWrapping(Wrapping):
    """The trial's wrapper on the fake group (module docstring): the mesh made outside the fake tensors; DDP without
    its construction's shape check, its buckets all-reduced by ``noop_hook``; FSDP2's model on the host built for each
    prediction, under the fake tensors with the meter aside, as a real rank keeps its real one outside its meter."""

    def _host_model(self, workload: Any, seed: int) -> nn.Module | None:
        from autotune.meters.tensor import meter_aside

        with meter_aside():
            return workload.build_model(seed=seed)

    def _mesh(self) -> Any:
        from torch._subclasses.fake_tensor import unset_fake_temporarily  # private, in every torch autotune supports

        with unset_fake_temporarily():  # a mesh of fake tensors has no ranks to read; the meter still counts it
            return super()._mesh()

    def _ddp(self, model: nn.Module) -> nn.Module:
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
        from torch.nn.parallel import DistributedDataParallel

        if "init_sync" not in inspect.signature(DistributedDataParallel.__init__).parameters:
            raise UsageError(f"predicting DDP needs DistributedDataParallel(init_sync=False) (torch 2.7 or later; "
                             f"this is {torch.__version__}): use --parallel fsdp, or run the job under torchrun")
        # The weights' broadcast of a real construction, as it runs there (before the Reducer's buckets are made):
        # flattened into buckets, two in flight, counted here as there. It was left out as below a step's peak, which
        # it is not where the weights are frozen (an adapter's model): 2x the weights at once, against a step's
        # weights and little else (the zoo's LoRA Llama at batch 2, plan all: 11% under its measurement)
        from torch.distributed.utils import _sync_module_states  # private, and what DistributedDataParallel calls

        _sync_module_states(model, self.group, BROADCAST_BUCKET_BYTES, 0,
                            set(getattr(model, "_ddp_params_and_buffers_to_ignore", ())))
        ddp = DistributedDataParallel(model, process_group=self.group, init_sync=False)
        ddp.register_comm_hook(None, noop_hook)
        return ddp
