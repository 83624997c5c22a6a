import pytest
import torch

import autotune
from autotune.training.applied import apply
from autotune.examples import TinyGPT, train_tinygpt
from autotune.records import Config, GuardRails, Measurement

TINY = {"n_layer": 4, "block_size": 32, "n_embd": 32, "n_head": 4, "vocab_size": 64}


def rec(precision, segments=2, batch=8):
    return Measurement(config=Config(precision, segments, batch), status="ok", peak_bytes=1, samples_per_s=1.0, step_s=1.0)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_applied_recommendation_trains(precision):
    report_dict = {"recommendation": rec(precision).to_dict(), "plan": {"micro_batch_size": 8, "accumulation_steps": 2},
                   "guard": {"clip_grad_norm": 1.0, "fp32_modules": ["LayerNorm"]}}
    losses = train_tinygpt(report_dict, steps=40, lr=1e-2, **TINY)
    assert len(losses) == 40
    # It learns: from about ln(64) = 4.16 plus init noise, down by a margin well above step-to-step noise.
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1


def test_apply_sets_up_plan_precision_and_guard_rails():
    model = TinyGPT(**TINY)
    run = apply(model, {"recommendation": rec("fp16", segments=2, batch=4).to_dict(), "plan": {"accumulation_steps": 3},
                        "guard": {"clip_grad_norm": 1e-3, "fp32_modules": ["LayerNorm"]}})
    assert run.model is model and run.micro_batch_size == 4 and run.accumulation_steps == 3
    assert run.scaler is not None and run.scaler.get_scale() == 2.0**16
    assert run.plan == {"name": "2", "recomputed_blocks": [0, 1], "chain_length": 4}
    with run.autocast():
        assert model.transformer.ln_f(torch.randn(2, 32)).dtype == torch.float32  # kept in fp32
        assert model.lm_head(torch.randn(2, 32)).dtype == torch.float16
    optimizer = torch.optim.AdamW(model.parameters())
    with run.autocast():
        loss = model(**model.example_batch(4)).loss
    run.backward(loss)
    norm = run.step(optimizer)
    assert norm is not None and norm > 1e-3  # clipped down to 1e-3 before the step
    assert all(p.grad is None for p in model.parameters())


def test_apply_takes_a_report_and_a_trial(tmp_path):
    report = autotune.tune("autotune.examples:TinyGPT", model_kwargs=TINY, device="cpu", budget="64MiB", precisions="bf16",
                           segments="0", batch_sizes="4,8", measure_steps=1, storage=f"sqlite:///{tmp_path}/a.db", study="a",
                           target_batch_size=32, clip_grad_norm=0.5)
    run = apply(TinyGPT(**TINY), report)
    assert run.precision == "bf16" and run.scaler is None and run.clip_grad_norm == 0.5
    assert run.micro_batch_size * run.accumulation_steps == 32
    assert apply(TinyGPT(**TINY), report.recommendation).accumulation_steps == 1
    report.to_json(tmp_path / "a.json")
    assert apply(TinyGPT(**TINY), autotune.load(tmp_path / "a.json")).micro_batch_size == run.micro_batch_size


def test_apply_refuses_what_it_cannot_use():
    with pytest.raises(autotune.UsageError, match="no recommendation"):
        apply(TinyGPT(**TINY), {"recommendation": None})
    with pytest.raises(autotune.UsageError, match="cannot apply"):
        apply(TinyGPT(**TINY), 42)


def test_guard_rails_in_trials_clip_and_keep_fp32():
    from autotune.training.trainer import Trainer
    from autotune.training.workload import Workload

    w = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=TINY)
    t = Trainer(w, Config("bf16", "0", 4), torch.device("cpu"), guard=GuardRails(clip_grad_norm=1e-3, fp32_modules=("LayerNorm",)),
                record_grad_norm=True)
    t.build()
    batch = w.make_batch(t.model, 4)
    stepped = []  # the gradients the optimizer steps with (Applied.step zeroes them after)
    step = t.optimizer.step
    t.optimizer.step = lambda *a, **k: stepped.append(torch.linalg.vector_norm(torch.stack(
        [p.grad.norm() for p in t.model.parameters() if p.grad is not None]))) or step(*a, **k)
    t.step(batch)
    assert stepped[0] <= 1e-3 * 1.0001 < t.grad_norms[0]
    with pytest.raises(autotune.UsageError, match="no module of that type"):
        Trainer(w, Config("fp32", "0", 4), torch.device("cpu"), guard=GuardRails(fp32_modules=("BatchNorm9d",))).build()
