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
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from autotune.errors import AutotuneError, UsageError, first_line

if TYPE_CHECKING:
    from autotune.options import Options

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOTHING_FITS, EXIT_INTERRUPTED = 0, 1, 2, 3, 130  # SIGTERM: 143


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit code 2, like our own usage errors
        self.exit(EXIT_USAGE, None if _follower() else f"autotune: error: {message} (see --help)\n")


def _follower() -> bool:
    """A torchrun rank other than 0: rank 0 alone speaks (one line of bad input, the table) and writes the JSON."""
    return os.environ.get("RANK", "0") != "0"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m autotune",
        description="Measure precision modes, gradient-checkpoint plans and batch sizes of a PyTorch model "
        "on this machine, and recommend the fastest configuration that fits a memory budget.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    w = p.add_argument_group("workload")
    w.add_argument("--model", required=True, metavar="MODULE:ATTR",
                   help="an nn.Module class or a factory returning one, e.g. autotune.examples:TinyGPT")
    w.add_argument("--model-kwargs", metavar="JSON", default=None, help="keyword arguments for the model, as a JSON object")
    w.add_argument("--data", metavar="MODULE:ATTR", default=None,
                   help="a map-style Dataset (or a factory for one) of (input, target) tuples or dicts; "
                   "default: the model's example_batch(batch_size) method")
    w.add_argument("--loss", metavar="MODULE:ATTR", default=None,
                   help="loss(output, target) for models whose output holds no loss")
    s = p.add_argument_group("search space and budget")
    s.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    s.add_argument("--budget", default=None, metavar="SIZE",
                   help="memory budget such as 24GiB or 512MiB (default: the device's total memory)")
    s.add_argument("--budgets", default=None, metavar="SIZE,SIZE",
                   help="more budgets, e.g. 8GiB,24GiB,80GiB: a recommendation for each from the same trials "
                   "(trials run under the largest)")
    s.add_argument("--headroom", type=float, default=0.1,
                   help="share of the budget the recommendation leaves free")
    s.add_argument("--precisions", default="auto",
                   help="comma-separated fp32,fp16,bf16; auto: the modes the device runs well")
    s.add_argument("--segments", default="auto", metavar="PLANS",
                   help="checkpoint plans, e.g. 0,2,every2,all: 0 is off, N recomputes the blocks of the first N-1 of N "
                   "segments, everyN every N-th block, all every block; auto: a spread from 0 to all")
    s.add_argument("--batch-sizes", default="1..512",
                   help="a range A..B (the powers of two in it) or a list such as 8,16,24")
    r = p.add_argument_group("search and trials")
    r.add_argument("--strategy", default="auto",
                   help="auto: fit each plan's memory line, bracket its largest batch, climb throughput; "
                   "grid: every point of the space; optuna: NSGA-II within --n-trials")
    r.add_argument("--n-trials", type=int, default=None, metavar="N",
                   help="trial budget of --strategy optuna (default: a quarter of the space)")
    r.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per trial on CUDA (on the CPU one metered step, the optimizer's "
                   "state primed before it)")
    r.add_argument("--measure-steps", type=int, default=5, help="at most this many timed steps per trial: timing stops once the last 3 lie within 2%% "
                   "of their median; the median is reported with the spread")
    r.add_argument("--settle-steps", type=int, default=3, metavar="N",
                   help="timing stops early once the last N steps lie within 2%% of their median; 0 times all "
                   "--measure-steps steps")
    r.add_argument("--trial-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="stop a trial running longer than this (status timeout)")
    r.add_argument("--isolation", default="auto", choices=("auto", "process", "none"),
                   help="process: each trial in a fresh worker process (a crash or a sticky CUDA error stays there); "
                   "none: in this process; auto: process on CUDA, none on CPU")
    r.add_argument("--parallel", default="none", choices=("none", "ddp", "fsdp"),
                   help="under torchrun: ddp or fsdp runs every trial on every rank under DistributedDataParallel or "
                   "FSDP2 (fully_shard on each repeated block), batch sizes per rank; none: the ranks are independent "
                   "workers sharing the study")
    r.add_argument("--storage", default=None, metavar="URL",
                   help="Optuna storage URL for the trial store (default: sqlite:///results/<study>.db)")
    r.add_argument("--study", default=None, help="study name (default: derived from the model and device)")
    b = p.add_argument_group("probe, training plan and guard rails")
    b.add_argument("--no-probe", action="store_true",
                   help="skip the probe (the top candidates training an epoch over a slice of --data)")
    b.add_argument("--probe-top", type=int, default=3, help="Pareto candidates to probe, fastest first")
    b.add_argument("--probe-epochs", type=int, default=1, help="epochs each candidate trains in the probe")
    b.add_argument("--probe-fraction", type=float, default=0.1, help="share of --data (drawn at random) the probe trains on")
    b.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes in the probe")
    b.add_argument("--target-batch-size", type=int, default=None, metavar="N",
                   help="batch size to train with: adds gradient-accumulation steps so micro x steps >= N")
    b.add_argument("--clip-grad-norm", type=float, default=None, metavar="NORM",
                   help="clip the global gradient norm (after unscaling fp16) in trials, probe and apply")
    b.add_argument("--fp32-modules", default="", metavar="NAME,NAME",
                   help="module class names kept outside autocast, e.g. LayerNorm,Softmax")
    b.add_argument("--no-library-compare", action="store_true",
                   help="skip measuring the model library's own per-layer checkpointing (Hugging Face, timm) "
                   "beside autotune's plan")
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
    p = _Parser(prog="python -m autotune show", description="Print a saved report's table and recommendation again; "
                "optionally export it or plot it.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("report", metavar="REPORT.json", help="a JSON report written by autotune")
    _output_flags(p.add_argument_group("output"))
    return p


def options_from(args: argparse.Namespace) -> "Options":
    """The :class:`~autotune.options.Options` the flags say: the same object ``autotune.tune`` builds."""
    from autotune.options import Options

    return Options(
        model=args.model, model_kwargs=args.model_kwargs, data=args.data, loss=args.loss, device=args.device,
        budget=args.budget, headroom=args.headroom, precisions=args.precisions, segments=args.segments,
        batch_sizes=args.batch_sizes, strategy=args.strategy, n_trials=args.n_trials, budgets=args.budgets,
        warmup_steps=args.warmup_steps, measure_steps=args.measure_steps, settle_steps=args.settle_steps,
        trial_timeout=args.trial_timeout,
        storage=args.storage, study=args.study, isolation=args.isolation, probe=not args.no_probe,
        probe_top=args.probe_top, probe_epochs=args.probe_epochs, probe_fraction=args.probe_fraction,
        num_workers=args.num_workers, target_batch_size=args.target_batch_size, clip_grad_norm=args.clip_grad_norm,
        fp32_modules=args.fp32_modules, compare_library=not args.no_library_compare, parallel=args.parallel,
    )


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
    if frameworks and report.recommendation is not None:
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
            print(f"autotune: wrote {path}", file=sys.stderr)
        if frameworks and report.recommendation is None:
            print("autotune: nothing to export: the report has no recommendation", file=sys.stderr)
    except UsageError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"autotune: error: {exc.filename or args.report}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK if report.recommendation is not None else EXIT_NOTHING_FITS


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
    level = logging.WARNING if args.quiet else (logging.DEBUG if args.verbose else logging.INFO)
    logging.basicConfig(format="autotune: %(message)s", stream=sys.stderr)
    logging.getLogger("autotune").setLevel(level)  # only ours: libraries keep their own levels

    from autotune.cli.progress import Progress

    try:
        if args.parallel != "none" and _follower():
            logging.getLogger("autotune").setLevel(logging.ERROR)  # rank 0 speaks for the job
            with _sigterm_as_interrupt() as stopped:
                return _follow(args, stopped)
        progress = Progress(quiet=args.quiet)
        with _sigterm_as_interrupt() as stopped:
            return _main(args, progress, stopped)
    finally:
        if args.parallel != "none":
            from autotune.execution.job import leave

            leave()


def _follow(args: argparse.Namespace, stopped: list[int]) -> int:
    """A follower rank of ``--parallel``: it trains rank 0's trials and exits as rank 0 does, saying nothing
    (rank 0 writes the JSON and the one line of bad input); its own Ctrl-C or SIGTERM sets its own code."""
    import autotune
    from autotune.tuner import run

    try:
        report = run(options_from(args))
    except (autotune.Interrupted, KeyboardInterrupt):
        return _interrupted_code(stopped)
    except UsageError:
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - one line, as rank 0 says its own
        print(f"autotune: rank {os.environ.get('RANK')}: error: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    if stopped:
        return _interrupted_code(stopped)
    return EXIT_OK if report.recommendation is not None else EXIT_NOTHING_FITS


def _interrupted_code(stopped: list[int]) -> int:
    """The exit code of an interrupted run: 128 + the signal that stopped it (SIGTERM: 143), else Ctrl-C's 130."""
    return 128 + stopped[0] if stopped else EXIT_INTERRUPTED


class Terminated(KeyboardInterrupt):
    """SIGTERM (what torchrun, SLURM, Kubernetes and systemd send, then wait a grace period): handled as Ctrl-C."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[list[int]]:
    """Inside the block, SIGTERM raises :class:`Terminated` (a KeyboardInterrupt): the running trial is
    discarded, the partial report written, and the exit code is 128 + 15. Yields the signals received."""
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        if len(received) == 1:  # a second SIGTERM must not cut the partial report short
            raise Terminated()

    if threading.current_thread() is not threading.main_thread():  # signals are only for the main thread
        yield received
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _ended_early(args: argparse.Namespace) -> Iterator[None]:
    """Bad input only rank 0 can see (its --out, --export, --plot): the other ranks of a --parallel job, which
    wait for rank 0's trials, are told to exit 2 too."""
    try:
        yield
    except UsageError as exc:
        if args.parallel != "none":
            with contextlib.suppress(Exception):
                from autotune.device import resolve_device
                from autotune.execution.job import end_early

                end_early(args.parallel, resolve_device(args.device), str(exc))
        raise


def _main(args: argparse.Namespace, progress: Any, stopped: list[int]) -> int:
    import autotune
    from autotune.tuner import run

    def how() -> str:
        return "stopped by SIGTERM" if stopped else "interrupted"

    try:
        options = options_from(args)  # bad options: every rank of a --parallel job says so alike, before joining
        with _ended_early(args):
            frameworks, plot = _outputs(args)
            _check_writable(args.out or os.path.join("results", "report.json"), create_folder=not args.out)
        report = run(options, progress=progress)
    except autotune.Interrupted as exc:
        try:
            wrote = f"wrote the partial report to {_write(exc.report, args.out)}"
        except (OSError, ValueError) as write_exc:
            wrote = f"could not write the partial report ({write_exc})"
        print(f"autotune: {how()} after {len(exc.report.trials)} trials; {wrote}; finished trials are kept in "
              f"{exc.report.search['storage']}: run the same command to continue", file=sys.stderr)
        return _interrupted_code(stopped)
    except UsageError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except AutotuneError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - a trial store or library failing mid-search: one line, not a traceback
        if args.verbose:
            import traceback

            traceback.print_exc()
        print(f"autotune: error: {type(exc).__name__}: {first_line(exc)} (finished trials are kept in the store; "
              f"--verbose shows the traceback)", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # before the search started: nothing measured
        print(f"autotune: {how()}", file=sys.stderr)
        return _interrupted_code(stopped)
    try:
        out = _write(report, args.out)
    except (OSError, ValueError) as exc:
        print(report.table())
        print(f"autotune: error: cannot write the report: {getattr(exc, 'strerror', None) or exc}; the trials are kept in "
              f"{report.search['storage']}, so run again with another --out", file=sys.stderr)
        return EXIT_ERROR
    print(report.table())
    if not args.quiet:
        print(f"autotune: wrote {out}", file=sys.stderr)
    try:
        written = _write_outputs(report, out, frameworks, plot)
    except (OSError, UsageError) as exc:
        print(f"autotune: error: the report is written ({out}) but its exports or plots are not: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if not args.quiet:
        for path in written:
            print(f"autotune: wrote {path}", file=sys.stderr)
    if frameworks and report.recommendation is None:
        print("autotune: nothing to export: no configuration fits (see below)", file=sys.stderr)
    if report.recommendation is None:
        print(_nothing_fits_hint(report), file=sys.stderr)
        return EXIT_NOTHING_FITS
    return EXIT_OK


def _write(report, out: str | None) -> str:
    """Write the JSON report to ``out`` (default ``results/<study>.json``); return the path."""
    out = out or os.path.join("results", f"{report.search['study']}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    report.to_json(out)
    return out


def _nothing_fits_hint(report) -> str:
    from autotune.units import format_bytes

    if report.probe:
        reasons = "; ".join(f"{r.config}: {r.reason}" for r in report.probe)
        return (f"autotune: every probed candidate was rejected ({reasons}): try a larger --budget, a smaller --headroom, "
                f"--probe-top to probe more candidates, or --no-probe to take the short trials' answer")

    measured = [m for m in report.trials if m.peak_bytes is not None and m.status in ("ok", "oom")]
    smallest = min(measured, key=lambda m: m.peak_bytes, default=None)
    tries = []
    space = report.search["space"]
    if "bf16" not in space["precisions"] and "fp16" not in space["precisions"]:
        tries.append("--precisions with bf16 or fp16")
    if all(str(s) in ("0", "1") for s in space["segments"]) and report.workload.get("chain"):
        tries.append("--segments auto")
    if min(space["batch_sizes"]) > 1:
        tries.append("smaller --batch-sizes")
    tries.append("a larger --budget")
    least = (f"; the smallest peak measured was {format_bytes(smallest.peak_bytes)} ({smallest.config}, {smallest.status})"
             if smallest else "")
    statuses = sorted({m.status for m in report.trials})
    return (f"autotune: nothing fits within {format_bytes(report.budget_bytes)} less {report.headroom:.0%} headroom "
            f"(trial outcomes: {', '.join(statuses)}){least}: try {', '.join(tries)}")


if __name__ == "__main__":
    sys.exit(main())
