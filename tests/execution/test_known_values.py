"""Fake tensors that know what the data alone decides (autotune.execution.known_values).

A prediction must take the branch the real step takes. What the batch and constants decide is computed for real
beside the fake tensors; what a weight decides, or a random draw, stays unknown and raises as fake tensors do.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor

from autotune.execution.known_values import KNOWN_NUMEL, KnowingFakeTensorMode
from autotune.execution.predict import fake_tensors

from tests.optional import needs


def test_a_value_the_data_decides_is_read_as_the_real_step_reads_it():
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[0, -2:] = 0
    labels = torch.randint(0, 5, (4, 8))
    with fake_tensors() as mode:
        padding = mask.to(torch.bool)  # an op on the real batch: a fake tensor, its value known
        assert isinstance(padding, FakeTensor) and torch.equal(mode.known(padding), mask.bool())
        assert not bool(padding.all()) and bool(padding[1:].all())  # a branch on the batch's values
        assert int((labels != -100).sum()) == labels.numel()  # .item()
        positions = torch.arange(8).expand(4, -1)  # constants: known too
        assert int(positions[:, -1].sum()) == 28
        assert torch.ones_like(torch.randint(0, 5, (3,))).sum().item() == 3  # ones_like reads only the shape


def test_an_output_shaped_by_values_is_made_from_the_known_values():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    with fake_tensors() as mode:
        where = mask.bool().nonzero()
        assert isinstance(where, FakeTensor) and where.shape == (3, 2)
        assert torch.equal(mode.known(where), mask.bool().nonzero())


def test_what_a_weight_or_a_random_draw_decides_stays_unknown():
    with fake_tensors():
        weight = torch.nn.Linear(8, 8).weight  # built under fake tensors: its values are never known
        with pytest.raises(DataDependentOutputException):
            bool((weight @ torch.ones(8)).sum() > 0)
        with pytest.raises(DataDependentOutputException):
            torch.rand(3).sum().item()
        with pytest.raises(DynamicOutputShapeException):
            (torch.randn(4) > 0).nonzero()
        with pytest.raises(DataDependentOutputException):
            torch.empty(3).sum().item()  # no defined value


def test_a_value_larger_than_the_limit_is_not_kept():
    with fake_tensors() as mode:
        small, large = torch.zeros(KNOWN_NUMEL), torch.zeros(KNOWN_NUMEL + 1)
        assert mode.known(small + 1) is not None and mode.known(large + 1) is None


def test_a_write_the_prediction_cannot_compute_forgets_the_value_and_no_real_tensor_is_written():
    batch = torch.zeros(4)
    with fake_tensors() as mode:
        x = batch * 2  # known, computed here
        view = x[:2]
        x.add_(torch.randn(4))  # a write whose result is not known: the storage's value is forgotten, views too
        assert mode.known(x) is None and mode.known(view) is None
        y = batch + 1
        y.mul_(3)  # a known write on a value made here: kept
        assert torch.equal(mode.known(y), torch.full((4,), 3.0))
        fake_batch = batch.to(torch.float32, copy=True)
        batch_view = batch[:2]
        batch_view.add_(fake_batch[:2])  # a write to the user's real tensor is never computed for real
    assert torch.equal(batch, torch.zeros(4))


def test_the_libraries_fake_tensor_test_answers_as_the_real_step_while_the_mode_is_on():
    needs("transformers")
    from transformers.utils import import_utils

    original = import_utils.is_fake_tensor
    with fake_tensors():
        known = torch.ones(2, 3).bool()
        unknown = torch.randn(2, 3)
        assert import_utils.is_fake_tensor(known) is False and import_utils.is_tracing(known) is False
        assert import_utils.is_fake_tensor(unknown) is True
    assert import_utils.is_fake_tensor is original


def test_a_library_imported_inside_the_mode_gets_its_test_answered(monkeypatch):
    needs("transformers")
    for name in [n for n in sys.modules if n == "transformers" or n.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)  # imported again inside the mode, as a model's factory imports it
    mode = KnowingFakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        from transformers.utils import import_utils

        known = torch.zeros(2) + 1  # the first op after the import answers the test
        assert import_utils.is_fake_tensor(known) is False
    assert import_utils.is_fake_tensor(mode.from_tensor(torch.zeros(2))) is True


def test_the_prediction_of_a_transformers_model_follows_the_real_kernel(tmp_path):
    """Where no token is padded, transformers skips the causal mask and SDPA runs the CPU's flash kernel, which keeps
    no score tensor for backward: under fake tensors it built the mask and ran the math kernel (a 2-layer Llama at
    256 tokens and 8 heads was predicted 2 MiB a sample over its measurement)."""
    needs("transformers")
    from autotune.execution.predict import predict_trial
    from autotune.execution.trial import run_trial
    from autotune.meters import TensorMeter
    from autotune.records import Config, TrialSettings
    from autotune.training.workload import Workload

    kwargs = {"model_type": "llama", "seq_len": 64, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 256}
    workload = Workload.from_specs("autotune.thirdparty:hf_causal_lm", model_kwargs=kwargs)
    for batch in (1, 4):
        config = Config("fp32", "0", batch)
        measured = run_trial(workload.unwarmed(), config, device="cpu", meter=TensorMeter("cpu"), timed=False,
                             settings=TrialSettings(timeout_s=None))
        assert predict_trial(workload, config).peak_bytes == measured.peak_bytes, batch


def test_a_module_to_that_converts_nothing_leaves_a_fake_module_as_it_is():
    """torch's Module._apply swaps each fake parameter for its converted self and fails on the converter's weak
    references, even where nothing changes: a PEFT adapter's build moves it to its base layer's device and dtype, its
    own already, so a LoRA model could not be built under fake tensors. A conversion that changes a dtype is still
    torch's (never a module silently left in the old dtype), and Module.to is torch's again once the mode is off."""
    from autotune.execution.fake_build import fake_buildable
    from autotune.training.workload import Workload

    original = torch.nn.Module.to
    with fake_tensors():
        linear = torch.nn.Linear(4, 4)
        assert linear.to("cpu", dtype=torch.float32) is linear and linear.to(torch.float32) is linear
        try:
            assert linear.to(torch.float64).weight.dtype == torch.float64
        except RuntimeError as exc:
            assert "Couldn't swap" in str(exc)  # torch's own failure, as before
    assert torch.nn.Module.to is original
    needs("transformers")
    needs("peft")
    from tests.zoo import llama_lora

    assert fake_buildable(Workload.from_specs(llama_lora), fake_tensors()).notice is None  # no real build needed
