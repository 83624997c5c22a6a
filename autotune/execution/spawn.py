"""The spawned-worker venue: each piece of work in a fresh process, so that nothing it does takes the search down.

A trial, a probe candidate or the plan checks that segfault, hit a sticky CUDA error (an illegal
memory access poisons the whole CUDA context), leak, or fragment the caching allocator are
confined to their own process: the worker is started with ``spawn`` (a clean interpreter and a
fresh CUDA context), builds the workload again from its spec, runs the work
(:mod:`autotune.execution.work`), sends back its result and exits. A worker that dies is recorded
as ``crashed`` with its exit code or signal; one that hangs past the work's time limit (plus
start-up time) is killed and recorded as ``timeout``. A worker whose parent dies (a SIGKILL of the
search, which cannot take its workers with it) exits within a second instead of training on.
"""

from __future__ import annotations

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

from autotune._log import logger
from autotune.errors import UsageError, first_line
from autotune.execution.work import Place, Venue, Work
from autotune.training.workload import Workload

__all__ = ["Spawned", "run_isolated", "check_picklable", "STARTUP_GRACE_S"]

STARTUP_GRACE_S = 120.0  # importing torch and building a CUDA context can take this long on a busy machine
_POLL_S = 1.0
_EXIT_GRACE_S = 30.0


def _exit_with(parent: int) -> None:
    """Exit once ``parent`` is gone (killed by SIGKILL, say, it could not kill this worker): no orphan trains on."""
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    os._exit(1)


def _worker(conn: Any, spec: dict, job: Callable[..., Any], job_kwargs: dict, log_level: int = logging.WARNING) -> None:
    # Ctrl-C reaches the whole process group, and a scheduler's SIGTERM often does (systemd's control group,
    # torchrun's children): the parent decides, and kills this worker. If the parent dies first, the worker exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(os.getppid(),), name="autotune-parent-watch", daemon=True).start()
    if log_level < logging.WARNING:  # --verbose: the trial's per-step lines, on the stderr the worker shares
        logging.basicConfig(format="autotune: %(message)s", stream=sys.stderr)
        logger.setLevel(log_level)
    try:
        workload = Workload.from_specs(**spec)
        conn.send(("result", job(workload, **job_kwargs)))
    except UsageError as exc:
        conn.send(("usage", str(exc)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which records the trial
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"))
    finally:
        conn.close()


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
        raise UsageError(f"--isolation process runs each trial in a fresh process, which needs the model, data and loss "
                         f"pickled, and they cannot be ({type(exc).__name__}: {first_line(exc)}): define them at module "
                         f"level in an importable file (pass MODULE:ATTR), or use --isolation none") from None
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if finder.in_main and not main_file:
        raise UsageError(f"--isolation process runs each trial in a fresh process, which cannot import "
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


def run_isolated(workload: Workload, job: Callable[..., Any], job_kwargs: dict, *, name: str,
                 timeout_s: float | None) -> tuple[str, Any, float]:
    """Run ``job(workload, **job_kwargs)`` in a fresh spawned process; return (outcome, payload, seconds).

    ``job`` is a module-level function (the worker imports it by name) whose result pickles. The
    outcome is ``"result"`` (payload: what the job returned), ``"timeout"``, ``"crashed"`` or
    ``"failed"`` (payload: one line saying why; for ``"crashed"``, "worker process killed by SIGKILL"). Bad input found in the worker is raised here as
    :class:`UsageError`; ``KeyboardInterrupt`` kills the worker.
    """
    if workload.spec is None:
        raise UsageError("process isolation needs a workload built by Workload.from_specs (or autotune.tune)")
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    started = time.monotonic()
    proc = ctx.Process(target=_worker, args=(sender, workload.spec, job, job_kwargs, logger.getEffectiveLevel()),
                       name=name, daemon=True)
    proc.start()
    sender.close()  # the worker holds the only writing end: its death closes the pipe
    limit = timeout_s + STARTUP_GRACE_S if timeout_s else None
    message = None
    try:
        while message is None:
            if receiver.poll(_POLL_S):
                try:
                    message = receiver.recv()
                except EOFError:
                    break  # the worker died without a word
            elif not proc.is_alive():
                break
            if message is None and limit is not None and time.monotonic() - started > limit:
                proc.kill()
                proc.join()
                return ("timeout", f"the worker ran past {limit:g} s and was killed (--trial-timeout plus start-up)",
                        time.monotonic() - started)
    finally:
        if message is None:
            proc.kill()
        proc.join(_EXIT_GRACE_S)  # a worker that has answered but hangs on its way out is not waited for
        if proc.is_alive():
            proc.kill()
            proc.join()
        receiver.close()
    seconds = time.monotonic() - started
    if message is None:
        return "crashed", f"worker process {_exit_cause(proc.exitcode)}", seconds
    kind, payload = message
    if kind == "usage":
        raise UsageError(payload)
    if kind == "error":
        return "failed", payload.splitlines()[0], seconds
    return "result", payload, seconds


def _run_work(workload: Workload, *, work: Work, device: str) -> Any:
    """The worker's side of :class:`Spawned`: the work at this worker's place, encoded for the pipe."""
    return work.encode(work.run(workload, Place(torch.device(device))))


class Spawned(Venue):
    """Each piece of work in a fresh spawned worker process (see the module docstring)."""

    kind = "process"

    def admit(self, workload: Workload) -> None:
        check_picklable(workload)  # one clear line now, not every trial crashed later

    def run(self, workload: Workload, work: Work) -> Any:
        status, payload, seconds = run_isolated(workload, _run_work, {"work": work, "device": str(self.device)},
                                                name=work.name, timeout_s=work.timeout_s)
        if status == "result":
            return work.decode(payload)
        return work.failed(status, payload, seconds)
