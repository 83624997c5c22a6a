"""``auto`` started from the space predicted under fake tensors (:mod:`autotune.search.predicted`).

The rules first, on synthetic peaks (:mod:`tests.search.test_strategies`' curves): a prediction stands for a variant only
once a measured trial of it agrees within 1%; it then implies the variant's sizes clear of the limit by more than 1%
(fitting or not); a prediction that a measurement contradicts is dropped for its variant. Then a real search on a bundled model, whose predictions the
tensor meter confirms to the byte.
"""

import dataclasses

import pytest

import autotune
from autotune.analysis.pareto import (PREDICTION_TOLERANCE, Implied, batch_limits, confirmed, prediction_failures, recommend,
                                      prediction_fits)
from autotune.records import PREDICTED, Config, Measurement
from autotune.search.predicted import predict_space
from autotune.search.strategies import AutoStrategy, GridStrategy

from tests.optional import needs
from tests.search.test_strategies import BUDGET, MiB, SPACE, grid_limits, limits, linear, measure, noisy, run


def predicted(curve, budget=BUDGET):
    """A predictor that answers as ``measure(curve)`` does, labelled predicted and untimed, counting its calls."""
    trial = measure(curve, budget)

    def predict(config):
        predict.calls += 1
        return dataclasses.replace(trial(config), step_s=None, samples_per_s=None, timed=False,
                                   memory_source=PREDICTED)

    predict.calls = 0
    return predict


def test_predict_space_finds_each_variants_boundary_in_two_or_three_predictions_on_a_line():
    predict = predicted(linear)
    predictions = predict_space(SPACE, predict, (BUDGET,), fixed_bytes=8 * MiB)
    assert predict.calls == len(predictions) <= 3 * len(SPACE.variants())
    for variant in SPACE.variants():  # each boundary closed: its largest fit and the size above (where there is one)
        fits = [b for b in SPACE.batch_sizes if linear(variant.at(b)) <= BUDGET]
        assert predictions[variant.at(fits[-1])].status == "ok"
        if fits[-1] != max(SPACE.batch_sizes):
            above = min(b for b in SPACE.batch_sizes if b > fits[-1])
            assert predictions[variant.at(above)].status == "oom"


def test_predict_space_closes_brackets_off_the_line_too_and_stops_at_its_deadline():
    predictions = predict_space(SPACE, predicted(noisy), (BUDGET, 0.9 * BUDGET))  # no fixed part: bisection first
    for variant in SPACE.variants():
        for limit in (BUDGET, 0.9 * BUDGET):
            fits = [b for b in SPACE.batch_sizes if noisy(variant.at(b)) <= limit]
            assert fits and variant.at(fits[-1]) in predictions
    assert predict_space(SPACE, predicted(linear), (BUDGET,), deadline=0.0) == {}


def test_predictions_stopped_by_their_deadline_leave_the_plans_with_the_least_recompute_to_trials(monkeypatch):
    # The limits of the plans with the most recompute are the largest batches, the dearest to bracket by trials: they
    # are predicted first, precisions alternating, as the search brackets them
    import autotune.search.predicted as module

    clock = iter(range(10**6))
    monkeypatch.setattr(module.time, "monotonic", lambda: next(clock))
    predictions = predict_space(SPACE, predicted(linear), (BUDGET,), deadline=12, fixed_bytes=8 * MiB)
    order = list(dict.fromkeys(c.variant for c in predictions))
    ranked = [(s, p) for s in reversed(SPACE.ordered_plans()) for p in SPACE.precisions]
    assert [(v.plan, v.precision) for v in order] == ranked[:len(order)] and 1 < len(order) < len(ranked)


def test_a_failed_prediction_ends_its_variants_bracket():
    def failing(config):
        return Measurement(config, "failed", error="RuntimeError: the model's own", memory_source=PREDICTED)

    assert len(predict_space(SPACE, failing, (BUDGET,))) == len(SPACE.variants())  # one each, then nothing more


def _ok(config, peak):
    return Measurement(config, "ok", peak_bytes=peak, step_s=1.0, samples_per_s=float(config.batch_size))


def test_a_prediction_stands_only_where_a_measured_trial_agrees_within_one_percent():
    a, b, c = Config("fp32", "0", 8), Config("fp32", "0", 16), Config("fp32", "0", 32)
    predictions = {a: _ok(a, 100 * MiB), b: _ok(b, 200 * MiB),
                   c: Measurement(c, "oom", peak_bytes=BUDGET + 1, memory_source=PREDICTED)}
    assert prediction_failures([], BUDGET, predictions) == {}  # nothing measured: nothing stands
    agree = _ok(b, int(200 * MiB * (1 + PREDICTION_TOLERANCE / 2)))
    assert confirmed([agree], predictions) == {("fp32", "0"): b}
    assert prediction_failures([agree], BUDGET, predictions) == {c: Implied(BUDGET + 1, b)}
    disagree = _ok(a, int(100 * MiB * (1 + 2 * PREDICTION_TOLERANCE)))
    assert confirmed([agree, disagree], predictions) == {}  # one contradiction: the variant's predictions fall
    assert prediction_failures([agree, disagree], BUDGET, predictions) == {}


def test_a_peak_predicted_within_the_tolerance_of_the_limit_is_measured_not_implied():
    a, b, c = Config("fp32", "0", 8), Config("fp32", "0", 16), Config("fp32", "0", 32)
    for near in (int(BUDGET * (1 + PREDICTION_TOLERANCE / 2)), int(BUDGET * (1 - PREDICTION_TOLERANCE / 2))):
        predictions = {a: _ok(a, 100 * MiB), b: _ok(b, near)}
        assert prediction_failures([_ok(a, 100 * MiB)], BUDGET, predictions) == {}
        assert prediction_fits([_ok(a, 100 * MiB)], BUDGET, predictions) == {}
    clear = {a: _ok(a, 100 * MiB), b: _ok(b, 200 * MiB), c: _ok(c, int(BUDGET * (1 - 2 * PREDICTION_TOLERANCE)))}
    assert prediction_fits([_ok(a, 100 * MiB)], BUDGET, clear) == {b: Implied(200 * MiB, a), c: Implied(clear[c].peak_bytes, a)}
    assert prediction_fits([], BUDGET, clear) == {}  # unconfirmed: nothing implied


@pytest.mark.parametrize("curve", [linear, noisy])
def test_auto_seeded_by_exact_predictions_finds_the_grids_limits_in_fewer_trials(curve):
    trial = measure(curve)
    predictions = predict_space(SPACE, predicted(curve), (BUDGET, 0.9 * BUDGET), fixed_bytes=8 * MiB)
    unseeded = run(AutoStrategy(), trial)
    seeded = run(AutoStrategy(predictions=predictions), trial)
    rows = batch_limits(seeded.values(), BUDGET, batch_sizes=SPACE.batch_sizes, plans=SPACE.plans,
                        blocks=SPACE.blocks, predictions=predictions)
    found = {(r["precision"], r["segments"]): (r["max_batch_size"], r["bracketed"]) for r in rows}
    assert found == grid_limits(trial)
    assert seeded.trials < unseeded.trials
    _limits_measured_or_confirmed(rows, seeded)
    assert any(r.get("max_rule") == "prediction" for r in rows)


def _limits_measured_or_confirmed(rows, measured):
    """Every largest fit measured, or implied by a prediction a measured trial confirmed; every failing side
    implied by a prediction has no trial of its own."""
    for r in rows:
        largest = Config(r["precision"], r["segments"], r["max_batch_size"])
        if r.get("max_rule") == "prediction":
            assert largest not in measured and r["max_implied_by"] in {str(c) for c in measured}
        else:
            assert largest in measured
        if r.get("min_oom_rule") == "prediction":
            assert Config(r["precision"], r["segments"], r["min_oom_batch_size"]) not in measured


def test_predictions_a_measurement_contradicts_are_dropped_and_the_limits_stay_the_grids():
    trial = measure(linear)
    wrong = predict_space(SPACE, predicted(lambda c: 0.5 * linear(c)), (BUDGET,), fixed_bytes=4 * MiB)  # half the truth
    seeded = run(AutoStrategy(predictions=wrong), trial)
    rows = batch_limits(seeded.values(), BUDGET, batch_sizes=SPACE.batch_sizes, plans=SPACE.plans,
                        blocks=SPACE.blocks, predictions=wrong)
    assert {(r["precision"], r["segments"]): (r["max_batch_size"], r["bracketed"]) for r in rows} == grid_limits(trial)
    assert not any(r.get("min_oom_rule") == "prediction" for r in rows)
    assert limits(seeded) == grid_limits(trial)  # and without the predictions, the measurements alone say the same


def test_a_real_search_starts_from_predictions_that_its_trials_confirm_to_the_byte(tmp_path):
    report = autotune.tune("autotune.examples:TinyGPT", device="cpu", budget="256MiB", precisions="fp32",
                           segments="0,all", batch_sizes="4..64", probe=False, isolation="none",
                           storage=f"sqlite:///{tmp_path}/s.db", study="s", measure_steps=2, warmup_steps=1)
    seeding = report.search["predictions"]
    assert seeding["configurations"] == len(report.predictions) > 0 and seeding["unavailable"] is None
    predictions = {m.config: m for m in report.predictions}
    # each step's time predicted too (this CPU calibrated): what the search times is what the model cannot separate
    assert all(m.predicted for m in report.predictions) and seeding["time_model"] == "cpu"
    assert all(m.time_source == "predicted" and m.step_s > 0 for m in report.predictions if m.status == "ok")
    both = [m for m in report.trials if m.config in predictions]
    assert both and all(m.peak_bytes == predictions[m.config].peak_bytes for m in both if m.status == "ok")
    rows = report.limits
    assert any(r.get("min_oom_rule") == "prediction" for r in rows)
    _limits_measured_or_confirmed(rows, {m.config: m for m in report.trials})
    # Every limit exact (the space's sizes are 4..64 in powers of two; the limits lie between them), and the
    # recommended variant's confirmed by a trial at each side
    assert all(r["exact"] and r["min_oom_batch_size"] == r["max_batch_size"] + 1 for r in rows)
    assert any(r["max_batch_size"] not in (4, 8, 16, 32, 64) for r in rows)
    rec, confirmed = report.recommendation, report.search["exact_limit"]
    assert confirmed["confirmed"] and (confirmed["precision"], confirmed["segments"]) == (rec.precision, str(rec.config.plan))
    measured = {m.config: m for m in report.trials}
    assert measured[rec.config.variant.at(confirmed["max_batch_size"])].fits(report.budget_bytes)
    assert measured[rec.config.variant.at(confirmed["min_oom_batch_size"])].status == "oom"
    again = autotune.Report.from_dict(report.to_dict())  # the predictions travel with the report, and so do its limits
    assert again.predictions == report.predictions and again.limits == rows


@pytest.mark.parametrize("model,why", [
    ("tests.test_dry_run:Masked", "cannot run under fake tensors"),  # a value decides a shape: fake tensors say so
    # transformers' grouped matmul of the experts: its fake kernel takes bf16 only, every prediction fails
    ("tests.zoo:mixtral", "every prediction failed under fake tensors: RuntimeError"),
])
def test_a_search_whose_model_cannot_run_under_fake_tensors_goes_on_without_predictions_and_says_so(
        tmp_path, capfd, model, why):
    if model.startswith("tests.zoo"):
        needs("transformers")
    report = autotune.tune(model, device="cpu", budget="256MiB", precisions="fp32",
                           segments="0", batch_sizes="2,4", probe=False, isolation="none",
                           storage=f"sqlite:///{tmp_path}/s.db", study="s", measure_steps=2, warmup_steps=1)
    assert report.predictions == () and why in report.search["predictions"]["unavailable"]
    assert any("not seeded by predictions" in n for n in report.notices)
    assert report.recommendation is not None
    assert "Traceback" not in capfd.readouterr().err  # torch logs a fake kernel's failure with one


def test_with_data_whose_items_are_views_the_predictions_count_what_the_trials_count(tmp_path):
    # token_dataset keeps its sequences in one tensor: an item is a view of it, and the tensor meter counts the whole
    # storage from the first item on, for the rest of the trial (the dataset keeps it alive). Fake tensors kept their
    # copy of it only while an item did: every prediction was the dataset's bytes short, and a plan whose peak is
    # small was refuted by its checking trial. Kept as long as the real tensor lives, it is counted as measured.
    from autotune.examples import token_dataset

    report = autotune.tune("autotune.examples:TinyGPT", data=token_dataset(size=512), device="cpu", budget="256MiB",
                           precisions="fp32", segments="0,all", batch_sizes="4..64", probe=False, isolation="none",
                           storage=f"sqlite:///{tmp_path}/s.db", study="s", measure_steps=2, warmup_steps=1)
    predictions = {m.config: m for m in report.predictions}
    both = [m for m in report.trials if m.config in predictions and m.status == "ok"]
    assert {m.config.plan for m in both} == {"0", "all"}
    assert all(m.peak_bytes == predictions[m.config].peak_bytes for m in both)
    assert {(r["segments"], r.get("max_rule")) for r in report.limits} >= {("all", "prediction")}


# -- every limit exact, and step times predicted (issue 47: items 5 and 6) ------------------------------------------


def timed_predictions(curve=linear, budget=BUDGET, error=0.0):
    """A predictor that answers as ``measure(curve)`` does, its step times predicted (``time_source`` predicted) off
    by ``error`` (a share, the same sign for every configuration of a precision: bf16 slower, fp32 faster)."""
    trial = measure(curve, budget)

    def predict(config):
        m = trial(config)
        if m.status != "ok":
            return dataclasses.replace(m, memory_source=PREDICTED)
        off = 1 + (error if config.precision == "bf16" else -error)
        return dataclasses.replace(m, step_s=m.step_s * off, samples_per_s=m.samples_per_s / off, timed=False,
                                   memory_source=PREDICTED, time_source=PREDICTED)

    return predict


def test_predict_space_goes_on_to_every_variants_exact_limit_between_and_above_the_spaces_sizes():
    predict = predicted(linear)
    predictions = predict_space(SPACE, predict, (BUDGET,), fixed_bytes=8 * MiB, multiple=1)
    for variant in SPACE.variants():
        exact = max(b for b in range(1, 32 * 256 + 1) if linear(variant.at(b)) <= BUDGET)
        assert predictions[variant.at(exact)].status == "ok"
        if exact < 32 * 256:
            assert predictions[variant.at(exact + 1)].status == "oom"
    assert predict.calls <= 6 * len(SPACE.variants())  # a line through the space's predictions: a few more each
    coarse = predict_space(SPACE, predicted(linear), (BUDGET,), fixed_bytes=8 * MiB, multiple=8)
    assert all(c.batch_size % 8 == 0 or c.batch_size in SPACE.batch_sizes for c in coarse)


def test_predictions_stand_for_every_plan_of_a_precision_once_one_trial_agrees_and_none_contradicts():
    predictions = {c: predicted(linear)(c) for c in SPACE.configs()}
    one = measure(linear)(Config("fp32", "all", 16))
    standing = confirmed([one], predictions)
    assert {v for v in standing} == {v for v in SPACE.variants() if v.precision == "fp32"}  # not bf16: none of its own
    assert set(standing.values()) == {one.config}
    wrong = dataclasses.replace(measure(linear)(Config("bf16", "2", 8)), peak_bytes=2 * int(linear(Config("bf16", "2", 8))))
    assert confirmed([one, wrong], predictions) == {one.config.variant: one.config}  # a contradiction anywhere: own only


def test_exact_limits_label_each_predicted_side_and_give_way_to_measurement():
    from autotune.analysis.exact import exact_limits

    predictions = predict_space(SPACE, predicted(linear), (BUDGET,), fixed_bytes=8 * MiB, multiple=1)
    one = measure(linear)(Config("fp32", "all", 16))
    rows = exact_limits(batch_limits([one], BUDGET, batch_sizes=SPACE.batch_sizes, plans=SPACE.plans,
                                     blocks=SPACE.blocks, predictions=predictions), [one], predictions, BUDGET, 1)
    by = {(r["precision"], r["segments"]): r for r in rows}
    row = by[("fp32", "0")]
    exact = max(b for b in range(1, 300) if linear(Config("fp32", "0", b)) <= BUDGET)
    assert (row["max_batch_size"], row["min_oom_batch_size"], row["exact"]) == (exact, exact + 1, True)
    assert row["max_rule"] == row["min_oom_rule"] == "prediction" and row["max_implied_by"] == str(one.config)
    assert row["max_predicted_bytes"] == int(linear(Config("fp32", "0", exact)))
    assert not any(r.get("exact") for (p, _), r in by.items() if p == "bf16")  # no bf16 trial: nothing stands
    # the side a trial measured is the trial's, unlabelled
    at = measure(linear)(Config("fp32", "0", exact))
    row = next(r for r in exact_limits(batch_limits([one, at], BUDGET, batch_sizes=SPACE.batch_sizes, plans=SPACE.plans,
                                                    blocks=SPACE.blocks, predictions=predictions),
                                       [one, at], predictions, BUDGET, 1) if (r["precision"], r["segments"]) == ("fp32", "0"))
    assert row["max_batch_size"] == exact and "max_rule" not in row and row["min_oom_rule"] == "prediction"


def test_a_precision_predicted_slower_everywhere_is_not_timed_and_the_climb_starts_where_predicted_fastest():
    predict = timed_predictions()
    predictions = predict_space(SPACE, predict, (BUDGET,), fixed_bytes=8 * MiB, multiple=1)
    space_only = {c: m for c, m in predictions.items() if c.batch_size in SPACE.batch_sizes}
    slow_fp32 = lambda c: dataclasses.replace(predict(c), samples_per_s=predict(c).samples_per_s / 2,  # noqa: E731
                                              step_s=2 * predict(c).step_s) if c.precision == "fp32" and \
        predict(c).status == "ok" else predict(c)
    slower = {c: slow_fp32(c) for c in space_only}
    measured = run(AutoStrategy(fixed_bytes_hint=8 * MiB, predictions=slower, time_error=0.1), measure(linear))
    timed = [c for c, m in measured.items() if m.samples_per_s is not None]
    assert timed and all(c.precision == "bf16" for c in timed)
    assert timed[0] == max((c for c in slower if c.precision == "bf16" and slower[c].status == "ok"
                            and slower[c].peak_bytes <= 0.9 * BUDGET), key=lambda c: (slower[c].samples_per_s, c.batch_size))
    grid = recommend(run(GridStrategy(), measure(linear)).values(), BUDGET)
    assert recommend(measured.values(), BUDGET).config == grid.config  # speed() peaks at 16: the climb finds it
    # and without step times the search times fp32 as before
    plain = run(AutoStrategy(fixed_bytes_hint=8 * MiB, predictions={c: predicted(linear)(c) for c in space_only}),
                measure(linear))
    assert any(c.precision == "fp32" and m.samples_per_s for c, m in plain.items())


def test_predicted_step_times_off_by_their_error_still_find_the_grids_recommendation():
    # bf16 predicted 10% slower and fp32 10% faster than they run: the ratio off by 22%, within twice a 12% error
    predictions = predict_space(SPACE, timed_predictions(error=0.1), (BUDGET,), fixed_bytes=8 * MiB, multiple=1)
    space_only = {c: m for c, m in predictions.items() if c.batch_size in SPACE.batch_sizes}
    measured = run(AutoStrategy(fixed_bytes_hint=8 * MiB, predictions=space_only, time_error=0.12), measure(linear))
    grid = recommend(run(GridStrategy(), measure(linear)).values(), BUDGET)
    assert recommend(measured.values(), BUDGET).config == grid.config
