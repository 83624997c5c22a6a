import math

import pytest
import torch

import autotune
from autotune.meters import TensorMeter
from autotune.analysis.pareto import choose, probe_candidates
from autotune.execution.probe import run_probe
from autotune.records import Config, Measurement, ProbeSettings, TrialSettings, accumulation_plan
from autotune.execution.trial import run_trial
from autotune.training.workload import Workload

TINY = {"n_layer": 4, "block_size": 64, "n_embd": 32, "n_head": 4, "vocab_size": 64}


def tune(tmp_path, **kwargs):
    options = dict(model="autotune.examples:TinyGPT", model_kwargs=TINY, device="cpu", precisions="fp32,bf16",
                   segments="0,2", measure_steps=2, storage=f"sqlite:///{tmp_path}/p.db", study="p")
    options.update(kwargs)
    return autotune.tune(options.pop("model"), **options)


def test_probe_trains_an_epoch_over_a_tenth_of_the_data_and_plans_the_target_batch(tmp_path):
    report = tune(tmp_path, data="tests.models:tiny_tokens", budget="40MiB", batch_sizes="4..32", probe_epochs=2,
                  target_batch_size=256)
    data = report.to_dict()
    probe = data["probe"]
    # The top 3 of the front within the headroom, fastest first; how many the front holds depends on measured speeds
    # (one trial both fastest and smallest is a front of one), and test_candidates_and_choice orders several.
    fitting = [m for m in report.pareto if m.peak_bytes <= 0.9 * data["budget_bytes"]]
    expected = sorted(fitting, key=lambda m: (-m.samples_per_s, m.peak_bytes))[:3]
    assert probe["settings"]["fraction"] == 0.1 and len(expected) >= 1
    assert [(c["precision"], c["segments"], c["batch_size"]) for c in probe["candidates"]] == [
        (m.precision, m.segments, m.batch_size) for m in expected]
    for candidate in probe["candidates"]:
        assert candidate["steps"] == 2 * math.ceil(0.1 * 320 / candidate["batch_size"])
        assert candidate["samples"] == 2 * math.ceil(0.1 * 320)
        assert candidate["accepted"] and candidate["peak_bytes_max"] <= data["budget_bytes"]
        assert candidate["step_s_p90"] >= candidate["step_s_median"] > 0
        assert candidate["grad_norm"]["max"] >= candidate["grad_norm"]["median"] > 0
    chosen = probe["chosen"]
    assert chosen == {k: data["recommendation"][k] for k in ("precision", "segments", "batch_size", "compile")}
    fastest = max(probe["candidates"], key=lambda c: c["samples_per_s"])
    assert (fastest["precision"], fastest["segments"], fastest["batch_size"], "none") == tuple(chosen.values())
    plan = data["accumulation"]
    assert plan["micro_batch_size"] == chosen["batch_size"]
    assert plan["micro_batch_size"] * plan["accumulation_steps"] >= 256 == plan["target_batch_size"]
    assert "learning rate" in plan["lr_note"]
    back = autotune.load(tmp_path / "r.json") if report.to_json(tmp_path / "r.json") else None
    assert back.recommendation == report.recommendation and back.accumulation == report.accumulation


def test_variable_lengths_do_not_surprise_the_probe(tmp_path):
    # The first items are short; one in twenty sequences is four times longer. Trials measure memory on the worst
    # batch the data can make, so no batch of the probe's epoch goes above it (autotune 0.1 measured the first
    # items and its favourite here ran out of the budget in the probe).
    report = tune(tmp_path, data="tests.models:tiny_variable_loader", budget="16MiB", batch_sizes="4..32", probe_top=4)
    searched = autotune.analysis.pareto.recommend(report.trials, report.budget_bytes, report.headroom)
    by_config = {r.config: r for r in report.probe}
    for r in report.probe:
        assert r.worst_batch_peak_bytes is not None and r.worst_batch_peak_bytes <= r.peak_bytes_max
        assert r.peak_bytes_max <= 1.01 * r.trial_peak_bytes  # the probe also computes gradient norms: a few KiB
    assert by_config[searched.config].accepted
    rec = report.recommendation
    assert rec is not None and by_config[rec.config].accepted
    assert by_config[rec.config].peak_bytes_max <= report.budget_bytes * (1 - report.headroom)
    assert "worst-case peak in the probe" in report.table() and "data: 640 items" in report.table()


def _trial(workload, config, budget=None):
    m = run_trial(workload, config, device="cpu", meter=TensorMeter(budget_bytes=budget), settings=TrialSettings(measure_steps=2))
    assert m.status == "ok"
    return m


def test_probe_rejects_an_oom():
    w = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=TINY, data="tests.models:tiny_variable_loader")
    first = w.with_worst_batches({32: range(32)})  # a trial on the first, short items, as autotune 0.1 measured
    trial = _trial(first, Config("fp32", "0", 32), budget=8 * 2**20)
    r = run_probe(w, trial, device=torch.device("cpu"), meter=TensorMeter(budget_bytes=8 * 2**20), budget_bytes=8 * 2**20,
                  headroom=0.1)
    assert not r.accepted and r.reason.startswith("oom:") and r.peak_bytes_max > 8 * 2**20


def test_probe_rejects_a_non_finite_loss():
    w = Workload.from_specs("tests.models:NanAfterThreeSteps", data="tests.models:pairs")
    r = run_probe(w, _trial(w, Config("fp32", "0", 4)), device=torch.device("cpu"), meter=TensorMeter(), budget_bytes=None,
                  headroom=0.1)
    # 10 steps of the epoch, then the worst batch's: its loss counts too
    assert not r.accepted and "non-finite loss in 8 of 11 steps" == r.reason and r.steps == 10
    assert r.nonfinite_losses == 8 and math.isfinite(r.loss_start) and math.isnan(r.loss_end)
    assert r.to_dict()["loss_end"] == "nan"


def test_probe_rejects_a_collapsing_loss_scale():
    w = Workload.from_specs("tests.models:Fp16Overflow", data="tests.models:pairs")
    r = run_probe(w, _trial(w, Config("fp16", "0", 2)), device=torch.device("cpu"), meter=TensorMeter(), budget_bytes=None,
                  headroom=0.1, settings=ProbeSettings(fraction=0.2))
    assert not r.accepted and "collapsed" in r.reason
    scale = r.loss_scale
    # Halved from 2^16 on every overflow until 1e5 x scale fits fp16: 19 skipped steps, down to 1/8.
    assert scale["initial"] == 2.0**16 and scale["skipped_steps"] == 19 and scale["min"] == scale["final"] == 0.125
    assert r.steps == 40


def test_healthy_fp16_probe_records_the_scale_history():
    w = Workload.from_specs("tests.models:DictLoss", data="tests.models:pairs")
    r = run_probe(w, _trial(w, Config("fp16", "0", 8)), device=torch.device("cpu"), meter=TensorMeter(), budget_bytes=None,
                  headroom=0.1)
    assert r.accepted and r.loss_scale["initial"] == 2.0**16 and r.loss_scale["skipped_steps"] <= 0.2 * r.steps


def test_candidates_and_choice():
    def m(b, peak, sps):
        return Measurement(config=Config("fp32", "0", b), status="ok", peak_bytes=peak, samples_per_s=sps, step_s=1.0)

    front = [m(1, 10, 5.0), m(2, 20, 9.0), m(4, 40, 12.0), m(8, 95, 20.0)]
    assert [c.batch_size for c in probe_candidates(front, 100, 0.1, top=2)] == [4, 2]
    from autotune.records import ProbeResult

    results = [ProbeResult(Config("fp32", "0", 4), False, "oom: x"), ProbeResult(Config("fp32", "0", 2), True, samples_per_s=8.0)]
    assert choose(results).config.batch_size == 2
    assert choose(results[:1]) is None


def test_no_data_skips_the_probe_with_a_notice(tmp_path):
    report = tune(tmp_path, budget="40MiB", batch_sizes="4,8", precisions="fp32", segments="0")
    assert report.probe is None and any("--data" in n for n in report.notices)
    assert report.to_dict()["probe"] is None


def test_no_probe_flag(tmp_path):
    report = tune(tmp_path, data="tests.models:tiny_tokens", budget="40MiB", batch_sizes="4,8", precisions="fp32",
                  segments="0", probe=False)
    assert report.probe is None


@pytest.mark.parametrize("micro, target, steps, effective", [(32, 256, 8, 256), (48, 256, 6, 288), (64, 64, 1, 64), (128, 64, 1, 128)])
def test_accumulation_plan(micro, target, steps, effective):
    plan = accumulation_plan(micro, target)
    assert (plan["accumulation_steps"], plan["effective_batch_size"]) == (steps, effective)
    assert plan["micro_batch_size"] * plan["accumulation_steps"] >= min(target, micro) or micro > target
    if effective != target:
        assert "linearly" in plan["lr_note"]


def test_an_offloading_candidate_reports_its_host_memory_and_is_held_to_the_host_budget():
    w = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=TINY, data="tests.models:tiny_variable_loader")
    trial = _trial(w, Config("fp32", "0+offload", 8))
    r = run_probe(w, trial, device=torch.device("cpu"), meter=TensorMeter(), budget_bytes=None, headroom=0.1)
    assert r.accepted and r.host_peak_bytes > 0, r
    assert autotune.ProbeResult.from_dict(r.to_dict()).host_peak_bytes == r.host_peak_bytes  # in the JSON
    # Under a host budget below what the epoch's host copies held: the host's out-of-memory error rejects it
    low = r.host_peak_bytes // 2
    r = run_probe(w, trial, device=torch.device("cpu"), meter=TensorMeter(), budget_bytes=None, headroom=0.1,
                  host_budget_bytes=low)
    assert not r.accepted and r.reason.startswith("oom: host memory: activation offload tried to hold"), r.reason
    assert r.host_peak_bytes > low  # what the refused copy asked for
    plain = run_probe(w, _trial(w, Config("fp32", "0", 8)), device=torch.device("cpu"), meter=TensorMeter(),
                      budget_bytes=None, headroom=0.1, host_budget_bytes=low)
    assert plain.accepted and plain.host_peak_bytes is None  # nothing offloaded: the host budget does not apply
