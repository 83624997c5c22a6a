import json

import pytest
import torch

import autotune
from autotune.execution.plan_check import Difference, check_plans, compare_steps
from autotune.examples import TinyGPT
from autotune.training.workload import Workload


def test_exact_plans_pass_bitwise():
    workload = Workload.from_specs("autotune.examples:ResNetish", model_kwargs={"depth": 3, "channels": 4, "image_size": 8})
    checks = check_plans(workload, ["0", "2", "all", "every2"], batch_size=2, device="cpu")
    assert [c.plan for c in checks] == ["2", "all", "every2"]  # "0" recomputes nothing: nothing to check
    assert all(c.status == "exact" and c.max_rel_diff == 0.0 and c.tolerance == 0.0 for c in checks)
    assert checks[1].recomputed_blocks == ("1", "2", "3")


def test_a_plan_that_cannot_be_exact_is_found():
    checks = check_plans(Workload.from_specs("tests.models:LoopState"), ["all", "every2"], batch_size=3, device="cpu")
    assert [c.status for c in checks] == ["differs", "differs"]
    assert checks[0].worst.startswith("grad:blocks.") and checks[0].max_rel_diff > 0.01
    assert "trains a different model" in checks[0].describe()


def test_compare_steps():
    a = {"loss": torch.tensor(1.0), "grad:w": torch.tensor([1.0, float("nan")])}
    assert compare_steps(a, {k: v.clone() for k, v in a.items()}) == Difference(0.0, 0.0, None)
    difference = compare_steps(a, {"loss": torch.tensor(1.0), "grad:w": torch.tensor([1.5, float("nan")])})
    assert difference == Difference(relative=0.5, absolute=0.5, where="grad:w")
    assert compare_steps(a, {"loss": torch.tensor(1.0)}).where == "grad:w"  # a gradient missing on one side


def test_a_difference_in_a_gradient_that_is_rounding_noise_is_measured_against_the_models_gradients():
    # ResNetish's convolution weights before a batch norm: gradients about 1e-6 of the model's largest, which compiling
    # changes by a quarter of their own size. Measured against 1e-3 of the largest gradient, not their own size.
    a = {"loss": torch.tensor(2.0), "grad:w": torch.tensor([0.25, -0.1]), "grad:scale_invariant": torch.tensor([1e-6])}
    b = {**a, "grad:scale_invariant": torch.tensor([1.25e-6])}
    d = compare_steps(a, b)
    assert d.where == "grad:scale_invariant" and abs(d.absolute - 0.25e-6) < 1e-12
    assert abs(d.relative - 0.25e-6 / (1e-3 * 0.25)) < 1e-9
    c = {**a, "grad:w": torch.tensor([0.25, -0.05])}  # a gradient of real size: its own largest entry
    d = compare_steps(a, c)
    assert d.where == "grad:w" and abs(d.relative - 0.05 / 0.25) < 1e-6 and abs(d.absolute - 0.05) < 1e-6


def test_the_tuner_drops_a_plan_that_differs_says_so_and_keeps_the_checks(tmp_path, caplog):
    common = dict(device="cpu", budget="64MiB", precisions="fp32", segments="0,all", batch_sizes="1,2",
                  measure_steps=1, storage=f"sqlite:///{tmp_path}/s.db", study="s", probe=False)
    with caplog.at_level("WARNING", logger="autotune"):
        report = autotune.tune("tests.models:LoopState", **common)
    assert report.search["space"]["segments"] == ["0"]
    assert {m.segments for m in report.trials} == {"0"}
    assert any("checkpoint plan all trains a different model" in n and "dropped" in n for n in report.notices)
    assert any("checkpoint plan all" in r.message for r in caplog.records)
    data = json.loads(report.to_json())
    assert [(c["plan"], c["status"]) for c in data["plan_checks"]] == [("all", "differs")]

    # A resumed search reuses the stored checks (it runs no check step) and the same trials.
    import autotune.preparation.study as tuner

    def no_checks(*args, **kwargs):
        raise AssertionError("the checks should come from the study")

    original = tuner.run_checks
    tuner.run_checks = no_checks
    try:
        again = autotune.tune("tests.models:LoopState", **common)
    finally:
        tuner.run_checks = original
    assert again.search["n_run"] == 0 and again.plan_checks == report.plan_checks


def test_only_plans_that_fail_leave_checkpointing_off(tmp_path):
    report = autotune.tune("tests.models:LoopState", device="cpu", budget="64MiB", precisions="fp32", segments="all",
                           batch_sizes="1", measure_steps=1, storage=f"sqlite:///{tmp_path}/s.db", study="s", probe=False)
    assert report.search["space"]["segments"] == ["0"]
    assert any("no checkpoint plan passed its check" in n for n in report.notices)


def test_apply_refuses_a_plan_whose_check_failed_and_warns_without_checks(tmp_path, caplog):
    report = autotune.tune("autotune.examples:TinyGPT", model_kwargs={"n_layer": 2, "block_size": 8, "n_embd": 16,
                           "n_head": 2, "vocab_size": 32}, device="cpu", budget="64MiB", precisions="fp32",
                           segments="all", batch_sizes="2", measure_steps=1, storage=f"sqlite:///{tmp_path}/s.db",
                           study="s", probe=False)
    assert report.recommendation.segments == "all" and report.plan_checks[0].status == "exact"
    model = TinyGPT(n_layer=2, block_size=8, n_embd=16, n_head=2, vocab_size=32)
    assert autotune.apply(model, report).plan["recomputed_blocks"] == [0, 1]
    data = json.loads(report.to_json())
    data["plan_checks"][0]["status"] = "differs"
    with pytest.raises(autotune.UsageError, match="failed its check"):
        autotune.apply(TinyGPT(n_layer=2, block_size=8, n_embd=16, n_head=2, vocab_size=32), data)
    del data["plan_checks"]
    with caplog.at_level("WARNING", logger="autotune"):
        autotune.apply(TinyGPT(n_layer=2, block_size=8, n_embd=16, n_head=2, vocab_size=32), data)
    assert any("was not checked on this model" in r.message for r in caplog.records)
