"""The torchrun job a ``--parallel ddp|fsdp`` run belongs to: who this rank is, and how the ranks talk.

Rank 0 (the leader) runs the tuner; it sends each piece of work to the other ranks (the
followers) on a gloo *control group* that no trial ever uses, so it is never left mid-collective.
The venue that runs work on every rank is :mod:`autotune.execution.ranks`; the wrapper a trial
trains under is :mod:`autotune.training.wrapping`; how the ranks agree on one outcome is
:mod:`autotune.execution.agreement`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from typing import Any, Iterable

import torch

from autotune.errors import UsageError
from autotune.units import parse_size
from autotune.vocabulary import PRECISIONS
from autotune.device import collective_backend, rank_device

__all__ = ["RANK_BUDGETS_ENV", "Job", "Ended", "RankInterrupted", "RankRefused", "join", "leave", "rank_budget",
           "under_torchrun"]

# "1=40MiB,3=20GiB": a smaller budget on some ranks (GPUs with less free memory; the tests' one-rank OOM).
RANK_BUDGETS_ENV = "AUTOTUNE_RANK_BUDGETS"
_CONTROL_TIMEOUT = datetime.timedelta(hours=24)  # followers wait here while the leader checks plans and writes


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or with its environment variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def rank_budget(budget_bytes: int | None, rank: int, env: str | None = None) -> int | None:
    """This rank's budget: ``budget_bytes``, or the smaller one :data:`RANK_BUDGETS_ENV` gives it."""
    text = os.environ.get(RANK_BUDGETS_ENV, "") if env is None else env
    for part in filter(None, (p.strip() for p in text.split(","))):
        who, sep, size = part.partition("=")
        if not sep or not who.strip().isdigit():
            raise UsageError(f"{RANK_BUDGETS_ENV}={text!r}: write RANK=SIZE pairs such as 1=40MiB,3=20GiB")
        if int(who) == rank:
            own = parse_size(size.strip())
            return own if budget_bytes is None else min(own, budget_bytes)
    return budget_bytes


@dataclasses.dataclass
class Job:
    """This process's place in a ``--parallel`` job."""

    wrapper: str  # "ddp" or "fsdp"
    rank: int
    world_size: int
    local_rank: int
    backend: str  # the trials' backend: gloo on the CPU, nccl on CUDA
    control: Any = dataclasses.field(repr=False, default=None)  # the gloo group of commands and agreement
    ended: bool = False  # rank 0 has told the others how it ended
    owns_default: bool = False  # autotune made the default process group (the CLI); a user's script made its own
    trials: int = 0  # trials this rank has entered: every rank counts the same, naming each trial in the store

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def local_world_size(self) -> int:
        """The ranks on this machine (torchrun's LOCAL_WORLD_SIZE; else all of them): they share its host memory."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))

    def device(self, device: torch.device) -> torch.device:
        """The device this rank trains on: its local GPU on CUDA (``--device cuda`` means each rank's own)."""
        return rank_device(device, self.local_rank)

    def describe(self, precisions: Iterable[str] = ()) -> dict[str, Any]:
        """The job in the report's and a trial's ``distributed``; ``precisions``: those of the search, or the trial's
        (``mixed_precision`` says how each trains: autocast, or FSDP2's policy for bf16-fsdp)."""
        return {"backend": self.backend, "world_size": self.world_size, "wrapper": self.wrapper,
                "mixed_precision": _mixed_precision(precisions)}

    def send(self, command: tuple) -> None:
        torch.distributed.broadcast_object_list([command], src=0, group=self.control)

    def receive(self) -> tuple:
        box: list[Any] = [None]
        torch.distributed.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        parts: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, obj, group=self.control)
        return parts


def _mixed_precision(precisions: Iterable[str]) -> str:
    """``autocast`` (fp16 and bf16 autocast over the wrapper's fp32 parameters; fp32 has nothing to cast), FSDP2's
    policy for bf16-fsdp alone, bf16-true's weights, and for a search of several, each:
    ``autocast; bf16-fsdp: MixedPrecisionPolicy(...)``."""
    names = list(precisions)
    autocast = ["autocast"] if not names or any(not (PRECISIONS[n].fsdp_only or PRECISIONS[n].true)
                                                for n in names) else []
    others = [(n, PRECISIONS[n].policy or f"the model's weights in {PRECISIONS[n].weight_dtype}, no autocast")
              for n in names if PRECISIONS[n].fsdp_only or PRECISIONS[n].true]
    return "; ".join(autocast + [text if len(names) == 1 else f"{n}: {text}" for n, text in others])


_JOB: Job | None = None  # this process's job: joined once


def join(wrapper: str, device: torch.device) -> Job:
    """Join the torchrun job (the default process group, once per process) as a ``wrapper`` rank."""
    import torch.distributed as dist

    global _JOB
    if _JOB is not None:  # a script calling tune() again: the same groups, perhaps another wrapper
        _JOB.wrapper = wrapper
        return _JOB

    rank_budget(None, 0)  # a malformed AUTOTUNE_RANK_BUDGETS fails on every rank alike, before any trial
    if not under_torchrun():
        raise UsageError(f"--parallel {wrapper} runs under torchrun, one process per GPU: torchrun --nproc-per-node N "
                         f"-m autotune ... --parallel {wrapper} (--parallel none tunes in this process)")
    if not dist.is_available():
        raise UsageError(f"--parallel {wrapper}: this build of torch has no torch.distributed")
    backend = collective_backend(device)
    if backend == "nccl":  # a timed-out trial group aborts its communicator, not the process (the default, 3, would)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo", timeout=_CONTROL_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    _JOB = Job(wrapper, dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), backend, control,
               owns_default=owns)
    return _JOB


def leave() -> None:
    """Destroy the process groups this process made (before it exits: gloo's threads must not outlive them)."""
    import torch.distributed as dist

    global _JOB
    if _JOB is None:
        return
    job, _JOB = _JOB, None
    with contextlib.suppress(Exception):
        dist.destroy_process_group(job.control)
        if job.owns_default and dist.is_initialized():
            dist.destroy_process_group()


@dataclasses.dataclass(frozen=True)
class RankInterrupted:
    """A rank's report that Ctrl-C (or SIGTERM) stopped its part of the trial."""

    rank: int


@dataclasses.dataclass(frozen=True)
class RankRefused:
    """A rank's report that its trial met bad input (a :class:`UsageError`): the job stops with it, on every rank."""

    rank: int
    message: str



@dataclasses.dataclass(frozen=True)
class Ended:
    """How the leader ended, as the followers reproduce it."""

    kind: str  # "report", "interrupted", "usage", "error"
    report: Any = None  # the leader's Report (pickled to the followers as it is)
    message: str = ""
