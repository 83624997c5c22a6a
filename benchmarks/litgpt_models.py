"""LitGPT's LoRA fine-tuning as its resource tables measured it (``benchmarks/published.py``'s LitGPT rows).

LitGPT's ``tutorials/resource-tables.md`` (its runs of October 2023: lit-gpt 8641822, torch 2.1.0, an A100 40 GB)
fine-tuned with ``finetune/lora.py``. That script's model is lit-gpt's own ``GPT`` (``lit_gpt/lora.py`` over
``lit_gpt/model.py``), not transformers' and not PEFT's, so it is written here from that commit's architecture,
as the ops it runs matter to the memory it holds:

* **the fused query-key-value projection with LoRA on q and v** (``LoRAQKVLinear``): the frozen projection, dropout
  on its input (LoRA's, p 0.05), ``lora_A`` of (2r, C), ``lora_B`` as a grouped ``conv1d``, the update padded to the
  key's place by ``index_copy`` and scaled by alpha / r;
* **its norms in the weights' dtype**: lit-gpt's RMSNorm squares and scales in bf16 (transformers' casts to
  float32), its LayerNorm is torch's;
* **rotary embeddings from a float32 cache**: the script sets ``max_seq_length`` to its longest sample after Fabric
  cast the model, so the cache is rebuilt in the default dtype (float32) and ``q * cos`` computes in float32;
* **the head in chunks of 128 tokens** (``lm_head_chunk_size=128``), each chunk cast to float32 by Fabric's
  bf16-true ``convert_output``, and the loss chunked over them (``chunked_cross_entropy``), the logits held through
  backward (:func:`litgpt_step`).

Built with random weights (a dry run builds it under fake tensors: nothing is downloaded); ``example_batch`` is the
longest Alpaca sample of the model's tokenizer, as the script's first iteration trains on it (its micro-batch padded
to that length). Importable from the repository root::

    python -m autotune --model benchmarks.litgpt_models:litgpt_lora --model-kwargs '{"name": "phi-1_5"}' \\
        --step benchmarks.litgpt_models:litgpt_step --precisions bf16-true ...
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CONFIGS", "LONGEST", "LitConfig", "litgpt_lora", "litgpt_step"]


@dataclasses.dataclass(frozen=True)
class LitConfig:
    """A lit-gpt ``Config`` (``lit_gpt/config.py`` at 8641822), the fields that shape the model."""

    n_layer: int
    n_embd: int
    padded_vocab_size: int  # the vocabulary rounded up to its padding multiple
    intermediate_size: int
    n_head: int = 32  # every model here has as many query groups as heads (multi-head attention)
    rotary_percentage: float = 0.25  # the share of each head's dimensions rotated
    parallel_residual: bool = True  # x + attn(norm_1(x)) + mlp(norm_2(x)); else attention, then the MLP
    shared_attention_norm: bool = False  # the MLP reads norm_1's output (phi)
    bias: bool = True
    lm_head_bias: bool = False
    norm: str = "LayerNorm"  # or "RMSNorm"
    mlp: str = "GptNeoxMLP"  # fc, GELU, proj; or "LLaMAMLP": proj(silu(fc_1(x)) * fc_2(x))
    gelu_approximate: str = "none"
    norm_eps: float = 1e-5

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def rope_n_elem(self) -> int:
        return int(self.rotary_percentage * self.head_size)


CONFIGS = {
    "Llama-2-7b-hf": LitConfig(n_layer=32, n_embd=4096, padded_vocab_size=32000, intermediate_size=11008,
                               rotary_percentage=1.0, parallel_residual=False, bias=False, norm="RMSNorm",
                               mlp="LLaMAMLP"),
    "phi-1_5": LitConfig(n_layer=24, n_embd=2048, padded_vocab_size=51200, intermediate_size=8192,
                         rotary_percentage=0.5, shared_attention_norm=True, lm_head_bias=True,
                         gelu_approximate="tanh"),
    "stablelm-base-alpha-3b": LitConfig(n_layer=16, n_embd=4096, padded_vocab_size=50688, intermediate_size=16384),
}
LONGEST = {"Llama-2-7b-hf": 1304, "phi-1_5": 1044, "stablelm-base-alpha-3b": 1034}  # tokens, the tables' list


class RMSNorm(nn.Module):
    """lit-gpt's RMSNorm: ``weight * (x * rsqrt(mean(x * x) + eps))``, all in ``x``'s dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm_x = torch.mean(x * x, dim=-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(norm_x + self.eps))


def _norm(config: LitConfig) -> nn.Module:
    if config.norm == "RMSNorm":
        return RMSNorm(config.n_embd, config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps)


class LoRAQKV(nn.Module):
    """The fused query-key-value projection, frozen, with a LoRA update on the queries and values only."""

    def __init__(self, config: LitConfig, *, r: int, alpha: int, dropout: float) -> None:
        super().__init__()
        c = config.n_embd
        self.linear = nn.Linear(c, 3 * c, bias=config.bias)
        self.lora_dropout = nn.Dropout(dropout)
        self.lora_A = nn.Parameter(torch.empty(2 * r, c))
        self.lora_B = nn.Parameter(torch.zeros(2 * c, r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / r
        self.lora_ind = [*range(c), *range(2 * c, 3 * c)]  # the query's and the value's columns of the output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pretrained = self.linear(x)
        after_a = F.linear(self.lora_dropout(x), self.lora_A)  # (B, T, 2r)
        after_b = F.conv1d(after_a.transpose(-2, -1), self.lora_B.unsqueeze(-1), groups=2).transpose(-2, -1)
        return pretrained + self._zero_pad(after_b) * self.scaling

    def _zero_pad(self, x: torch.Tensor) -> torch.Tensor:
        """Place the (B, T, 2C) update in the query's and value's columns of a (B, T, 3C) zero tensor, as lit-gpt's
        ``zero_pad`` does (through (T, B, ...) and an out-of-place ``index_copy``)."""
        out = self.linear.out_features
        x = x.transpose(0, 1)
        result = x.new_zeros((*x.shape[:-1], out)).view(-1, out)
        index = torch.tensor(self.lora_ind, device=result.device)
        result = result.index_copy(1, index, x.reshape(-1, x.shape[-1]))
        return result.view((*x.shape[:-1], out)).transpose(0, 1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """lit-gpt's ``apply_rope``: the halves rotated, computed in the cache's dtype, cast back to ``x``'s."""
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return ((x * cos) + (rotated * sin)).type_as(x)


class CausalSelfAttention(nn.Module):
    """lit-gpt's attention: the fused projection split by query group, rotary on the first ``rope_n_elem``
    dimensions, causal SDPA, the output projection (frozen)."""

    def __init__(self, config: LitConfig, **lora: float) -> None:
        super().__init__()
        self.config = config
        self.attn = LoRAQKV(config, **lora)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        hs, groups, n = self.config.head_size, self.config.n_head, self.config.rope_n_elem
        qkv = self.attn(x).view(b, t, groups, 3, hs).permute(0, 2, 3, 1, 4)  # (B, groups, q+k+v, T, hs)
        q, k, v = qkv.split((1, 1, 1), dim=2)
        k, v = k.expand(b, groups, 1, t, hs), v.expand(b, groups, 1, t, hs)  # one query per group: views
        q, k, v = (z.reshape(b, -1, t, hs) for z in (q, k, v))
        q = torch.cat((_rope(q[..., :n], cos, sin), q[..., n:]), dim=-1)
        k = torch.cat((_rope(k[..., :n], cos, sin), k[..., n:]), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=1.0 / math.sqrt(hs), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """``GptNeoxMLP`` (fc, GELU, proj) or ``LLaMAMLP`` (proj(silu(fc_1(x)) * fc_2(x))), frozen."""

    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.config = config
        c, i, bias = config.n_embd, config.intermediate_size, config.bias
        if config.mlp == "LLaMAMLP":
            self.fc_1, self.fc_2 = nn.Linear(c, i, bias=bias), nn.Linear(c, i, bias=bias)
        else:
            self.fc = nn.Linear(c, i, bias=bias)
        self.proj = nn.Linear(i, c, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.mlp == "LLaMAMLP":
            return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))
        return self.proj(F.gelu(self.fc(x), approximate=self.config.gelu_approximate))


class Block(nn.Module):
    """A lit-gpt block: parallel residual (GPT-NeoX, phi) or attention then MLP (Llama)."""

    def __init__(self, config: LitConfig, **lora: float) -> None:
        super().__init__()
        self.config = config
        self.norm_1 = _norm(config)
        self.attn = CausalSelfAttention(config, **lora)
        self.norm_2 = None if config.shared_attention_norm else _norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n_1 = self.norm_1(x)
        h = self.attn(n_1, cos, sin)
        if self.config.parallel_residual:
            n_2 = n_1 if self.norm_2 is None else self.norm_2(x)
            return x + h + self.mlp(n_2)
        x = x + h
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    """lit-gpt's ``GPT`` with LoRA: embedding, blocks, final norm, head; ``forward(idx, lm_head_chunk_size)`` returns
    the head's output in chunks of that many tokens (a list), as ``finetune/lora.py`` calls it."""

    def __init__(self, config: LitConfig, **lora: float) -> None:
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=config.lm_head_bias)
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(config.padded_vocab_size, config.n_embd),
                                          "h": nn.ModuleList(Block(config, **lora) for _ in range(config.n_layer)),
                                          "ln_f": _norm(config)})
        self.rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # float32, not a buffer: see _rope_cache

    def _rope_cache(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables for ``seq`` positions, float32 (kept as plain attributes so that a bf16-true cast
        of the module leaves them as the script's were: made in float32 after Fabric cast the model)."""
        if self.rope_cache is None or self.rope_cache[0].size(0) != seq or self.rope_cache[0].device != device:
            n = self.config.rope_n_elem
            theta = 1.0 / (10000 ** (torch.arange(0, n, 2, device=device, dtype=torch.float32) / n))
            angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), theta).repeat(1, 2)
            self.rope_cache = (torch.cos(angles), torch.sin(angles))
        return self.rope_cache

    def forward(self, idx: torch.Tensor, lm_head_chunk_size: int = 0) -> torch.Tensor | list[torch.Tensor]:
        cos, sin = self._rope_cache(idx.size(1), idx.device)
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        x = self.transformer.ln_f(x)
        if lm_head_chunk_size > 0:
            return [self.lm_head(x_i) for x_i in x.split(lm_head_chunk_size, dim=1)]
        return self.lm_head(x)


def litgpt_lora(name: str = "Llama-2-7b-hf", seq: int | None = None, r: int = 8, alpha: int = 16,
                dropout: float = 0.05, **config: Any) -> nn.Module:
    """Build lit-gpt's LoRA ``GPT`` for ``name`` (a key of :data:`CONFIGS`) as ``finetune/lora.py`` trains it: LoRA of
    rank ``r`` on the query and value, alpha 16, dropout 0.05, every other parameter frozen
    (``mark_only_lora_as_trainable``). Its ``example_batch(batch_size)`` is ``(input_ids, labels)`` of ``seq``
    tokens (default: the model's longest Alpaca sample, :data:`LONGEST`). ``config`` overrides :class:`LitConfig`'s
    fields (a smaller model of the same shape, for tests)."""
    config = dataclasses.replace(CONFIGS[name], **config)
    model = GPT(config, r=r, alpha=alpha, dropout=dropout)
    for param_name, param in model.named_parameters():
        param.requires_grad_("lora_" in param_name)
    tokens = LONGEST[name] if seq is None else seq

    def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, config.padded_vocab_size, (batch_size, tokens))
        return ids, ids.clone()

    model.example_batch = example_batch
    return model


MINIBATCH = 128  # finetune/lora.py's batch_size: the micro-batches' gradients accumulate to it


def litgpt_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Run ``finetune/lora.py``'s training iteration up to its backward: the head in chunks of 128 tokens, each cast to
    float32 as Fabric's bf16-true ``convert_output`` casts the module's output, the last position dropped, the loss
    chunked as ``chunked_cross_entropy`` (ignore index -1) and divided by the accumulation steps.

    The script keeps ``logits`` through ``backward`` (a local of its loop); here they are held on the model until the
    next step begins, where the script would let them go when the next forward pass returns (a shorter batch: its
    first iteration, the longest sample, is the one that peaks)."""
    input_ids, targets = batch
    model.__dict__.pop("_litgpt_logits", None)
    chunks = model(input_ids, lm_head_chunk_size=128)
    logits = [chunk.to(torch.float32) for chunk in chunks]  # Fabric's convert_output, to the default dtype
    del chunks
    logits[-1] = logits[-1][..., :-1, :]
    targets = targets[..., 1:]
    logit_chunks = [chunk.reshape(-1, chunk.size(-1)) for chunk in logits]
    target_chunks = [chunk.reshape(-1) for chunk in targets.split(logits[0].size(1), dim=1)]
    losses = [F.cross_entropy(lc, tc, ignore_index=-1, reduction="none") for lc, tc in zip(logit_chunks, target_chunks)]
    model.__dict__["_litgpt_logits"] = logits
    return torch.cat(losses).mean() / max(MINIBATCH // input_ids.size(0), 1)
