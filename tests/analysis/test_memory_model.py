"""The memory model on synthetic, exactly linear peaks: which line each variant gets, and from what.

tests/search/test_strategies.py checks the model inside the search (a two-point fit, one shared-intercept
plan and one plan predicted from another precision); these tests pin each rule on its own, with
values computed by hand or by numpy's own least squares.
"""

import numpy as np
import pytest

from autotune.analysis.memory_model import MemoryLine, MemoryModel
from autotune.records import Config, Measurement


def m(precision, segments, batch, peak, status="ok"):
    return Measurement(Config(precision, segments, batch), status, peak_bytes=peak)


def line(precision, segments, fixed, per_sample, batches):
    """Measurements exactly on ``fixed + per_sample * b``."""
    return [m(precision, segments, b, fixed + per_sample * b) for b in batches]


# --- own lines -----------------------------------------------------------------------------------


def test_a_plan_with_several_points_gets_its_exact_line():
    model = MemoryModel.fit(line("fp32", "0", 5000, 300, (1, 2, 4, 8)), [("fp32", "0")])
    fitted = model.lines[("fp32", "0")]
    assert (fitted.source, fitted.points, fitted.variant) == ("fit", 4, ("fp32", "0"))
    assert fitted.fixed_bytes == pytest.approx(5000) and fitted.per_sample_bytes == pytest.approx(300)
    assert fitted.max_error_bytes == pytest.approx(0, abs=1e-6) and model.relative_error() == pytest.approx(0, abs=1e-12)
    assert model.estimate(("fp32", "0"), 100) == pytest.approx(35000)
    assert fitted.estimate(0) == pytest.approx(5000)


def test_trials_that_did_not_finish_or_read_no_peak_are_not_points():
    trials = line("fp32", "0", 1000, 100, (1, 2)) + [
        m("fp32", "0", 64, 10**9, status="oom"), m("fp32", "0", 32, 10**9, status="timeout"),
        m("fp32", "0", 16, 10**9, status="failed"), m("fp32", "0", 8, 10**9, status="crashed"),
        m("fp32", "0", 4, None), m("fp32", "0", 3, 0),
    ]
    fitted = MemoryModel.fit(trials, [("fp32", "0")]).lines[("fp32", "0")]
    assert fitted.points == 2
    assert (fitted.fixed_bytes, fitted.per_sample_bytes) == pytest.approx((1000, 100))


def test_the_least_squares_line_and_its_residuals_match_numpy():
    batches, peaks = [1, 2, 4, 8], [1100, 1230, 1390, 1850]
    model = MemoryModel.fit([m("bf16", "all", b, y) for b, y in zip(batches, peaks)], [("bf16", "all")])
    fitted = model.lines[("bf16", "all")]
    slope, intercept = np.polyfit(batches, peaks, 1)
    assert fitted.per_sample_bytes == pytest.approx(slope) and fitted.fixed_bytes == pytest.approx(intercept)
    residuals = np.abs(np.array(peaks) - (intercept + slope * np.array(batches)))
    assert fitted.max_error_bytes == pytest.approx(residuals.max())
    assert fitted.max_relative_error == pytest.approx((residuals / peaks).max())
    assert model.relative_error() == pytest.approx((residuals / peaks).max())


def test_relative_error_counts_only_lines_of_three_or_more_points():
    # A line through two points is exact whatever the memory does: it says nothing about the model's error.
    off = [m("fp32", "0", 1, 1100), m("fp32", "0", 2, 1200), m("fp32", "0", 4, 1500)]  # bent
    model = MemoryModel.fit(off + line("fp32", "2", 1000, 50, (1, 2)), [("fp32", "0"), ("fp32", "2")])
    assert model.lines[("fp32", "0")].max_relative_error > 0.01
    assert model.relative_error() == model.lines[("fp32", "0")].max_relative_error
    two = MemoryModel.fit(off[:2], [("fp32", "0")])
    assert two.relative_error() == 0.0


def test_a_flat_or_falling_line_keeps_a_positive_per_sample_cost():
    model = MemoryModel.fit([m("fp32", "0", 1, 5000), m("fp32", "0", 8, 5000), m("fp32", "2", 1, 5000),
                             m("fp32", "2", 8, 4000)], [("fp32", "0"), ("fp32", "2")])
    assert model.lines[("fp32", "0")].per_sample_bytes == 1.0
    assert model.lines[("fp32", "2")].per_sample_bytes == 1.0
    assert model.estimate(("fp32", "0"), 1000) > model.estimate(("fp32", "0"), 1)


# --- one point: the shared intercept ---------------------------------------------------------------


def test_a_one_point_plan_shares_the_intercept_of_its_precisions_other_plans():
    trials = line("fp32", "0", 7000, 500, (1, 2)) + line("fp32", "2", 7000, 200, (2, 4)) + [m("fp32", "all", 8, 7000 + 8 * 80)]
    model = MemoryModel.fit(trials, [("fp32", s) for s in ("0", "2", "all")])
    one = model.lines[("fp32", "all")]
    assert (one.source, one.points) == ("shared-intercept", 1)
    assert one.fixed_bytes == pytest.approx(7000) and one.per_sample_bytes == pytest.approx(80)
    assert one.max_error_bytes == pytest.approx(0, abs=1e-6)
    assert model.estimate(("fp32", "all"), 64) == pytest.approx(7000 + 64 * 80)


def test_the_shared_intercept_is_the_joint_least_squares_one():
    # Two plans whose own lines disagree on the intercept: the shared one is fitted with a slope per plan.
    a = [(1, 1100), (2, 1200), (4, 1400)]  # 1000 + 100 b
    b = [(2, 1300), (8, 1600)]  # 1200 + 50 b
    trials = [m("fp32", "0", x, y) for x, y in a] + [m("fp32", "4", x, y) for x, y in b] + [m("fp32", "all", 16, 2000)]
    rows = [[1, x, 0] for x, _ in a] + [[1, 0, x] for x, _ in b]
    (shared, _, _), *_ = np.linalg.lstsq(np.array(rows, float), np.array([y for _, y in a + b], float), rcond=None)
    model = MemoryModel.fit(trials, [("fp32", s) for s in ("0", "4", "all")])
    one = model.lines[("fp32", "all")]
    assert one.fixed_bytes == pytest.approx(shared)
    assert one.per_sample_bytes == pytest.approx((2000 - shared) / 16)
    # the multi-point plans keep their own lines
    assert model.lines[("fp32", "4")].fixed_bytes == pytest.approx(1200)


def test_a_negative_shared_intercept_is_taken_as_zero():
    trials = line("fp32", "0", -500, 100, (10, 20)) + [m("fp32", "2", 10, 800)]
    one = MemoryModel.fit(trials, [("fp32", "0"), ("fp32", "2")]).lines[("fp32", "2")]
    assert one.fixed_bytes == 0.0 and one.per_sample_bytes == pytest.approx(80)


def test_a_precision_without_a_multi_point_plan_takes_the_median_intercept_of_the_others():
    trials = (line("fp32", "0", 1000, 100, (1, 2)) + line("fp16", "0", 3000, 50, (1, 2))
              + line("fp16", "2", 3000, 20, (1, 4)) + [m("bf16", "0", 10, 2000 + 10 * 40)])
    one = MemoryModel.fit(trials, [("bf16", "0")]).lines[("bf16", "0")]
    assert one.source == "shared-intercept"
    assert one.fixed_bytes == pytest.approx(2000)  # the median of 1000 and 3000
    assert one.per_sample_bytes == pytest.approx(40)


@pytest.mark.parametrize("hint, fixed, per_sample", [(200.0, 200.0, 50.0), (None, 0.0, 100.0)])
def test_without_any_multi_point_plan_the_hint_is_the_intercept(hint, fixed, per_sample):
    model = MemoryModel.fit([m("fp32", "0", 4, 400)], [("fp32", "0")], fixed_bytes_hint=hint)
    one = model.lines[("fp32", "0")]
    assert (one.fixed_bytes, one.per_sample_bytes) == pytest.approx((fixed, per_sample))


def test_an_intercept_above_the_point_gives_way_to_the_point():
    # A hint of 1000 bytes cannot be right for a peak of 400: half the point is taken as fixed, half per sample.
    one = MemoryModel.fit([m("fp32", "0", 4, 400)], [("fp32", "0")], fixed_bytes_hint=1000.0).lines[("fp32", "0")]
    assert (one.fixed_bytes, one.per_sample_bytes) == pytest.approx((200, 50))
    assert one.estimate(4) == pytest.approx(400) and one.per_sample_bytes > 0


# --- no point: borrowed slopes ---------------------------------------------------------------------


def test_an_unmeasured_plan_borrows_from_another_precision_scaled_by_the_median_measured_ratio():
    trials = (line("fp32", "0", 1000, 100, (1, 2)) + line("fp32", "2", 1000, 60, (1, 2)) + line("fp32", "all", 1000, 20, (1, 2))
              + line("bf16", "0", 800, 50, (1, 2)) + line("bf16", "2", 800, 36, (1, 2)))  # ratios 0.5 and 0.6
    model = MemoryModel.fit(trials, [(p, s) for p in ("fp32", "bf16") for s in ("0", "2", "all")], blocks=4)
    predicted = model.lines[("bf16", "all")]
    assert (predicted.source, predicted.points) == ("predicted", 0)
    assert predicted.per_sample_bytes == pytest.approx(20 * 0.55)  # not bf16's own recompute line (22)
    assert predicted.fixed_bytes == pytest.approx(800)  # its precision's intercept
    assert predicted.max_error_bytes is None and predicted.max_relative_error is None
    assert model.estimate(("bf16", "all"), 10) == pytest.approx(800 + 110)


def test_an_unmeasured_plan_follows_its_precisions_recompute_share_line():
    # 4 blocks: plan 0 recomputes none (r=0), all of them (r=1), 2 and every2 half, every4 a quarter.
    trials = line("fp32", "0", 1000, 100, (1, 2)) + line("fp32", "all", 1000, 20, (1, 2))
    variants = [("fp32", s) for s in ("0", "2", "every2", "every4", "all")]
    model = MemoryModel.fit(trials, variants, blocks=4)
    slopes = {s: model.lines[("fp32", s)].per_sample_bytes for _, s in variants}
    assert slopes == pytest.approx({"0": 100, "2": 60, "every2": 60, "every4": 80, "all": 20})
    assert all(model.lines[("fp32", s)].source == "predicted" for s in ("2", "every2", "every4"))


def test_the_recompute_share_line_is_drawn_through_block_plans_and_places_selective_plans_by_their_prior():
    from autotune.vocabulary import SELECTIVE

    # A measured selective plan (its share is only a prior) does not bend the block plans' line ...
    trials = (line("fp32", "0", 1000, 100, (1, 2)) + line("fp32", "all", 1000, 20, (1, 2))
              + line("fp32", "sac-matmul", 1000, 30, (1, 2)))
    model = MemoryModel.fit(trials, [("fp32", "2"), ("fp32", "sac-linear")], blocks=4)
    assert model.lines[("fp32", "2")].per_sample_bytes == pytest.approx(60)
    # ... and an unmeasured selective plan sits on that line at its prior share.
    assert model.lines[("fp32", "sac-linear")].per_sample_bytes == pytest.approx(100 - 80 * SELECTIVE["sac-linear"].prior)


def test_the_recompute_share_line_is_fitted_to_every_measured_plan():
    trials = (line("fp32", "0", 1000, 100, (1, 2)) + line("fp32", "2", 1000, 70, (1, 2))
              + line("fp32", "all", 1000, 10, (1, 2)))  # r = 0, 0.5, 1 with 4 blocks
    a1, a0 = np.polyfit([0.0, 0.5, 1.0], [100, 70, 10], 1)
    model = MemoryModel.fit(trials, [("fp32", "every4")], blocks=4)
    assert model.lines[("fp32", "every4")].per_sample_bytes == pytest.approx(a0 + a1 * 0.25)


def test_a_recompute_share_line_that_falls_below_zero_gives_the_smallest_measured_cost():
    trials = line("fp32", "0", 1000, 100, (1, 2)) + line("fp32", "2", 1000, 10, (1, 2))  # a(1) would be -80
    model = MemoryModel.fit(trials, [("fp32", "all")], blocks=4)
    assert model.lines[("fp32", "all")].per_sample_bytes == pytest.approx(10)


def test_with_one_measured_plan_a_recomputed_block_keeps_fifteen_percent():
    model = MemoryModel.fit(line("fp32", "0", 1000, 100, (1, 2)), [("fp32", "all"), ("fp32", "2")], blocks=4)
    assert model.lines[("fp32", "all")].per_sample_bytes == pytest.approx(15)
    assert model.lines[("fp32", "2")].per_sample_bytes == pytest.approx(100 * (1 - 0.85 * 0.5))
    # and backwards, from a plan that recomputes half the blocks to none
    back = MemoryModel.fit(line("fp32", "2", 1000, 57.5, (1, 2)), [("fp32", "0")], blocks=4)
    assert back.lines[("fp32", "0")].per_sample_bytes == pytest.approx(100)


def test_without_a_block_count_the_recompute_share_is_guessed_from_the_name():
    # "4" recomputes three of four segments (0.75), "every4" a quarter, "all" everything
    trials = line("fp32", "0", 1000, 100, (1, 2)) + line("fp32", "all", 1000, 20, (1, 2))
    model = MemoryModel.fit(trials, [("fp32", "4"), ("fp32", "every4")])
    assert model.lines[("fp32", "4")].per_sample_bytes == pytest.approx(100 - 80 * 0.75)
    assert model.lines[("fp32", "every4")].per_sample_bytes == pytest.approx(100 - 80 * 0.25)


def test_before_any_plan_is_measured_in_both_precisions_element_sizes_scale():
    model = MemoryModel.fit(line("fp32", "0", 1000, 100, (1, 2)), [("bf16", "0"), ("fp16", "0"), ("bf16", "all")], blocks=4)
    assert model.lines[("bf16", "0")].per_sample_bytes == pytest.approx(50)  # 2 bytes against 4
    assert model.lines[("fp16", "0")].per_sample_bytes == pytest.approx(50)
    assert model.lines[("bf16", "all")].per_sample_bytes == pytest.approx(0.5 * 15)  # fp32's prior line, halved
    assert model.lines[("bf16", "0")].fixed_bytes == pytest.approx(1000)  # the only intercept known
    back = MemoryModel.fit(line("bf16", "0", 1000, 50, (1, 2)), [("fp32", "0")])
    assert back.lines[("fp32", "0")].per_sample_bytes == pytest.approx(100)


def test_a_precisions_own_plans_come_before_element_sizes():
    # bf16 measured only with every block recomputed, fp32 only without: no plan in both.
    trials = line("fp32", "0", 1000, 100, (1, 2)) + line("bf16", "all", 1000, 6, (1, 2))
    model = MemoryModel.fit(trials, [("bf16", "0")], blocks=4)
    assert model.lines[("bf16", "0")].per_sample_bytes == pytest.approx(6 / 0.15)  # not 100 x 2/4


# --- the model as a whole --------------------------------------------------------------------------


def test_with_nothing_measured_nothing_is_predicted():
    model = MemoryModel.fit([m("fp32", "0", 8, 100, status="oom")], [("fp32", "0"), ("bf16", "all")], fixed_bytes_hint=10.0)
    assert model.lines == {} and model.to_list() == [] and model.relative_error() == 0.0
    assert model.estimate(("fp32", "0"), 8) is None


def test_measured_variants_outside_the_list_are_fitted_and_repeated_variants_are_one():
    trials = line("fp32", "0", 1000, 100, (1, 2)) + line("bf16", "2", 900, 40, (1, 2))
    model = MemoryModel.fit(trials, [("fp32", "0"), ("fp32", "0")])
    assert set(model.lines) == {("fp32", "0"), ("bf16", "2")}
    assert model.estimate(("fp32", "all"), 4) is None  # not asked for: not predicted


def test_to_list_is_sorted_and_rounded():
    trials = [m("fp32", "0", 1, 1100.4), m("fp32", "0", 2, 1200.4), m("fp32", "0", 3, 1301.0)] + line("bf16", "0", 1000, 50, (1, 2))
    model = MemoryModel.fit(trials, [("fp32", "0"), ("bf16", "0"), ("bf16", "all")], blocks=4)
    rows = model.to_list()
    assert [(r["precision"], r["segments"]) for r in rows] == [("bf16", "0"), ("bf16", "all"), ("fp32", "0")]
    assert all(isinstance(r["fixed_bytes"], int) and isinstance(r["per_sample_bytes"], int) for r in rows)
    fp32 = rows[2]
    assert fp32["points"] == 3 and fp32["source"] == "fit" and isinstance(fp32["max_error_bytes"], int)
    assert fp32["max_relative_error"] == round(model.lines[("fp32", "0")].max_relative_error, 5)
    assert rows[1]["source"] == "predicted" and rows[1]["max_error_bytes"] is None and rows[1]["max_relative_error"] is None


def test_memory_line_by_hand():
    ml = MemoryLine("fp16", "every2", fixed_bytes=1000.4, per_sample_bytes=99.6, points=0, source="predicted")
    assert ml.variant == ("fp16", "every2") and ml.estimate(10) == pytest.approx(1996.4)
    assert ml.to_dict() == {"precision": "fp16", "segments": "every2", "fixed_bytes": 1000, "per_sample_bytes": 100,
                            "points": 0, "source": "predicted", "max_error_bytes": None, "max_relative_error": None,
                            "compile": "none"}
    assert MemoryModel({ml.variant: ml}).estimate(("fp16", "every2"), 0) == pytest.approx(1000.4)
