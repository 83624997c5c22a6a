"""The issue's acceptance run, scaled down: the bundled examples through the whole pipeline on CPU."""

import pytest

import autotune

CASES = {
    "TinyGPT": ("autotune.examples:TinyGPT", {"n_layer": 4, "block_size": 64, "n_embd": 32, "n_head": 4, "vocab_size": 64}, "40MiB"),
    "ResNetish": ("autotune.examples:ResNetish", {"depth": 4, "channels": 16, "image_size": 16}, "16MiB"),
}


@pytest.mark.parametrize("name", CASES)
def test_bf16_and_checkpointing_fit_larger_batches(name, tmp_path):
    model, kwargs, budget = CASES[name]
    report = autotune.tune(model, model_kwargs=kwargs, device="cpu", budget=budget, precisions="fp32,bf16",
                           segments="0,2", batch_sizes="1..64", strategy="grid", warmup_steps=2, measure_steps=2,
                           storage=f"sqlite:///{tmp_path}/e2e.db", study=name)
    statuses = {(m.precision, m.segments, m.batch_size): m.status for m in report.trials}
    assert statuses[("fp32", "0", 64)] == "oom"  # some OOM at large batches
    assert statuses[("fp32", "0", 1)] == "ok"
    rec = report.recommendation
    assert rec is not None and rec.peak_bytes <= report.budget_bytes * 0.9
    limits = {(r["precision"], r["segments"]): r["max_batch_size"] for r in report.limits}
    assert limits[("fp32", "2")] > limits[("fp32", "0")]
    assert limits[("bf16", "0")] > limits[("fp32", "0")]
    assert rec.config in {m.config for m in report.pareto}

    # The default strategy finds the same limits, exact: between the grid's sizes (or above its top), the largest
    # batch that fits and the next, with fewer trials.
    auto = autotune.tune(model, model_kwargs=kwargs, device="cpu", budget=budget, precisions="fp32,bf16",
                         segments="0,2", batch_sizes="1..64", warmup_steps=2, measure_steps=2,
                         storage=f"sqlite:///{tmp_path}/auto.db", study=name)
    assert auto.search["strategy"] == "auto"
    exact = {(r["precision"], r["segments"]): r["max_batch_size"] for r in auto.limits}
    assert {v: max(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= exact[v]) for v in exact} == limits
    assert all(r["bracketed"] and r["exact"] for r in auto.limits if r["max_batch_size"] < 64)
    assert len(auto.trials) <= len(report.trials) // 2
    assert auto.recommendation is not None and auto.recommendation.peak_bytes <= auto.budget_bytes * 0.9
    model_rows = auto.to_dict()["memory_model"]
    assert {(r["precision"], r["segments"]) for r in model_rows} == set(limits)
    fitted = [r for r in model_rows if r["points"] >= 2]
    assert fitted and all(r["per_sample_bytes"] > 0 and r["max_relative_error"] < 0.1 for r in fitted)


def test_model_without_a_chain_gets_segments_0_with_a_notice(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="autotune"):
        report = autotune.tune("tests.models:NoChain", device="cpu", budget="8MiB", precisions="fp32",
                               batch_sizes="1,2", measure_steps=1, storage=f"sqlite:///{tmp_path}/n.db", study="n")
    assert report.search["space"]["segments"] == ["0"]
    assert any("no repeated blocks" in n for n in report.notices)
    assert sum("no repeated blocks" in r.message for r in caplog.records) == 1


def test_data_flag_feeds_trials_from_a_dataset(tmp_path):
    report = autotune.tune("tests.models:NoLoss", data="tests.models:pair_dataset", loss="torch.nn.functional:cross_entropy",
                           device="cpu", budget="8MiB", precisions="fp32,bf16", batch_sizes="4,8", measure_steps=2,
                           storage=f"sqlite:///{tmp_path}/d.db", study="d")
    assert {m.status for m in report.trials} == {"ok"}
    assert report.workload["data"] == "tests.models:pair_dataset"
