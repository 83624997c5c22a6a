"""Run a trial in a fresh worker process, so that nothing one trial does can take the search down.

A trial that segfaults, hits a sticky CUDA error (an illegal memory access poisons the whole CUDA
context), leaks, or fragments the caching allocator is confined to its own process: the worker is
started with ``spawn`` (a clean interpreter and a fresh CUDA context), builds the workload again
from its spec, runs :func:`~autotune.trial.run_trial`, sends back the measurement and exits. A
worker that dies is recorded as ``crashed`` with its exit code or signal; one that hangs past the
trial's time limit (plus start-up time) is killed and recorded as ``timeout``.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import sys
import time
import traceback
from typing import Any

import torch

from autotune._log import logger
from autotune.errors import UsageError
from autotune.space import Config
from autotune.trial import Measurement, TrialSettings
from autotune.workload import Workload

__all__ = ["run_trial_isolated", "STARTUP_GRACE_S"]

STARTUP_GRACE_S = 120.0  # importing torch and building a CUDA context can take this long on a busy machine
_POLL_S = 1.0
_EXIT_GRACE_S = 30.0


def _worker(conn: Any, spec: dict, config: Config, device: str, budget_bytes: int | None, settings: TrialSettings,
            log_level: int = logging.WARNING) -> None:
    # Ctrl-C reaches the whole process group: the parent decides, and kills this worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_level < logging.WARNING:  # --verbose: the trial's per-step lines, on the stderr the worker shares
        logging.basicConfig(format="autotune: %(message)s", stream=sys.stderr)
        logger.setLevel(log_level)
    try:
        from autotune.meters import make_meter
        from autotune.trial import run_trial

        workload = Workload.from_specs(**spec)
        meter = make_meter(device, budget_bytes=budget_bytes)
        try:
            measurement = run_trial(workload, config, device=device, meter=meter, settings=settings)
        finally:
            meter.close()
        conn.send(("measurement", measurement.to_dict()))
    except UsageError as exc:
        conn.send(("usage", str(exc)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which records the trial
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"))
    finally:
        conn.close()


def _exit_cause(exitcode: int | None) -> str:
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def run_trial_isolated(
    workload: Workload,
    config: Config,
    *,
    device: torch.device | str,
    budget_bytes: int | None,
    settings: TrialSettings,
) -> Measurement:
    """Run one trial in a fresh spawned process and return its measurement.

    Bad input found in the worker is raised here as :class:`UsageError`; ``KeyboardInterrupt``
    kills the worker.
    """
    if workload.spec is None:
        raise UsageError("process isolation needs a workload built by Workload.from_specs (or autotune.tune)")
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    started = time.monotonic()
    proc = ctx.Process(
        target=_worker, args=(sender, workload.spec, config, str(device), budget_bytes, settings, logger.getEffectiveLevel()),
        name=f"autotune-trial-{config.precision}-s{config.segments}-b{config.batch_size}", daemon=True,
    )
    proc.start()
    sender.close()  # the worker holds the only writing end: its death closes the pipe
    limit = settings.timeout_s + STARTUP_GRACE_S if settings.timeout_s else None
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
                return Measurement(config=config, status="timeout", wall_s=time.monotonic() - started,
                                   error=f"the worker ran past {limit:g} s and was killed (--trial-timeout plus start-up)")
    finally:
        if message is None:
            proc.kill()
        proc.join(_EXIT_GRACE_S)  # a worker that has answered but hangs on its way out is not waited for
        if proc.is_alive():
            proc.kill()
            proc.join()
        receiver.close()
    if message is None:
        return Measurement(config=config, status="crashed", wall_s=time.monotonic() - started,
                           error=f"the trial's worker process {_exit_cause(proc.exitcode)}")
    kind, payload = message
    if kind == "usage":
        raise UsageError(payload)
    if kind == "error":
        return Measurement(config=config, status="failed", wall_s=time.monotonic() - started,
                           error=payload.splitlines()[0])
    return Measurement.from_dict(payload)
