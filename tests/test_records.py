"""The records every stage passes on: their JSON, and the rules that read them (no training here)."""

import json
import math

import pytest

from autotune.errors import UsageError
from autotune.records import (
    Config,
    GuardRails,
    Measurement,
    PlanCheck,
    ProbeResult,
    ProbeSettings,
    accumulation_plan,
    completed,
    retimed,
    settled,
    timing_fields,
    usable_bytes,
)
from autotune.units import quantile

# --- Config --------------------------------------------------------------------------------------


@pytest.mark.parametrize("given, name", [(2, "2"), ("02", "2"), (" ALL ", "all"), ("Every02", "every2"), (0, "0")])
def test_config_canonicalises_the_plan_name(given, name):
    config = Config("fp32", given, 8)
    assert config.segments == name
    assert config.variant == ("fp32", name)
    assert config == Config("fp32", name, 8) and hash(config) == hash(Config("fp32", name, 8))
    assert str(config) == f"fp32 segments={name} batch=8"


def test_config_refuses_an_unknown_plan_as_bad_input():
    with pytest.raises(UsageError, match="unknown checkpoint plan 'every0'"):
        Config("fp32", "every0", 8)
    with pytest.raises(UsageError, match="--segments"):
        Config("fp32", "half", 8)


def test_configs_differing_only_in_batch_share_a_variant_and_sort():
    a, b = Config("bf16", "all", 4), Config("bf16", "all", 16)
    assert a.variant == b.variant and a != b
    assert sorted([b, a]) == [a, b]


# --- Measurement ---------------------------------------------------------------------------------


def _measurement(**kw):
    base = dict(config=Config("fp16", "every2", 8), status="ok", peak_bytes=1000, step_s=0.5, samples_per_s=16.0,
                step_times_s=(0.4, 0.5, 0.6), loss_first=3.0, loss_final=2.0, loss_scale_history=(65536.0, 32768.0),
                skipped_steps=1, plan={"name": "every2", "recomputed_blocks": [0, 2]}, wall_s=1.5)
    base.update(kw)
    return Measurement(**base)


def test_measurement_json_is_flat_and_strict_json_even_with_nan_and_inf_losses():
    m = _measurement(loss_first=float("-inf"), loss_final=float("nan"), nonfinite_losses=2)
    data = m.to_dict()
    assert "config" not in data
    assert (data["precision"], data["segments"], data["batch_size"]) == ("fp16", "every2", 8)
    assert data["loss_first"] == "-inf" and data["loss_final"] == "nan"
    assert data["step_times_s"] == [0.4, 0.5, 0.6] and data["loss_scale_history"] == [65536.0, 32768.0]
    text = json.dumps(data, allow_nan=False)  # strict JSON: no bare NaN or Infinity
    back = Measurement.from_dict(json.loads(text))
    assert back.config == m.config and back.loss_first == float("-inf") and math.isnan(back.loss_final)
    assert back.step_times_s == m.step_times_s and back.loss_scale_history == m.loss_scale_history
    assert back.plan == m.plan and back.nonfinite_losses == 2 and back.skipped_steps == 1


def test_measurement_round_trip_is_exact_for_finite_values():
    m = _measurement()
    assert Measurement.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_measurement_from_dict_ignores_unknown_keys_and_reads_old_integer_segments():
    data = _measurement().to_dict()
    data.update({"segments": 2, "added_in_a_later_version": {"x": 1}, "schema": 9})
    back = Measurement.from_dict(data)
    assert back.config == Config("fp16", "2", 8) and back.segments == "2"
    assert not hasattr(back, "added_in_a_later_version")


def test_measurement_from_dict_fills_defaults_for_missing_fields():
    back = Measurement.from_dict({"precision": "fp32", "segments": "0", "batch_size": "4", "status": "oom"})
    assert back.config == Config("fp32", "0", 4) and back.status == "oom"
    assert back.peak_bytes is None and back.step_times_s == () and back.loss_scale_history == () and back.plan == {}


def test_measurement_from_dict_does_not_change_its_argument():
    data = _measurement().to_dict()
    copy = json.loads(json.dumps(data))
    Measurement.from_dict(data)
    assert data == copy


def test_measurement_shortcuts():
    m = _measurement()
    assert (m.precision, m.segments, m.batch_size) == ("fp16", "every2", 8)


@pytest.mark.parametrize("status, peak, limit, fits", [
    ("ok", 1000, None, True),
    ("ok", 1000, 1000, True),  # at the limit is within it
    ("ok", 1000, 999.5, False),
    ("ok", None, 10, True),  # ran to the end with no peak reading: nothing says it does not fit
    ("oom", 10, 1000, False),
    ("oom", None, None, False),
    ("timeout", 10, None, False),
    ("failed", 10, 1000, False),
    ("crashed", None, None, False),
])
def test_measurement_fits(status, peak, limit, fits):
    assert _measurement(status=status, peak_bytes=peak).fits(limit) is fits


# --- usable_bytes, quantile ----------------------------------------------------------------------


def test_usable_bytes_is_the_budget_less_its_headroom():
    assert usable_bytes(None, 0.1) is None
    assert usable_bytes(1000, 0.1) == pytest.approx(900)
    assert usable_bytes(1000, 0.0) == 1000
    assert usable_bytes(2**30, 0.25) == pytest.approx(0.75 * 2**30)


@pytest.mark.parametrize("values, q, expected", [
    ([], 0.5, None),
    ([7], 0.0, 7), ([7], 0.9, 7), ([7], 1.0, 7),
    ([4, 1, 3, 2], 0.5, 2),  # two of four at or below 2
    ([4, 1, 3, 2], 0.51, 3),
    ([4, 1, 3, 2], 0.0, 1), ([4, 1, 3, 2], 1.0, 4),
    (list(range(10, 0, -1)), 0.9, 9),
    (list(range(1, 21)), 0.9, 18),
    ([0.3, 0.1, 0.2], 0.9, 0.3),
])
def test_quantile(values, q, expected):
    assert quantile(values, q) == expected


def test_quantile_is_not_moved_by_floating_point_error():
    values = list(range(1, 101))
    assert [quantile(values, q) for q in (0.07, 0.29, 0.57, 0.9)] == [7, 29, 57, 90]  # 0.07 * 100 = 7.000000000000001


def test_quantile_does_not_sort_its_argument_in_place():
    values = [3, 1, 2]
    quantile(values, 0.5)
    assert values == [3, 1, 2]


# --- accumulation_plan ---------------------------------------------------------------------------


def test_accumulation_plan_without_a_target_is_one_step_of_the_micro_batch():
    assert accumulation_plan(16, None) == {"target_batch_size": None, "micro_batch_size": 16, "accumulation_steps": 1,
                                           "effective_batch_size": 16, "lr_note": None}


@pytest.mark.parametrize("target", [0, -4])
def test_accumulation_plan_refuses_a_target_below_one(target):
    with pytest.raises(UsageError, match=f"--target-batch-size {target} must be at least 1"):
        accumulation_plan(8, target)


def test_accumulation_plan_that_hits_the_target_exactly_keeps_the_learning_rate():
    plan = accumulation_plan(16, 64)
    assert (plan["accumulation_steps"], plan["effective_batch_size"]) == (4, 64)
    assert "keep the learning rate you tuned for batch 64" in plan["lr_note"] and "4 micro-batches of 16" in plan["lr_note"]


def test_accumulation_plan_that_overshoots_says_how_to_scale_or_hit_the_target():
    plan = accumulation_plan(24, 100)  # 5 steps of 24 = 120
    assert (plan["accumulation_steps"], plan["effective_batch_size"]) == (5, 120)
    assert "120/100 = 1.200" in plan["lr_note"]
    assert "micro-batches of 20" in plan["lr_note"]  # 5 x 20 = 100 exactly
    assert plan["micro_batch_size"] == 24 and plan["target_batch_size"] == 100


def test_accumulation_plan_with_a_micro_batch_above_the_target_is_one_step():
    plan = accumulation_plan(96, 32)
    assert (plan["accumulation_steps"], plan["effective_batch_size"]) == (1, 96)
    assert "larger than the target" in plan["lr_note"] and "3.000" in plan["lr_note"]


def test_accumulation_plan_of_one_sample_micro_batches():
    plan = accumulation_plan(1, 7)
    assert (plan["accumulation_steps"], plan["effective_batch_size"]) == (7, 7)


# --- GuardRails, ProbeSettings -------------------------------------------------------------------


def test_guard_rails_from_dict():
    assert GuardRails.from_dict(None) == GuardRails() == GuardRails.from_dict({})
    guard = GuardRails.from_dict({"clip_grad_norm": 1.0, "fp32_modules": ["LayerNorm", "Softmax"], "other": 3})
    assert guard == GuardRails(1.0, ("LayerNorm", "Softmax"))
    assert isinstance(guard.fp32_modules, tuple)
    hash(guard)  # frozen and hashable: it is part of TrialSettings, which is fingerprinted
    assert GuardRails.from_dict(json.loads(json.dumps(guard.to_dict()))) == guard
    assert guard.to_dict() == {"clip_grad_norm": 1.0, "fp32_modules": ["LayerNorm", "Softmax"]}


def test_probe_settings_to_dict():
    assert ProbeSettings(top=2, fraction=0.5).to_dict()["top"] == 2
    assert set(ProbeSettings().to_dict()) == {"top", "epochs", "fraction", "num_workers", "max_skipped_share", "seed",
                                              "timeout_s", "target_batch_size"}


# --- ProbeResult ---------------------------------------------------------------------------------


def test_probe_result_round_trips_through_strict_json_with_non_finite_values():
    r = ProbeResult(Config("bf16", "4", 32), accepted=False, reason="loss went nan", steps=10, samples=320,
                    peak_bytes_max=5000, loss_start=float("inf"), loss_end=float("nan"), nonfinite_losses=3,
                    loss_scale={"initial": 65536.0, "final": 1024.0}, grad_norm={"median": 1.5, "max": float("inf")})
    data = r.to_dict()
    assert data["loss_start"] == "inf" and data["loss_end"] == "nan" and data["grad_norm"]["max"] == "inf"
    assert (data["precision"], data["segments"], data["batch_size"]) == ("bf16", "4", 32)
    back = ProbeResult.from_dict(json.loads(json.dumps(data, allow_nan=False)))
    assert back.config == r.config and back.accepted is False and back.reason == "loss went nan"
    assert back.loss_start == float("inf") and math.isnan(back.loss_end)
    assert back.grad_norm == {"median": 1.5, "max": float("inf")} and back.loss_scale == r.loss_scale


def test_probe_result_round_trip_is_exact_for_finite_values_and_ignores_unknown_keys():
    r = ProbeResult(Config("fp32", "0", 4), accepted=True, steps=3, samples=12, step_s_median=0.1, step_s_p90=0.2,
                    grad_norm={"median": 0.5, "max": 2.0})
    data = {**r.to_dict(), "from_the_future": True}
    assert ProbeResult.from_dict(data) == r
    assert ProbeResult.from_dict(ProbeResult(Config("fp32", 2, 4), True).to_dict()).grad_norm is None


# --- PlanCheck -----------------------------------------------------------------------------------


def test_plan_check_round_trip_and_ok():
    check = PlanCheck("every2", "within_noise", 4, recomputed_blocks=("transformer.h.0", "transformer.h.2"),
                      max_rel_diff=1e-6, max_abs_diff=1e-7, worst="grad:lm_head.weight", noise=1e-7, tolerance=1e-6)
    data = json.loads(json.dumps(check.to_dict()))
    assert data["recomputed_blocks"] == ["transformer.h.0", "transformer.h.2"]
    back = PlanCheck.from_dict({**data, "unknown": 1})
    assert back == check and isinstance(back.recomputed_blocks, tuple)
    assert check.ok and PlanCheck("2", "exact", 4, max_rel_diff=0.0).ok
    assert not PlanCheck("2", "differs", 4).ok and not PlanCheck("2", "failed", 4).ok


def test_plan_check_describe():
    assert PlanCheck("2", "exact", 4, max_rel_diff=0.0).describe() == \
        "checkpoint plan 2: exact (largest relative difference 0)"
    failed = PlanCheck("all", "failed", 4, error="RuntimeError: boom")
    assert failed.describe() == "checkpoint plan all: its check step failed (RuntimeError: boom)"
    differs = PlanCheck("every2", "differs", 4, max_rel_diff=0.25, max_abs_diff=0.5, worst="loss", tolerance=1e-5)
    text = differs.describe()
    assert "trains a different model" in text and "loss differs by 0.25" in text and "1e-05 allowed" in text


def test_plan_check_from_dict_fills_defaults():
    back = PlanCheck.from_dict({"plan": "2", "status": "exact", "batch_size": 2})
    assert back.recomputed_blocks == () and back.noise == 0.0 and back.error is None


@pytest.mark.parametrize("times, steps, share, done", [
    ([1.0, 1.01, 0.99], 3, 0.02, True),
    ([1.0, 1.03, 0.99], 3, 0.02, False),  # 1.03 is 3% above the median
    ([5.0, 1.0, 1.01, 0.99], 3, 0.02, True),  # only the last three count
    ([1.0, 1.0], 3, 0.02, False),  # not three yet
    ([1.0, 1.0, 1.0], 0, 0.02, False),  # settle_steps 0: never early
])
def test_timing_settles_when_the_last_steps_lie_within_a_share_of_their_median(times, steps, share, done):
    assert settled(times, steps, share) is done


def test_timing_fields_come_from_the_median_step():
    fields = timing_fields(8, (0.5, 0.3, 0.4), 240, True)
    assert fields["step_s"] == 0.4 and fields["samples_per_s"] == 20.0
    assert fields["step_s_spread"] == pytest.approx(0.5) and fields["tokens_per_s"] == pytest.approx(200.0)
    assert timing_fields(8, (0.5,), None, False)["samples_per_s"] is None


def test_a_memory_trial_has_memory_figures_only_and_a_timing_completes_it():
    config = Config("bf16", "all", 8)
    memory = Measurement(config, "ok", peak_bytes=1000, peak_allocated_bytes=1000, memory_source="tensor", timed=False,
                         wall_s=2.0)
    assert memory.figures == "memory" and memory.to_dict()["figures"] == "memory"
    timing = Measurement(config, "ok", memory_source="", **timing_fields(8, (0.2, 0.2, 0.2), None, True), wall_s=1.0)
    both = completed(memory, timing, memory_trial=7)
    assert both.figures == "memory+time" and both.memory_from == 7
    assert both.peak_bytes == 1000 and both.memory_source == "tensor" and both.samples_per_s == 40.0 and both.wall_s == 3.0
    assert Measurement.from_dict(both.to_dict()) == both
    cut = Measurement(config, "timeout", error="too slow")
    assert completed(memory, cut, memory_trial=7) == cut  # the timing's failure is the configuration's outcome
    assert Measurement(config, "oom", peak_bytes=2000).figures == "memory"
    assert Measurement(config, "failed").figures == "none"


def test_a_near_tie_timed_again_is_judged_on_the_steps_of_both_runs():
    config = Config("fp32", "0", 4)
    first = Measurement(config, "ok", peak_bytes=10, **timing_fields(4, (1.0, 1.0, 1.0), 30, True))
    second = Measurement(config, "ok", **timing_fields(4, (0.5, 0.5, 0.5), 30, True))
    both = retimed(first, second)
    assert both.step_times_s == (1.0, 1.0, 1.0, 0.5, 0.5, 0.5) and both.timings == 2
    assert both.step_s == 0.75 and both.peak_bytes == 10 and both.tokens_per_s == pytest.approx(60 / 4.5)
