"""The bundled example models and datasets: they build small, follow the workload protocol and train."""

import math

import pytest
import torch

from autotune.examples import (
    GPTConfig,
    ResNetish,
    TinyGPT,
    image_dataset,
    pad_collate,
    token_dataset,
    train_tinygpt,
    variable_token_loader,
)
from autotune.records import Config, Measurement
from autotune.training.workload import Workload

GPT = {"n_layer": 2, "block_size": 16, "n_embd": 16, "n_head": 2, "vocab_size": 32}
RESNET = {"depth": 2, "channels": 8, "image_size": 8, "num_classes": 5}


def one_step(workload, batch_size, steps=1, lr=1e-2):
    """Train ``steps`` AdamW steps on the same batch through the workload protocol; return the losses."""
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batch = workload.make_batch(model, batch_size)
    losses = []
    for _ in range(steps):
        loss = workload.loss(model, batch)
        loss.backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# --- TinyGPT -------------------------------------------------------------------------------------


def test_tiny_gpt_builds_from_kwargs_with_tied_weights():
    model = TinyGPT(**GPT)
    assert model.config == GPTConfig(**GPT)
    assert len(model.transformer.h) == 2 and model.lm_head.out_features == 32
    assert model.transformer.wte.weight is model.lm_head.weight
    with pytest.raises(TypeError):
        TinyGPT(d_model=32)  # not one of GPTConfig's fields


def test_tiny_gpt_example_batch_is_next_token_prediction():
    batch = TinyGPT(**GPT).example_batch(3)
    assert set(batch) == {"idx", "targets"}
    assert batch["idx"].shape == batch["targets"].shape == (3, 16) and batch["idx"].dtype == torch.long
    assert torch.equal(batch["idx"][:, 1:], batch["targets"][:, :-1])  # shifted by one token
    assert int(batch["idx"].max()) < 32 and int(batch["idx"].min()) >= 0
    assert torch.equal(batch["idx"], TinyGPT(**GPT).example_batch(3)["idx"])  # the same batch every time


def test_tiny_gpt_trains_a_step_through_the_workload_protocol():
    w = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=GPT)
    losses = one_step(w, 4, steps=5)
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(32)) < 1.0  # near a uniform guess over the vocabulary at the start
    assert losses[-1] < losses[0]


def test_tiny_gpt_takes_json_kwargs_as_the_cli_gives_them():
    w = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs='{"n_layer": 1, "block_size": 8, "n_embd": 8, '
                                                                      '"n_head": 2, "vocab_size": 16}')
    model = w.build_model()
    assert model.config.n_layer == 1 and model.training
    out = model(**w.make_batch(model, 2))
    assert out.logits.shape == (2, 8, 16) and out.loss.ndim == 0


def test_tiny_gpt_is_causal():
    torch.manual_seed(0)
    model = TinyGPT(**GPT).eval()
    idx = TinyGPT(**GPT).example_batch(2)["idx"]
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 32  # a different future
    with torch.no_grad():
        a, b = model(idx).logits, model(changed).logits
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_tiny_gpt_without_targets_has_no_loss_and_shorter_sequences_work():
    model = TinyGPT(**GPT)
    out = model(torch.zeros(2, 5, dtype=torch.long))
    assert out.loss is None and out.logits.shape == (2, 5, 32)


def test_token_dataset_items_match_the_example_batch():
    data = token_dataset(size=10, block_size=16, vocab_size=32)
    assert len(data) == 10
    item = data[3]
    assert item["idx"].shape == item["targets"].shape == (16,)
    assert torch.equal(item["idx"][1:], item["targets"][:-1])
    w = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=GPT, data=data)
    model = w.build_model()
    batch = w.make_batch(model, 4)  # the worst batch of 4 items, collated
    assert batch["idx"].shape == (4, 16) and torch.isfinite(w.loss(model, batch))


def test_pad_collate_pads_inputs_with_zeros_and_targets_with_ignore_index():
    items = [{"idx": torch.tensor([5, 6, 7]), "targets": torch.tensor([6, 7, 8])},
             {"idx": torch.tensor([1]), "targets": torch.tensor([2])}]
    batch = pad_collate(items)
    assert batch["idx"].tolist() == [[5, 6, 7], [1, 0, 0]]
    assert batch["targets"].tolist() == [[6, 7, 8], [2, -100, -100]]
    model = TinyGPT(**GPT)
    full = model(idx=batch["idx"][:1], targets=batch["targets"][:1]).loss  # padding does not count in the loss
    alone = model(idx=batch["idx"][1:, :1], targets=batch["targets"][1:, :1]).loss
    both = model(**batch).loss
    assert torch.allclose(both, (full * 3 + alone) / 4, atol=1e-5)


def test_variable_token_loader_has_a_long_tail_after_typical_first_items():
    loader = variable_token_loader(size=400, block_size=32, vocab_size=32, batch_size=8)
    assert loader.collate_fn is pad_collate and loader.batch_size == 8
    lengths = [len(loader.dataset[i]["idx"]) for i in range(len(loader.dataset))]
    assert all(4 <= n <= 8 for n in lengths[:64])  # short: an eighth to a quarter of block_size
    assert 32 in lengths[64:] and set(lengths) <= set(range(4, 9)) | {32}
    first = next(iter(loader))
    assert first["idx"].shape[0] == 8 and first["idx"].shape[1] == max(lengths[:8])
    w = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs={**GPT, "block_size": 32}, data=loader)
    model = w.build_model()
    assert w.make_batch(model, 4)["idx"].shape[1] == 32  # the worst batch holds a full-length sequence


# --- ResNetish -----------------------------------------------------------------------------------


def test_resnetish_builds_from_kwargs_as_a_sequential_chain():
    model = ResNetish(**RESNET)
    assert isinstance(model, torch.nn.Sequential) and len(model) == 2 + 2  # stem, 2 blocks, head
    images, labels = model.example_batch(3)
    assert images.shape == (3, 3, 8, 8) and labels.shape == (3,) and int(labels.max()) < 5
    assert model(images).shape == (3, 5)


def test_resnetish_trains_a_step_through_the_workload_protocol():
    w = Workload.from_specs("autotune.examples:ResNetish", model_kwargs=RESNET)
    losses = one_step(w, 4, steps=5)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


def test_image_dataset_items_are_image_and_label():
    data = image_dataset(size=6, image_size=8, num_classes=5)
    image, label = data[0]
    assert len(data) == 6 and image.shape == (3, 8, 8) and label.dtype == torch.long
    w = Workload.from_specs("autotune.examples:ResNetish", model_kwargs=RESNET, data=data)
    model = w.build_model()
    assert torch.isfinite(w.loss(model, w.make_batch(model, 4)))


# --- train_tinygpt -------------------------------------------------------------------------------


def test_train_tinygpt_follows_a_bare_trial():
    rec = Measurement(Config("fp32", "0", 4), "ok", peak_bytes=1, samples_per_s=1.0, step_s=1.0)
    losses = train_tinygpt(rec, steps=3, **GPT)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(32)) < 1.0
    assert train_tinygpt(rec, steps=3, **GPT) == losses  # seeded: the same losses every time


def test_train_tinygpt_accumulates_micro_batches_into_one_step():
    report = {"recommendation": Measurement(Config("bf16", "0", 2), "ok", peak_bytes=1).to_dict(),
              "accumulation": {"micro_batch_size": 2, "accumulation_steps": 3}}
    losses = train_tinygpt(report, steps=2, **GPT)
    assert len(losses) == 2  # one loss per optimizer step, not per micro-batch
    assert abs(losses[0] - math.log(32)) < 1.0  # the mean of the micro-batches' losses, not their sum


# --- docs/examples/hf_factory.py: a Hugging Face model from its config, on the command line -----------------------


@pytest.mark.parametrize("named", [False, True], ids=["tiny-gpt2-with-its-data", "config-folder-by-name"])
def test_the_hf_factory_example_tunes_from_the_command_line(tmp_path, named):
    # What docs/workload.md tells a user to type, from the repository root: the factory by MODULE:ATTR, built from a
    # config (a folder holding a config.json stands for a checkpoint's name: AutoConfig.from_pretrained reads both)
    import json
    import os
    import sys

    from tests import procs
    from tests.optional import needs

    transformers = needs("transformers")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--model", "docs.examples.hf_factory:causal_lm", "--device", "cpu", "--budget", "64MiB", "--precisions",
            "fp32", "--batch-sizes", "1,4", "--no-probe", "--no-library-compare", "--warmup-steps", "1",
            "--measure-steps", "2", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(tmp_path / "r.json")]
    if named:
        config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=128)
        config.save_pretrained(tmp_path / "checkpoint")
        args += ["--model-kwargs", json.dumps({"name": str(tmp_path / "checkpoint"), "seq_len": 64}), "--segments", "0"]
    else:
        args += ["--data", "docs.examples.hf_factory:random_tokens", "--segments", "0,all"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = procs.run([sys.executable, "-m", "autotune", *args], cwd=root, env=env, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["recommendation"] is not None and "recommendation: fp32" in done.stdout
    assert data["workload"]["model"] == "docs.examples.hf_factory:causal_lm"
    if named:  # the folder's config was the one built: its parameter count
        expected = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        assert data["workload"]["parameter_count"] == expected
    else:  # its data, and the GPT-2 blocks found for the plans
        assert data["data"]["items"] == 256 and data["workload"]["chain"]["length"] == 2
        assert [c["status"] for c in data["plan_checks"]] == ["exact"]
