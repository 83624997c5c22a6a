"""A Hugging Face causal language model for ``--model``, from a checkpoint's name or its config, and batches for
``--data``: the command-line path for a model you would otherwise load with ``from_pretrained``.

The model is built with ``AutoModelForCausalLM.from_config``: random weights, the checkpoint's shape. Memory and
step time depend on the shape, not on the weights' values, so nothing but the config is needed. From the repository
root (``docs/examples`` imports as a namespace package from there; for your own project, copy this file next to
your code and name it ``yourmodule:causal_lm``)::

    python -m autotune --model docs.examples.hf_factory:causal_lm \\
        --model-kwargs '{"name": "gpt2", "seq_len": 512}' --device cuda --budget 24GiB

``name`` is what ``transformers.AutoConfig.from_pretrained`` takes: a checkpoint on the Hugging Face Hub (its
``config.json`` is downloaded, no weights) or a local folder holding a ``config.json``. Other keys of
``--model-kwargs`` override the config's fields (``{"name": "gpt2", "n_layer": 6}``). Without ``name`` the model
is a tiny GPT-2 built offline, which is what the docs' run and the test use::

    python -m autotune --model docs.examples.hf_factory:causal_lm --data docs.examples.hf_factory:random_tokens \\
        --device cpu --budget 256MiB --precisions fp32,bf16 --batch-sizes 1..32

Without ``--data`` the trials train on the model's ``example_batch``: random tokens of ``seq_len``. ``--data``
names a dataset factory, called with no arguments; ``random_tokens`` below stands for your tokenized data: any
map-style dataset of dicts with ``input_ids``, ``attention_mask`` and ``labels`` works as it is (a
``datasets.Dataset`` after ``set_format("torch")``, say), and its token ids must be below the model's vocabulary
size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

# The offline model: GPT-2's architecture at a size that trains in a fraction of a second on a CPU.
# Its special tokens inside the vocabulary (GPT2Config's defaults, 50256, are GPT-2's own).
TINY_GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128, "vocab_size": 1024, "bos_token_id": 1023,
             "eos_token_id": 1023}
SEQ_LEN = 128


def causal_lm(name: str | None = None, seq_len: int = SEQ_LEN, **overrides: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of ``name``'s config (the tiny GPT-2 without it), ``overrides`` applied;
    its ``example_batch(batch_size)`` is random tokens of ``seq_len``."""
    import transformers

    if name is None:
        config = transformers.GPT2Config(**{**TINY_GPT2, **overrides})
    else:
        config = transformers.AutoConfig.from_pretrained(name, **overrides)
    config.use_cache = False  # training keeps no key/value cache
    model = transformers.AutoModelForCausalLM.from_config(config)
    vocab = config.vocab_size

    def example_batch(batch_size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch_size, seq_len))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    model.example_batch = example_batch
    return model


class _RandomTokens(Dataset):
    """``size`` items of ``seq_len`` random token ids below ``vocab``, the same every time (seeded)."""

    def __init__(self, size: int, seq_len: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (size, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def random_tokens() -> Dataset:
    """The data factory ``--data`` calls: 256 items for the tiny GPT-2's vocabulary and context."""
    return _RandomTokens(256, SEQ_LEN, TINY_GPT2["vocab_size"])
