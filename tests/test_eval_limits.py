"""The evaluation batch: eval_limits found after the search, held against real evaluation passes on the CPU meter.

One small search (TinyGPT on its token data, evaluated on long-tailed sequences) serves most tests: each limit's
pass fits the budget less headroom and the next size's does not, measured; the predictions equal the measurements;
the exports, ``autotune.apply`` and the table carry them. The plan's indifference and the resident state are held
on their own.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import autotune
from autotune.eval_limits import EVAL_TOP_FACTOR, NOT_SIZED
from autotune.examples import ResNetish, TinyGPT, token_dataset, variable_token_loader
from autotune.execution.eval_pass import predict_eval, run_eval
from autotune.export import export
from autotune.meters import TensorMeter
from autotune.records import Config, usable_bytes
from autotune.training.evaluation import EvalKind, eval_workload, EvalData
from autotune.training.workload import Workload
from autotune.vocabulary import Status

TINY = {"n_layer": 2, "block_size": 32, "n_embd": 32, "n_head": 4, "vocab_size": 64}
BUDGET = "8MiB"


def tokens():
    return token_dataset(size=512, block_size=32, vocab_size=64)


def long_tailed():
    return variable_token_loader(size=512, block_size=32, vocab_size=64)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> autotune.Report:
    storage = f"sqlite:///{tmp_path_factory.mktemp('eval')}/s.db"
    return autotune.tune("autotune.examples:TinyGPT", model_kwargs=TINY, data=tokens, eval_data=long_tailed,
                         device="cpu", budget=BUDGET, precisions="fp32,bf16", segments="0,all", batch_sizes="1..16",
                         probe=False, compare_library=False, storage=storage, study="eval")


def evaluation() -> Workload:
    return eval_workload(Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=TINY, data=tokens),
                         EvalData.load(long_tailed))


def test_every_precision_and_plan_has_both_limits_and_the_recommendation_is_measured(report):
    assert [(r["precision"], r["segments"]) for r in report.eval_limits] == [
        ("fp32", "0"), ("fp32", "all"), ("bf16", "0"), ("bf16", "all")]
    rec = report.recommendation
    for row in report.eval_limits:
        measured = (row["precision"], row["segments"]) == (rec.precision, rec.config.plan)
        assert row["source"] == ("measured" if measured else "predicted")
        training = next(r["max_batch_size"] for r in report.limits
                        if (r["precision"], r["segments"]) == (row["precision"], row["segments"]))
        # no gradients and no activations kept for a backward: evaluation fits more than training; alone, more still
        assert training < row["during_training_max_batch_size"] <= row["inference_max_batch_size"]
        assert not row["during_training"]["at_top"] and row["during_training"]["error"] is None
    summary = report.search["eval_limits"]
    assert summary["data"] == "--eval-data" and summary["measured"] == [f"{rec.precision}/{rec.config.plan}"]
    assert summary["top_batch_size"] == 512 < EVAL_TOP_FACTOR * 16  # the evaluation data's 512 items (below 64 x 16)
    assert summary["not_sized"] == NOT_SIZED and "generate" in NOT_SIZED


def test_each_limits_pass_fits_and_the_next_sizes_does_not_measured(report):
    """Real passes on the CPU meter, for every row (the predicted ones too): at the limit within the budget less
    headroom, at the next size over it; a predicted limit's peak is the measured one, to the byte."""
    workload = evaluation()
    usable = usable_bytes(report.budget_bytes, report.headroom)
    for row in report.eval_limits:
        for kind in EvalKind:
            limit = row[f"{kind}_max_batch_size"]
            at, above = (run_eval(workload, Config(row["precision"], row["segments"], b), kind, device="cpu",
                                  meter=TensorMeter()) for b in (limit, limit + 1))
            assert at.status is Status.OK and at.peak_bytes <= usable < above.peak_bytes, (row, kind)
            assert at.peak_bytes == row[str(kind)]["peak_bytes"]
            assert above.peak_bytes == row[str(kind)]["next_peak_bytes"] or row["source"] == "measured"  # its oom: a bound


def test_the_plan_changes_no_pass_without_gradients_and_the_prediction_is_the_measurement():
    """One precision's limits hold for every plan (found on one plan's model): each plan's pass holds the same bytes,
    measured and predicted alike, on TinyGPT and on ResNetish (BatchNorm in eval mode)."""
    cases = [(evaluation(), ("0", "2", "every2", "all", "sac-linear", "2+offload"), 24),
             (Workload.from_specs(ResNetish, model_kwargs={"depth": 3, "channels": 16, "image_size": 16}),
              ("0", "2", "all", "all+offload"), 8)]
    for workload, plans, batch in cases:
        for precision in ("fp32", "bf16"):
            for kind in EvalKind:
                peaks = set()
                for plan in plans:
                    config = Config(precision, plan, batch)
                    measured = run_eval(workload, config, kind, device="cpu", meter=TensorMeter())
                    predicted = predict_eval(workload, config, kind)
                    assert predicted.memory_source == "predicted" and measured.status is Status.OK
                    peaks |= {measured.peak_bytes, predicted.peak_bytes}
                assert len(peaks) == 1, (workload.name, precision, kind, peaks)


def test_the_training_state_held_is_weights_and_optimizer_state_and_no_gradients(report):
    workload = evaluation()
    config = Config("fp32", "0", 8)
    during, alone = (run_eval(workload, config, kind, device="cpu", meter=TensorMeter()) for kind in EvalKind)
    assert during.peak_bytes - alone.peak_bytes == report.workload["optimizer"]["state_bytes"]


def test_the_exports_apply_and_the_table_carry_the_recommendations_evaluation_batch(report, tmp_path):
    rec = report.recommendation
    row = report.eval_limit(rec.precision, rec.config.plan)
    size = row["during_training_max_batch_size"]
    assert export(report, "hf")["training_arguments"]["per_device_eval_batch_size"] == size
    assert export(report, "lightning")["val_batch_size"] == size
    assert export(report, "accelerate")["eval_batch_size"] == size
    assert any(f"evaluation batch (no config key: the evaluation DataLoader's batch_size) {size}" in note
               for note in export(report, "deepspeed")["notes"])
    assert any("eval_accumulation_steps" in note for note in export(report, "hf")["notes"])
    path = tmp_path / "r.json"
    report.to_json(path)
    for source in (report, autotune.load(path), json.loads(path.read_text())):
        run = autotune.apply(TinyGPT(**TINY), source)
        assert (run.eval_batch_size, run.inference_batch_size) == (size, row["inference_max_batch_size"])
    assert "largest evaluation batch" in report.table() and f"{size} / {row['inference_max_batch_size']}" in report.table()


def test_a_dry_run_predicts_the_same_limits_and_none_are_looked_for_when_asked_not_to(report, tmp_path):
    common = dict(model_kwargs=TINY, data=tokens, eval_data=long_tailed, device="cpu", budget=BUDGET,
                  precisions="fp32,bf16", segments="0,all", batch_sizes="1..16", probe=False, compare_library=False,
                  storage=f"sqlite:///{tmp_path}/s.db")
    dry = autotune.tune("autotune.examples:TinyGPT", dry_run=True, **common)
    assert {r["source"] for r in dry.eval_limits} == {"predicted"}
    limits = ("during_training_max_batch_size", "inference_max_batch_size")
    assert [[r[k] for k in limits] for r in dry.eval_limits] == [[r[k] for k in limits] for r in report.eval_limits]
    without = autotune.tune("autotune.examples:TinyGPT", dry_run=True, eval_limits=False, **common)
    assert without.eval_limits is None and "eval_limits" not in without.to_dict()
    older = dataclasses.replace(report, eval_limits=None)  # as a search with --no-eval-limits writes it
    assert "per_device_eval_batch_size" not in export(older, "hf")["training_arguments"]
    assert autotune.apply(TinyGPT(**TINY), older).eval_batch_size is None


def test_a_report_reads_back_with_its_evaluation_limits(report):
    again = autotune.Report.from_dict(json.loads(report.to_json()))
    assert again.eval_limits == report.eval_limits and again.table() == report.table()
    older = {k: v for k, v in report.to_dict().items() if k != "eval_limits"}  # a report from before them
    assert autotune.Report.from_dict(older).eval_limits is None
    assert dataclasses.replace(report, eval_limits=None).eval_limit("fp32", "0") is None
