"""Framework exports, checked by building each framework's own object from them where it is installed.

The reports are the committed CPU quickstart report and variants of it (another precision, checkpoint
segments, a target batch size), so no model runs. On a machine without a GPU some frameworks refuse
or rewrite a 16-bit setting; those tests assert the framework's known behaviour there.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os

import pytest
import torch

import autotune
from autotune.errors import UsageError
from autotune.export import FRAMEWORKS, export, parse_frameworks, write_exports
from autotune.training.precision import INIT_LOSS_SCALE

from tests.optional import needs
from tests.paths import DATA

# The quick start's report from before plan names (schema version 1): exports read old reports too.
QUICKSTART = os.path.join(DATA, "quickstart-v1.json")
HAS_GPU = torch.cuda.is_available()

# (precision, segments, target batch size): the quickstart recommendation is bf16, segments 0, batch 16
VARIANTS = [("fp32", "0", None), ("fp16", "0", 64), ("bf16", "0", None), ("bf16", "3", 40), ("fp16", "12", None),
            ("fp32", "all", None), ("bf16", "every4", None)]
VARIANT_IDS = [f"{p}-s{s}-t{t}" for p, s, t in VARIANTS]


@pytest.fixture(scope="module")
def quickstart() -> autotune.Report:
    return autotune.load(QUICKSTART)


def variant(report: autotune.Report, precision: str, segments: str, target: int | None = None,
            **guard: object) -> autotune.Report:
    """The report with its recommended trial alone, as ``precision`` and ``segments``, planned for ``target``."""
    rec = report.recommendation
    trial = dataclasses.replace(rec, config=dataclasses.replace(rec.config, precision=precision, plan=segments))
    return dataclasses.replace(report, trials=(trial,), probe=None, target_batch_size=target,
                               guard=dataclasses.replace(report.guard, **guard))


def steps_of(report: autotune.Report) -> int:
    return report.accumulation["accumulation_steps"] if report.accumulation else 1


def test_quickstart_export_is_json_safe_and_carries_the_recommendation(quickstart):
    for framework in FRAMEWORKS:
        data = export(quickstart, framework)
        assert json.loads(json.dumps(data, allow_nan=False)) == data
        assert data["framework"] == framework
        assert data["autotune_recommendation"] == {"precision": "bf16", "segments": "0", "batch_size": 16,
                                                   "compile": "none"}
        assert data["notes"] and all(isinstance(n, str) for n in data["notes"])
        assert any("ran on a CPU" in n for n in data["notes"])  # bf16 measured on a CPU
        assert not any("checkpoint plan" in n for n in data["notes"])  # nothing to checkpoint


def test_plan_sets_accumulation_everywhere(quickstart):
    report = variant(quickstart, "fp32", "0", target=64)  # micro 16 -> 4 steps
    assert report.accumulation["accumulation_steps"] == 4
    assert export(report, "hf")["training_arguments"]["gradient_accumulation_steps"] == 4
    assert export(report, "lightning")["trainer"]["accumulate_grad_batches"] == 4
    assert export(report, "deepspeed")["config"]["gradient_accumulation_steps"] == 4
    assert export(report, "accelerate")["accelerator"]["gradient_accumulation_steps"] == 4
    assert report.accumulation["lr_note"] in export(report, "hf")["notes"]


def test_checkpoint_notes_say_what_each_framework_does_instead(quickstart):
    report = variant(quickstart, "fp32", "3")
    hf = export(report, "hf")
    assert hf["training_arguments"]["gradient_checkpointing"] is True
    assert hf["training_arguments"]["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    plan = "checkpoint plan 3 (3 segments over the 12 blocks of transformer.h, the last not recomputed)"
    assert any(plan in n and "every layer" in n for n in hf["notes"])
    for framework in ("lightning", "deepspeed", "accelerate"):
        notes = " ".join(export(report, framework)["notes"])
        assert "no setting for gradient checkpointing" in notes and "autotune.apply(model, report)" in notes
    assert "deepspeed.checkpointing.checkpoint" in " ".join(export(report, "deepspeed")["notes"])
    # segments 1 recomputes nothing: nothing to switch on
    one = export(variant(quickstart, "fp32", "1"), "hf")
    assert one["training_arguments"]["gradient_checkpointing"] is False
    assert any("segments 1 recomputes nothing" in n for n in one["notes"])


def test_hf_expresses_all_and_every_n_exactly(quickstart):
    every = export(variant(quickstart, "fp32", "every4"), "hf")
    assert every["training_arguments"]["gradient_checkpointing"] is True
    assert every["training_arguments"]["gradient_checkpointing_kwargs"] == {"use_reentrant": False, "every_n_layers": 4}
    assert not any("every layer" in n for n in every["notes"]) and any("5.24" in n for n in every["notes"])
    every_one = export(variant(quickstart, "fp32", "all"), "hf")
    assert every_one["training_arguments"]["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert not any("every layer" in n or "every_n_layers" in n for n in every_one["notes"])


def test_the_cited_apply_call_matches_its_signature():
    params = list(inspect.signature(autotune.apply).parameters.values())
    assert [p.name for p in params[:2]] == ["model", "recommendation"]
    assert all(p.kind is p.KEYWORD_ONLY for p in params[2:])


def test_guard_rails_are_exported_or_noted(quickstart):
    report = variant(quickstart, "fp16", "0", clip_grad_norm=1.0, fp32_modules=("lm_head",))
    assert export(report, "hf")["training_arguments"]["max_grad_norm"] == 1.0
    assert export(report, "lightning")["trainer"]["gradient_clip_val"] == 1.0
    assert export(report, "deepspeed")["config"]["gradient_clipping"] == 1.0
    assert any("clip_grad_norm_" in n for n in export(report, "accelerate")["notes"])
    assert all(any("lm_head" in n for n in export(report, f)["notes"]) for f in FRAMEWORKS)


# --- each framework's own object, built from the export -------------------------------------------------------------


# transformers 5 renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs) and warns on the old
# names; the export keeps the old ones, which every release up to v6 accepts (the export's notes say so).
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
@pytest.mark.parametrize("precision,segments,target", VARIANTS, ids=VARIANT_IDS)
def test_hf_training_arguments(quickstart, tmp_path, precision, segments, target):
    transformers = needs("transformers", "the hf extra")
    report = variant(quickstart, precision, segments, target)
    kwargs = export(report, "hf")["training_arguments"]
    if precision == "bf16" and not HAS_GPU:
        # without a GPU, TrainingArguments refuses bf16 unless told to train on the CPU (the export's note)
        with pytest.raises(ValueError, match="doesn't support bf16/gpu.*use_cpu"):
            transformers.TrainingArguments(output_dir=str(tmp_path), **kwargs)
        assert any("use_cpu=True" in n for n in export(report, "hf")["notes"])
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=not HAS_GPU, **kwargs)
    assert {k: getattr(args, k) for k in kwargs} == kwargs
    assert args.per_device_train_batch_size == 16 and args.gradient_accumulation_steps == steps_of(report)
    assert (args.fp16, args.bf16) == (precision == "fp16", precision == "bf16")
    assert args.gradient_checkpointing is (segments not in ("0", "1"))


@pytest.mark.parametrize("precision,segments,target", VARIANTS, ids=VARIANT_IDS)
def test_lightning_trainer(quickstart, precision, segments, target):
    needs("lightning", "the frameworks extra")
    from lightning.pytorch import Trainer

    report = variant(quickstart, precision, segments, target)
    data = export(report, "lightning")

    def build() -> Trainer:
        return Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **data["trainer"])

    if precision == "fp16":
        # Lightning has no fp16 autocast on a CPU: it warns and trains in bf16 (the export's note)
        with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU"):
            trainer = build()
        assert trainer.precision == "bf16-mixed"
        assert any("'bf16-mixed'" in n for n in data["notes"])
    else:
        trainer = build()
        assert trainer.precision == data["trainer"]["precision"]
    assert trainer.accumulate_grad_batches == steps_of(report)
    assert data["batch_size"] == 16


@pytest.mark.parametrize("precision,segments,target", VARIANTS, ids=VARIANT_IDS)
def test_deepspeed_config(quickstart, precision, segments, target):
    needs("deepspeed", "the frameworks extra")
    from deepspeed.runtime.config import DeepSpeedConfig

    report = variant(quickstart, precision, segments, target)
    config = DeepSpeedConfig(export(report, "deepspeed")["config"])
    assert config.train_micro_batch_size_per_gpu == 16
    assert config.gradient_accumulation_steps == steps_of(report)
    assert config.train_batch_size == 16 * steps_of(report)  # one process: world size 1
    assert (config.float16_config.enabled, config.bfloat16_config.enabled) == (precision == "fp16", precision == "bf16")
    if precision == "fp16":  # dynamic loss scaling as autotune's GradScaler does it
        scaler = autotune.training.precision.get_mode("fp16").grad_scaler("cpu")
        fp16 = config.float16_config
        assert fp16.loss_scale == 0 and fp16.initial_dynamic_scale() == INIT_LOSS_SCALE
        assert fp16.loss_scale_window == scaler.get_growth_interval() == 2000
        assert fp16.hysteresis == 1


@pytest.fixture
def fresh_accelerate():
    """accelerate keeps its state in process-wide singletons: reset them around each test."""
    state = needs("accelerate.state", "the frameworks extra")
    state.AcceleratorState._reset_state(True)
    state.GradientState._reset_state()
    yield
    state.AcceleratorState._reset_state(True)
    state.GradientState._reset_state()


@pytest.mark.parametrize("precision,segments,target", VARIANTS, ids=VARIANT_IDS)
def test_accelerate_accelerator(quickstart, fresh_accelerate, precision, segments, target):
    from accelerate import Accelerator

    report = variant(quickstart, precision, segments, target)
    data = export(report, "accelerate")
    accelerator = Accelerator(**data["accelerator"])
    assert accelerator.mixed_precision == {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}[precision]
    assert accelerator.gradient_accumulation_steps == steps_of(report)
    assert data["batch_size"] == 16
    x = torch.ones(2, 2, device=accelerator.device)
    with accelerator.autocast():
        dtype = (x @ x).dtype
    if precision == "fp16" and accelerator.device.type == "cpu":
        # accepted, but on a CPU accelerate neither autocasts to fp16 nor makes a GradScaler (the export's note)
        assert (dtype, accelerator.scaler) == (torch.float32, None)
        assert any("trains in fp32" in n for n in data["notes"])
    else:
        assert dtype == {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]


# --- files and errors -----------------------------------------------------------------------------------------------


def test_write_exports_next_to_the_report(quickstart, tmp_path):
    json_path = tmp_path / "quickstart-cpu.json"
    paths = write_exports(quickstart, json_path, "hf,deepspeed")
    assert paths == [str(tmp_path / "quickstart-cpu.hf.json"), str(tmp_path / "quickstart-cpu.deepspeed.json")]
    for path, framework in zip(paths, ("hf", "deepspeed")):
        with open(path) as f:
            assert json.load(f) == export(quickstart, framework)
    assert write_exports(quickstart, str(json_path), ["lightning", "accelerate"]) == [
        str(tmp_path / "quickstart-cpu.lightning.json"), str(tmp_path / "quickstart-cpu.accelerate.json")]


def test_parse_frameworks():
    assert parse_frameworks("hf,lightning") == ("hf", "lightning")
    assert parse_frameworks(["deepspeed", "hf, accelerate", "hf"]) == ("deepspeed", "hf", "accelerate")
    valid = "choose from hf, lightning, deepspeed, accelerate$"
    with pytest.raises(UsageError, match="unknown framework 'keras': " + valid):
        parse_frameworks("hf,keras")
    with pytest.raises(UsageError, match="no framework given"):
        parse_frameworks(" , ")


def test_usage_errors(quickstart, tmp_path):
    with pytest.raises(UsageError, match="unknown framework 'jax'"):
        export(quickstart, "jax")
    nothing_fits = dataclasses.replace(quickstart, budget_bytes=1, probe=None)
    with pytest.raises(UsageError, match="^nothing to export: the report has no recommendation$"):
        export(nothing_fits, "hf")
    with pytest.raises(UsageError):
        write_exports(quickstart, tmp_path / "r.json", "hf,keras")
    with pytest.raises(UsageError):
        write_exports(nothing_fits, tmp_path / "r.json", "hf")
    assert os.listdir(tmp_path) == []  # all or nothing


@pytest.mark.parametrize("switch, on", [("activation_checkpointing_enable", True), ("gradient_checkpointing_enable", True),
                                        ("set_grad_checkpointing", False), (None, False)])
def test_hf_turns_on_checkpointing_only_for_a_model_with_the_transformers_switch(quickstart, switch, on):
    report = variant(quickstart, "bf16", 3)
    report = dataclasses.replace(report, workload={**report.workload, "library_checkpointing": switch})
    data = export(report, "hf")
    assert data["training_arguments"]["gradient_checkpointing"] is on
    assert ("gradient_checkpointing_kwargs" in data["training_arguments"]) is on
    assert any("it is left off" in n and "autotune.apply(model, report)" in n for n in data["notes"]) is not on


# --- under FSDP2: autocast over fp32 shards (fp16, bf16), or FSDP2's own policy (bf16-fsdp) ---------------------------


def _fsdp(report: autotune.Report, precision: str, segments: str = "sac-torchtitan") -> autotune.Report:
    """``variant`` as measured under FSDP2 on eight ranks."""
    return dataclasses.replace(variant(report, precision, segments),
                               distributed={"wrapper": "fsdp", "world_size": 8, "backend": "nccl"})


def test_bf16_fsdp_asks_each_framework_for_fsdp2_s_policy_without_autocast(quickstart):
    report = _fsdp(quickstart, "bf16-fsdp")
    policy = "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
    hf, lightning = export(report, "hf"), export(report, "lightning")
    deepspeed, accelerate = export(report, "deepspeed"), export(report, "accelerate")
    assert json.loads(json.dumps([hf, lightning, deepspeed, accelerate], allow_nan=False))
    assert hf["training_arguments"]["bf16"] is True  # the nearest: its note says what differs and the exact way
    assert any(f"fsdp_plugin.mixed_precision_policy = {policy}" in n and "bf16=False" in n for n in hf["notes"])
    assert lightning["trainer"]["precision"] == "32-true"  # no autocast: the policy is the strategy's
    fsdp1 = "MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
    assert any(fsdp1 in n for n in lightning["notes"])
    assert any(f"mp_policy={policy}" in n for n in lightning["notes"])  # ModelParallelStrategy's fully_shard
    assert deepspeed["config"]["bf16"] == {"enabled": True} and deepspeed["config"]["communication_data_type"] == "fp32"
    assert accelerate["accelerator"]["mixed_precision"] == "no"
    assert accelerate["mixed_precision_policy"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert "mixed_precision_policy" not in accelerate["fsdp_plugin"]  # a dtype is no JSON: the note says how
    plugin = needs("accelerate.utils", "the frameworks extra").FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    made = plugin(**accelerate["fsdp_plugin"], mixed_precision_policy=MixedPrecisionPolicy(
        **{k: getattr(torch, v) for k, v in accelerate["mixed_precision_policy"].items()}))
    assert (made.mixed_precision_policy.param_dtype, made.mixed_precision_policy.reduce_dtype) == (
        torch.bfloat16, torch.float32)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_autocast_under_fsdp_keeps_accelerate_s_fsdp2_in_fp32_as_measured(quickstart, precision):
    accelerate = export(_fsdp(quickstart, precision), "accelerate")
    assert accelerate["accelerator"]["mixed_precision"] == precision
    assert accelerate["fsdp_plugin"]["mixed_precision_policy"] == "fp32"
    made = needs("accelerate.utils", "the frameworks extra").FullyShardedDataParallelPlugin
    plugin = made(**accelerate["fsdp_plugin"])
    plugin.set_mixed_precision(precision)  # what the Accelerator's state does with its own mixed_precision
    assert (plugin.mixed_precision_policy.param_dtype, plugin.mixed_precision_policy.reduce_dtype) == (
        torch.float32, torch.float32)
    lightning = " ".join(export(_fsdp(quickstart, precision), "lightning")["notes"])
    assert "mixed_precision=MixedPrecision(param_dtype=torch.float32" in lightning
    assert f"with {precision}=True accelerate's FSDP2 also gathers" in " ".join(
        export(_fsdp(quickstart, precision), "hf")["notes"])


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
def test_bf16_true_asks_each_framework_for_bf16_weights_without_autocast(quickstart, tmp_path, fresh_accelerate):
    report = variant(quickstart, "bf16-true", "0")
    hf, lightning = export(report, "hf"), export(report, "lightning")
    deepspeed, accelerate = export(report, "deepspeed"), export(report, "accelerate")
    assert json.loads(json.dumps([hf, lightning, deepspeed, accelerate], allow_nan=False))
    # transformers: the model loaded in bf16, the Trainer without autocast (TrainingArguments cannot cast a model)
    assert hf["from_pretrained"] == {"dtype": "bfloat16"}
    args = hf["training_arguments"]
    assert (args["bf16"], args["fp16"]) == (False, False) and any("dtype=torch.bfloat16" in n for n in hf["notes"])
    transformers = needs("transformers", "the hf extra")
    made = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=not HAS_GPU, **args)
    assert (made.bf16, made.fp16) == (False, False)
    # Lightning's own bf16-true
    needs("lightning", "the frameworks extra")
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **lightning["trainer"])
    assert trainer.precision == "bf16-true"
    precision = trainer.strategy.precision_plugin
    assert precision.convert_module(torch.nn.Linear(2, 2)).weight.dtype == torch.bfloat16
    assert precision.convert_input(torch.ones(2)).dtype == torch.bfloat16
    with precision.forward_context():  # no autocast: a float32 matmul stays float32 (bf16 is only the default dtype)
        x = torch.ones(2, 2, dtype=torch.float32)
        assert (x @ x).dtype == torch.float32 and torch.ones(1).dtype == torch.bfloat16
    # DeepSpeed: no fp32 master weights, the state in bf16 (its ZeRO optimizer's options)
    needs("deepspeed", "the frameworks extra")
    from deepspeed.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig(deepspeed["config"]).bfloat16_config
    assert config.enabled and config.bf16_master_weights_and_grads and config.bf16_optimizer_states
    # accelerate: no autocast, the cast by hand (its note)
    from accelerate import Accelerator

    accelerator = Accelerator(**accelerate["accelerator"])
    assert accelerator.mixed_precision == "no" and any("model.to(torch.bfloat16)" in n for n in accelerate["notes"])


def test_every_precision_has_each_frameworks_word_and_every_framework_its_evaluation_setting():
    from autotune.export.context import ACCELERATE_PRECISION, LIGHTNING_PRECISION, NAMES
    from autotune.export.engines import accelerate, deepspeed  # noqa: F401 - the engines' exporters live here
    from autotune.export.notes import EVAL_SETTING
    from autotune.vocabulary import PRECISIONS

    assert set(LIGHTNING_PRECISION) == set(ACCELERATE_PRECISION) == set(PRECISIONS)
    assert set(EVAL_SETTING) <= set(NAMES) and {"hf", "lightning"} <= set(EVAL_SETTING)
