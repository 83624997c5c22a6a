"""The spawned-worker venue: work in a worker process of its own, so that nothing it does takes the search down.

A trial, a probe candidate or the plan checks that segfault, hit a sticky CUDA error (an illegal
memory access poisons the whole CUDA context), leak, or fragment the caching allocator are
confined to a worker process: started with ``spawn`` (a clean interpreter and a fresh CUDA
context), it builds the workload again from its spec and then serves one piece of work
(:mod:`autotune.execution.work`) after another, sending back each result.

**Warm workers.** Starting a worker costs seconds (an interpreter, ``import torch``, a CUDA
context, the model's build) while a short trial on a GPU steps for milliseconds, so a worker is
kept for the next piece of work of the same workload as long as it is as clean as it started:
after each piece of work it releases what that work left (garbage collection, the allocator's
cache, cuBLAS's workspaces, the peak statistics) and counts what it still holds on the device
(:meth:`~autotune.device.Backend.held_bytes`); more than ``CLEAN_TOLERANCE_BYTES`` above what it
held before its first piece of work, and it is replaced. The result goes back first and the check
follows it, so the search records the trial and chooses the next while the worker checks itself;
the check is read before the worker is handed anything more. That check, not the work's status,
decides whether a worker survives an out-of-memory error. A worker that crashed or timed out is
replaced too, and one found dead between two pieces of work is replaced before it takes the next.

What a reused worker shares with the next trial: the interpreter and its imports, the CUDA
context, the libraries' handles and plans (cuDNN, cuBLAS: a real training run holds them too),
the model's build on the CPU (:meth:`~autotune.training.workload.Workload.warm`: each trial trains
an exact copy) and the worst batches found. What it does not share: anything on the device (the
caching allocator's blocks are handed back and the check above proves it), the peak statistics
(reset), the random state (each trial starts from the seed's), the meter and the budget (each
trial makes its own). ``trials_per_worker=1`` (``--trials-per-worker 1``) is a fresh worker per
piece of work, as before warm workers.

A worker that dies is recorded as ``crashed`` with its exit code or signal; one that hangs past
the work's time limit (plus start-up time for a new worker, ``WARM_GRACE_S`` for a warm one) is
killed and recorded as ``timeout``. A worker whose parent dies (a SIGKILL of the search, which
cannot take its workers with it) exits within a second instead of training on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import io
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch

from autotune._log import log_to_stderr, logger
from autotune.device import backend_for
from autotune.errors import UsageError, first_line
from autotune.execution.work import Place, Venue, Work
from autotune.training.workload import Workload
from autotune.vocabulary import Isolation, Status

__all__ = ["Spawned", "Reply", "TaskResult", "run_isolated", "check_picklable", "STARTUP_GRACE_S", "WARM_GRACE_S",
           "CLEAN_TOLERANCE_BYTES"]

STARTUP_GRACE_S = 120.0  # importing torch and building a CUDA context can take this long on a busy machine
WARM_GRACE_S = 30.0  # a warm worker's time on top of the work's limit: the model's copy, the release and the check
CLEAN_TOLERANCE_BYTES = 1 << 20  # what a reused worker may hold above its first baseline (lazily made constants)
_POLL_S = 1.0
_EXIT_GRACE_S = 30.0


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """What a task handed to a worker came to: ``outcome`` (:attr:`Reply.RESULT`, or the trial's :class:`Status`:
    ``timeout``, ``crashed`` or ``failed``), ``payload`` (what the task returned, or one line saying why) and the
    ``seconds`` it took, the worker's start included."""

    outcome: "Reply | Status"
    payload: Any
    seconds: float


class Reply(str, enum.Enum):
    """What a worker says of a task it took (or that it is gone), beside the trial's own statuses (timeout, crashed):
    the pipe's words, not a trial's outcome."""

    RESULT = "result"  # the task returned: its payload
    USAGE = "usage"  # the task found bad input (UsageError): raised again in the parent, one line
    ERROR = "error"  # any other exception: the worker's text, recorded as the trial's failure
    GONE = "gone"  # the worker died before it took the task (a warm one is replaced once)


def _exit_with(parent: int) -> None:
    """Exit once ``parent`` is gone (killed by SIGKILL, say, it could not kill this worker): no orphan trains on."""
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    os._exit(1)


def _serve(conn: Any, spec: dict, device: str, log_level: int = logging.WARNING) -> None:
    """The worker: build the workload from ``spec`` at the first task, then run tasks until told to stop."""
    # Ctrl-C reaches the whole process group, and a scheduler's SIGTERM often does (systemd's control group,
    # torchrun's children): the parent decides, and kills this worker. If the parent dies first, the worker exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(os.getppid(),), name="autotune-parent-watch", daemon=True).start()
    if log_level < logging.WARNING:  # --verbose: the trial's per-step lines, on the stderr the worker shares
        log_to_stderr()
        logger.setLevel(log_level)
    workload = backend = baseline = None
    tasks, frozen = 0, 0  # frozen: the bytes counted when what the first task left was frozen out of the collector
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent closed its end
            return
        if message[0] == "stop":
            return
        _, task, task_kwargs = message
        conn.send(("taken",))
        try:
            if workload is None:
                workload = Workload.from_specs(**spec)
                backend = backend_for(device)
                # What exists now (interpreter, imports, the workload) lives as long as the worker: frozen out of the
                # collector, so that each trial's garbage collection and the check after it walk only what came later.
                gc.collect()
                gc.freeze()
                baseline = _held(backend, workload)
            reply: tuple = (Reply.RESULT, task(workload, **task_kwargs))
        except UsageError as exc:
            reply = (Reply.USAGE, str(exc))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which records the trial
            reply = (Reply.ERROR, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}")
        conn.send(reply)  # the result first: the parent goes on while this worker checks itself
        held = None if workload is None else _held(backend, workload)
        conn.send(("held", None if held is None else held + frozen, baseline))
        tasks += 1
        if tasks == 1 and held is not None and held <= baseline + CLEAN_TOLERANCE_BYTES:
            # What the first task left (lazy imports, library caches) lives on too: frozen as well, its tensors' bytes
            # counted once here, so that every later collection and check walk only what later tasks made.
            gc.freeze()
            frozen = held if backend.held_by_scan else 0  # an allocator's count sees frozen tensors anyway


def _held(backend: Any, workload: Workload) -> int | None:
    """What the worker holds on the device once the last task's memory is released; None if the device cannot say."""
    try:
        backend.release()
        return backend.held_bytes(workload.kept_tensors())
    except Exception:  # noqa: BLE001 - a sticky CUDA error: the worker is not reused
        return None


class _MainFinder(pickle.Pickler):
    """A pickler that notes the objects it pickles by reference to ``__main__``."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO())
        self.in_main: list[str] = []

    def persistent_id(self, obj: Any) -> None:
        cls = obj if isinstance(obj, type) else type(obj)
        for owner in (obj, cls):
            if getattr(owner, "__module__", None) == "__main__" and (isinstance(owner, type) or callable(owner)):
                self.in_main.append(getattr(owner, "__qualname__", repr(owner)))
                break
        return None


def check_picklable(workload: Workload) -> None:
    """Raise :class:`UsageError` (one line) when a worker process could not rebuild ``workload``.

    A worker is started with ``spawn``: it receives the model, data and loss pickled, by reference
    to their module. A lambda or a local function cannot be pickled at all, and an object defined
    in ``__main__`` (a notebook, ``python -c``) cannot be found by a fresh interpreter unless
    ``__main__`` is a file it can run again. Without this check every trial would crash late.
    """
    if workload.spec is None:
        raise UsageError("process isolation needs a workload built by Workload.from_specs (or autotune.tune)")
    finder = _MainFinder()
    try:
        finder.dump(workload.spec)
    except Exception as exc:  # noqa: BLE001 - PicklingError, AttributeError ("Can't pickle local object"), TypeError
        raise UsageError(f"--isolation process runs trials in a worker process, which needs the model, data and loss "
                         f"pickled, and they cannot be ({type(exc).__name__}: {first_line(exc)}): define them at module "
                         f"level in an importable file (pass MODULE:ATTR), or use --isolation none") from None
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if finder.in_main and not main_file:
        raise UsageError(f"--isolation process runs trials in a worker process, which cannot import "
                         f"{finder.in_main[0]}: it is defined in __main__ (a notebook or python -c), not in a file: move "
                         f"it to a module (pass MODULE:ATTR), or use --isolation none")


def _exit_cause(exitcode: int | None) -> str:
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


_LATE = object()


class _Worker:
    """The parent's handle on one worker process (see the module docstring)."""

    def __init__(self, spec: dict, device: str, name: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.spec, self.tasks = spec, 0
        self.checking = False  # its check after the last task is on its way (read before the next task)
        self.proc = ctx.Process(target=_serve, args=(child, spec, device, logger.getEffectiveLevel()), name=name,
                                daemon=True)
        self.proc.start()
        child.close()  # the worker holds the only other end: its death closes the pipe

    def serves(self, spec: dict) -> bool:
        """Whether this worker built the workload of ``spec`` and is still alive."""
        try:
            same = spec is self.spec or bool(spec == self.spec)
        except Exception:  # noqa: BLE001 - values that do not compare (tensors): another workload
            same = False
        return same and self.proc.is_alive()

    def hand(self, task: Callable[..., Any], task_kwargs: dict, timeout_s: float | None) -> tuple["Reply | Status", Any]:
        """Hand the worker a task and wait; return (outcome, payload); its check follows (:meth:`check`).

        Outcomes: the worker's :class:`Reply` (``RESULT``, ``USAGE``, ``ERROR``: payload its text), :attr:`Status.TIMEOUT`,
        :attr:`Status.CRASHED` (payload: one line) and :attr:`Reply.GONE`: the worker died before it took the task.
        """
        fresh = self.tasks == 0
        self.tasks += 1
        limit = timeout_s + (STARTUP_GRACE_S if fresh else WARM_GRACE_S) if timeout_s else None
        deadline = time.monotonic() + limit if limit is not None else None
        try:
            self.conn.send(("task", task, task_kwargs))
        except OSError:  # BrokenPipeError: it is gone
            self.proc.join(_EXIT_GRACE_S)
            return Reply.GONE, None
        try:
            taken = self._receive(deadline)
            if taken is None:
                self.proc.join(_EXIT_GRACE_S)
                return Reply.GONE, None
            message = self._receive(deadline) if taken is not _LATE else _LATE
        except BaseException:  # KeyboardInterrupt: the worker goes with the work
            self.kill()
            raise
        if message is _LATE:
            self.kill()
            grace = "start-up" if fresh else f"{WARM_GRACE_S:g} s"
            return Status.TIMEOUT, f"the worker ran past {limit:g} s and was killed (--trial-timeout plus {grace})"
        if message is None:
            self.proc.join(_EXIT_GRACE_S)
            return Status.CRASHED, f"worker process {_exit_cause(self.proc.exitcode)}"
        self.checking = True
        return message

    def check(self) -> tuple[int | None, int | None] | None:
        """The check the worker sent after its last task: (held bytes, baseline); None if it died or hung first."""
        self.checking = False
        try:
            message = self._receive(time.monotonic() + WARM_GRACE_S)
        except BaseException:
            self.kill()
            raise
        if message is None or message is _LATE:
            return None
        _, held, baseline = message
        return held, baseline

    def _receive(self, deadline: float | None) -> Any:
        """The worker's next message; None when it died first, ``_LATE`` past ``deadline``."""
        while True:
            if self.conn.poll(_POLL_S):
                try:
                    return self.conn.recv()
                except (EOFError, OSError):
                    return None
            if not self.proc.is_alive() and not self.conn.poll(0):
                return None
            if deadline is not None and time.monotonic() > deadline:
                return _LATE

    def stop(self) -> None:
        """Let the worker exit; kill it if it does not within ``_EXIT_GRACE_S``."""
        with contextlib.suppress(OSError):
            self.conn.send(("stop",))
        self.proc.join(_EXIT_GRACE_S)  # a worker that hangs on its way out is not waited for
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()


class Workers:
    """At most one worker at a time, reused while it stays clean (see the module docstring).

    ``trials_per_worker`` caps the pieces of work one worker serves (1: a fresh worker for each);
    None serves as many as stay clean.
    """

    def __init__(self, device: torch.device | str = "cpu", trials_per_worker: int | None = None) -> None:
        self.device = str(device)
        self.trials_per_worker = trials_per_worker
        self.started = 0  # workers started
        self.replaced_unclean = 0  # workers retired because they held more than before their first task
        self._worker: _Worker | None = None

    @property
    def pid(self) -> int | None:
        """The live worker's process id, if one is waiting for work."""
        return self._worker.proc.pid if self._worker is not None else None

    def run_task(self, workload: Workload, task: Callable[..., Any], task_kwargs: dict, *, name: str,
                timeout_s: float | None) -> TaskResult:
        """Run ``task(workload, **task_kwargs)`` in a worker; its :class:`TaskResult`, as :func:`run_isolated`'s."""
        if workload.spec is None:
            raise UsageError("process isolation needs a workload built by Workload.from_specs (or autotune.tune)")
        started = time.monotonic()
        for _ in range(2):  # a warm worker found dead as it is handed the task: once more, in a new one
            worker = self._worker_for(workload.spec, name)
            warm = worker.tasks > 0
            kind, payload = worker.hand(task, task_kwargs, timeout_s)
            if kind != Reply.GONE or not warm:
                break
            logger.info("the worker died between two pieces of work (%s): a new one runs the next",
                        _exit_cause(worker.proc.exitcode))
            self._retire()
        if kind == Reply.GONE:
            kind, payload = Status.CRASHED, f"worker process {_exit_cause(self._worker.proc.exitcode)}"
        if kind != Reply.RESULT or worker.tasks == self.trials_per_worker:
            self._retire()  # a result's worker is checked as the next piece of work comes (_worker_for)
        seconds = time.monotonic() - started
        if kind == Reply.USAGE:
            raise UsageError(payload)
        if kind == Reply.ERROR:
            return TaskResult(Status.FAILED, payload.splitlines()[0], seconds)
        return TaskResult(kind, payload, seconds)

    def _worker_for(self, spec: dict, name: str) -> _Worker:
        if self._worker is not None and self._worker.checking and not self._clean(self._worker.check()):
            self._retire()
        if self._worker is not None and not self._worker.serves(spec):
            if not self._worker.proc.is_alive():
                logger.info("the waiting worker is gone (%s): a new one runs the next piece of work",
                            _exit_cause(self._worker.proc.exitcode))
            self._retire()
        if self._worker is None:
            self._worker = _Worker(spec, self.device, name)
            self.started += 1
        return self._worker

    def _clean(self, memory: tuple[int | None, int | None] | None) -> bool:
        held, baseline = memory if memory is not None else (None, None)
        if held is None or baseline is None:
            logger.info("the worker could not say what it holds (it died, hung, or its device failed): a new one runs "
                        "the next piece of work")
            return False
        if held > baseline + CLEAN_TOLERANCE_BYTES:
            self.replaced_unclean += 1
            logger.info("the worker holds %d bytes on the device, %d more than before its first trial: a new one "
                        "runs the next", held, held - baseline)
            return False
        return True

    def _retire(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def close(self) -> None:
        """Stop the worker, if one is waiting."""
        self._retire()


def run_isolated(workload: Workload, task: Callable[..., Any], task_kwargs: dict, *, name: str,
                 timeout_s: float | None, device: torch.device | str = "cpu") -> TaskResult:
    """Run ``task(workload, **task_kwargs)`` in a fresh spawned process; its :class:`TaskResult`.

    ``task`` is a module-level function (the worker imports it by name) whose result pickles. The
    outcome is :attr:`Reply.RESULT` (payload: what the task returned), or the trial's :class:`Status`: ``timeout``,
    ``crashed`` or ``failed`` (payload: one line saying why; for ``"crashed"``, "worker process killed by SIGKILL").
    Bad input found in the worker is raised here as :class:`UsageError`; ``KeyboardInterrupt`` kills
    the worker. The worker has exited when this returns.
    """
    workers = Workers(device, trials_per_worker=1)
    try:
        return workers.run_task(workload, task, task_kwargs, name=name, timeout_s=timeout_s)
    finally:
        workers.close()


def _run_work(workload: Workload, *, work: Work, device: str) -> Any:
    """The worker's side of :class:`Spawned`: the work at this worker's place, encoded for the pipe."""
    return work.encode(work.run(workload, Place(torch.device(device))))


class Spawned(Venue):
    """Each piece of work in a spawned worker process, warm from one piece of work to the next (see the module docstring)."""

    kind = Isolation.PROCESS.value

    def __init__(self, device: torch.device | str, trials_per_worker: int | None = None) -> None:
        super().__init__(device)
        self.workers = Workers(self.device, trials_per_worker)

    def admit(self, workload: Workload) -> None:
        check_picklable(workload)  # one clear line now, not every trial crashed later

    def run(self, workload: Workload, work: Work) -> Any:
        done = self.workers.run_task(workload, _run_work, {"work": work, "device": str(self.device)}, name=work.name,
                                    timeout_s=work.timeout_s)
        if done.outcome == Reply.RESULT:
            return work.decode(done.payload)
        return work.failed(done.outcome, done.payload, done.seconds)  # a Status: it timed out, crashed or failed

    def describe(self) -> dict[str, Any]:
        return {"workers_started": self.workers.started, "workers_replaced_unclean": self.workers.replaced_unclean,
                "trials_per_worker": self.workers.trials_per_worker}

    def close(self) -> None:
        self.workers.close()
