import pytest

from autotune.analysis.limits import largest_within
from autotune.analysis.pareto import (LineRule, batch_limits, implied_failures, line_failures, pareto_front,
                                     predicted_choice, recommend)
from autotune.records import Config, Measurement
from autotune.vocabulary import Status

MiB = 2**20


def m(precision, segments, batch, status="ok", peak=None, sps=None):
    return Measurement(config=Config(precision, segments, batch), status=status, peak_bytes=peak, samples_per_s=sps,
                       step_s=batch / sps if sps else None)


TRIALS = [
    m("fp32", "0", 8, peak=100 * MiB, sps=80.0),
    m("fp32", "0", 16, peak=200 * MiB, sps=100.0),
    m("fp32", "0", 32, status="oom", peak=1100 * MiB),
    m("bf16", "0", 16, peak=120 * MiB, sps=150.0),  # dominates fp32/16
    m("bf16", "0", 32, peak=950 * MiB, sps=170.0),  # fits the budget, not the headroom
    m("bf16", "2", 32, peak=600 * MiB, sps=140.0),  # slower and bigger than bf16/16: dominated
    m("bf16", "2", 64, status="timeout"),
    m("fp16", "0", 8, status="failed"),
]


def test_front_keeps_only_non_dominated_feasible_trials():
    front = pareto_front(TRIALS, 1000 * MiB)
    assert [t.config for t in front] == [Config("fp32", "0", 8), Config("bf16", "0", 16), Config("bf16", "0", 32)]
    assert [t.config for t in pareto_front(TRIALS, 900 * MiB)] == [Config("fp32", "0", 8), Config("bf16", "0", 16)]


def test_recommendation_is_the_fastest_within_the_headroom():
    assert recommend(TRIALS, 1000 * MiB, headroom=0.1).config == Config("bf16", "0", 16)
    assert recommend(TRIALS, 1000 * MiB, headroom=0.0).config == Config("bf16", "0", 32)
    assert recommend(TRIALS, 50 * MiB) is None
    assert recommend(TRIALS, None).config == Config("bf16", "0", 32)


def test_a_dry_runs_near_ties_go_to_the_larger_batch_and_measured_ones_to_the_faster():
    import dataclasses

    from autotune.records import PREDICTED

    trials = [m("bf16", "0", 8, peak=100 * MiB, sps=104.0), m("bf16", "0", 32, peak=300 * MiB, sps=102.4),
              m("fp32", "0", 64, peak=500 * MiB, sps=90.0)]  # the larger batch, but 13% slower: no tie
    assert recommend(trials, None).config == Config("bf16", "0", 8)  # measured: the faster, however close
    predicted = [dataclasses.replace(t, time_source=PREDICTED) for t in trials]
    assert recommend(predicted, None).config == Config("bf16", "0", 32)  # predicted 1.6% apart: not told apart
    assert recommend(predicted, 200 * MiB).config == Config("bf16", "0", 8)  # the tie's other side does not fit
    batch = {3.0: 8, 2.9: 16, 2.0: 64}.get  # 2.9 ties with 3.0 and has the larger batch; 2.0's larger still is no tie
    assert predicted_choice([3.0, 2.9, 2.0], lambda s: s, batch) == 2.9
    # within the time model's measured error (a tie of 40%), 2.0 is not told apart either: its batch is the largest
    assert predicted_choice([3.0, 2.9, 2.0], lambda s: s, batch, tie=0.4) == 2.0
    assert recommend(predicted, None, tie=0.15).config == Config("fp32", "0", 64)  # 13% slower: within a 15% error


def test_limits_per_precision_and_plan():
    limits = {(r["precision"], r["segments"]): r for r in batch_limits(TRIALS, 1000 * MiB)}
    assert limits[("fp32", "0")]["max_batch_size"] == 16 and limits[("fp32", "0")]["min_oom_batch_size"] == 32
    assert limits[("bf16", "2")]["max_batch_size"] == 32 and limits[("bf16", "2")]["min_oom_batch_size"] is None
    assert limits[("fp16", "0")]["max_batch_size"] is None
    # under a smaller budget, a trial that ran but peaked above it counts as too big
    assert {(r["precision"], r["segments"]): r for r in batch_limits(TRIALS, 500 * MiB)}[("bf16", "0")]["min_oom_batch_size"] == 32


def test_a_failure_implies_the_failures_of_plans_that_need_more_memory_and_the_limits_say_which_trial():
    trials = [m("fp32", "all", 64, peak=500 * MiB, sps=10.0), m("fp32", "all", 128, status="oom", peak=1100 * MiB),
              m("fp32", "4", 64, peak=900 * MiB), m("fp32", "sac-linear", 64, peak=950 * MiB),
              m("fp32", "2", 32, peak=600 * MiB), m("fp32", "2", 64, status="oom", peak=1100 * MiB),
              m("bf16", "4", 64, peak=400 * MiB)]
    plans = ("0", "every4", "2", "4", "all", "sac-linear")
    implied = implied_failures(trials, 1000 * MiB, plans, 12)
    by_all, by_2 = Config("fp32", "all", 128), Config("fp32", "2", 64)
    # all's failure at 128: every other plan of that precision (0 and 2 need more at any batch); 2's at 64: plan 0
    assert implied == {Config("fp32", p, 128): by_all for p in ("0", "every4", "2", "4", "sac-linear")} | {
        Config("fp32", "0", 64): by_2}
    assert not any(c.precision == "bf16" for c in implied)  # never across precisions
    rows = {r["segments"]: r for r in batch_limits(trials, 1000 * MiB, batch_sizes=(32, 64, 128), plans=plans, blocks=12)
            if r["precision"] == "fp32"}
    assert rows["4"] == {"precision": "fp32", "segments": "4", "compile": "none", "max_batch_size": 64, "min_oom_batch_size": 128,
                         "min_oom_implied_by": "fp32 segments=all batch=128", "min_oom_rule": "nested-plan",
                         "bracketed": True}
    assert rows["2"]["min_oom_batch_size"] == 64 and "min_oom_implied_by" not in rows["2"]  # its own trial
    assert rows["all"]["bracketed"] and "min_oom_implied_by" not in rows["all"]
    # without the plans (an old report), nothing is implied: the limit is open
    assert not {r["segments"]: r for r in batch_limits(trials, 1000 * MiB, batch_sizes=(32, 64, 128))}["4"]["bracketed"]


# --- failing sides implied by a variant's memory line (LineRule) -----------------------------------------------


def _ok(precision, plan, b, peak):
    return Measurement(Config(precision, plan, b), "ok", peak_bytes=peak, step_s=0.1, samples_per_s=b / 0.1)


def test_the_memory_line_implies_sizes_it_predicts_well_over_the_limit():
    rule = LineRule(100 * MiB)  # the state: weights, gradients and optimizer state, measured
    trials = [_ok("fp32", "0", 4, 500 * MiB)]  # 100 MiB of state, 100 MiB per sample
    sizes = [1, 2, 4, 8, 16, 32]
    # at 8: 900 MiB predicted, under 1.25 x 1000 MiB (measure it); at 16: 1700 MiB
    assert line_failures(trials, 1000 * MiB, sizes, rule) == {Config("fp32", "0", 16): 1700 * MiB,
                                                              Config("fp32", "0", 32): 3300 * MiB}
    assert line_failures(trials, 1000 * MiB, sizes, None) == {}  # no rule: the state was not measured
    assert line_failures(trials, 1000 * MiB, sizes, LineRule(100 * MiB, min_points=2)) == {}  # data whose shapes vary
    assert line_failures(trials, None, sizes, rule) == {}  # no budget, nothing fails
    (row,) = batch_limits(trials + [_ok("fp32", "0", 8, 900 * MiB)], 1000 * MiB, batch_sizes=sizes, line_rule=rule)
    assert row == {"precision": "fp32", "segments": "0", "compile": "none", "max_batch_size": 8, "min_oom_batch_size": 16,
                   "min_oom_implied_by": "memory line", "min_oom_rule": "memory-line",
                   "min_oom_predicted_bytes": 1700 * MiB, "bracketed": True}


def test_a_memory_line_that_misses_its_own_points_implies_nothing():
    rule, sizes = LineRule(100 * MiB), [4, 8, 16, 32]
    close = [_ok("fp32", "0", 4, 500 * MiB), _ok("fp32", "0", 8, 905 * MiB)]  # within 2% of one line
    far = [_ok("fp32", "0", 4, 500 * MiB), _ok("fp32", "0", 8, 700 * MiB)]  # the state is not this line's fixed part
    assert Config("fp32", "0", 16) in line_failures(close, 1000 * MiB, sizes, rule)
    assert line_failures(far, 1000 * MiB, sizes, rule) == {}
    assert LineRule.of(100 * MiB, state_measured=False, shapes_vary=False) is None
    assert LineRule.of(100 * MiB, state_measured=True, shapes_vary=True).min_points == 2


def test_a_measured_failure_of_a_nested_plan_is_named_before_the_memory_line():
    rule, sizes = LineRule(100 * MiB), [4, 8, 16]
    trials = [_ok("fp32", "0", 4, 500 * MiB), _ok("fp32", "0", 8, 900 * MiB),
              Measurement(Config("fp32", "all", 16), "oom", peak_bytes=1001 * MiB)]
    rows = {r["segments"]: r for r in batch_limits(trials, 1000 * MiB, batch_sizes=sizes, plans=["0", "all"], blocks=4,
                                                    line_rule=rule)}
    assert rows["0"]["min_oom_rule"] == "nested-plan" and rows["0"]["min_oom_implied_by"] == "fp32 segments=all batch=16"


def test_a_variant_no_trial_ran_has_a_row_when_another_plans_failure_implies_it_fits_nothing():
    # plan 2 recomputes more than plan 0 and failed at the smallest size: plan 0 fits nothing either (a 16 MiB run of
    # the quick start measured fp32/2 failing at batch 1 and never ran fp32/0, whose row was missing)
    ms = [Measurement(Config("fp32", "2", 1), "oom", peak_bytes=17_000_000),
          Measurement(Config("bf16", "2", 1), "ok", peak_bytes=15_000_000, timed=False)]
    rows = {(r["precision"], r["segments"]): r for r in batch_limits(ms, 16 * 2**20, batch_sizes=(1, 2, 4),
                                                                    plans=("0", "2"), blocks=4)}
    assert rows[("fp32", "0")]["max_batch_size"] is None and rows[("fp32", "0")]["min_oom_batch_size"] == 1
    assert rows[("fp32", "0")]["min_oom_rule"] == "nested-plan"
    assert rows[("fp32", "0")]["min_oom_implied_by"] == "fp32 segments=2 batch=1"
    assert ("bf16", "0") not in rows  # bf16/2 fit: nothing is implied of bf16/0


def test_a_trial_that_ran_where_its_prediction_failed_refutes_the_variant_for_the_search_and_the_report_alike():
    from autotune.analysis.pareto import confirmed, refuted

    ok = Measurement(Config("fp32", "0", 4), "ok", peak_bytes=1000, timed=False)
    agrees = {Config("fp32", "0", 4): Measurement(Config("fp32", "0", 4), "ok", peak_bytes=1005)}
    assert confirmed([ok], agrees) == {("fp32", "0"): ok.config} and not refuted([ok], agrees)
    failed = {Config("fp32", "0", 4): Measurement(Config("fp32", "0", 4), "failed", error="fake tensors could not")}
    assert refuted([ok], failed) == {("fp32", "0")} and confirmed([ok], failed) == {}
    # one agreeing trial does not outweigh one that contradicts: the variant is searched on measurements alone
    other = Measurement(Config("fp32", "0", 8), "ok", peak_bytes=2000, timed=False)
    mixed = {**agrees, other.config: Measurement(other.config, "ok", peak_bytes=2500)}
    assert refuted([ok, other], mixed) == {("fp32", "0")} and confirmed([ok, other], mixed) == {}


def _measuring(peak_of, calls, failed_at=None):
    """A measurement of batch b with peak ``peak_of(b)`` (its status oom above 1000 bytes), each call kept."""
    def measure(b):
        calls.append(b)
        if failed_at is not None and b >= failed_at:
            return Measurement(Config("fp32", "0", b), "failed", error="the model's own")
        peak = peak_of(b)
        return Measurement(Config("fp32", "0", b), "ok" if peak <= 1000 else "oom", peak_bytes=peak)
    return measure


@pytest.mark.parametrize("multiple", [1, 8])
@pytest.mark.parametrize("first", [1, 40, 300, 5000])
def test_the_largest_size_within_a_limit_is_exact_in_steps_of_the_multiple(multiple, first):
    for peak_of in (lambda b: 100 + 3 * b,  # a line: a couple of sizes past the first
                    lambda b: 100 + 3 * b + (400 if b > 200 else 0),  # a step in the line (longer items join)
                    lambda b: 50 + b * b // 100):  # not a line at all
        calls = []
        found = largest_within(_measuring(peak_of, calls), 900, multiple, 4096, first)
        lo, hi, seen = found.max_batch_size, found.min_oom_batch_size, found.measured
        fitting = [b for b in range(multiple, 4097, multiple) if peak_of(b) <= 900]
        assert lo == max(fitting) and hi == lo + multiple, (peak_of, lo, hi)
        assert set(seen) == set(calls) and all(b % multiple == 0 for b in calls)
        assert len(calls) <= 14  # a bisection from 1 to 4096 alone would take 12 sizes


def test_a_line_is_found_in_four_sizes_from_below():
    calls = []
    found = largest_within(_measuring(lambda b: 100 + 3 * b, calls), 900, 1, 4096, 10)
    lo, hi = found.max_batch_size, found.min_oom_batch_size
    assert (lo, hi) == (266, 267) and calls == [10, 20, 266, 267]  # two sizes make the line; its size, the next


def test_nothing_fits_the_top_fits_and_a_failure_ends_the_search():
    calls = []
    found = largest_within(_measuring(lambda b: 2000 + b, calls), 900, 4, 4096, 64)
    assert (found.max_batch_size, found.min_oom_batch_size) == (0, 4)
    calls = []
    found = largest_within(_measuring(lambda b: b // 10, calls), 900, 4, 1000, 64)
    lo, hi, seen = found.max_batch_size, found.min_oom_batch_size, found.measured
    assert (lo, hi) == (1000, None) and max(calls) == 1000
    calls = []
    found = largest_within(_measuring(lambda b: 100 + b, calls, failed_at=128), 900, 1, 4096, 64)
    lo, hi, seen = found.max_batch_size, found.min_oom_batch_size, found.measured
    assert seen[max(calls)].status is Status.FAILED and (lo, hi) == (64, None)


def test_a_start_at_the_limit_with_the_lines_slope_takes_two_sizes_from_either_side():
    for first, slope in ((266, 3), (267, 3), (266, 2.5)):
        calls = []
        found = largest_within(_measuring(lambda b: 100 + 3 * b, calls), 900, 1, 4096, first, per_sample_bytes=slope)
        lo, hi = found.max_batch_size, found.min_oom_batch_size
        assert (lo, hi) == (266, 267) and sorted(calls) == [266, 267]
