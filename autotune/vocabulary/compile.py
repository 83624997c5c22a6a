"""Compiled training by name: ``--compile none,default`` and the modes of ``torch.compile`` (no torch here).

``none`` trains the model as it is (eager); any other name is a ``mode`` of ``torch.compile`` and trains the
model it returns (:mod:`autotune.training.compiled`). A configuration's compile mode is an axis of the search
like its precision: the trial store, the JSON (``compile``) and the table name it.

``MODE+static`` is the same mode compiled for one batch size, ``torch.compile(model, dynamic=False)``: a search's
compiled trials mark the batch dimension dynamic (one graph for every batch size), and the recommendation, where it
is compiled, is timed again static at its batch size (the graph plain ``torch.compile(model)`` builds for a fixed
batch size), which can be faster.
"""

from __future__ import annotations

from autotune.errors import UsageError

__all__ = ["EAGER", "DEFAULT", "COMPILE_MODES", "STATIC", "parse_compile", "compile_label", "compile_mode", "is_static",
           "static_of"]

EAGER = "none"  # no torch.compile: the model as the user wrote it
DEFAULT = "default"  # torch.compile(model) with mode=None
# torch.compile's modes (torch._inductor.list_mode_options())
COMPILE_MODES = (EAGER, DEFAULT, "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
STATIC = "+static"  # MODE+static: compiled for one batch size (dynamic=False)


def parse_compile(text: str | list | tuple) -> tuple[str, ...]:
    """Parse ``"none,default"`` (or a list of names) into the compile modes to search, in order, without repeats."""
    parts = text.split(",") if isinstance(text, str) else [str(t) for t in text]
    names = tuple(dict.fromkeys(p.strip().lower() for p in parts if p.strip()))
    unknown = [n for n in names if compile_mode(n) not in COMPILE_MODES or n == EAGER + STATIC]
    if unknown or not names:
        raise UsageError(f"unknown --compile mode {', '.join(unknown) or repr(text)}: choose from "
                         f"{', '.join(COMPILE_MODES)}, a mode but none with {STATIC} for one batch size "
                         f"(e.g. --compile none,default)")
    return names


def compile_mode(value: str) -> str:
    """The ``torch.compile`` mode of a compile value (``default+static``: ``default``)."""
    return value[:-len(STATIC)] if value.endswith(STATIC) else value


def is_static(value: str) -> bool:
    """Whether a compile value compiles for one batch size (``dynamic=False``)."""
    return value.endswith(STATIC)


def static_of(value: str) -> str:
    """The same compile mode for one batch size: ``default`` -> ``default+static``."""
    return compile_mode(value) + STATIC


def compile_label(value: str) -> str:
    """How a table names a compile value: ``eager``, ``compiled`` (mode default), ``compiled (MODE)``, and
    ``compiled (static)`` or ``compiled (MODE, static)`` for one batch size."""
    if value == EAGER:
        return "eager"
    mode, static = compile_mode(value), is_static(value)
    if mode == "default":
        return "compiled (static)" if static else "compiled"
    return f"compiled ({mode}, static)" if static else f"compiled ({mode})"
