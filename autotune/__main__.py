"""Command line: ``python -m autotune --model MODULE:ATTR [options]``, and ``python -m autotune show X.json``.

Exit codes: 0 with a recommendation, 3 when nothing fits the budget (the JSON is still written),
2 for bad input (one line on stderr), 130 when interrupted (Ctrl-C), 143 when stopped by SIGTERM (as
schedulers stop a job: the same partial report as Ctrl-C), 1 for an unexpected failure (one line).
Under torchrun with ``--parallel ddp|fsdp`` every rank exits with these codes; rank 0 alone prints
and writes the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any, Iterator, Sequence

from autotune.cli.parser import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_NOTHING_FITS,
    EXIT_OK,
    EXIT_USAGE,
    build_parser,
    build_show_parser,
    follower,
    options_from,
)
from autotune._log import log_to_stderr
from autotune.errors import AutotuneError, UsageError, first_line
from autotune.cli.advice import nothing_fits
from autotune.vocabulary import Parallel

__all__ = ["main", "build_parser", "options_from"]

def _outputs(args: argparse.Namespace) -> tuple[tuple[str, ...], bool]:
    """Check --export and --plot before any work: unknown frameworks or a missing matplotlib are bad input."""
    frameworks: tuple[str, ...] = ()
    if args.export:
        from autotune.export import parse_frameworks

        frameworks = parse_frameworks(",".join(args.export))
    if args.plot:
        from autotune.plot import require_matplotlib

        require_matplotlib()
    return frameworks, args.plot


def _write_outputs(report, json_path: str, frameworks: tuple[str, ...], plot: bool) -> list[str]:
    paths: list[str] = []
    if frameworks and report.recommendation is not None and not report.dry_run:
        from autotune.export import write_exports

        paths += write_exports(report, json_path, frameworks)
    if plot:
        from autotune.plot import write_plots

        paths += write_plots(report, json_path)
    return paths


def show(argv: Sequence[str]) -> int:
    """``python -m autotune show REPORT.json [--export ...] [--plot]``."""
    args = build_show_parser().parse_args(argv)
    import autotune

    try:
        frameworks, plot = _outputs(args)
        try:
            report = autotune.load(args.report)
        except FileNotFoundError:
            raise UsageError(f"{args.report}: no such file") from None
        except (ValueError, KeyError, TypeError) as exc:  # not JSON, or not an autotune report
            raise UsageError(f"{args.report} is not an autotune report ({type(exc).__name__}: {first_line(exc)})") from None
        print(report.table())
        for path in _write_outputs(report, args.report, frameworks, plot):
            _say(f"wrote {path}")
        if frameworks and report.recommendation is None:
            _say("nothing to export: the report has no recommendation")
    except (UsageError, OSError) as exc:
        _say(f"error: {exc}" if isinstance(exc, UsageError) else
             f"error: {exc.filename or args.report}: {exc.strerror or exc}")
        return EXIT_USAGE
    return EXIT_NOTHING_FITS if report.nothing_fits else EXIT_OK


def _check_writable(path: str, *, create_folder: bool = False) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if create_folder:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create {folder} for the report ({exc.strerror}): pass --out PATH") from None
    if not os.path.isdir(folder):
        raise UsageError(f"--out {path!r}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"--out {path!r} is not writable: choose another path")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["show"]:
        return show(argv[1:])
    args = build_parser().parse_args(argv)
    # Under torchrun with --parallel, rank 0 speaks for the job (the table, the JSON, one line of bad input); the
    # other ranks train its trials and exit with its code, saying only an unexpected error of their own.
    speaks = args.parallel == Parallel.NONE or not follower()
    level = logging.WARNING if args.quiet else (logging.DEBUG if args.verbose else logging.INFO)
    log_to_stderr()
    logging.getLogger("autotune").setLevel(level if speaks else logging.ERROR)  # only ours: libraries keep theirs

    from autotune.cli.progress import Progress

    try:
        with _sigterm_as_interrupt() as stopped:
            progress = _StopsAtTheNextTrial(Progress(quiet=args.quiet or not speaks), stopped)
            return _main(args, progress, stopped, speaks)
    finally:
        if args.parallel != Parallel.NONE:
            from autotune.execution.job import leave

            leave()


def _interrupted_code(stopped: list[int]) -> int:
    """The exit code of an interrupted run: 128 + the signal that stopped it (SIGTERM: 143), else Ctrl-C's 130."""
    return 128 + stopped[0] if stopped else EXIT_INTERRUPTED


class Terminated(KeyboardInterrupt):
    """SIGTERM (what torchrun, SLURM, Kubernetes and systemd send, then wait a grace period): handled as Ctrl-C."""


class _Signals(list):
    """The SIGTERMs received (the list), and how many Ctrl-Cs (``interrupts``)."""

    interrupts = 0


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[_Signals]:
    """Inside the block, SIGTERM raises :class:`Terminated` (a KeyboardInterrupt): the running trial is
    discarded, the partial report written, and the exit code is 128 + 15. Ctrl-C raises KeyboardInterrupt as
    Python's own handler does, and is counted. Yields the signals received."""
    received = _Signals()

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        if len(received) == 1:  # a second SIGTERM must not cut the partial report short
            raise Terminated()

    def ctrl_c(signum: int, frame: object) -> None:
        received.interrupts += 1
        raise KeyboardInterrupt()

    if threading.current_thread() is not threading.main_thread():  # signals are only for the main thread
        yield received
        return
    previous = signal.signal(signal.SIGTERM, handler)
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.default_int_handler:  # not where Ctrl-C is ignored (nohup) or handled by the caller
        signal.signal(signal.SIGINT, ctrl_c)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _quiet_about_signals(previous_hook)
    try:
        yield received
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGTERM, previous)
        if previous_int is signal.default_int_handler:
            signal.signal(signal.SIGINT, previous_int)


def _quiet_about_signals(previous: Any) -> Any:
    """An unraisable hook that drops a KeyboardInterrupt (Terminated is one) raised by our handlers inside a
    finalizer or a weakref callback, where Python cannot propagate it and would print "Exception ignored" and a
    traceback: the signal is recorded, and :class:`_StopsAtTheNextTrial` stops the run at the next trial. Anything
    else goes to the hook that was there."""

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous(unraisable)

    return hook


class _StopsAtTheNextTrial:
    """The CLI's progress, which also stops the run as the next trial or probe starts if a SIGTERM or a Ctrl-C has
    come and the search goes on: Python runs a signal's handler between any two bytecodes, a finalizer's or a weakref
    callback's too (SQLAlchemy's ``InstanceState._cleanup``, torch's ``WeakIdKeyDictionary``), and an exception
    raised there is dropped (Python prints "Exception ignored", which _quiet_about_signals holds back). Seen in CI, once
    for each signal: the search then ran to its end and exited 0 instead of 143 or 130."""

    def __init__(self, progress: Any, received: _Signals) -> None:
        self.progress, self.received = progress, received

    def __getattr__(self, name: str) -> Any:
        return getattr(self.progress, name)

    def trial_started(self, *args: Any, **kwargs: Any) -> None:
        self._stop_if_signalled()
        self.progress.trial_started(*args, **kwargs)

    def probe_started(self, *args: Any, **kwargs: Any) -> None:
        self._stop_if_signalled()
        self.progress.probe_started(*args, **kwargs)

    def _stop_if_signalled(self) -> None:
        # Had the handler's exception propagated, it would have ended the search: it was swallowed
        if self.received:
            raise Terminated()
        if self.received.interrupts:
            raise KeyboardInterrupt()


def _say(message: str) -> None:
    print(f"autotune: {message}", file=sys.stderr)


def _main(args: argparse.Namespace, progress: Any, stopped: list[int], speaks: bool) -> int:
    """Tune, then (where this process speaks for the job) print the table and write the report, exports and plots."""
    import autotune
    from autotune.tuner import run

    say = _say if speaks else (lambda message: None)
    outputs: list[Any] = []

    def how() -> str:  # asked when it is said: a SIGTERM may come at any moment
        return "stopped by SIGTERM" if stopped else "interrupted"

    def check_outputs() -> None:  # run before any work by whoever speaks: its bad input ends every rank with exit 2
        outputs.extend(_outputs(args))
        _check_writable(args.out or os.path.join("results", "report.json"), create_folder=not args.out)

    try:
        options = options_from(args)  # bad options: every rank of a --parallel job says so alike, before joining
        report = run(options, progress=progress, before=check_outputs if speaks else None)
    except autotune.Interrupted as exc:
        if speaks:
            try:
                wrote = f"wrote the partial report to {_write(exc.report, args.out)}"
            except (OSError, ValueError) as write_exc:
                wrote = f"could not write the partial report ({write_exc})"
            say(f"{how()} after {len(exc.report.trials)} trials; {wrote}; finished trials are kept in "
                f"{exc.report.search.storage}: run the same command to continue")
        return _interrupted_code(stopped)
    except autotune.NothingFits as exc:  # the model's state alone exceeds the budget: no trial ran, no report
        say(str(exc))
        return EXIT_NOTHING_FITS
    except (UsageError, AutotuneError) as exc:
        say(f"error: {exc}")
        return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - a trial store or library failing mid-search: one line, not a traceback
        if args.verbose:
            import traceback

            traceback.print_exc()
        where = "" if speaks else f"rank {os.environ.get('RANK')}: "  # a rank's own failure: said by that rank
        _say(f"{where}error: {type(exc).__name__}: {first_line(exc)} (finished trials are kept in the store; "
             f"--verbose shows the traceback)")
        return EXIT_ERROR
    except KeyboardInterrupt:  # before the search started: nothing measured
        say(how())
        return _interrupted_code(stopped)
    if not speaks:
        return _interrupted_code(stopped) if stopped else EXIT_NOTHING_FITS if report.nothing_fits else EXIT_OK
    return _finish(args, report, *outputs)


def _finish(args: argparse.Namespace, report: Any, frameworks: tuple[str, ...], plot: bool) -> int:
    """Write the report, print its table, write exports and plots; the exit code says whether anything fits."""
    try:
        out = _write(report, args.out)
    except (OSError, ValueError) as exc:
        print(report.table())
        _say(f"error: cannot write the report: {getattr(exc, 'strerror', None) or exc}; the trials are kept in "
             f"{report.search.storage}, so run again with another --out")
        return EXIT_ERROR
    print(report.table())
    try:
        written = [out, *_write_outputs(report, out, frameworks, plot)]
    except (OSError, UsageError) as exc:
        _say(f"error: the report is written ({out}) but its exports or plots are not: {exc}")
        return EXIT_ERROR
    if not args.quiet:
        for path in written:
            _say(f"wrote {path}")
    if frameworks and (report.recommendation is None or report.dry_run):
        _say("nothing to export: a dry run's recommendation is an estimate, not measured" if report.dry_run else
             "nothing to export: no configuration fits (see below)")
    if report.nothing_fits:
        print(nothing_fits(report.shortfall()), file=sys.stderr)
        return EXIT_NOTHING_FITS
    return EXIT_OK


def _write(report, out: str | None) -> str:
    """Write the JSON report to ``out`` (default ``results/<study>.json``); return the path."""
    out = out or os.path.join("results", f"{report.search.study}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    report.to_json(out)
    return out


if __name__ == "__main__":
    sys.exit(main())
