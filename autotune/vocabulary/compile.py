"""Compiled training by name: ``--compile none,default`` and the modes of ``torch.compile`` (no torch here).

``none`` trains the model as it is (eager); any other name is a ``mode`` of ``torch.compile`` and trains the
model it returns (:mod:`autotune.training.compiled`). A configuration's compile mode is an axis of the search
like its precision: the trial store, the JSON (``compile``) and the table name it.
"""

from __future__ import annotations

from autotune.errors import UsageError

__all__ = ["EAGER", "COMPILE_MODES", "parse_compile", "compile_label"]

EAGER = "none"  # no torch.compile: the model as the user wrote it
# torch.compile's modes (torch._inductor.list_mode_options()); "default" is mode=None
COMPILE_MODES = (EAGER, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def parse_compile(text: str | list | tuple) -> tuple[str, ...]:
    """Parse ``"none,default"`` (or a list of names) into the compile modes to search, in order, without repeats."""
    parts = text.split(",") if isinstance(text, str) else [str(t) for t in text]
    names = tuple(dict.fromkeys(p.strip().lower() for p in parts if p.strip()))
    unknown = [n for n in names if n not in COMPILE_MODES]
    if unknown or not names:
        raise UsageError(f"unknown --compile mode {', '.join(unknown) or repr(text)}: choose from "
                         f"{', '.join(COMPILE_MODES)} (e.g. --compile none,default)")
    return names


def compile_label(mode: str) -> str:
    """How a table names a compile mode: ``eager``, ``compiled`` (mode default) or ``compiled (MODE)``."""
    if mode == EAGER:
        return "eager"
    return "compiled" if mode == "default" else f"compiled ({mode})"
