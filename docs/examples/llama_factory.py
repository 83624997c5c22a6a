"""A Llama-shaped model from a Hugging Face config, with random weights: what ``--model`` takes to plan a checkpoint.

A dry run builds the model under fake tensors, so nothing is downloaded and no weight is allocated; only the
config's shape matters. For a checkpoint on the Hub, build its config instead of the one below::

    config = transformers.AutoConfig.from_pretrained("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T")
    model = transformers.AutoModelForCausalLM.from_config(config)

Planned from the repository root (``docs/examples`` imports as a namespace package from there)::

    python -m autotune --model docs.examples.llama_factory:tinyllama --device cpu --budget 24GiB \\
        --precisions bf16 --dry-run

``--model-kwargs '{"layers": 2, "seq": 256}'`` takes a slice of the same widths (small enough to train for real).
"""

from __future__ import annotations

import torch
from torch import nn


def tinyllama(layers: int = 22, hidden: int = 2048, intermediate: int = 5632, heads: int = 32, kv_heads: int = 4,
              vocab: int = 32000, seq: int = 2048) -> nn.Module:
    """TinyLlama 1.1B's shape (22 layers of width 2048, grouped-query attention with 4 key-value heads), trained on
    sequences of ``seq`` tokens: the batch is ``example_batch``'s."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                                      max_position_embeddings=max(seq, 2048), tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)

    def example_batch(batch_size: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, vocab, (batch_size, seq))
        return {"input_ids": tokens, "labels": tokens}

    model.example_batch = example_batch
    return model
