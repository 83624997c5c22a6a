"""Signal deferral: hold Ctrl-C and SIGTERM while a piece of state is written whole.

Used wherever half a write would leave state nobody closes: a trial claimed in the store, a
measurement being stored, a process group being made or destroyed by every rank of a job.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

__all__ = ["shielded"]


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends, so that a write is made whole or not at all.

    A signal landing inside ``study.ask()`` (the trial created, not yet ours) or half-way through
    storing a measurement would leave a RUNNING trial that nobody closes. The handler in force
    before the block runs when it ends, with the first signal held.
    """
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    held: list[tuple[int, Any]] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if held:
            signum, frame = held[0]
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            else:  # SIG_DFL: the default action, now that the write is whole
                signal.raise_signal(signum)
