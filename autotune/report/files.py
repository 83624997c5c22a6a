"""Writing result files whole: a reader (or a parallel worker writing the same file) never sees half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile

__all__ = ["write_atomically"]


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file of its own in the same folder, then rename it."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
