"""bitsandbytes' 8-bit AdamW from its layout, for a CUDA plan made where bitsandbytes is not installed."""

import json
import sys

import pytest
import torch

from autotune.__main__ import main
from autotune.training.lowbit import EightBitLayout, StandIn, stand_in
from autotune.training.optimizer import OptimizerSpec, measure_optimizer
from autotune.training.state import eight_bit_state_bytes
from autotune.training.workload import Workload

from tests.optional import needs

MODELS = ["autotune.examples:TinyGPT", "autotune.examples:ResNetish"]


def test_the_layout_stands_in_only_for_a_cuda_plan_without_bitsandbytes(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    spec = "bitsandbytes.optim:AdamW8bit"
    assert stand_in(spec, planned_cuda=False) == StandIn(spec)  # anywhere else: bad input (pip install bitsandbytes)
    assert stand_in("torch.optim:AdamW", planned_cuda=True) == StandIn("torch.optim:AdamW", None)
    chosen = stand_in(spec, planned_cuda=True)
    assert chosen.optimizer is EightBitLayout and "its state is predicted from its layout" in chosen.notice


@pytest.mark.parametrize("spec", MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stand_in_holds_the_layout(spec, dtype):
    model = Workload.from_specs(spec).build_model()
    measured = measure_optimizer(OptimizerSpec(EightBitLayout), model, 1e-3, dtype=dtype)
    assert measured.why is None and measured.state_bytes == eight_bit_state_bytes(p.numel() for p in model.parameters())


def test_a_cuda_plan_names_bitsandbytes_and_says_its_state_is_from_the_layout(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    out = tmp_path / "plan.json"
    code = main(["--model", "autotune.examples:TinyGPT", "--optimizer", "bitsandbytes.optim:AdamW8bit", "--device",
                 "cuda", "--dry-run", "--budget", "1GiB", "--precisions", "bf16-true", "--segments", "0",
                 "--batch-sizes", "8", "--quiet", "--out", str(out)])
    report = json.loads(out.read_text())
    optimizer = report["workload"]["optimizer"]
    assert code == 0 and optimizer["name"].startswith("bitsandbytes.optim:AdamW8bit (its layout: ")
    assert any("bitsandbytes is not installed here, so its state is predicted from its layout" in n
               for n in report["notices"])
    model = Workload.from_specs("autotune.examples:TinyGPT").build_model()
    assert report["workload"]["state_by_precision"]["bf16-true"]["optimizer_state"] == eight_bit_state_bytes(
        p.numel() for p in model.parameters())
    assert [t["status"] for t in report["trials"]] == ["ok"]


@pytest.mark.parametrize("spec", MODELS)
def test_the_stand_in_predicts_bitsandbytes_own_trials_to_the_byte(spec):
    """On this CPU bitsandbytes runs (0.50): its real trial against the stand-in's prediction."""
    bnb = needs("bitsandbytes", "the lowbit extra")
    from autotune.execution.predict import predict_trial
    from autotune.execution.trial import run_trial
    from autotune.meters import TensorMeter
    from autotune.plans.checkpointing import find_chain
    from autotune.records import Config, TrialSettings

    for precision in ("fp32", "bf16-true"):
        config = Config(precision, "0", 8)
        laid_out = Workload.from_specs(spec, optimizer=EightBitLayout)
        real = Workload.from_specs(spec, optimizer=bnb.optim.AdamW8bit)
        laid_out, real = (w.with_chain(find_chain(w.build_model())) for w in (laid_out, real))
        predicted = predict_trial(laid_out, config)
        measured = run_trial(real.unwarmed(), config, device="cpu", meter=TensorMeter("cpu"), timed=False,
                             settings=TrialSettings(timeout_s=None))
        assert predicted.status == measured.status == "ok" and predicted.peak_bytes == measured.peak_bytes, precision
