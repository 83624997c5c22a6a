"""Processes the tests start, stopped with everything they started, however the test ends.

A CLI with ``--isolation process`` spawns its trials' workers (and multiprocessing's resource tracker), torchrun
its ranks: killing only the process a test started leaves those running after a failure or a time-out, where
they load the machine for the tests after it. So a test's process leads a process group of its own
(``start_new_session``), and the whole group is killed when the test is done with it: on success, on a
failure, on ``subprocess.TimeoutExpired``, and on pytest-timeout's time-out (setup.cfg's ``timeout_method =
signal`` raises it in the test, so ``finally`` blocks and fixture teardowns run).
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any, Sequence


def leads_a_group(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` (still running) leads a process group of its own."""
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:  # it has exited (not reaped yet: its pid still names it), or it is gone
        return False


def stop(proc: subprocess.Popen, *, group: bool) -> None:
    """Kill ``proc`` (its whole process group where ``group``: what it started too), reap it and close its pipes."""
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader while a member is left
        except ProcessLookupError:
            pass
    elif proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


class Started(list):
    """The ``processes`` fixture's list: it notes, as each process is added, whether it leads a group."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[int, bool] = {}

    def append(self, proc: subprocess.Popen) -> None:
        self.groups[id(proc)] = leads_a_group(proc)
        super().append(proc)

    def extend(self, procs) -> None:
        for proc in procs:
            self.append(proc)

    def stop_all(self) -> None:
        for proc in self:
            stop(proc, group=self.groups.get(id(proc), False))


def run(command: Sequence[str], *, timeout: float, **popen: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout)``, in a process group of its own
    that is killed whole once the command has ended or the wait for it has (a time-out, pytest-timeout's, Ctrl-C)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        stop(proc, group=True)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
