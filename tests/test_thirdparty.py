"""Hugging Face and timm models built offline from a config: chains, plans, tuning, library checkpointing."""

import json

import pytest
import torch

import autotune
from autotune.plans.checkpointing import apply_plan, find_chain
from autotune.errors import UsageError
from autotune.meters import TensorMeter
from autotune.thirdparty import library_checkpointing
from autotune.training.workload import Workload

from tests.optional import needs

GPT2 = {"n_layer": 4, "n_embd": 64, "n_head": 4, "n_positions": 64, "vocab_size": 256}
BERT = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        "max_position_embeddings": 64, "vocab_size": 256, "seq_len": 64}
VIT = {"name": "vit_tiny_patch16_224", "img_size": 32, "patch_size": 4, "depth": 4, "embed_dim": 64, "num_heads": 2,
       "num_classes": 10}
MODELS = {
    # spec, kwargs, the chain autotune must find, the package it needs
    "gpt2": ("autotune.thirdparty:gpt2", GPT2, ("transformer.h", "GPT2Block"), "transformers"),
    "bert": ("autotune.thirdparty:bert", BERT, ("bert.encoder.layer", "BertLayer"), "transformers"),
    "vit": ("autotune.thirdparty:timm_model", VIT, ("blocks", "Block"), "timm"),
}


def _step(workload, segments, batch_size, *, library=False):
    """One training step of a fresh, seeded model: (gradients, peak bytes, loss)."""
    torch.manual_seed(0)
    model = workload.build_model()
    if library:
        assert library_checkpointing(model) is not None
    else:
        apply_plan(model, segments)
    torch.manual_seed(1)
    batch = workload.make_batch(model, batch_size)
    with TensorMeter().measure() as h:
        h.track(model.parameters())
        loss = workload.loss(model, batch)
        loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return grads, h.reading.peak_bytes, loss.item()


@pytest.mark.parametrize("name", list(MODELS))
def test_plans_on_third_party_models_keep_gradients_and_lower_the_peak(name):
    spec, kwargs, (path, block), package = MODELS[name]
    needs(package)
    workload = Workload.from_specs(spec, model_kwargs=kwargs)
    chain = find_chain(workload.build_model())
    assert (chain.containers, chain.block_types, chain.length) == ((path,), (block,), 4)
    grads, peak, loss = _step(workload, "0", 8)
    peaks = {}
    for plan in ("2", "4", "all"):
        g, peaks[plan], l = _step(workload, plan, 8)
        assert l == loss and torch.equal(g, grads)  # bitwise: dropout masks are replayed in the recompute
    assert peaks["all"] <= peaks["4"] < peaks["2"] < peak  # on a ViT the last block's recompute saves nothing more
    g, library_peak, _ = _step(workload, "0", 8, library=True)
    torch.testing.assert_close(g, grads, rtol=1e-4, atol=1e-6)
    assert peaks["all"] <= library_peak < peak  # autotune's lowest-memory plan is at or below the library's switch


@pytest.mark.parametrize("name", ["gpt2", "vit"])
def test_third_party_model_tuned_under_a_budget(tmp_path, name):
    spec, kwargs, _, package = MODELS[name]
    needs(package)
    # The budget lets plan 4 fit batches that no checkpointing cannot.
    budget = {"gpt2": "40MiB", "vit": "20MiB"}[name]
    report = autotune.tune(spec, model_kwargs=kwargs, device="cpu", budget=budget, precisions="fp32,bf16",
                           segments="0,2,4", batch_sizes="1..64", measure_steps=2, probe=False,
                           storage=f"sqlite:///{tmp_path}/t.db", study="t")
    rec = report.recommendation
    assert rec is not None and rec.fits(report.budget_bytes * (1 - report.headroom))
    limits = {(r["precision"], r["segments"]): r["max_batch_size"] for r in report.limits}
    for precision in ("fp32", "bf16"):
        assert limits[(precision, "4")] > limits[(precision, "0")]  # checkpointing lowers the peak enough for more
    lib = report.library_checkpointing
    assert lib["method"] in ("activation_checkpointing_enable", "gradient_checkpointing_enable", "set_grad_checkpointing")
    assert (lib["precision"], lib["batch_size"]) == (rec.precision, rec.batch_size)
    assert lib["autotune"]["segments"] == "all" and lib["library"]["status"] == "ok"
    if lib["autotune"]["status"] == "ok":
        assert lib["autotune"]["peak_bytes"] <= lib["library"]["peak_bytes"]
    if lib["none"] is not None and lib["none"]["status"] == "ok":
        assert lib["library"]["peak_bytes"] < lib["none"]["peak_bytes"]
    assert "library checkpointing at" in report.table()
    again = autotune.load(report.to_json(tmp_path / "r.json") and tmp_path / "r.json")
    assert again.library_checkpointing == lib
    assert json.loads(report.to_json())["workload"]["library_checkpointing"] == lib["method"]


def test_a_model_without_a_library_switch_gets_no_comparison(tmp_path):
    report = autotune.tune("autotune.examples:TinyGPT", model_kwargs={"n_layer": 2, "block_size": 16, "n_embd": 16,
                                                                      "n_head": 2, "vocab_size": 32},
                           device="cpu", budget="64MiB", precisions="fp32", segments="0,2", batch_sizes="1,2",
                           measure_steps=1, probe=False, storage=f"sqlite:///{tmp_path}/n.db", study="n")
    assert report.library_checkpointing is None and report.workload["library_checkpointing"] is None


def test_bad_third_party_configs_are_one_line_usage_errors():
    needs("transformers")
    with pytest.raises(UsageError, match="seq_len 128 is longer than the model's 64 positions"):
        Workload.from_specs("autotune.thirdparty:gpt2", model_kwargs={**GPT2, "seq_len": 128}).build_model()
    with pytest.raises(UsageError, match="transformers: Unrecognized model identifier"):
        Workload.from_specs("autotune.thirdparty:hf_causal_lm", model_kwargs={"model_type": "no-such-model"}).build_model()


def test_a_comparison_that_fails_is_a_notice_and_the_report_is_kept(tmp_path, monkeypatch):
    needs("transformers")

    def failing(target, workload, config):
        raise RuntimeError("the library's switch broke")

    monkeypatch.setattr("autotune.tuner.compare_library_trial", failing)
    report = autotune.tune("autotune.thirdparty:gpt2", model_kwargs=GPT2, device="cpu", budget="40MiB", precisions="fp32",
                           segments="0,all", batch_sizes="1,2", measure_steps=1, probe=False, eval_limits=False,
                           storage=f"sqlite:///{tmp_path}/f.db", study="f")
    assert report.recommendation is not None and report.library_checkpointing is None
    assert any("could not be made (RuntimeError: the library's switch broke)" in n for n in report.notices)


def test_the_library_switch_survives_a_rebuild_from_the_spec_in_a_worker():
    needs("transformers")
    from autotune.execution import spawn as isolation
    from autotune.execution.trial import TrialWork
    from autotune.records import Config, TrialSettings

    spec = Workload.from_specs("autotune.thirdparty:gpt2", model_kwargs=GPT2).spec
    lib = Workload.from_specs(**{**spec, "library_checkpointing": True})
    settings = TrialSettings(measure_steps=1)
    here = autotune.run_trial(lib, Config("fp32", "0", 4), device="cpu", meter=TensorMeter(budget_bytes=2**30), settings=settings)
    there = isolation.Spawned("cpu").run(lib, TrialWork(Config("fp32", "0", 4), settings, 2**30))
    plain = autotune.run_trial(Workload.from_specs(**spec), Config("fp32", "0", 4), device="cpu",
                               meter=TensorMeter(budget_bytes=2**30), settings=settings)
    assert there.status == "ok" and there.peak_bytes == here.peak_bytes < plain.peak_bytes


def test_a_masked_lm_batch_has_a_target_in_every_row():
    needs("transformers")
    w = Workload.from_specs("autotune.thirdparty:bert", model_kwargs={**BERT, "seq_len": 4, "mask_share": 0.01})
    batch = w.make_batch(w.build_model(), 64)
    assert ((batch["labels"] != -100).sum(dim=1) >= 1).all()
    assert (batch["input_ids"][batch["labels"] != -100] == 0).all()  # what is predicted is masked


LORA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 128, "max_position_embeddings": 32, "r": 4}


def test_a_lora_model_is_tuned_applied_and_exported_as_it_is(tmp_path):
    """hf_lora's PeftModel, searched as it is: its blocks inside PEFT's wrappers, plan all checked exact, the state
    its adapter's, the report's recommendation applied to a fresh build (the plan on its blocks, only the adapter
    trained) and exported with the note that the adapter is the model's."""
    needs("transformers")
    needs("peft")
    from autotune.export import export
    from autotune.units import format_bytes

    report = autotune.tune("autotune.thirdparty:hf_lora", model_kwargs=LORA, device="cpu", budget="64MiB",
                           precisions="fp32", segments="all", batch_sizes="2,4", measure_steps=1, probe=False,
                           storage=f"sqlite:///{tmp_path}/l.db", study="l")
    model = Workload.from_specs("autotune.thirdparty:hf_lora", model_kwargs=LORA).build_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    trained = sum(p.numel() * 4 for p in trainable)
    workload = report.workload
    assert workload["model_class"] == "PeftModelForCausalLM"
    assert workload["chain"]["containers"] == ["base_model.model.model.layers"] and workload["chain"]["length"] == 2
    assert workload["trainable_parameter_count"] == sum(p.numel() for p in trainable) == 2 * 2 * 2 * 4 * 64
    assert 2 * trained <= workload["optimizer"]["state_bytes"] < 2 * trained + 4096  # AdamW's moments of the adapter
    assert workload["fixed_bytes"] == workload["parameter_bytes"] + trained + workload["optimizer"]["state_bytes"]
    assert [(c.plan, c.status) for c in report.plan_checks] == [("all", "exact")]
    assert {m.status for m in report.trials} == {"ok"} and report.recommendation is not None
    assert report.library_checkpointing["library"]["status"] == "ok"  # transformers' switch, through PEFT's wrappers
    assert f"gradients of {format_bytes(trained)}" in report.table()

    run = autotune.apply(model, report)
    assert run.plan["recomputed_blocks"] == [0, 1]
    batch = model.example_batch(run.micro_batch_size)
    run.backward(model(**batch).loss)
    assert {id(p) for p in model.parameters() if p.grad is not None} == {id(p) for p in trainable}
    note = next(n for n in export(report, "hf")["notes"] if "parameters (the rest frozen" in n)
    assert f"trains {workload['trainable_parameter_count']:,} of its {workload['parameter_count']:,}" in note


def test_a_lora_model_without_peft_or_with_targets_it_lacks_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    import sys

    from autotune.__main__ import main

    needs("transformers")
    needs("peft")
    args = ["--model", "autotune.thirdparty:hf_lora", "--device", "cpu", "--budget", "64MiB", "--quiet",
            "--storage", f"sqlite:///{tmp_path}/s.db", "--out", str(tmp_path / "o.json")]

    def said(kwargs: dict) -> str:
        assert main([*args, "--model-kwargs", json.dumps(kwargs)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        return err.strip()

    assert "peft: Target modules {'c_attn'} not found in the base model" in said({**LORA, "target_modules": ["c_attn"]})
    monkeypatch.setitem(sys.modules, "peft", None)  # as where peft is not installed
    assert "this model needs peft (" in said(LORA) and said(LORA).endswith(
        "pip install peft (autotune's extra 'peft' brings it)")
    assert not (tmp_path / "o.json").exists()
