"""Plots of a report: throughput vs peak memory (the Pareto front) and peak memory vs batch size.

matplotlib is optional and imported only here, inside the functions. Figures are built on
``matplotlib.figure.Figure`` with an Agg canvas: no display is needed and pyplot's global state
(current figure, backend) is left alone. Both plots draw a precision with the same marker and a
segment count with the same colour, so one reads the other.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Sequence

from autotune.errors import UsageError
from autotune.vocabulary import EAGER, Plan, PrecisionName, Status, Variant, compile_label, plan_order
from autotune.records import usable_bytes
from autotune.units import format_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from autotune.report import Report

__all__ = ["require_matplotlib", "pareto_figure", "memory_figure", "write_plots"]

_N = PrecisionName
MARKERS = {_N.FP32: "o", _N.FP16: "s", _N.BF16: "^", _N.BF16_FSDP: "v", _N.BF16_TRUE: "P"}  # a shape per precision
OTHER_MARKER = "D"
FAINT = 0.3  # alpha of trials that are not on the front


def require_matplotlib() -> None:
    """Raise UsageError when matplotlib cannot be imported (the CLI checks before a long search)."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None


def write_plots(report: Report, json_path: str | os.PathLike) -> list[str]:
    """Write ``<stem>.pareto.png`` and ``<stem>.memory.png`` next to the report JSON; return their paths."""
    stem = os.path.splitext(os.fspath(json_path))[0]
    paths = []
    for name, figure in (("pareto", pareto_figure), ("memory", memory_figure)):
        path = f"{stem}.{name}.png"
        figure(report).savefig(path, dpi=120)
        paths.append(path)
    return paths


def pareto_figure(report: Report) -> Figure:
    """Samples/s vs peak memory of every trial, the Pareto front, the budget and the recommendation."""
    require_matplotlib()
    from matplotlib.lines import Line2D

    fig, (ax,) = _figure(1, width=10.0)
    unit, scale = _unit(report)
    colors = _segment_colors(report)
    budget = report.budget_bytes
    fits = [m for m in report.trials if m.fits(budget) and m.samples_per_s is not None and m.peak_bytes]
    front = {m.config for m in report.pareto}
    for p in _precisions(report):
        pts = [m for m in fits if m.precision == p]
        for on_front, alpha, edge in ((False, FAINT, "none"), (True, 1.0, "black")):
            sel = [m for m in pts if (m.config in front) == on_front]
            if sel:
                ax.scatter([m.peak_bytes / scale for m in sel], [m.samples_per_s for m in sel], s=45 if on_front else 30,
                           marker=_marker(p), c=[colors[m.config.plan] for m in sel], alpha=alpha, edgecolors=edge,
                           linewidths=0.8, zorder=3 if on_front else 2, gid=f"{'front' if on_front else 'trials'}:{p}")
    compiled = [m for m in fits if m.config.compiled]
    if compiled:  # a compiled configuration: a dot inside its marker
        ax.scatter([m.peak_bytes / scale for m in compiled], [m.samples_per_s for m in compiled], marker=".", s=18,
                   color="black", zorder=3.5, gid="compiled")
    if report.pareto:
        ax.plot([m.peak_bytes / scale for m in report.pareto], [m.samples_per_s for m in report.pareto],
                drawstyle="steps-post", color="black", linewidth=1.2, zorder=2.5, gid="front")
    over = [m for m in report.trials if m.peak_bytes and not m.fits(budget) and m.status.measured_memory]
    if over:  # what did not fit: at its peak, on the floor unless it ran (an ok trial over the budget)
        ax.scatter([m.peak_bytes / scale for m in over], [m.samples_per_s or 0.0 for m in over], marker="x", s=40,
                   color="0.45", linewidths=1.2, clip_on=False, zorder=3, gid="did-not-fit")
    budget_handles = _budget_lines(ax, report, scale, vertical=True)
    rec = report.recommendation
    if rec is not None and rec.peak_bytes and rec.samples_per_s is not None:
        ax.scatter([rec.peak_bytes / scale], [rec.samples_per_s], s=420, facecolors="none", edgecolors="crimson",
                   linewidths=2.2, zorder=4, gid="recommendation")
    if not fits:
        empty = "no trials" if not report.trials else "nothing fits the budget" if budget else "no trial ran to the end"
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", fontsize=13, color="0.35")
    ax.set_xscale("log")
    _memory_ticks(ax.xaxis)
    fastest = max([m.samples_per_s for m in fits] + [m.samples_per_s or 0.0 for m in over], default=0.0)
    ax.set_ylim(0, fastest * 1.25 or 1.0)  # room above the fastest point for the recommendation's label
    ax.set_xlabel(f"peak memory ({unit}, log scale)")
    ax.set_ylabel("throughput (samples/s)")
    ax.grid(True, which="major", alpha=0.3)
    ax.set_title(_title(report, "throughput vs peak memory"))
    if rec is not None and rec.peak_bytes and rec.samples_per_s is not None:  # after the limits: it reads them
        way = f", {compile_label(rec.config.compile)}" if rec.config.compiled else ""
        _annotate(ax, rec.peak_bytes / scale, rec.samples_per_s, f"{rec.precision}, seg {rec.config.plan}{way}, batch "
                  f"{rec.batch_size}\n{rec.samples_per_s:.1f} samples/s, {format_bytes(rec.peak_bytes)}")
    _legend(ax, _style_handles(report, colors)
          + ([Line2D([], [], color="black", marker="o", markeredgecolor="black", markerfacecolor="0.8",
                     label="Pareto front")] if report.pareto else [])
          + ([Line2D([], [], linestyle="none", marker="x", color="0.45", label="did not fit (OOM: on the floor)")]
             if over else [])
          + ([Line2D([], [], linestyle="none", marker=".", color="black", label="compiled (a dot inside the marker)")]
             if compiled else [])
          + budget_handles + _ring_handle(rec))
    return fig


def memory_figure(report: Report) -> Figure:
    """Peak memory vs batch size per plan: measured (OOM hollow), the fitted line dashed, the budget."""
    require_matplotlib()
    import numpy as np
    from matplotlib.lines import Line2D

    modes = _modes(report) or [(PrecisionName.FP32, EAGER)]  # a panel per precision, and per compile mode where compiled
    fig, axes = _figure(len(modes), width=max(4.6 * len(modes) + 2.2, 9.0))
    unit, scale = _unit(report)
    colors = _segment_colors(report)
    model = report.memory_model
    space_sizes = (report.search.space or {}).get("batch_sizes") or []
    measured = [m for m in report.trials if m.peak_bytes and m.status.measured_memory]
    all_sizes = sorted({m.batch_size for m in measured} | set(space_sizes))
    blocks = (report.search.space or {}).get("blocks")
    rec = report.recommendation
    budget_handles: list[Any] = []
    for ax, (p, c) in zip(axes, modes):
        trials = [m for m in measured if m.config.variant.mode == (p, c)]
        name = p if c == EAGER else f"{p} {compile_label(c)}"  # the panel's title, and its series' gids
        for s in plan_order({m.config.plan for m in trials} | {v.plan for v in model.lines if v.mode == (p, c)}, blocks):
            kw = dict(marker=_marker(p), color=colors[s], markersize=6, linestyle="none")
            ok = [m for m in trials if m.config.plan == s and m.status == Status.OK]
            oom = [m for m in trials if m.config.plan == s and m.status == Status.OOM]
            if ok:
                ax.plot([m.batch_size for m in ok], [m.peak_bytes / scale for m in ok], gid=f"measured:{name}:{s}", **kw)
            if oom:
                ax.plot([m.batch_size for m in oom], [m.peak_bytes / scale for m in oom], markerfacecolor="none",
                        markeredgewidth=1.4, gid=f"oom:{name}:{s}", **kw)
            line = model.lines.get(Variant(p, s, c))
            if line is not None and all_sizes:  # over the whole search: a one-point plan's line shows too
                b = np.geomspace(min(all_sizes), max(all_sizes), 64)
                ax.plot(b, (line.fixed_bytes + line.per_sample_bytes * b) / scale, linestyle="--", linewidth=1.2,
                        color=colors[s], alpha=0.8, gid=f"fit:{name}:{s}")
        budget_handles = _budget_lines(ax, report, scale, vertical=False)
        if rec is not None and rec.config.variant.mode == (p, c) and rec.peak_bytes:
            ax.scatter([rec.batch_size], [rec.peak_bytes / scale], s=300, facecolors="none", edgecolors="crimson",
                       linewidths=2, zorder=4, gid="recommendation")
        if not trials:
            ax.text(0.96, 0.04, f"no {name} trial measured", transform=ax.transAxes, ha="right", va="bottom",
                    color="0.35")
        _batch_axes(ax, all_sizes, name)
    peaks = [m.peak_bytes / scale for m in measured] + [b / scale for b in (report.budget_bytes, *report.budgets) if b]
    if peaks:  # extrapolated fits may run off the top; the measurements and budgets decide the range
        axes[0].set_ylim(min(peaks) / 1.3, max(peaks) * 1.3)
    axes[0].set_ylabel(f"peak memory ({unit}, log scale)")
    fig.suptitle(_title(report, "peak memory vs batch size"))
    _legend(axes[-1], _style_handles(report, colors)
          + [Line2D([], [], color="0.3", marker="o", linestyle="none", label="measured (ok)"),
             Line2D([], [], color="0.3", marker="o", linestyle="none", markerfacecolor="none", label="OOM (peak reached)"),
             Line2D([], [], color="0.3", linestyle="--", label="memory model fit")]
          + budget_handles + _ring_handle(rec))
    return fig


# -- shared pieces ---------------------------------------------------------------------------------


def _batch_axes(ax: Any, sizes: list[int], title: str) -> None:
    """Batch sizes along x (log2, each size a tick when few), peak memory along y (log)."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    if 0 < len(sizes) <= 12:
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.xaxis.set_minor_locator(NullLocator())
    if sizes:
        ax.set_xlim(min(sizes) / 1.25, max(sizes) * 1.25)
    ax.set_yscale("log")
    _memory_ticks(ax.yaxis)
    ax.grid(True, which="major", alpha=0.3)
    ax.set_title(title)
    ax.set_xlabel("batch size (log2 scale)")


def _figure(ncols: int, *, width: float) -> tuple[Figure, Sequence[Axes]]:
    """A figure on its own Agg canvas (no pyplot), with ``ncols`` axes side by side."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, ncols, sharex=True, sharey=True, squeeze=False)[0])


def _precisions(report: Report) -> list[str]:
    """Precisions in the space's order, then any other a trial used."""
    space = (report.search.space or {}).get("precisions") or []
    return list(dict.fromkeys([*space, *(m.precision for m in report.trials)]))


def _modes(report: Report) -> list[tuple[str, str]]:
    """(precision, compile mode) pairs: the precisions in :func:`_precisions`' order, each in the compile modes its
    trials ran, eager first (eager alone where none ran: its panel says so)."""
    modes = {p: sorted({m.config.compile for m in report.trials if m.precision == p}, key=lambda c: (c != EAGER, c))
             for p in _precisions(report)}
    return [(p, c) for p in modes for c in (modes[p] or [EAGER])]


def _marker(precision: str) -> str:
    return MARKERS.get(precision, OTHER_MARKER)


def _segment_colors(report: Report) -> dict[str, Any]:
    """One colour per checkpoint plan in the report, the same in both plots."""
    from matplotlib import colormaps

    space = report.search.space or {}
    segments = plan_order({*(space.get("segments") or []), *(m.config.plan for m in report.trials)}, space.get("blocks"))
    cmap = colormaps["tab10" if len(segments) <= 10 else "tab20"]
    return {s: cmap(i % cmap.N) for i, s in enumerate(segments)}


def _style_handles(report: Report, colors: dict[str, Any]) -> list[Any]:
    """Legend entries: a grey marker per precision, a colour per checkpoint plan."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    return ([Line2D([], [], linestyle="none", marker=_marker(p), color="0.35", label=p) for p in _precisions(report)]
            + [Patch(color=c, label=Plan(s).label) for s, c in colors.items()])


def _unit(report: Report) -> tuple[str, float]:
    """The binary unit that keeps the report's peaks and budget readable: KiB, MiB or GiB."""
    largest = max([m.peak_bytes or 0 for m in report.trials] + [report.budget_bytes or 0, *report.budgets])
    for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if largest >= 4 * size:
            return name, float(size)
    return "KiB", 1024.0


def _memory_ticks(axis: Any) -> None:
    """Plain numbers (``20``, ``500``) on a log memory axis, with 2x and 5x ticks between decades."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _budget_lines(ax: Axes, report: Report, scale: float, *, vertical: bool) -> list[Any]:
    """Draw the budget (solid), the budget less headroom (dashed) and any --budgets (dotted); return legend entries."""
    from matplotlib.lines import Line2D

    line = ax.axvline if vertical else ax.axhline
    lines = []
    if report.budget_bytes:
        lines.append((report.budget_bytes, "-", "crimson", f"budget {format_bytes(report.budget_bytes)}", "budget"))
        if report.headroom:
            limit = usable_bytes(report.budget_bytes, report.headroom)
            lines.append((limit, "--", "crimson", f"budget less {report.headroom:.0%} headroom", "headroom"))
    lines += [(b, ":", "0.4", f"budget {format_bytes(b)} (--budgets)", f"budget:{b}") for b in report.budgets
              if b != report.budget_bytes]
    for value, style, color, _, gid in lines:
        line(value / scale, linestyle=style, color=color, linewidth=1.3, alpha=0.8, zorder=1, gid=gid)
    return [Line2D([], [], linestyle=style, color=color, label=label) for _, style, color, label, _ in lines]


def _ring_handle(rec: object) -> list[Any]:
    """The legend entry of the recommendation's ring, when there is one."""
    from matplotlib.lines import Line2D

    return [] if rec is None else [Line2D([], [], linestyle="none", marker="o", markersize=13, markerfacecolor="none",
                                          markeredgecolor="crimson", markeredgewidth=2, label="recommendation")]


def _legend(ax: Axes, handles: list[Any]) -> None:
    """The legend outside the axes, to their right: it never covers a point."""
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=9,
              frameon=False)


def _annotate(ax: Axes, x: float, y: float, text: str) -> None:
    """Label the recommendation beside its ring, on the side with more room and just above it.

    The recommendation is the fastest trial within the headroom, so nothing to its left is faster:
    above and to the left of it is empty.
    """
    left, right = ax.get_xlim()
    on_right = (x / left > right / x) if ax.get_xscale() == "log" else (x - left > right - x)
    ax.annotate(text, (x, y), xytext=(-30 if on_right else 30, 10), textcoords="offset points",
                ha="right" if on_right else "left", va="bottom", fontsize=9, color="crimson",
                bbox=dict(boxstyle="round,pad=0.3", facecolor="white", edgecolor="crimson", alpha=0.9),
                arrowprops=dict(arrowstyle="-", color="crimson", shrinkA=0, shrinkB=11), zorder=5)


def _title(report: Report, what: str) -> str:
    env, work = report.environment, report.workload
    model = work.get("model_class") or str(work.get("model", "model")).rpartition(":")[2]
    device = env.get("device", "?") + (f" ({env['device_name']})" if env.get("device_name") else "")
    return f"{model} on {device}: {what}"
