"""Progress of a search and its probe on stderr.

On a terminal: one tqdm bar (trials done / planned, the configuration running now, the best so
far, elapsed time), with each finished trial printed above it. Not on a terminal (CI logs, a
pipe): one plain line per finished trial and probe candidate. With ``quiet``: nothing. The tuner
calls the methods below through its ``progress`` argument; any object with some of them works.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, TextIO

from autotune.records import Config, Measurement
from autotune.units import format_bytes
from autotune.vocabulary import Status

__all__ = ["Progress"]


class Progress:
    """Search and probe progress for the command line."""

    def __init__(self, *, quiet: bool = False, stream: TextIO | None = None, bar: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        # A bar only on a terminal: in a log file its redraws are noise.
        self.use_bar = not quiet and (bar if bar is not None else self.stream.isatty())
        self._bar: Any = None
        self._done = 0
        self._budget: int | None = None
        self._best: Measurement | None = None
        self._exit = contextlib.ExitStack()

    # -- the tuner's events ------------------------------------------------------------------------

    def search_started(self, *, space_size: int, planned: int | None, strategy: str, budget_bytes: int | None) -> None:
        """``planned`` is the trial count when the strategy knows it (grid, optuna), else None."""
        self._budget = budget_bytes
        if not self.use_bar:
            return
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._bar = tqdm(total=planned or space_size, desc=f"{strategy} search", unit="trial", file=self.stream, leave=True,
                         bar_format="{desc}: " + ("{n_fmt}/{total_fmt} trials" if planned else "{n_fmt} trials (at most {total_fmt})")
                         + " [{elapsed}]{postfix}")
        self._exit.enter_context(logging_redirect_tqdm())  # log lines go above the bar, not through it

    def trial_started(self, config: Config) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(f"running {config}"))

    def trial_done(self, m: Measurement, reused: bool) -> None:
        self._done += 1
        if m.fits(self._budget) and m.samples_per_s and (self._best is None or m.samples_per_s > self._best.samples_per_s):
            self._best = m
        if self.quiet:
            return
        detail = format_bytes(m.peak_bytes) + (f", {m.step_s:.4f} s/step" if m.step_s else "")
        if m.predicted:
            detail += " (predicted: not run)"
        elif m.memory_only:
            detail += " (memory trial: not timed)"
        elif m.memory_from is not None or m.timings > 1:
            detail += f" (timed {'again' if m.timings > 1 else 'after its memory trial'})"
        if m.error and m.status != Status.OK:
            detail += f" ({_clipped(m.error, 100)})"
        self._say(f"autotune: [{self._done}] {m.config}: {m.status} {detail}{' (from the store)' if reused else ''}")
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(self._postfix(""))

    def search_done(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._exit.close()

    def probe_started(self, config: Config, index: int, count: int) -> None:
        if not self.quiet:
            self._say(f"autotune: probe {index}/{count}: {config} ...")

    def probe_done(self, result: Any) -> None:
        if self.quiet:
            return
        verdict = "accepted" if result.accepted else f"rejected ({result.reason})"
        self._say(f"autotune: probe {result.config}: {result.steps} steps, worst-case peak "
                  f"{format_bytes(result.peak_bytes_max)}, {verdict}")

    # -- helpers ------------------------------------------------------------------------------------

    def _postfix(self, now: str) -> str:
        best = (f"best {self._best.config} {self._best.samples_per_s:.1f} samples/s" if self._best else "best: none yet")
        return f"{best}; {now}" if now else best

    def _say(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)


def _clipped(text: str, width: int) -> str:
    """``text`` cut at a word before ``width`` characters, with an ellipsis where it was cut (the JSON keeps it all)."""
    if len(text) <= width:
        return text
    return text[:width].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
