import dataclasses
import json
import os
import subprocess
import sys

import pandas as pd
import pytest

import autotune
from tests.paths import DATA


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    storage = f"sqlite:///{tmp_path_factory.mktemp('r') / 't.db'}"
    return autotune.tune(
        "autotune.examples:TinyGPT", model_kwargs={"n_layer": 4, "block_size": 32, "n_embd": 32, "n_head": 4, "vocab_size": 64},
        device="cpu", budget="3MiB", precisions="fp32,bf16", segments="0,2", batch_sizes="1,4,64",
        strategy="grid", warmup_steps=2, measure_steps=2, storage=storage, study="r",
    )


def test_json_has_the_documented_fields(report, tmp_path):
    path = tmp_path / "out.json"
    report.to_json(path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 5
    assert {"torch_version", "device_name", "total_memory_bytes"} <= set(data["environment"])
    assert data["workload"]["model"] == "autotune.examples:TinyGPT" and data["workload"]["parameter_count"] > 0
    assert data["workload"]["chain"] == {"length": 4, "containers": ["transformer.h"], "block_types": ["Block"],
                                         "blocks": [f"transformer.h.{i}" for i in range(4)], "ordered_by": "forward"}
    assert [(c["plan"], c["status"], c["recomputed_blocks"]) for c in data["plan_checks"]] == [
        ("2", "exact", ["transformer.h.0", "transformer.h.1"])]
    assert data["search"]["space"]["segments"] == ["0", "2"] and data["search"]["space"]["blocks"] == 4
    assert data["budget_bytes"] == 3 * 2**20
    assert data["search"]["strategy"] == "grid" and data["search"]["n_trials"] == 12 and data["search"]["wall_s"] > 0
    for trial in data["trials"]:
        assert {"precision", "segments", "batch_size", "status", "peak_bytes", "step_s", "samples_per_s", "plan"} <= set(trial)
        if trial["status"] == "ok":
            assert trial["plan"] == {"name": trial["segments"], "chain_length": 4,
                                     "recomputed_blocks": [0, 1] if trial["segments"] == "2" else []}
    assert {t["status"] for t in data["trials"]} == {"ok", "oom"}
    for trial in (t for t in data["trials"] if t["status"] == "oom"):  # both figures, named for what they are
        assert trial["oom_held_bytes"] <= data["budget_bytes"] < trial["oom_needed_bytes"] == trial["peak_bytes"]
    assert {(r["precision"], r["segments"]) for r in data["limits"]} == {("fp32", "0"), ("fp32", "2"), ("bf16", "0"), ("bf16", "2")}
    assert all(r["max_batch_size"] == 4 for r in data["limits"])
    rec = data["recommendation"]
    assert rec["feasible"] and rec["peak_bytes"] <= 0.9 * data["budget_bytes"]
    assert rec in data["pareto"]
    assert json.loads(report.to_json()) == data


def test_report_round_trips_through_json(report, tmp_path):
    path = tmp_path / "r.json"
    report.to_json(path)
    back = autotune.load(path)
    assert back.recommendation == report.recommendation
    assert back.pareto == report.pareto and back.limits == report.limits


def test_dataframe_has_a_row_per_trial(report):
    df = report.to_dataframe()
    assert isinstance(df, pd.DataFrame) and len(df) == 12
    assert list(df.columns[:8]) == ["precision", "segments", "compile", "batch_size", "status", "peak_bytes", "step_s",
                                    "samples_per_s"]
    assert df["recommended"].sum() == 1 and df["pareto"].sum() == len(report.pareto)
    assert (df.loc[df.status == "oom", "feasible"] == False).all()  # noqa: E712


def test_table_names_the_recommendation(report):
    text = report.table()
    rec = report.recommendation
    assert f"recommendation: {rec.precision}, segments {rec.segments}, batch size {rec.batch_size}" in text
    assert text.count("\n") >= 12


def test_reports_of_schema_version_1_still_load_show_and_apply(tmp_path, caplog):
    """The committed quick-start report predates plan names: segments were numbers, the chain one container."""
    path = os.path.join(DATA, "quickstart-v1.json")
    with open(path) as f:
        assert json.load(f)["schema_version"] == 1
    old = autotune.load(path)
    assert old.search["space"]["segments"] == ["0", "2"] and old.search["space"]["blocks"] == 12
    assert {m.segments for m in old.trials} == {"0", "2"} and old.recommendation is not None
    assert json.loads(old.to_json())["schema_version"] == 5  # written again in today's terms
    assert {r["segments"] for r in old.memory_model.to_list()} == {"0", "2"}
    out = subprocess.run([sys.executable, "-m", "autotune", "show", path], capture_output=True, text=True)
    assert out.returncode == 0 and "recommendation: bf16, segments 0" in out.stdout
    from autotune.examples import TinyGPT

    trial = dataclasses.replace(old.recommendation, config=dataclasses.replace(old.recommendation.config, plan=2))
    with caplog.at_level("WARNING", logger="autotune"):
        run = autotune.apply(TinyGPT(), dataclasses.replace(old, trials=(trial,), probe=None))
    assert run.segments == "2" and run.plan["recomputed_blocks"] == list(range(6))
    assert any("was not checked on this model" in r.message for r in caplog.records)


def test_the_library_line_reads_a_memory_trial_without_a_speed(report):
    # The search's no-checkpointing trial at the recommended batch may be a memory trial: a peak, no samples/s
    # (CI found the table failing on it).
    row = {"status": "ok", "peak_bytes": 2 << 20, "step_s": 0.1, "samples_per_s": 80.0, "error": None}
    library = {"method": "gradient_checkpointing_enable", "precision": "fp32", "batch_size": 4, "library": row,
               "autotune": {"segments": "all", **row},
               "none": {**row, "step_s": None, "samples_per_s": None}}
    table = dataclasses.replace(report, library_checkpointing=library).table()
    assert "no checkpointing: peak 2.00 MiB (a memory trial: not timed)" in table


def test_the_table_says_which_limits_the_memory_line_implied(report):
    # Without fp32's trials at 64 (plan 2's failure there would imply plan 0's first), fp32/0's failing side is
    # implied by its own line through the measured state and its trial at 4 (its trial at 1 dropped too: at these
    # sizes the step's batch-independent temporaries bend the line more than the rule's 2% allow)
    assert report.line_rule is not None and report.line_rule.margin == 1.25
    dropped = [m for m in report.trials if (m.precision, m.batch_size) == ("fp32", 64) or
               (m.precision, m.segments, m.batch_size) == ("fp32", "0", 1)]
    assert len(dropped) == 3 and not any(m.fits(report.budget_bytes) for m in dropped if m.batch_size == 64)
    trimmed = dataclasses.replace(report, trials=tuple(m for m in report.trials if m not in dropped))
    row = next(r for r in trimmed.limits if (r["precision"], r["segments"]) == ("fp32", "0"))
    assert row["min_oom_batch_size"] == 64 and row["min_oom_rule"] == "memory-line" and row["bracketed"]
    assert row["min_oom_predicted_bytes"] >= 1.25 * report.budget_bytes
    assert ("end where the plan's own memory line (the measured state plus its trials' bytes per sample) predicts "
            "1.25x the budget or more at the next size (no trial of its own): fp32/0 at 64") in trimmed.table()


def test_when_nothing_fits_and_the_floor_would_the_advice_is_to_recompute_every_block():
    # The quick start under 16 MiB searched plans 0 and 2; batch 1 with every block recomputed needs 11.58 MiB, within
    # the 14.4 MiB the headroom leaves: the first thing to try is plan all, said with the figure.
    from autotune.cli.advice import nothing_fits
    from autotune.records import Config, Measurement
    from autotune.report import Report

    MiB = 2**20
    trials = (Measurement(Config("fp32", "2", 1), "oom", peak_bytes=int(16.03 * MiB)),)
    report = Report(environment={"device_type": "cpu"}, budget_bytes=16 * MiB, headroom=0.1,
                    workload={"fixed_bytes": int(9.81 * MiB), "chain": {"blocks": ["b0", "b1"]},
                              "floor": {"activations": int(1.77 * MiB), "precision": "bf16"}},
                    search={"space": {"precisions": ["fp32", "bf16"], "segments": ["0", "2"], "batch_sizes": [1, 2]}},
                    trials=trials)
    said = nothing_fits(report.shortfall())
    assert said.index("try --segments all (batch 1 with every block recomputed needs about 11.58 MiB") > 0
    assert "--precisions with bf16 or fp16" not in said  # bf16 was searched
    # the state (9.81 MiB) is over half of the 14.4 MiB: bf16-true, which halves it, was not searched
    assert "--precisions bf16-true (the weights, gradients and optimizer state in bf16: half the state" in said
    searched = dataclasses.replace(report, search={"space": {**report.search["space"], "precisions": ["bf16-true"]}},
                                   workload={**report.workload, "state_by_precision": {"bf16-true": {
                                       "weights": 1, "gradients": 1, "optimizer_state": int(4.9 * MiB)}}})
    assert "bf16-true" not in nothing_fits(searched.shortfall()) and searched.shortfall().state_bytes == int(4.9 * MiB) + 2
    with_all = dataclasses.replace(report, search={"space": {**report.search["space"], "segments": ["0", "all"]}})
    assert "--segments all" not in nothing_fits(with_all.shortfall())


def test_a_result_file_is_written_whole_or_left_as_it_was(tmp_path):
    from autotune.report.files import write_atomically

    path = tmp_path / "r.json"
    write_atomically(path, "first")
    with pytest.raises(TypeError):
        write_atomically(path, 42)  # the write fails: the file is the old one, and no temporary file is left
    assert path.read_text() == "first" and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_the_table_and_the_frame_hold_every_trial_of_a_report():
    from autotune.report.frame import TABLE_COLUMNS, to_dataframe
    from autotune.report.table import render

    report = autotune.load(os.path.join(DATA, "quickstart-v1.json"))
    frame = to_dataframe(report)
    assert list(frame.columns[:len(TABLE_COLUMNS)]) == TABLE_COLUMNS and len(frame) == len(report.trials)
    assert frame["recommended"].sum() == 1 and frame[frame["recommended"]].iloc[0]["batch_size"] == report.recommendation.batch_size
    rows = [line for line in render(report).splitlines() if line.startswith(("fp32 ", "bf16 ", "fp16 "))]
    assert len(rows) == len(report.trials)
