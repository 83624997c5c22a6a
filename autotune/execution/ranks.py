"""The venue of a ``--parallel ddp|fsdp`` job: every piece of work on every torchrun rank, the ranks agreeing.

* **One writer.** Rank 0 (the leader) runs the tuner: it owns the Optuna study and the JSON, and
  sends each piece of work to the other ranks (the followers) as a command on the job's control
  group (:mod:`autotune.execution.job`). Followers only train (:func:`follow`). When the leader
  ends, it sends its outcome (the report, bad input, an interruption, an error), so every rank
  returns or raises the same thing (:func:`lead`).
* **A process group per piece of work.** Each trial trains on a process group of its own, with a
  short timeout. A rank that fails mid-step (out of memory, a time-out, an error in the model)
  leaves the others inside the wrapper's collectives (:mod:`autotune.training.wrapping`): it
  destroys the group at once, which ends theirs with an error on gloo (on NCCL the watch of
  :mod:`autotune.execution.watch` aborts it), and at the group's timeout at worst. Only then do
  the ranks agree on the outcome (:mod:`autotune.execution.agreement`), on the control group.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
from typing import Any

import torch

from autotune._log import logger
from autotune.errors import AutotuneError, Interrupted, UsageError, first_line
from autotune.execution.job import Ended, Job, RankInterrupted, RankRefused
from autotune.execution.watch import Watch, say_left
from autotune.execution.work import Place, Venue, Work
from autotune.training.wrapping import Wrapping
from autotune.signals import shielded
from autotune.training.workload import Workload

__all__ = ["Ranks", "lead", "follow", "portable", "own_spec", "OWN"]


class Ranks(Venue):
    """Every piece of work on every rank of ``job`` (this process is its leader), under the job's wrapper."""

    kind = "ranks"

    def __init__(self, device: torch.device, job: Job) -> None:
        super().__init__(device)
        self.job = job

    def admit(self, workload: Workload) -> None:
        if workload.spec is None:
            raise UsageError("--parallel needs a workload built from specs (a model class or MODULE:ATTR), so that "
                             "every rank can build it")

    def run(self, workload: Workload, work: Work) -> Any:
        """The leader's side: every rank runs ``work`` and they agree on one result. Ctrl-C on any rank raises here."""
        if not work.every_rank:
            return work.run(workload, Place(self.device))
        self.admit(workload)
        job, instead = self.job, None
        try:
            with shielded(), _ranks_gone():  # the command goes out whole
                job.send(("work", portable(workload.spec), work))
        except KeyboardInterrupt:  # sent: the others are making the work's group, so this rank joins and leaves it
            instead = RankInterrupted(job.rank)
        local = _on_group(job, work, workload, self.device, instead)
        with shielded(), _ranks_gone():  # every rank leaves the agreement together
            agreed = work.agree(job.gather(local), job)
        if isinstance(agreed, RankInterrupted):
            raise KeyboardInterrupt(f"rank {agreed.rank} was interrupted")
        if isinstance(agreed, RankRefused):
            raise UsageError(agreed.message if agreed.rank == 0 else f"rank {agreed.rank}: {agreed.message}")
        return agreed


OWN = "<each rank's own>"  # a spec entry every rank fills from its own call (an object, not a MODULE:ATTR)
_OBJECTS = ("model", "data", "loss", "step", "optimizer")  # the entries that may hold the user's objects


def portable(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` as the leader sends it: the user's objects (a model copy, a dataset, a trainer's loss) stay on each
    rank, which passed its own to its own call under torchrun; names, classes and functions go as they are."""
    return {k: OWN if k in _OBJECTS and not (v is None or isinstance(v, (str, type)) or inspect.isfunction(v)) else v
            for k, v in spec.items()}


def own_spec(options: Any) -> dict[str, Any]:
    """The entries a follower fills with its own objects: what its own call was given."""
    return {"model": options.model, "data": options.data, "loss": options.loss, "step": options.step,
            "optimizer": options.optimizer}


@contextlib.contextmanager
def _ranks_gone() -> Any:
    """A collective on the control group that fails means a rank died (killed, out of host memory): say so."""
    try:
        yield
    except Exception as exc:
        raise AutotuneError(f"a rank of the job is gone ({type(exc).__name__}: {first_line(exc)}); finished trials "
                            f"are kept: run the same command to continue") from None


# Making a group connects every pair of ranks, and a rank that died meanwhile is waited for until the group's timeout
# (not noticed, as a collective notices a closed connection): the ranks meet on the control group first, so this
# covers only the moment between that meeting and the group.
_CONNECT_TIMEOUT = datetime.timedelta(seconds=60)


def _group_timeout(timeout_s: float | None) -> datetime.timedelta:
    """A piece of work's group gives up on a silent rank a minute after its own limit."""
    return datetime.timedelta(seconds=(timeout_s or 600.0) + 60.0)


def _set_timeout(group: Any, timeout: datetime.timedelta) -> None:
    """The collectives' timeout of a group made with a shorter one to connect (torch >= 2.3; public as dist.set_timeout later)."""
    import torch.distributed as dist

    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    set_timeout(timeout, group)


def _on_group(job: Job, work: Work, workload: Any, device: torch.device,
              instead: RankInterrupted | RankRefused | None = None) -> Any:
    """This rank's part of ``work``, on a process group of its own (destroyed at once when it fails)."""
    import torch.distributed as dist

    job.trials += 1
    try:
        with shielded(), _ranks_gone():  # every rank makes the group: a Ctrl-C waits for it
            job.gather(None)  # every rank is here (a dead one fails this at once; making a group would wait for it)
            group = dist.new_group(backend=job.backend, timeout=_CONNECT_TIMEOUT)
            _set_timeout(group, _group_timeout(work.timeout_s))
    except KeyboardInterrupt:  # held until the group was made (it is assigned): this rank leaves it at once
        instead = instead or RankInterrupted(job.rank)
    watch = Watch(job, group) if job.backend == "nccl" else None
    local = instead or RankInterrupted(job.rank)
    try:
        if instead is None:  # interrupted, or the workload refused, before the trial: leave at once
            local = work.run(workload, Place(device, parallel=Wrapping(job, group, device)))
    except KeyboardInterrupt:
        pass
    except UsageError as exc:  # agreed like any outcome, then raised on rank 0: the others must not wait for it
        local = RankRefused(job.rank, str(exc))
    finally:
        try:
            with shielded():  # the group goes whole, whatever comes: the agreement follows on every rank
                if isinstance(local, (RankInterrupted, RankRefused)) or work.left_early(local):
                    say_left(job)
                if watch is not None:
                    watch.stop()
                with contextlib.suppress(Exception):  # an aborted NCCL group may refuse to be destroyed
                    dist.destroy_process_group(group)  # on gloo, a rank in a collective of the group errs now
        except KeyboardInterrupt:
            local = RankInterrupted(job.rank)
    return local


def lead(job: Job, run: Any) -> Any:
    """Run ``run()`` on the leader; whatever it returns or raises, tell the followers, so they end the same way."""
    outcome = Ended("error", message="rank 0 failed")
    job.ended = False
    try:
        report = run()
        outcome = Ended("report", report)
        return report
    except Interrupted as exc:
        outcome = Ended("interrupted", exc.report)
        raise
    except UsageError as exc:
        outcome = Ended("usage", message=str(exc))
        raise
    except BaseException as exc:
        outcome = Ended("interrupted" if isinstance(exc, KeyboardInterrupt) else "error",
                        message=f"rank 0: {type(exc).__name__}: {exc}")
        raise
    finally:
        with shielded():
            try:
                job.send(("end", outcome))
            except Exception as exc:  # noqa: BLE001 - a follower already gone: nothing to tell it
                logger.debug("could not tell the other ranks that rank 0 ended: %s", exc)
            job.ended = True


def follow(job: Job, device: torch.device, own: dict[str, Any] | None = None) -> Any:
    """A follower's life: run the leader's pieces of work until it ends; return its report or raise what it raised.

    ``own`` (:func:`own_spec`) fills the entries the leader left to each rank (:func:`portable`).
    """
    workloads: dict[str, Workload] = {}
    interrupted = False
    while True:
        try:
            with shielded():  # a Ctrl-C waits for the whole command
                command = job.receive()
        except KeyboardInterrupt:  # held until the whole command came (it is assigned): answered as interrupted
            interrupted = True
        except Exception as exc:
            raise AutotuneError(f"rank {job.rank}: rank 0 is gone ({type(exc).__name__}: {exc})") from None
        if command[0] == "end":
            outcome: Ended = command[1]
            if interrupted and outcome.kind == "report":  # this rank was stopped: it exits as stopped
                raise KeyboardInterrupt()
            if outcome.kind == "report":
                return outcome.report
            if outcome.kind == "interrupted":
                if outcome.report is not None:
                    raise Interrupted(outcome.report)
                raise KeyboardInterrupt()
            if outcome.kind == "usage":
                raise UsageError(outcome.message)
            raise AutotuneError(outcome.message)
        _, spec, work = command
        spec = {k: (own or {}).get(k) if isinstance(v, str) and v == OWN else v for k, v in spec.items()}
        key = repr(sorted(spec.items()))
        instead = RankInterrupted(job.rank) if interrupted else None
        try:
            if key not in workloads:
                workloads[key] = Workload.from_specs(**spec)
        except UsageError as exc:  # this rank cannot build what rank 0 built (another node's files): agreed, then fatal
            instead = instead or RankRefused(job.rank, str(exc))
        try:
            local = _on_group(job, work, workloads.get(key), device, instead)
        except KeyboardInterrupt:
            local = RankInterrupted(job.rank)
        try:
            with shielded():
                job.gather(local)
        except KeyboardInterrupt:  # after the agreement: the next command is answered as interrupted
            interrupted = True
