import dataclasses
import os
import struct
import sys

import numpy as np
import pytest

from tests.optional import needs

needs("matplotlib", "the plots need it: the plot extra")

import autotune  # noqa: E402
from autotune.errors import UsageError  # noqa: E402
from autotune.plot import MARKERS, memory_figure, pareto_figure, require_matplotlib, write_plots  # noqa: E402
from autotune.records import Config, Measurement  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), os.pardir, "results")
QUICKSTART_V1 = os.path.join(os.path.dirname(__file__), "data", "quickstart-v1.json")  # a report of schema version 1
MiB = 2**20


def load(name):
    return autotune.load(name if os.path.isabs(name) else os.path.join(RESULTS, name))


@pytest.fixture(scope="module")
def grid():
    return load("grid-TinyGPT-cpu.json")


@pytest.fixture(scope="module")
def quickstart():
    return load(QUICKSTART_V1)


def png_size(path):
    """Width and height of a PNG, from its signature and IHDR chunk."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def by_gid(ax, prefix):
    """Lines and collections of ``ax`` whose gid starts with ``prefix``, by gid."""
    return {a.get_gid(): a for a in [*ax.lines, *ax.collections] if (a.get_gid() or "").startswith(prefix)}


def marker_vertices(marker):
    from matplotlib.markers import MarkerStyle

    style = MarkerStyle(marker)
    return style.get_path().transformed(style.get_transform()).vertices


@pytest.mark.parametrize("name", [QUICKSTART_V1, "grid-TinyGPT-cpu.json", "example-gpt2-cpu.json"])
def test_write_plots_writes_two_pngs_next_to_the_json(tmp_path, name):
    paths = write_plots(load(name), tmp_path / "run.json")
    assert paths == [str(tmp_path / "run.pareto.png"), str(tmp_path / "run.memory.png")]
    for path in paths:
        width, height = png_size(path)
        assert 800 <= width <= 3000 and 400 <= height <= 1500
        assert os.path.getsize(path) > 20_000  # drawn, not blank


def test_pareto_figure_marks_the_front_budget_and_recommendation(grid):
    fig = pareto_figure(grid)
    ax, = fig.axes
    assert "MiB" in ax.get_xaxis().get_label().get_text() and ax.get_xscale() == "log"
    rec = grid.recommendation
    ring = by_gid(ax, "recommendation")["recommendation"]
    np.testing.assert_allclose(ring.get_offsets(), [[rec.peak_bytes / MiB, rec.samples_per_s]])
    label, = [t for t in ax.texts if t.get_text().startswith(f"{rec.precision}, seg")]
    assert label.get_text().splitlines()[0] == f"{rec.precision}, seg {rec.segments}, batch {rec.batch_size}"

    assert by_gid(ax, "budget")["budget"].get_xdata()[0] == pytest.approx(grid.budget_bytes / MiB)
    assert by_gid(ax, "headroom")["headroom"].get_xdata()[0] == pytest.approx(grid.budget_bytes * 0.9 / MiB)
    front = by_gid(ax, "front")
    np.testing.assert_allclose(front["front"].get_xdata(), [m.peak_bytes / MiB for m in grid.pareto])
    np.testing.assert_allclose(front["front"].get_ydata(), [m.samples_per_s for m in grid.pareto])

    # Every feasible trial once, in one series per precision, with that precision's marker.
    points = {**by_gid(ax, "trials:"), **by_gid(ax, "front:")}
    assert {gid.split(":")[1] for gid in points} == {"fp32", "bf16"}
    assert sum(len(c.get_offsets()) for c in points.values()) == sum(m.fits(grid.budget_bytes) for m in grid.trials)
    assert sum(len(points[g].get_offsets()) for g in points if g.startswith("front:")) == len(grid.pareto)
    for gid, series in points.items():
        np.testing.assert_allclose(series.get_paths()[0].vertices, marker_vertices(MARKERS[gid.split(":")[1]]))
    # What did not fit lies on the floor at its peak.
    oom = by_gid(ax, "did-not-fit")["did-not-fit"].get_offsets()
    assert len(oom) == sum(m.status == "oom" for m in grid.trials) and not oom[:, 1].any()
    assert (oom[:, 0] > grid.budget_bytes * 0.9 / MiB).all()


def test_memory_figure_has_a_panel_per_precision_and_a_line_per_plan(grid):
    fig = memory_figure(grid)
    model = grid.memory_model
    assert [ax.get_title() for ax in fig.axes] == ["fp32", "bf16"]
    colors = {}
    for ax in fig.axes:
        p = ax.get_title()
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8", "16", "32", "64", "128", "256"]
        plans = sorted(v.plan for v in model.lines if v.precision == p)
        fits = by_gid(ax, "fit:")
        assert sorted(g.split(":")[2] for g in fits) == plans == sorted(
            ["0", "every4", "2", "4", "8", "all", "sac-matmul", "sac-lean", "sac-linear"])  # --segments auto, L = 12
        for s in plans:
            fit, measured = fits[f"fit:{p}:{s}"], by_gid(ax, f"measured:{p}:{s}")[f"measured:{p}:{s}"]
            assert fit.get_linestyle() == "--" and fit.get_color() == measured.get_color()
            b = fit.get_xdata()
            np.testing.assert_allclose(fit.get_ydata(), [model.estimate((p, s), x) / MiB for x in b])
            ok = sorted((m for m in grid.trials if m.config.variant == (p, s) and m.status == "ok"), key=lambda m: m.batch_size)
            assert list(measured.get_xdata()) == [m.batch_size for m in ok]
            np.testing.assert_allclose(measured.get_ydata(), [m.peak_bytes / MiB for m in ok])
            assert measured.get_marker() == MARKERS[p]
            colors.setdefault(s, set()).add(measured.get_color())
        ooms = by_gid(ax, "oom:")
        assert sum(len(line.get_xdata()) for line in ooms.values()) == sum(
            m.status == "oom" and m.precision == p for m in grid.trials)
        assert all(line.get_markerfacecolor() == "none" for line in ooms.values())
        assert by_gid(ax, "budget")["budget"].get_ydata()[0] == pytest.approx(grid.budget_bytes / MiB)
    # One colour per segment count, the same in both panels.
    assert all(len(c) == 1 for c in colors.values()) and len({c.pop() for c in colors.values()}) == len(colors)
    ring = by_gid(fig.axes[1], "recommendation")["recommendation"]
    np.testing.assert_allclose(ring.get_offsets(), [[grid.recommendation.batch_size, grid.recommendation.peak_bytes / MiB]])


def test_one_point_plans_get_their_shared_intercept_line_over_the_search(quickstart):
    fig = memory_figure(quickstart)
    sources = {plan: m.source for plan, m in quickstart.memory_model.lines.items()}
    assert sources[("fp32", "2")] == "shared-intercept"
    fit = by_gid(fig.axes[0], "fit:fp32:2")["fit:fp32:2"]
    assert (fit.get_xdata()[0], fit.get_xdata()[-1]) == pytest.approx((1, 64))


def over_budget(report):
    extra = (Measurement(Config("bf16", "0", 64), "ok", peak_bytes=1200 * MiB, samples_per_s=70.0),
             Measurement(Config("bf16", "2", 64), "timeout"), Measurement(Config("bf16", "2", 128), "failed", error="x"))
    return dataclasses.replace(report, trials=report.trials + extra, budgets=(256 * MiB,))


def fp16_only(report):
    trials = tuple(dataclasses.replace(m, config=dataclasses.replace(m.config, precision="fp16"))
                   for m in report.trials if m.precision == "bf16")
    return dataclasses.replace(report, trials=trials, search={"space": {"precisions": ["fp16"]}})


EDGE_CASES = {
    "nothing fits": lambda r: dataclasses.replace(r, budget_bytes=MiB),
    "no budget": lambda r: dataclasses.replace(r, budget_bytes=None),
    "one trial": lambda r: dataclasses.replace(r, trials=r.trials[:1]),
    "no trials": lambda r: dataclasses.replace(r, trials=()),
    "only an oom": lambda r: dataclasses.replace(r, trials=tuple(m for m in r.trials if m.status == "oom")),
    "fp16 only": fp16_only,
    "over the budget and other budgets": over_budget,
}


@pytest.mark.parametrize("case", EDGE_CASES)
def test_edge_cases_still_plot(tmp_path, quickstart, case):
    report = EDGE_CASES[case](quickstart)
    for path in write_plots(report, tmp_path / "r.json"):
        assert png_size(path)[0] > 0
    ax, = pareto_figure(report).axes
    rec = report.recommendation
    assert bool(by_gid(ax, "recommendation")) == (rec is not None)
    assert bool(by_gid(ax, "budget")) == (report.budget_bytes is not None)
    panels = [ax.get_title() for ax in memory_figure(report).axes]
    assert panels == (["fp16"] if case == "fp16 only" else ["fp32", "bf16"])


def test_nothing_feasible_says_so(quickstart):
    ax, = pareto_figure(dataclasses.replace(quickstart, budget_bytes=MiB)).axes
    assert not by_gid(ax, "front") and not by_gid(ax, "recommendation")
    assert "nothing fits the budget" in [t.get_text() for t in ax.texts]
    assert len(by_gid(ax, "did-not-fit")["did-not-fit"].get_offsets()) == len(quickstart.trials)


def test_the_fp16_marker_is_its_own(quickstart):
    report = fp16_only(quickstart)
    for line in by_gid(memory_figure(report).axes[0], "measured:").values():
        assert line.get_marker() == MARKERS["fp16"] != MARKERS["bf16"]


def test_missing_matplotlib_is_a_usage_error(tmp_path, monkeypatch, quickstart):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(UsageError, match=r"--plot needs matplotlib: pip install matplotlib"):
        require_matplotlib()
    with pytest.raises(UsageError, match="pip install matplotlib"):
        write_plots(quickstart, tmp_path / "r.json")
    assert not list(tmp_path.iterdir())


def test_compiled_trials_get_panels_of_their_own():
    # Eager and compiled trials of one precision hold other memory: one panel per precision and compile mode, each
    # with its own trials and memory lines (results/compile-TinyGPT-cpu.json: fp32 and bf16, eager and compiled).
    report = load("compile-TinyGPT-cpu.json")
    fig = memory_figure(report)
    assert [ax.get_title() for ax in fig.axes] == ["fp32", "fp32 compiled", "bf16", "bf16 compiled"]
    for ax, (precision, compile) in zip(fig.axes, [("fp32", "none"), ("fp32", "default"), ("bf16", "none"),
                                                   ("bf16", "default")]):
        name = ax.get_title()
        for plan in ("0", "all"):
            measured = by_gid(ax, f"measured:{name}:{plan}")[f"measured:{name}:{plan}"]
            trials = sorted((m.batch_size, m.peak_bytes / MiB) for m in report.trials if m.status == "ok"
                            and (m.precision, m.config.compile, str(m.config.plan)) == (precision, compile, plan))
            np.testing.assert_allclose(np.column_stack([measured.get_xdata(), measured.get_ydata()]), trials)
    # The throughput plot marks each compiled configuration that fits with a dot inside its marker
    ax = pareto_figure(report).axes[0]
    dots = by_gid(ax, "compiled")["compiled"].get_offsets()
    fits = sorted((m.peak_bytes / MiB, m.samples_per_s) for m in report.trials
                  if m.config.compiled and m.fits(report.budget_bytes) and m.samples_per_s)
    np.testing.assert_allclose(sorted(map(tuple, dots)), fits)
    assert "compiled (a dot inside the marker)" in [t.get_text() for t in ax.get_legend().get_texts()]
