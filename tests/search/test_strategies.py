"""Strategies on synthetic memory curves: no model runs, only the decisions.

Each curve maps a configuration to its peak bytes and speed; a trial "runs out of memory" above
the budget, as the tensor meter makes it. The grid of the same curve is the reference.
"""

import dataclasses
import math
import random

import pytest

from autotune.errors import UsageError
from autotune.analysis.memory_model import MemoryModel
from autotune.analysis.pareto import LineRule, batch_limits, recommend
from autotune.vocabulary import Plan
from autotune.records import Config, Measurement
from autotune.search.space import SearchSpace
from autotune.search.strategies import AutoStrategy, GridStrategy, OptunaStrategy, make_strategy
from autotune.analysis.limits import bracket
from autotune.search.strategies.auto import next_in_bracket

MiB = 2**20
BUDGET = 1024 * MiB
BLOCKS = 12
# 1..256: 108 configs; the plans TinyGPT's 12 blocks get from --segments auto
SPACE = SearchSpace(("fp32", "bf16"), ("0", "every4", "2", "4", "8", "all"), tuple(2**k for k in range(9)), blocks=BLOCKS)


def linear(config):
    """Like TinyGPT on the CPU: recomputed blocks keep a little of their activations, bf16 roughly halves them."""
    r = Plan(config.segments).recompute_share(BLOCKS)
    per_sample = 18 * MiB * (1.0 - 0.9 * r + 0.05 * math.sqrt(r))
    per_sample *= 0.55 if config.precision == "bf16" else 1.0
    return 8 * MiB + per_sample * config.batch_size


def speed(config):
    """Samples/s that peak at batch 16 (a CPU's caches), lower with more recompute and in fp32."""
    base = 40.0 / (1 + abs(math.log2(config.batch_size) - 4) * 0.15)
    r = Plan(config.segments).recompute_share(BLOCKS)
    return base * (1.0 - 0.25 * r) * (1.2 if config.precision == "bf16" else 1.0)


def measure(curve, budget=BUDGET):
    def trial(config):
        peak = int(curve(config))
        if budget is not None and peak > budget:
            return Measurement(config, "oom", peak_bytes=budget + 1, error="DefaultCPUAllocator: can't allocate memory")
        sps = speed(config)
        return Measurement(config, "ok", peak_bytes=peak, step_s=config.batch_size / sps, samples_per_s=sps)
    return trial


class Runs(dict):
    """Measurements by configuration, and how many trials made them (a timing after a memory trial is one more)."""

    trials = 0
    memory_trials = 0


def run(strategy, trial, space=SPACE, budget=BUDGET):
    measured = Runs()
    while (proposal := strategy.propose(space, measured, budget)) is not None:
        config, earlier = proposal.config, measured.get(config := proposal.config)
        assert config in space.configs()
        if earlier is not None:  # only a timing that completes a memory trial, or a near tie timed once more
            assert proposal.timed and earlier.status == "ok" and (not earlier.timed or earlier.timings < 2), \
                f"{proposal} proposed again after {earlier}"
        m = trial(config)
        if not proposal.timed:
            m = dataclasses.replace(m, timed=False, step_s=None, samples_per_s=None)
            measured.memory_trials += 1
        elif earlier is not None and earlier.timed:
            m = dataclasses.replace(m, timings=earlier.timings + 1)
        measured[config] = m
        measured.trials += 1
    return measured


def limits(measured, budget=BUDGET, sizes=SPACE.batch_sizes, space=SPACE, line_rule=None):
    """Each variant's largest fitting batch, and whether the next size up is known not to fit (measured or implied)."""
    return {(r["precision"], r["segments"]): (r["max_batch_size"], r["bracketed"])
            for r in batch_limits(measured.values(), budget, batch_sizes=sizes, plans=space.plans, blocks=space.blocks,
                                  line_rule=line_rule)}


def grid_limits(trial, space=SPACE, budget=BUDGET):
    return {plan: (b, True) for plan, (b, _) in limits(run(GridStrategy(), trial, space, budget), budget, space.batch_sizes,
                                                         space).items()}


def stepwise(config):  # an allocator that hands out memory in 64 MiB blocks
    return 64 * MiB * math.ceil(linear(config) / (64 * MiB))


def noisy(config):  # +-4% around the line, the same for a configuration every time
    return linear(config) * (1 + random.Random(str(config)).uniform(-0.04, 0.04))


# A coarse allocator makes a line a worse guess: a few more trials, the same limits.
@pytest.mark.parametrize("curve, share", [(linear, 0.25), (noisy, 0.25), (stepwise, 0.33)])
def test_auto_finds_every_plans_exact_limit_with_a_fraction_of_the_grid(curve, share):
    trial = measure(curve)
    auto = run(AutoStrategy(fixed_bytes_hint=8 * MiB), trial)
    found = limits(auto)
    assert found == grid_limits(trial)  # the same largest batch per plan, each bracketed by measurement
    assert len(auto) <= share * len(SPACE)
    grid = recommend(run(GridStrategy(), trial).values(), BUDGET)
    assert recommend(auto.values(), BUDGET).config == grid.config


def test_bracketing_measures_the_largest_fit_and_measures_or_implies_the_next_size():
    auto = run(AutoStrategy(), measure(linear))
    implied = 0
    for row in batch_limits(auto.values(), BUDGET, batch_sizes=SPACE.batch_sizes, plans=SPACE.plans, blocks=BLOCKS):
        largest, i = row["max_batch_size"], SPACE.batch_sizes.index(row["max_batch_size"])
        assert auto[Config(row["precision"], row["segments"], largest)].status == "ok"
        if i + 1 == len(SPACE.batch_sizes):
            continue
        above = Config(row["precision"], row["segments"], SPACE.batch_sizes[i + 1])
        if "min_oom_implied_by" in row:  # a measured failure of a plan that needs no more memory, at that size
            implied += 1
            assert above not in auto and row["min_oom_batch_size"] == above.batch_size
            source = next(c for c in auto if str(c) == row["min_oom_implied_by"])
            assert auto[source].status == "oom" and source.batch_size == above.batch_size
            assert Plan(source.segments).needs_no_more_memory_than(above.segments, BLOCKS)
        else:
            assert auto[above].status == "oom"
    assert implied >= 1  # nested plans with the same limit


def test_a_failure_implies_the_failures_of_plans_that_need_more_memory():
    # Nothing fits: the plan that recomputes every block fails at the middle size and at batch 1 (the search's first
    # plan at the largest size before them), and so does every other plan, without a trial of its own.
    auto = run(AutoStrategy(), measure(lambda c: 2 * BUDGET))
    first = Config(SPACE.precisions[0], "all", max(SPACE.batch_sizes))
    assert sorted(auto) == sorted([first] + [Config(p, "all", b) for p in SPACE.precisions for b in (1, 16)])
    assert all(largest is None for largest, _ in limits(auto).values())
    assert recommend(auto.values(), BUDGET) is None


def test_everything_feasible_measures_the_largest_batch_and_climbs_from_there():
    trial = measure(lambda c: 10 * MiB + c.batch_size * 1024)
    auto = run(AutoStrategy(), trial)
    assert all(largest == 256 and closed for largest, closed in limits(auto).values())
    assert recommend(auto.values(), BUDGET).config == recommend(run(GridStrategy(), trial).values(), BUDGET).config
    assert len(auto) <= 1 + 12 + 6  # the first plan's smallest batch, each plan once, the climb


def test_without_a_budget_every_plan_is_measured_at_its_largest_batch():
    auto = run(AutoStrategy(), measure(linear, budget=None), budget=None)
    assert {c for c in auto if c.batch_size == 256} == {Config(p, s, 256) for p in SPACE.precisions for s in SPACE.plans}


def test_a_list_of_batch_sizes_is_bracketed_too():
    space = SearchSpace(("fp32",), (0, 4), (8, 24, 40, 56, 72, 88, 104))
    trial = measure(linear)
    assert limits(run(AutoStrategy(), trial, space), sizes=space.batch_sizes) == grid_limits(trial, space)


def test_a_wrong_model_falls_back_to_bisection_and_still_brackets():
    # Memory that jumps at batch 24 for no reason a line could foresee.
    trial = measure(lambda c: 8 * MiB + c.batch_size * MiB * (1 if c.batch_size < 24 else 50))
    space = SearchSpace(("fp32",), (0,), tuple(range(1, 65)))
    auto = run(AutoStrategy(), trial, space)
    assert limits(auto, sizes=space.batch_sizes) == {("fp32", "0"): (23, True)}
    # Guided jumps, then bisection, then the climb along 23 sizes: logarithmic, not a scan of 64.
    assert len(auto) <= 3 + math.ceil(math.log2(64)) + 2 * math.ceil(math.log2(23))


def test_timeouts_stop_the_bracket_like_out_of_memory():
    def trial(config):
        if config.batch_size >= 64:
            return Measurement(config, "timeout", error="the trial would run past its limit")
        return measure(linear)(config)
    auto = run(AutoStrategy(), trial)
    assert limits(auto)[("bf16", "all")] == (32, True)


def test_a_plan_another_worker_is_measuring_is_left_to_it():
    strategy = AutoStrategy(fixed_bytes_hint=8 * MiB)
    first = strategy.propose(SPACE, {}, BUDGET)
    second = strategy.propose(SPACE, {}, BUDGET, pending=frozenset({first.config}))
    assert second is not None and second.config.variant != first.config.variant


def test_smaller_budgets_come_from_the_same_trials_where_the_model_is_sure():
    trial = measure(linear)
    budgets = (256 * MiB, 512 * MiB, BUDGET)
    auto = run(AutoStrategy(budgets=budgets, fixed_bytes_hint=8 * MiB), trial)
    single = run(AutoStrategy(fixed_bytes_hint=8 * MiB), trial)
    model = MemoryModel.fit(auto.values(), [(p, s) for p in SPACE.precisions for s in SPACE.plans])
    for budget in budgets[:2]:
        truth = {plan: b for plan, (b, _) in limits(run(GridStrategy(), trial), budget).items()}
        rows = batch_limits(auto.values(), budget, batch_sizes=SPACE.batch_sizes, model=model)
        got = {(r["precision"], r["segments"]): r["max_batch_size"] if r["bracketed"] else r["predicted_max_batch_size"]
               for r in rows}
        assert got == truth
        grid = recommend(run(GridStrategy(), trial).values(), budget)
        assert recommend(auto.values(), budget).config == grid.config
    assert len(auto) < len(single) + 12  # a few trials more, not a search per budget


def test_the_memory_model_recovers_lines_and_predicts_unmeasured_plans():
    trial = measure(linear)
    points = [trial(Config("fp32", "0", b)) for b in (1, 8)] + [trial(Config("fp32", "4", 16)), trial(Config("bf16", "0", 8))]
    model = MemoryModel.fit(points, [(p, s) for p in ("fp32", "bf16") for s in ("0", "4")], blocks=BLOCKS)
    fp32 = model.lines[("fp32", "0")]
    assert fp32.source == "fit" and fp32.fixed_bytes == pytest.approx(8 * MiB, rel=1e-6)
    assert fp32.per_sample_bytes == pytest.approx(18 * MiB, rel=1e-6) and fp32.max_error_bytes < 1
    assert model.lines[("fp32", "4")].source == "shared-intercept"
    assert model.estimate(("fp32", "4"), 64) == pytest.approx(linear(Config("fp32", "4", 64)), rel=1e-6)
    bf16_4 = model.lines[("bf16", "4")]  # never measured: fp32's plan scaled by the bf16/fp32 ratio of plan 0
    assert bf16_4.source == "predicted" and bf16_4.points == 0
    assert bf16_4.estimate(64) == pytest.approx(linear(Config("bf16", "4", 64)), rel=0.02)
    row = model.to_list()[0]
    assert set(row) == {"precision", "segments", "fixed_bytes", "per_sample_bytes", "points", "source",
                        "max_error_bytes", "max_relative_error", "compile"}


@pytest.mark.parametrize("outcomes, expected", [
    ({}, (-1, 4)), ({1: True}, (0, 4)), ({1: True, 8: False}, (0, 3)), ({2: True, 4: True, 8: False}, (2, 3)),
    ({1: False}, (-1, 0)), ({8: True}, (3, 4)),
])
def test_bracket_indices(outcomes, expected):
    known = bracket([1, 2, 4, 8], outcomes)
    assert (known.lo, known.hi) == expected and known.closed == (known.hi == known.lo + 1)


def test_next_in_bracket_jumps_to_the_predicted_boundary_then_bisects():
    sizes = [1, 2, 4, 8, 16, 32, 64]
    predicted = {b: 10 + 3 * b for b in sizes}  # 64 bytes fits at most batch 16
    assert next_in_bracket(sizes, {}, predicted, 64, tries=0) == 16
    assert next_in_bracket(sizes, {16: True}, predicted, 64, tries=1) == 32  # the next size up, to close it
    assert next_in_bracket(sizes, {16: True, 32: False}, predicted, 64, tries=2) is None
    assert next_in_bracket(sizes, {}, None, 64, tries=0) == 8  # nothing known: the middle size draws a line
    assert next_in_bracket(sizes, {8: False}, None, 64, tries=1) == 1  # it did not fit: does anything?
    # The search's first plan: the largest size first (the plan that keeps the least often fits it), then as above
    assert next_in_bracket(sizes, {}, None, 64, tries=0, top_first=True) == 64
    assert next_in_bracket(sizes, {64: False}, None, 64, tries=1, top_first=True) == 8
    assert next_in_bracket(sizes, {64: False, 8: False}, None, 64, tries=2, top_first=True) == 1
    # With the memory line's rule, a size predicted under 1.25x the limit is measured first: were the size below it
    # to fit, this one could not be implied by the line and would be measured anyway
    assert next_in_bracket(sizes, {}, predicted, 64, tries=0, margin=1.25) == 16  # 32 predicts 106: implied if 16 fits
    assert next_in_bracket(sizes, {}, predicted, 170, tries=0, margin=1.25) == 64  # 202 <= 1.25 x 170: fits or not
    assert next_in_bracket(sizes, {}, predicted, 170, tries=0) == 32
    assert next_in_bracket(sizes, {1: True, 2: True, 64: False}, predicted, 64, tries=3) == 8  # bisection of 2..64


def test_optuna_strategy_stays_within_its_trial_budget_and_never_repeats():
    trial = measure(linear)
    measured = run(OptunaStrategy(n_trials=20, seed=1), trial)
    assert len(measured) == 20
    assert recommend(measured.values(), BUDGET) is not None


def test_strategy_options_are_checked():
    with pytest.raises(UsageError, match="--n-trials"):
        make_strategy("auto", n_trials=5)
    with pytest.raises(UsageError, match="at least 1"):
        make_strategy("optuna", n_trials=0)
    assert make_strategy("optuna").name == "optuna" and make_strategy("auto").name == "auto"


def test_auto_brackets_selective_plans_like_any_plan():
    # Selective plans whose memory is not where their prior share puts it (TinyGPT: sac-matmul frees 12%
    # of the activations, not 15%; sac-linear 62%, not 75%): the same exact limits as the grid's.
    freed = {"sac-matmul": 0.12, "sac-lean": 0.17, "sac-linear": 0.62}

    def curve(config):
        if config.segments not in freed:
            return linear(config)
        per_sample = 18 * MiB * (1.0 - freed[config.segments]) * (0.55 if config.precision == "bf16" else 1.0)
        return 8 * MiB + per_sample * config.batch_size

    space = SearchSpace(("fp32", "bf16"), ("0", "sac-matmul", "sac-lean", "every4", "2", "sac-linear", "all"),
                        SPACE.batch_sizes, blocks=BLOCKS)
    measured = run(AutoStrategy(fixed_bytes_hint=8 * MiB), measure(curve), space)
    assert limits(measured, sizes=space.batch_sizes, space=space) == grid_limits(measure(curve), space)
    assert {c.segments for c in measured} >= set(freed)


def _tied(speeds: dict[int, float]):
    """Trials where plan 0 runs at ``speeds`` (batch size -> samples/s, each timed with a 4% spread), its other sizes
    at 50 samples/s and every other plan at 10: the sizes in ``speeds`` are a near tie, the rest well apart."""
    def trial(config):
        m = measure(linear)(config)
        if m.status != "ok":
            return m
        sps = speeds.get(config.batch_size, 50.0) if config.segments == "0" else 10.0
        return dataclasses.replace(m, samples_per_s=sps, step_s=config.batch_size / sps, step_s_spread=0.04)
    return trial


def test_a_near_tie_for_the_recommendation_is_timed_again_alternately_and_only_once():
    trial = _tied({16: 100.0, 32: 99.0})  # two points within 1% of each other

    space = SearchSpace(("fp32",), ("0", "all"), SPACE.batch_sizes, blocks=BLOCKS)
    proposals = []
    strategy = AutoStrategy(fixed_bytes_hint=8 * MiB)
    measured = Runs()
    while (proposal := strategy.propose(space, measured, BUDGET)) is not None:
        proposals.append(proposal)
        earlier, m = measured.get(proposal.config), trial(proposal.config)
        if not proposal.timed:
            m = dataclasses.replace(m, timed=False, samples_per_s=None, step_s=None)
        elif earlier is not None and earlier.timed:
            m = dataclasses.replace(m, timings=earlier.timings + 1)
        measured[proposal.config] = m
    tied = {Config("fp32", "0", 16), Config("fp32", "0", 32)}
    again = [p.config for i, p in enumerate(proposals) if p.timed and any(q.config == p.config and q.timed
                                                                          for q in proposals[:i])]
    assert sorted(again) == sorted(tied)  # each once more, and nothing else
    assert {c for c in tied if measured[c].timings == 2} == tied


def test_a_selective_plan_does_not_hide_a_faster_block_plan_at_the_same_batch():
    # As GPT-2 on this CPU: at batch 16 only checkpointing fits; sac-matmul recomputes less than every4 but runs a
    # dispatch mode over every operation, so it is the slower of the two. Time has no order between selective and
    # block plans: the climb must time both, and find the recommendation the grid finds.
    share = {"0": 0.0, "sac-matmul": 0.3, "every4": 0.2, "all": 0.9}

    def curve(config):
        return 8 * MiB + 70 * MiB * (1 - share[config.segments]) * config.batch_size

    def trial(config):
        m = measure(curve)(config)
        if m.status == "ok" and config.segments == "sac-matmul":
            sps = 0.6 * m.samples_per_s
            m = dataclasses.replace(m, samples_per_s=sps, step_s=config.batch_size / sps)
        return m

    space = SearchSpace(("fp32",), tuple(share), SPACE.batch_sizes, blocks=BLOCKS)
    auto, grid = run(AutoStrategy(fixed_bytes_hint=8 * MiB), trial, space), run(GridStrategy(), trial, space)
    best = recommend(grid.values(), BUDGET)
    assert best.config == Config("fp32", "every4", 16)
    assert recommend(auto.values(), BUDGET).config == best.config


# The memory line implies a failing side only where it is measured: the state (8 MiB here, the curves' fixed part) and
# the plan's own trials. A coarse allocator or noise must not move a limit.
@pytest.mark.parametrize("curve", [linear, noisy, stepwise])
def test_failing_sides_implied_by_the_memory_line_save_trials_and_move_no_limit(curve):
    trial, rule = measure(curve), LineRule(8 * MiB)
    without = run(AutoStrategy(fixed_bytes_hint=8 * MiB), trial)
    auto = run(AutoStrategy(fixed_bytes_hint=8 * MiB, line_rule=rule), trial)
    assert limits(auto, line_rule=rule) == grid_limits(trial)  # every limit bracketed, and the grid's
    assert auto.trials <= without.trials
    rows = batch_limits(auto.values(), BUDGET, batch_sizes=SPACE.batch_sizes, plans=SPACE.plans, blocks=BLOCKS,
                        line_rule=rule)
    by_line = [r for r in rows if r.get("min_oom_rule") == "memory-line"]
    for r in by_line:  # not measured, predicted well over the budget, and really over it
        config = Config(r["precision"], r["segments"], r["min_oom_batch_size"])
        assert config not in auto and r["min_oom_predicted_bytes"] >= 1.25 * BUDGET and curve(config) > BUDGET
    if curve is linear:
        assert by_line and auto.trials < without.trials


def test_the_memory_line_needs_two_points_where_batches_change_shape():
    trial = measure(linear)
    one = run(AutoStrategy(fixed_bytes_hint=8 * MiB, line_rule=LineRule(8 * MiB)), trial)
    two = run(AutoStrategy(fixed_bytes_hint=8 * MiB, line_rule=LineRule(8 * MiB, min_points=2)), trial)
    assert limits(two, line_rule=LineRule(8 * MiB, min_points=2)) == grid_limits(trial)
    assert one.trials <= two.trials


def _timed(precision, plan, b, step_s):
    return Measurement(Config(precision, plan, b), "ok", peak_bytes=MiB, step_s=step_s, samples_per_s=b / step_s)


def test_the_time_model_bounds_a_checkpointed_step_from_the_plan_without_recompute_and_the_recompute_seen():
    from autotune.search.strategies.auto import step_time_bound

    def base(b):
        return 0.01 + 0.001 * b

    measured = {m.config: m for m in (_timed("bf16", "0", 16, base(16)), _timed("bf16", "0", 32, base(32)))}
    # before any checkpointed plan is timed, the bound is the plan without recompute's own line
    assert step_time_bound(Config("bf16", "all", 128), measured, BLOCKS) == pytest.approx(128 / base(128))
    slow = _timed("bf16", "all", 64, base(64) * 1.4)  # recomputing every block cost 40% here
    measured[slow.config] = slow
    share = Plan("2").recompute_share(BLOCKS)
    assert step_time_bound(Config("bf16", "2", 128), measured, BLOCKS) == pytest.approx(128 / (base(128) * (1 + 0.4 * share)))
    fast = _timed("bf16", "8", 64, base(64) * 0.9)  # faster than no recompute (noise): the bound takes no recompute cost
    measured[fast.config] = fast
    assert step_time_bound(Config("bf16", "2", 128), measured, BLOCKS) == pytest.approx(128 / base(128))
    assert step_time_bound(Config("bf16", "0", 24), measured, BLOCKS) is None  # between plan 0's own timed sizes
    assert step_time_bound(Config("bf16", "0", 8), measured, BLOCKS) == pytest.approx(8 / base(8))  # outside them
    assert step_time_bound(Config("fp32", "2", 128), measured, BLOCKS) is None  # nothing timed in fp32


def test_a_climb_step_to_a_checkpointed_point_is_skipped_once_the_time_model_says_it_cannot_win():
    from autotune.search.strategies.view import View

    def base(b):  # the plan without recompute: 76 samples/s at 32, 86 at 64, 93 at 128 if it fitted
        return 0.1 + 0.01 * b

    envelope = [Config("bf16", "0", 32), Config("bf16", "0", 64), Config("bf16", "2", 128)]
    measured = {c: _timed("bf16", "0", c.batch_size, base(c.batch_size)) for c in envelope[:2]}
    view = View(SPACE, measured, None, frozenset())
    best = measured[envelope[1]]
    # no recompute cost seen yet: plan 2 at 128 might reach 93 samples/s, more than 86 and its noise: timed
    assert AutoStrategy._climb(envelope, view, best) == envelope[2]
    slow = _timed("bf16", "all", 16, base(16) * 1.5)  # recomputing every block cost 50%: plan 2 at 128 at most 74
    measured[slow.config] = slow
    assert AutoStrategy._climb(envelope, View(SPACE, measured, None, frozenset()), best) is None


def test_a_slower_precision_that_keeps_the_same_bytes_is_not_climbed():
    # fp16 and bf16 autocast keep the same bytes; here each plan's peaks lie up to 1% off its line, so lines drawn
    # through the trials each precision happens to have differ by a few bytes (fp16 was climbed, seeded or not). fp16 steps 3x slower (a CPU without native half
    # arithmetic): once a configuration is timed in both, fp16 fits nowhere bf16 does not, and is not climbed.
    def same_bytes(config):
        c = dataclasses.replace(config, precision="bf16")
        return linear(c) * (1 + random.Random(f"{c.segments}-{c.batch_size}").uniform(-0.01, 0.01))

    def trial(config):
        m = measure(same_bytes)(config)
        if m.status == "ok" and config.precision == "fp16":
            m = dataclasses.replace(m, samples_per_s=m.samples_per_s / 3, step_s=m.step_s * 3)
        return m

    space = SearchSpace(("fp16", "bf16"), SPACE.plans, SPACE.batch_sizes, blocks=BLOCKS)
    exact = {c: Measurement(c, "ok", peak_bytes=int(same_bytes(c))) if same_bytes(c) <= BUDGET
             else Measurement(c, "oom", peak_bytes=BUDGET + 1) for c in space.configs()}
    grid = recommend(run(GridStrategy(), trial, space).values(), BUDGET)
    for predictions in ({}, exact):
        auto = run(AutoStrategy(fixed_bytes_hint=8 * MiB, predictions=predictions), trial, space)
        assert [c.batch_size for c, m in auto.items() if c.precision == "fp16" and m.samples_per_s] == [64]
        assert recommend(auto.values(), BUDGET).config == grid.config


@pytest.mark.parametrize("probed", [0, 1, 3])
def test_a_near_tie_the_probe_will_train_is_left_to_the_probe(probed):
    trial = _tied({16: 99.0, 32: 100.0})  # within 1%, the larger one faster: both on the front

    space = SearchSpace(("fp32",), ("0", "all"), SPACE.batch_sizes, blocks=BLOCKS)
    measured = run(AutoStrategy(fixed_bytes_hint=8 * MiB, probed=probed), trial, space)
    again = {c for c, m in measured.items() if m.timings == 2}
    # the probe trains the front's fastest, fastest first: with two or more, both of the tie, and it decides
    assert again == (set() if probed >= 2 else {Config("fp32", "0", 16), Config("fp32", "0", 32)})


def test_each_strategy_says_what_it_plans_and_whether_it_starts_from_predictions():
    from autotune.search.strategies.base import Proposal

    assert Proposal(Config("fp32", "0", 4)).timed  # a proposal is timed unless it asks for memory alone
    assert GridStrategy().planned(SPACE) == len(SPACE) and AutoStrategy().planned(SPACE) is None
    assert OptunaStrategy(n_trials=7).planned(SPACE) == 7 and OptunaStrategy().planned(SPACE) == len(SPACE) // 4
    assert [s.starts_from_predictions for s in (GridStrategy(), AutoStrategy(), OptunaStrategy())] == [False, True, False]
