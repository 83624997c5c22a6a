"""On NCCL, wake the other ranks when one leaves a trial (gloo needs no help: its closed pairs wake them)."""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.execution.job import Job

__all__ = ["Watch", "say_left"]


def _left_key(job: "Job") -> str:
    return f"autotune/trial-{job.trials}/left"


def say_left(job: "Job") -> None:
    """Tell the other ranks, through the job's store, that this rank left the trial (NCCL does not tell them)."""
    from torch.distributed.distributed_c10d import _get_default_store

    with contextlib.suppress(Exception):
        _get_default_store().set(_left_key(job), str(job.rank))


class Watch:
    """On NCCL, a rank that left a trial does not wake the others: their kernels wait for it until the group's
    timeout, when NCCL's watchdog (by default) ends the whole process. This thread watches the job's store
    for a rank that left and aborts this rank's trial group, so its collectives fail now and the trial ends
    with the others. (gloo needs none: a destroyed group closes its connections, which wakes the peers.)"""

    def __init__(self, job: "Job", group: Any, every_s: float = 0.2) -> None:
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
