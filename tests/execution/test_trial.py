import dataclasses

import pytest
import torch

from autotune.meters import TensorMeter
from autotune.records import Config, Measurement, TrialSettings
from autotune.execution.trial import run_trial
from autotune.training.workload import Workload

QUICK = TrialSettings(warmup_steps=2, measure_steps=3)


@pytest.fixture
def gpt(tiny_gpt_kwargs):
    return Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=tiny_gpt_kwargs)


def test_ok_trial_measures_memory_time_and_loss(gpt):
    m = run_trial(gpt, Config("fp32", "0", 4), device="cpu", meter=TensorMeter(), settings=QUICK)
    assert m.status == "ok" and m.error is None
    assert len(m.step_times_s) == 3 and m.step_s == sorted(m.step_times_s)[1]
    assert m.samples_per_s == pytest.approx(4 / m.step_s)
    params = sum(p.numel() for p in gpt.build_model().parameters()) * 4
    assert m.peak_bytes > 4 * params  # weights, gradients and AdamW's two moments, plus activations
    assert m.memory_source == "tensor"
    assert m.loss_final < m.loss_first  # it really trains
    assert m.plan == {"name": "0", "recomputed_blocks": [], "chain_length": None}


def test_a_memory_trial_meters_the_same_peak_without_timing(gpt):
    full = run_trial(gpt, Config("bf16", "2", 4), device="cpu", meter=TensorMeter(), settings=QUICK)
    memory = run_trial(gpt, Config("bf16", "2", 4), device="cpu", meter=TensorMeter(), settings=QUICK, timed=False)
    assert memory.status == "ok" and memory.figures == "memory" and not memory.timed
    assert memory.peak_bytes == full.peak_bytes and memory.peak_allocated_bytes == full.peak_allocated_bytes
    assert memory.step_times_s == () and memory.step_s is None and memory.samples_per_s is None
    assert len(memory.loss_scale_history) == 0 and memory.loss_first == full.loss_first  # the one metered step


def test_an_unmetered_timing_run_times_without_the_meter(gpt):
    timing = run_trial(gpt, Config("fp32", "0", 4), device="cpu", meter=TensorMeter(budget_bytes=1), settings=QUICK,
                       metered=False)  # a budget of one byte: the meter, had it run, would have stopped it
    assert timing.status == "ok" and timing.peak_bytes is None and timing.memory_source == ""
    assert len(timing.step_times_s) == 3 and timing.samples_per_s == pytest.approx(4 / timing.step_s)


def test_timing_stops_once_the_last_steps_settle_and_runs_to_the_maximum_otherwise(gpt):
    lax = dataclasses.replace(QUICK, measure_steps=8, settle_steps=3, settle_share=10.0)  # any three steps agree
    strict = dataclasses.replace(QUICK, measure_steps=5, settle_steps=3, settle_share=0.0)  # none do
    assert len(run_trial(gpt, Config("fp32", "0", 2), device="cpu", meter=TensorMeter(), settings=lax).step_times_s) == 3
    assert len(run_trial(gpt, Config("fp32", "0", 2), device="cpu", meter=TensorMeter(), settings=strict).step_times_s) == 5


def test_every_trial_starts_from_a_fresh_model(gpt):
    a = run_trial(gpt, Config("fp32", "0", 2), device="cpu", meter=TensorMeter(), settings=QUICK)
    b = run_trial(gpt, Config("fp32", "0", 2), device="cpu", meter=TensorMeter(), settings=QUICK)
    assert a.loss_first == b.loss_first and a.loss_final == b.loss_final
    assert a.peak_bytes == b.peak_bytes


def test_checkpointed_and_bf16_trials_use_less_memory(gpt):
    peaks = {c: run_trial(gpt, Config(*c, 8), device="cpu", meter=TensorMeter(), settings=QUICK).peak_bytes
             for c in [("fp32", "0"), ("fp32", "2"), ("bf16", "0")]}
    assert peaks[("fp32", "2")] < peaks[("fp32", "0")]
    assert peaks[("bf16", "0")] < peaks[("fp32", "0")]


def test_fp16_trial_records_the_loss_scale(gpt):
    m = run_trial(gpt, Config("fp16", "0", 2), device="cpu", meter=TensorMeter(), settings=QUICK)
    assert m.status == "ok"
    assert len(m.loss_scale_history) == 4 and m.loss_scale_history[0] <= 2.0**16  # one metered step, three timed
    assert m.skipped_steps == sum(b < a for a, b in zip((2.0**16,) + m.loss_scale_history, m.loss_scale_history))


def test_over_budget_is_an_oom_outcome(gpt):
    m = run_trial(gpt, Config("fp32", "0", 64), device="cpu", meter=TensorMeter(budget_bytes=2 * 2**20), settings=QUICK)
    assert m.status == "oom" and "can't allocate memory" in m.error
    assert m.peak_bytes > 2 * 2**20 and m.step_s is None and m.samples_per_s is None


def test_slow_trial_is_cut_at_the_timeout(gpt):
    m = run_trial(gpt, Config("fp32", "0", 256), device="cpu", meter=TensorMeter(),
                  settings=TrialSettings(measure_steps=1000, settle_steps=0, timeout_s=0.5))
    assert m.status == "timeout" and "--trial-timeout" in m.error
    assert m.wall_s < 5


def test_failing_model_is_a_failed_outcome():
    w = Workload.from_specs("tests.models:ExplodingForward")
    m = run_trial(w, Config("fp32", "0", 2), device="cpu", meter=TensorMeter(), settings=QUICK)
    assert m.status == "failed" and m.error == "ValueError: boom in forward"


def test_measurement_round_trips_through_a_dict_with_non_finite_losses():
    m = Measurement(config=Config("fp16", "2", 8), status="ok", peak_bytes=10, loss_first=float("nan"), loss_final=float("inf"),
                    loss_scale_history=(65536.0, 32768.0), step_times_s=(0.1, 0.2))
    data = m.to_dict()
    assert data["loss_first"] == "nan" and data["precision"] == "fp16" and data["batch_size"] == 8
    back = Measurement.from_dict(data)
    assert back.config == m.config and back.loss_scale_history == m.loss_scale_history
    assert back.loss_final == float("inf")


def test_a_trial_says_how_long_it_took_to_set_up_and_to_step(gpt):
    import time

    from autotune.records import completed, retimed

    m = run_trial(gpt, Config("fp32", "0", 4), device="cpu", meter=TensorMeter(), settings=QUICK)
    assert m.setup_s >= 0 and m.steps_s > 0 and m.setup_s + m.steps_s <= m.wall_s + 0.01
    # Asked for 2 s ago (a worker starting, say): the set-up counts from the ask
    late = run_trial(gpt, Config("fp32", "0", 4), device="cpu", meter=TensorMeter(), settings=QUICK,
                     asked_at=time.time() - 2.0)
    assert late.setup_s >= 2.0
    # A memory trial completed by a timing run, or a timing run again: the two runs' seconds together
    for both in (completed(dataclasses.replace(m, timed=False), late, 0), retimed(m, late)):
        assert both.setup_s == pytest.approx(m.setup_s + late.setup_s)
        assert both.steps_s == pytest.approx(m.steps_s + late.steps_s)
    # A trial that never reached its first step is all set-up
    oom = run_trial(gpt, Config("fp32", "0", 4), device="cpu", meter=TensorMeter(budget_bytes=1000), settings=QUICK)
    assert oom.status == "oom" and oom.steps_s == 0.0 and oom.setup_s > 0


def test_a_failure_is_recorded_as_the_outcome_it_is():
    from autotune.errors import TrialTimeoutError, UsageError
    from autotune.execution.work import Outcome, outcome
    from autotune.vocabulary import Status

    assert outcome(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB\nmore")).status == Status.OOM
    assert outcome(TrialTimeoutError("stopped at 300 s")) == Outcome(Status.TIMEOUT, "stopped at 300 s")
    assert outcome(ValueError("bad shape\ntrace")) == Outcome(Status.FAILED, "ValueError: bad shape")
    with pytest.raises(UsageError):
        outcome(UsageError("--budget must be positive"))  # bad input is not an outcome: it goes to the user
