"""The training state by part in each precision, and the figures of the levers that would shrink it
(autotune.training.state): each layout held against the optimizer it describes, run on the CPU."""

import pytest
import torch

from autotune.plans.checkpointing import find_chain
from autotune.training.optimizer import OptimizerSpec, measure_optimizer
from autotune.training.state import Adapters, adapter_parameters, eight_bit_state_bytes, factored_state_bytes
from autotune.training.workload import Workload

from tests.optional import needs

MODELS = ["autotune.examples:TinyGPT", "autotune.examples:ResNetish"]
LLAMA = {"layers": 2, "hidden": 64, "intermediate": 160, "heads": 4, "kv_heads": 2, "vocab": 128, "seq": 16}


def _model(spec: str, **kwargs) -> torch.nn.Module:
    return Workload.from_specs(spec, model_kwargs=kwargs or None).build_model()


@pytest.mark.parametrize("spec", MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_adafactor_holds_its_layout(spec, dtype):
    model = _model(spec).to(dtype)
    measured = measure_optimizer(OptimizerSpec(torch.optim.Adafactor), model, 1e-3)
    assert measured.why is None and measured.state_bytes == factored_state_bytes(model.parameters())


@pytest.mark.parametrize("spec", MODELS)
def test_the_8_bit_layout_is_what_bitsandbytes_holds(spec):
    """bitsandbytes' AdamW8bit runs on this CPU (0.50): its state, measured by twins, is its layout's."""
    bnb = needs("bitsandbytes", "the lowbit extra")
    model = _model(spec)
    for dtype in (torch.float32, torch.bfloat16):
        measured = measure_optimizer(OptimizerSpec(bnb.optim.AdamW8bit), model, 1e-3, dtype=dtype)
        assert measured.why is None and measured.state_bytes == eight_bit_state_bytes(p.numel() for p in model.parameters())


def test_the_8_bit_layout_by_hand():
    # 5,000 entries: 8-bit, 20 blocks of 256; 100 entries: 32-bit; the two 256-entry maps once
    assert eight_bit_state_bytes([5000, 100]) == (2 * 5000 + 2 * 4 * 20) + 8 * 100 + 2 * 256 * 4
    assert eight_bit_state_bytes([100]) == 800  # no 8-bit parameter: no maps


def test_the_adapters_are_counted_as_peft_counts_lora_on_every_linear_layer():
    peft = needs("peft", "the adapters' lever")
    needs("transformers", "the hf extra")
    model = _model("docs.examples.llama_factory:tinyllama", **LLAMA)
    counted = adapter_parameters(model, find_chain(model), rank=8)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    trained = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert counted == Adapters(trained, 2 * 7)  # q, k, v, o, gate, up, down in each block
    assert adapter_parameters(_model("autotune.examples:ResNetish"), None) == Adapters(0, 0)  # no blocks: no lever


def test_a_model_with_frozen_parameters_is_offered_no_adapters():
    from autotune.training.state import smaller_state

    model = _model("autotune.examples:TinyGPT")
    chain = find_chain(model)
    parts = {"weights": 1, "gradients": 1, "optimizer_state": 10**9}
    assert smaller_state(model, chain, OptimizerSpec(), 1e-4, parts, true_runs=True,
                         true_searched=False).adapter_parameters > 0
    model.lm_head.weight.requires_grad_(False)  # tied to the embedding: both frozen, as a PEFT base is
    offered = smaller_state(model, chain, OptimizerSpec(), 1e-4, parts, true_runs=True, true_searched=False)
    assert offered.adapter_parameters == 0 and offered.true_parts is not None
