"""The command line's parsers, built from the fields of :class:`~autotune.options.Options`.

Each option's flag, default, choices, help and group are stated once, on its field
(:func:`autotune.options.option`); this module turns them into argparse arguments, adds the
output flags that only the command line has (``--out``, ``--export``, ``--plot``, ``--quiet``,
``--verbose``), and turns parsed arguments back into :class:`Options`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from autotune.options import Flag, Options

__all__ = ["EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_NOTHING_FITS", "EXIT_INTERRUPTED", "build_parser",
           "build_show_parser", "options_from", "follower"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOTHING_FITS, EXIT_INTERRUPTED = 0, 1, 2, 3, 130  # SIGTERM: 143
_GROUPS = ("workload", "search space and budget", "search and trials", "probe, training plan and guard rails")


def follower() -> bool:
    """A torchrun rank other than 0: rank 0 alone speaks (one line of bad input, the table) and writes the JSON."""
    return os.environ.get("RANK", "0") != "0"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit code 2, like our own usage errors
        self.exit(EXIT_USAGE, None if follower() else f"autotune: error: {message} (see --help)\n")


def _flags() -> list[tuple[dataclasses.Field, Flag]]:
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(Options) if "flag" in f.metadata]


def _help(field: dataclasses.Field, flag: Flag) -> str:
    """The flag's help with its default, said once."""
    if flag.negate or flag.switch:
        return flag.help
    default = flag.default_text or (None if field.default in (None, (), "") else field.default)
    if isinstance(default, tuple):
        default = ",".join(default)
    return flag.help if default is None else f"{flag.help} (default: {default})"


def build_parser() -> argparse.ArgumentParser:
    """``python -m autotune``'s parser: every option of :class:`Options`, then the output flags."""
    p = _Parser(prog="python -m autotune",
                description="Measure precision modes, gradient-checkpoint plans and batch sizes of a PyTorch model on "
                "this machine, and recommend the fastest configuration that fits a memory budget. "
                "'python -m autotune show REPORT.json' prints a saved report again (see its --help).")
    groups = {name: p.add_argument_group(name) for name in _GROUPS}
    for field, flag in _flags():
        kwargs: dict[str, Any] = {"dest": field.name, "help": _help(field, flag)}
        if flag.negate or flag.switch:
            kwargs.update(action="store_true" if flag.switch else "store_false", default=field.default)
        else:
            kwargs.update(default=field.default, type=flag.type, metavar=flag.metavar, choices=flag.choices,
                          required=flag.required)
        groups[flag.group].add_argument(flag.flag(field.name), **kwargs)
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, metavar="PATH", help="JSON report path (default: results/<study>.json)")
    _output_flags(o)
    o.add_argument("--quiet", action="store_true", help="print only the final table and errors")
    o.add_argument("--verbose", action="store_true", help="log each trial as it starts and each of its steps")
    return p


def _output_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--export", action="append", default=[], metavar="FRAMEWORK[,FRAMEWORK]",
                       help="also write the recommendation for hf (TrainingArguments), lightning (Trainer), deepspeed "
                       "(config) or accelerate (Accelerator), next to the JSON as <stem>.<framework>.json; repeatable")
    group.add_argument("--plot", action="store_true",
                       help="also write <stem>.pareto.png and <stem>.memory.png next to the JSON (needs matplotlib)")


def build_show_parser() -> argparse.ArgumentParser:
    """``python -m autotune show``'s parser."""
    p = _Parser(prog="python -m autotune show", description="Print a saved report's table and recommendation again; "
                "optionally export it or plot it.")
    p.add_argument("report", metavar="REPORT.json", help="a JSON report written by autotune")
    _output_flags(p.add_argument_group("output"))
    return p


def options_from(args: argparse.Namespace) -> Options:
    """The :class:`Options` the flags say: the same object ``autotune.tune`` builds."""
    return Options(**{field.name: getattr(args, field.name) for field, _ in _flags()})
