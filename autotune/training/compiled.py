"""Compiled training: the prepared model under ``torch.compile``, and what compiling it cost.

A configuration whose compile mode is not ``none`` trains the model ``torch.compile`` returns (mode ``default``
is ``mode=None``). Trials count what dynamo did while they ran (:class:`CompileCount`): the graphs it compiled
and its graph breaks, from ``torch._dynamo.utils.counters``. Within one process, dynamo keeps each compiled
graph keyed by the model's code and guards: a fresh copy of the same model at another batch size reuses it,
and the batch dimension is marked dynamic from the first step (:func:`mark_batch_dynamic`), so a variant compiles
once per process, whatever the number of batch sizes (twice where dynamo specialises the first size after all: its
automatic dynamic shapes then make the second size's graph dynamic). Another plan or precision is another graph.

While a compiled step runs, dynamo may recompile more often than its default limit allows across the search's
variants; past its limit it would fall back to eager code without a word, and a trial would measure eager
training under a compiled name. :func:`compiling` raises that limit and makes a hit an error instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from typing import Any, Iterator

import torch
from torch import nn

from autotune.device import autocast_type
from autotune.errors import UsageError, first_line
from autotune.vocabulary import DEFAULT, EAGER, compile_mode, is_static

__all__ = ["compile_model", "CompileCount", "compiling", "CompileFailed", "compile_failure", "cxx_compiler",
           "require_compiler", "mark_batch_dynamic"]

_RECOMPILE_LIMIT = 64  # per code object: every variant of a search (plans x precisions x 2 shapes) in one worker


class CompileFailed(RuntimeError):
    """``torch.compile`` could not compile the model (dynamo or inductor raised): the compiled configuration
    fails, the eager one stands."""


def compile_model(model: nn.Module, value: str) -> nn.Module:
    """``torch.compile(model)`` in the compile value's mode (``default``: torch's default; ``MODE+static``:
    ``dynamic=False``, one graph per batch size); ``none``: the model itself."""
    if value == EAGER:
        return model
    mode = compile_mode(value)
    return torch.compile(model, mode=None if mode == DEFAULT else mode, dynamic=False if is_static(value) else None)


def mark_batch_dynamic(batch: Any, batch_size: int, value: str) -> None:
    """Under compile value ``value``, mark the batch dimension of ``batch``'s tensors (those with ``batch_size`` rows)
    dynamic, so that the graph compiled at one batch size serves every other; eager (``none``) and ``MODE+static``
    (one graph per size) mark nothing. ``maybe``: dynamo may still specialise it (code that branches on the size), and
    then recompiles once, as without the mark."""
    from torch.utils._pytree import tree_leaves

    if value == EAGER or is_static(value) or batch_size < 2:  # dynamo specialises sizes 0 and 1 whatever is marked
        return
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == batch_size:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def compile_failure(exc: BaseException) -> CompileFailed | None:
    """The :class:`CompileFailed` for an error that dynamo or inductor raised, else None."""
    from torch._dynamo.exc import TorchDynamoException

    if isinstance(exc, CompileFailed):
        return exc
    if isinstance(exc, TorchDynamoException):
        cause = exc.__cause__ or exc.__context__
        why = f"{type(cause).__name__}: {first_line(cause)}" if cause is not None else first_line(exc)
        return CompileFailed(f"torch.compile failed ({type(exc).__name__}; {why})")
    return None


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Dynamo's recompile limit raised for the search's variants, and a hit an error, not a silent eager fallback."""
    import torch._dynamo.config as config

    settings = {name: value for name, value in (("recompile_limit", _RECOMPILE_LIMIT),
                                                 ("cache_size_limit", _RECOMPILE_LIMIT),
                                                 ("fail_on_recompile_limit_hit", True),
                                                 ("fail_on_cache_limit_hit", True)) if name in config._config}
    with config.patch(settings):
        yield


_BREAKS: dict[Any, int] = {}  # per variant, the graph breaks dynamo met when it last compiled it in this process


@dataclasses.dataclass
class CompileCount:
    """What dynamo compiled between :meth:`start` and now: graphs, and graph breaks (counters are process-wide).

    A trial that compiled nothing (its variant's graphs were this process's already) runs the graphs, and the
    breaks, of the trial that compiled them: :attr:`breaks` reports those, remembered per ``variant``.
    """

    variant: Any = None
    graphs_at: int = 0
    breaks_at: int = 0

    @staticmethod
    def _now() -> tuple[int, int]:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))

    def start(self) -> "CompileCount":
        self.graphs_at, self.breaks_at = self._now()
        return self

    @property
    def graphs(self) -> int:
        return self._now()[0] - self.graphs_at

    @property
    def breaks(self) -> int:
        graphs, breaks = self._now()
        if graphs > self.graphs_at or self.variant not in _BREAKS:
            _BREAKS[self.variant] = breaks - self.breaks_at
        return _BREAKS[self.variant]


def cxx_compiler() -> str | None:
    """The C++ compiler inductor builds CPU kernels with (``$CXX``, else g++, clang++ or c++), or None."""
    wanted = os.environ.get("CXX")
    for name in ([wanted] if wanted else ["g++", "clang++", "c++"]):
        found = shutil.which(name)
        if found:
            return found
    return None


def require_compiler(device: torch.device) -> None:
    """One line where compiled training cannot run on the CPU here: inductor needs a C++ compiler."""
    if autocast_type(device) == "cpu" and cxx_compiler() is None:
        raise UsageError("--compile on the CPU needs a C++ compiler (inductor builds its kernels with one): install "
                         "g++ (e.g. apt install g++), set CXX to one, or search eager only (--compile none)")
