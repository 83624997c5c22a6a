"""Inductor made cheaper to start for the tests that compile, and put back exactly as it was.

Scalar kernels (no g++ probe of each vector instruction set, about 20 s cold), no precompiled header (it would go
to /tmp/torchinductor_<user>, not the cache directory), no pool of compile workers left running after a module.
The settings go through inductor's own ``config.patch``, which restores each value it changed: a monkeypatch of
``config.cpp.vec_isa_ok`` (a sub-config proxy, not a plain attribute) left the attribute gone after its undo, and
a later module in the same process failed on it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

__all__ = ["cheap_inductor"]

SETTINGS = {"cpp.vec_isa_ok": False, "cpp_cache_precompile_headers": False, "compile_threads": 1}
# The same, by the environment, for a worker process a test starts (inductor reads TORCHINDUCTOR_* as it imports)
ENVIRONMENT = {"TORCHINDUCTOR_VEC_ISA_OK": "0", "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
               "TORCHINDUCTOR_COMPILE_THREADS": "1"}


@contextlib.contextmanager
def cheap_inductor(cache_dir, *, workers: bool = False) -> Iterator[None]:
    """Inside: inductor's cache in ``cache_dir`` and its cheap settings (``workers``: the processes a test starts
    get them too, by the environment); everything as it was after."""
    import torch._inductor.config as inductor

    with pytest.MonkeyPatch.context() as patch, inductor.patch(SETTINGS):
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
        if workers:
            for name, value in ENVIRONMENT.items():
                patch.setenv(name, value)
        yield
