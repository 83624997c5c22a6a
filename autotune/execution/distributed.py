"""Tune a distributed training job: every trial on every rank under DDP or FSDP2, the ranks agreeing.

``torchrun --nproc-per-node N -m autotune ... --parallel ddp|fsdp`` (``none``, the default, keeps
torchrun's ranks independent workers sharing one study). Here:

* **One writer.** Rank 0 (the leader) runs the tuner: it owns the Optuna study and the JSON, and
  sends each trial to the other ranks (the followers) as a command on a gloo control group.
  Followers only train. When the leader ends, it sends its outcome (the report, bad input, an
  interruption, an error), so every rank returns or raises the same thing.
* **A trial per process group.** Each trial trains on a process group of its own, with a short
  timeout. A rank that fails mid-step (out of memory, a time-out, an error in the model) leaves
  the others inside the wrapper's collectives: it destroys the trial's group at once, which ends
  theirs with an error on gloo (and at the group's timeout at worst). Only then do the ranks agree
  on the outcome, on the control group, which no trial ever uses, so it is never left mid-collective.
* **Agreement.** An outcome on any rank is the trial's on every rank, in the order oom > crashed >
  timeout > failed; a rank's error caused only by another rank leaving the group counts last. The
  peak is the largest rank's (each rank's is kept); throughput is global: world size x micro-batch
  over the slowest rank's step, each step's time taken as the slowest rank's (the ranks agree after
  every timed step, so they also stop timing at the same step).

Mixed precision is autocast under both wrappers, as in a single process: FSDP2's
``MixedPrecisionPolicy`` (parameters cast for the all-gather) is not searched, and each trial's
``distributed.mixed_precision`` says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from typing import Any

import torch
from torch import nn

from autotune._log import logger
from autotune.errors import AutotuneError, UsageError, first_line
from autotune.records import Config, Measurement, ProbeResult, timing_fields

__all__ = ["leave", "end_early", "RANK_BUDGETS_ENV", "Job", "Wrapping", "join", "run_everywhere", "probe_everywhere", "follow", "lead",
           "combine", "rank_budget", "under_torchrun"]

# "1=40MiB,3=20GiB": a smaller budget on some ranks (GPUs with less free memory; the tests' one-rank OOM).
RANK_BUDGETS_ENV = "AUTOTUNE_RANK_BUDGETS"
_ORDER = ("oom", "crashed", "timeout", "failed")  # which rank's outcome is the trial's
_CONTROL_TIMEOUT = datetime.timedelta(hours=24)  # followers wait here while the leader checks plans and writes
# What a rank's error says when only another rank's leaving caused it (gloo's closed pair, NCCL's abort).
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "gloo", "nccl", "disterror",
              "distbackenderror", "distnetworkerror")


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or with its environment variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def rank_budget(budget_bytes: int | None, rank: int, env: str | None = None) -> int | None:
    """This rank's budget: ``budget_bytes``, or the smaller one :data:`RANK_BUDGETS_ENV` gives it."""
    from autotune.units import parse_size

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

    def device(self, device: torch.device) -> torch.device:
        """The device this rank trains on: its local GPU on CUDA (``--device cuda`` means each rank's own)."""
        if device.type != "cuda":
            return device
        torch.cuda.set_device(self.local_rank)
        return torch.device("cuda", self.local_rank)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "world_size": self.world_size, "wrapper": self.wrapper,
                "mixed_precision": "autocast"}

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
    backend = "nccl" if device.type == "cuda" else "gloo"
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


def end_early(wrapper: str, device: torch.device, message: str) -> None:
    """Rank 0 met bad input before the tuner ran (an unwritable --out): tell the followers, who wait for it."""
    if not under_torchrun() or os.environ.get("RANK") != "0":
        return
    job = join(wrapper, device)
    if not job.ended:
        job.send(("end", _Outcome("usage", message=message)))
        job.ended = True


class Wrapping:
    """One trial's process group, and how a model trains on it: the wrapper, and agreed step times."""

    def __init__(self, job: Job, group: Any, device: torch.device) -> None:
        self.job, self.group, self.device = job, group, device

    def wrap(self, model: nn.Module, blocks: tuple[str, ...]) -> nn.Module:
        """``model`` (on its device, plan applied) under DDP, or FSDP2 on each of ``blocks`` and the root."""
        if self.job.wrapper == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            return DistributedDataParallel(model, device_ids=ids, process_group=self.group)
        from torch.distributed.device_mesh import DeviceMesh

        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        # A mesh named for this trial: meshes of equal ranks and names are equal, and DTensor's caches (the
        # sharding plans of clip_grad_norm_, of the GradScaler's unscale_) would hand a later trial the group
        # of an earlier one, destroyed by then ("Could not resolve the process group registered under ...").
        mesh = DeviceMesh.from_group(self.group, self.device.type, mesh_dim_names=(f"trial{self.job.trials}",))
        for path in blocks:
            fully_shard(model.get_submodule(path), mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def slowest(self, seconds: float, late: bool) -> tuple[float, bool]:
        """The slowest rank's time of this step, and whether any rank would run past its time limit next."""
        on = self.device if self.job.backend == "nccl" else torch.device("cpu")
        both = torch.tensor([seconds, float(late)], dtype=torch.float64, device=on)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return float(both[0]), bool(both[1])


@dataclasses.dataclass(frozen=True)
class _Interrupted:
    """A rank's report that Ctrl-C (or SIGTERM) stopped its part of the trial."""

    rank: int


@dataclasses.dataclass(frozen=True)
class _Refused:
    """A rank's report that its trial met bad input (a :class:`UsageError`): the job stops with it, on every rank."""

    rank: int
    message: str


def _group_timeout(timeout_s: float | None) -> datetime.timedelta:
    """A trial's group gives up on a silent rank a minute after the trial's own limit."""
    return datetime.timedelta(seconds=(timeout_s or 600.0) + 60.0)


def _trial(job: Job, workload: Any, device: torch.device, parallel: Wrapping, *, config: Config,
           budget_bytes: int | None, settings: Any, timed: bool, metered: bool) -> Measurement:
    """This rank's part of a search trial."""
    from autotune.device import backend_for
    from autotune.execution.trial import run_trial

    meter = backend_for(device).meter(rank_budget(budget_bytes, job.rank))
    return run_trial(workload, config, device=device, meter=meter, settings=settings, timed=timed, metered=metered,
                     parallel=parallel)


def _probe(job: Job, workload: Any, device: torch.device, parallel: Wrapping, *, trial: dict,
           budget_bytes: int | None, headroom: float, settings: Any, guard: Any) -> "ProbeResult":
    """This rank's part of a probe candidate: its share of the data's slice."""
    from autotune.execution.probe import run_probe

    budget = rank_budget(budget_bytes, job.rank)
    return run_probe(workload, Measurement.from_dict(trial), device=device, budget_bytes=budget, headroom=headroom,
                     settings=settings, guard=guard, parallel=parallel)


_WORK = {"trial": _trial, "probe": _probe}


def _probe_status(r: ProbeResult) -> str:
    """The outcome a rejected candidate's reason starts with ("oom", "failed", ...); a verdict's first words else."""
    return (r.reason or "").split(":")[0]


def _left(local: Any) -> bool:
    """Whether this rank stopped before the others could (an exception, not a verdict on a finished run)."""
    if isinstance(local, Measurement):
        return local.status != "ok"
    if isinstance(local, ProbeResult):  # "oom: ...", "failed: ..." came from an exception, a verdict did not
        return not local.accepted and _probe_status(local) in _ORDER
    return True


def _on_group(job: Job, kind: str, workload: Any, device: torch.device, kwargs: dict,
              instead: "_Interrupted | _Refused | None" = None) -> Any:
    """This rank's part of a trial or probe, on a process group of its own (destroyed at once when it fails)."""
    import torch.distributed as dist

    from autotune.search.store import shielded

    job.trials += 1
    passes = 2 if kind == "probe" else 1  # the probe on a slowing meter: metered, then timed
    limit = kwargs["settings"].timeout_s
    try:
        with shielded():  # every rank makes the group (a collective on the default group): a Ctrl-C waits for it
            group = dist.new_group(backend=job.backend, timeout=_group_timeout(limit * passes if limit else None))
    except KeyboardInterrupt:  # held until the group was made (it is assigned): this rank leaves it at once
        instead = instead or _Interrupted(job.rank)
    watch = _Watch(job, group) if job.backend == "nccl" else None
    local = instead or _Interrupted(job.rank)
    try:
        if instead is None:  # interrupted, or the workload refused, before the trial: leave at once
            local = _WORK[kind](job, workload, device, Wrapping(job, group, device), **kwargs)
    except KeyboardInterrupt:
        pass
    except UsageError as exc:  # agreed like any outcome, then raised on rank 0: the others must not wait for it
        local = _Refused(job.rank, str(exc))
    finally:
        try:
            with shielded():  # the group goes whole, whatever comes: the agreement follows on every rank
                if _left(local):
                    _say_left(job)
                if watch is not None:
                    watch.stop()
                with contextlib.suppress(Exception):  # an aborted NCCL group may refuse to be destroyed
                    dist.destroy_process_group(group)  # on gloo, a rank in a collective of the group errs now
        except KeyboardInterrupt:
            local = _Interrupted(job.rank)
    return local


def _left_key(job: Job) -> str:
    return f"autotune/trial-{job.trials}/left"


def _say_left(job: Job) -> None:
    """Tell the other ranks, through the job's store, that this rank left the trial (NCCL does not tell them)."""
    from torch.distributed.distributed_c10d import _get_default_store

    with contextlib.suppress(Exception):
        _get_default_store().set(_left_key(job), str(job.rank))


class _Watch:
    """On NCCL, a rank that left a trial does not wake the others: their kernels wait for it until the group's
    timeout, when NCCL's watchdog (by default) ends the whole process. This thread watches the job's store
    for a rank that left and aborts this rank's trial group, so its collectives fail now and the trial ends
    with the others. (gloo needs none: a destroyed group closes its connections, which wakes the peers.)"""

    def __init__(self, job: Job, group: Any, every_s: float = 0.2) -> None:
        import threading

        from torch.distributed.distributed_c10d import _get_default_store

        self.group, self.key, self.store = group, _left_key(job), _get_default_store()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(every_s,), name="autotune-trial-watch", daemon=True)
        self.thread.start()

    def _run(self, every_s: float) -> None:
        try:
            from torch.distributed.distributed_c10d import _abort_process_group
        except ImportError:  # torch < 2.5: the group's timeout is the only way out
            return
        while not self.done.wait(every_s):
            with contextlib.suppress(Exception):
                if self.store.check([self.key]):
                    _abort_process_group(self.group)
                    return

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=5.0)


def _stopped(parts: list[Any]) -> "_Interrupted | _Refused | None":
    """An interruption on any rank, else bad input on any rank: it ends the job, whatever the others measured."""
    return next((p for p in parts if isinstance(p, _Interrupted)), None) or next(
        (p for p in parts if isinstance(p, _Refused)), None)


def _origin(outcomes: list[tuple[str, str] | None]) -> int | None:
    """The rank whose outcome is the job's: per rank its (status, error text), None where it went well.

    The first in the order oom > crashed > timeout > failed > anything else; among failures, one that
    only says another rank left the trial's group (not a cause of its own) comes last.
    """
    def key(status: str, text: str) -> tuple[int, bool]:
        gone = status == "failed" and any(word in text.lower() for word in _PEER_GONE)
        return (_ORDER.index(status) if status in _ORDER else len(_ORDER), gone)

    ranked = [(key(*o), r) for r, o in enumerate(outcomes) if o is not None]
    return min(ranked)[1] if ranked else None


def _largest(items: list[Any], field: str) -> Any:
    """The largest of the ranks' ``field`` (None where no rank has one)."""
    values = [getattr(item, field) for item in items if getattr(item, field) is not None]
    return max(values) if values else None


def combine(parts: list[Measurement | _Interrupted | _Refused], job: Job) -> Measurement | _Interrupted | _Refused:
    """The trial's one measurement from every rank's (index = rank); an interruption anywhere wins, then bad input.

    The outcome is the first rank's in the order oom > crashed > timeout > failed (a failure that
    only says another rank left comes last), its error prefixed with the rank. Peaks are the largest
    rank's; step times are already the slowest rank's (agreed each step), and samples/s count every
    rank's micro-batch.
    """
    stopped = _stopped(parts)
    if stopped:
        return stopped
    ms: list[Measurement] = list(parts)  # type: ignore[arg-type]
    origin = _origin([None if m.status == "ok" else (m.status, m.error or "") for m in ms])
    first = ms[0] if origin is None else ms[origin]
    ok = first.status == "ok"
    times = tuple(ms[0].step_times_s) if ok else ()
    tokens = [None if m.tokens_per_s is None else m.tokens_per_s * sum(m.step_times_s) for m in ms]
    real = round(sum(tokens)) if tokens and None not in tokens and times else None
    ranks = [{"rank": r, "status": m.status, "peak_bytes": m.peak_bytes, "step_s": m.step_s,
              **({"error": m.error} if m.error else {})} for r, m in enumerate(ms)]
    return dataclasses.replace(
        first,
        error=None if origin is None else f"rank {origin}: {first.error}",
        peak_bytes=_largest(ms, "peak_bytes"),
        peak_allocated_bytes=_largest(ms, "peak_allocated_bytes"),
        peak_reserved_bytes=_largest(ms, "peak_reserved_bytes"),
        peak_nvml_bytes=_largest(ms, "peak_nvml_bytes"),
        **timing_fields(first.config.batch_size * job.world_size, times, real, ok),
        wall_s=max(m.wall_s for m in ms),
        distributed={**job.describe(), "outcome_rank": origin, "ranks": ranks},
    )


def combine_probe(parts: list[Any], job: Job) -> Any:
    """A candidate's one probe result from every rank's: accepted when every rank accepted it.

    A rejection is the first rank's in the order oom > crashed > timeout > failed > a verdict (a
    non-finite loss, a collapsed loss scale, too little headroom); worst peaks are the largest
    rank's; samples count every rank's share, over the slowest rank's steps (agreed each step).
    """
    stopped = _stopped(parts)
    if stopped:
        return stopped
    rs: list[ProbeResult] = list(parts)
    origin = _origin([None if r.accepted else (_probe_status(r), r.reason or "") for r in rs])
    first = rs[0]
    samples = sum(r.samples for r in rs)
    rate = sum(r.samples_per_s for r in rs) if origin is None and all(r.samples_per_s for r in rs) else None
    return dataclasses.replace(
        first,
        accepted=origin is None,
        reason=None if origin is None else f"rank {origin}: {rs[origin].reason}",
        samples=samples,
        samples_per_s=rate,  # each rank's samples over the same (slowest) times: their sum is the job's rate
        peak_bytes_max=_largest(rs, "peak_bytes_max"),
        worst_batch_peak_bytes=_largest(rs, "worst_batch_peak_bytes"),
        peak_bytes_median=_largest(rs, "peak_bytes_median"),
        peak_reserved_bytes_max=_largest(rs, "peak_reserved_bytes_max"),
        nonfinite_losses=sum(r.nonfinite_losses for r in rs),
        wall_s=max(r.wall_s for r in rs),
        distributed={**job.describe(), "outcome_rank": origin, "ranks": [
            {"rank": i, "accepted": r.accepted, "peak_bytes_max": r.peak_bytes_max, "samples": r.samples,
             **({"reason": r.reason} if r.reason else {})} for i, r in enumerate(rs)]},
    )


def run_everywhere(job: Job, workload: Any, config: Config, *, device: torch.device, budget_bytes: int | None,
                   settings: Any, timed: bool = True, metered: bool = True) -> Measurement:
    """The leader's trial: every rank runs it, and they agree on one measurement. Ctrl-C on any rank raises here."""
    return _everywhere(job, "trial", workload, device, combine, config=config, budget_bytes=budget_bytes,
                       settings=settings, timed=timed, metered=metered)


def probe_everywhere(job: Job, workload: Any, trial: Measurement, *, device: torch.device, budget_bytes: int | None,
                     headroom: float, settings: Any, guard: Any) -> "ProbeResult":
    """The leader's probe of one candidate: every rank trains its share of the slice under the wrapper."""
    return _everywhere(job, "probe", workload, device, combine_probe, trial=trial.to_dict(), budget_bytes=budget_bytes,
                       headroom=headroom, settings=settings, guard=guard)


def _everywhere(job: Job, kind: str, workload: Any, device: torch.device, agree: Any, **kwargs: Any) -> Any:
    from autotune.search.store import shielded

    if workload.spec is None:
        raise UsageError("--parallel needs a workload built from specs (a model class or MODULE:ATTR), so that every "
                         "rank can build it")
    instead = None
    try:
        with shielded(), _ranks_gone():  # the command goes out whole
            job.send((kind, workload.spec, kwargs))
    except KeyboardInterrupt:  # sent: the others are making the trial's group, so this rank joins and leaves it
        instead = _Interrupted(job.rank)
    local = _on_group(job, kind, workload, device, kwargs, instead)
    with shielded(), _ranks_gone():  # every rank leaves the agreement together
        agreed = agree(job.gather(local), job)
    if isinstance(agreed, _Interrupted):
        raise KeyboardInterrupt(f"rank {agreed.rank} was interrupted")
    if isinstance(agreed, _Refused):
        raise UsageError(agreed.message if agreed.rank == 0 else f"rank {agreed.rank}: {agreed.message}")
    return agreed


@contextlib.contextmanager
def _ranks_gone() -> Any:
    """A collective on the control group that fails means a rank died (killed, out of host memory): say so."""
    try:
        yield
    except Exception as exc:
        raise AutotuneError(f"a rank of the job is gone ({type(exc).__name__}: {first_line(exc)}); finished trials "
                            f"are kept: run the same command to continue") from None


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """How the leader ended, as the followers reproduce it."""

    kind: str  # "report", "interrupted", "usage", "error"
    report: dict | None = None
    message: str = ""


def lead(job: Job, run: Any) -> Any:
    """Run ``run()`` on the leader; whatever it returns or raises, tell the followers, so they end the same way."""
    from autotune.errors import Interrupted
    from autotune.search.store import shielded

    outcome = _Outcome("error", message="rank 0 failed")
    job.ended = False
    try:
        report = run()
        outcome = _Outcome("report", report.to_dict())
        return report
    except Interrupted as exc:
        outcome = _Outcome("interrupted", exc.report.to_dict())
        raise
    except UsageError as exc:
        outcome = _Outcome("usage", message=str(exc))
        raise
    except BaseException as exc:
        outcome = _Outcome("interrupted" if isinstance(exc, KeyboardInterrupt) else "error",
                           message=f"rank 0: {type(exc).__name__}: {exc}")
        raise
    finally:
        with shielded():
            try:
                job.send(("end", outcome))
            except Exception as exc:  # noqa: BLE001 - a follower already gone: nothing to tell it
                logger.debug("could not tell the other ranks that rank 0 ended: %s", exc)
            job.ended = True


def follow(job: Job, device: torch.device) -> Any:
    """A follower's life: run the leader's trials and probes until it ends; return its report or raise what it raised."""
    from autotune.errors import Interrupted
    from autotune.report import Report
    from autotune.search.store import shielded
    from autotune.training.workload import Workload

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
            outcome: _Outcome = command[1]
            if interrupted and outcome.kind == "report":  # this rank was stopped: it exits as stopped
                raise KeyboardInterrupt()
            if outcome.kind == "report":
                return Report.from_dict(outcome.report)
            if outcome.kind == "interrupted":
                if outcome.report is not None:
                    raise Interrupted(Report.from_dict(outcome.report))
                raise KeyboardInterrupt()
            if outcome.kind == "usage":
                raise UsageError(outcome.message)
            raise AutotuneError(outcome.message)
        kind, spec, kwargs = command
        key = repr(sorted(spec.items()))
        instead = _Interrupted(job.rank) if interrupted else None
        try:
            if key not in workloads:
                workloads[key] = Workload.from_specs(**spec)
        except UsageError as exc:  # this rank cannot build what rank 0 built (another node's files): agreed, then fatal
            instead = instead or _Refused(job.rank, str(exc))
        try:
            local = _on_group(job, kind, workloads.get(key), device, kwargs, instead)
        except KeyboardInterrupt:
            local = _Interrupted(job.rank)
        try:
            with shielded():
                job.gather(local)
        except KeyboardInterrupt:  # after the agreement: the next command is answered as interrupted
            interrupted = True

