"""Models and training steps that published memory figures were measured with (``benchmarks/published.py``).

Each builds its source's architecture with random weights (a dry run builds it under fake tensors: nothing is
downloaded, no weight is allocated) and gives it an ``example_batch`` shaped as the source trained it. Importable from
the repository root (``benchmarks`` is a namespace package there)::

    python -m autotune --model benchmarks.published_models:llama3_torchtitan \\
        --step benchmarks.published_models:torchtitan_step ...

* :func:`llama3_torchtitan`: Llama 3 as torchtitan's ``torchtitan/models/llama/model.py`` built it in December 2024
  (written here from its architecture: RMSNorm in float32, rotary embeddings as complex numbers, grouped-query
  attention through SDPA, SwiGLU, no biases, untied output), trained on ``seq`` tokens with torchtitan's loss
  (:func:`torchtitan_step`: the logits cast to float32, then cross-entropy; ``del pred`` before backward).
* :func:`bert_classifier`: ``BertForSequenceClassification`` from a ``BertConfig`` (bert-large-uncased's shape by
  default), eager attention by default, on random token ids and labels as Hugging Face's single-GPU
  training page made them; ``attention="2022"`` is BERT's attention as that page's run had it
  (:func:`bert_attention_2022`), and :func:`zeroed_grads_step` that page's Trainer step as torch 1.x ran it
  (gradients zeroed in place between steps, not freed).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["llama3_torchtitan", "torchtitan_step", "bert_classifier", "bert_attention_2022", "zeroed_grads_step",
           "mpt_foundry"]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32 and cast back to the input's dtype, then scaled (torchtitan's
    ``rmsnorm``)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary(head_dim: int, seq: int, theta: float) -> torch.Tensor:
    """Return the rotary embedding's unit complex numbers, (seq, head_dim / 2) complex64."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def _rotate(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (batch, seq, heads, head_dim) as complex pairs in float32; return it in ``x``'s dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * cis[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention: ``kv_heads`` key/value heads repeated to ``heads``, causal SDPA, no biases."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k = _rotate(q, cis), _rotate(k, cis)
        repeat = self.heads // self.kv_heads  # each key/value head serves this many query heads (a copy, as torchtitan)
        k = k.unsqueeze(3).expand(b, t, self.kv_heads, repeat, self.head_dim).reshape(b, t, self.heads, self.head_dim)
        v = v.unsqueeze(3).expand(b, t, self.kv_heads, repeat, self.head_dim).reshape(b, t, self.heads, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``, no biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then the feed-forward network, each on a residual."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.attention = Attention(dim, heads, kv_heads)
        self.feed_forward = FeedForward(dim, ffn)

    def forward(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama3(nn.Module):
    """Token embedding, the blocks (a ``ModuleDict`` keyed "0", "1", ..., as torchtitan's), a final norm and an
    untied output layer; the rotary table is a buffer as long as the training sequence."""

    def __init__(self, *, dim: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int,
                 rope_theta: float, eps: float) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", rotary(dim // heads, seq, rope_theta), persistent=True)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, kv_heads, ffn, eps) for i in range(layers)})
        self.norm = RMSNorm(dim, eps)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def llama3_torchtitan(layers: int = 32, dim: int = 4096, heads: int = 32, kv_heads: int = 8, ffn: int = 14336,
                      vocab: int = 128256, seq: int = 8192, rope_theta: float = 500000.0,
                      eps: float = 1e-5) -> nn.Module:
    """Build Llama 3 8B as torchtitan builds it (its ``8B`` flavour: FFN 14336 from ``ffn_dim_multiplier`` 1.3 and
    ``multiple_of`` 1024; vocabulary 128256, the tiktoken tokenizer's), trained on ``seq`` tokens; the batch is
    ``example_batch``'s ``(tokens, labels)``."""
    model = Llama3(dim=dim, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab, seq=seq,
                   rope_theta=rope_theta, eps=eps)

    def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, vocab, (batch_size, seq)), torch.randint(0, vocab, (batch_size, seq))

    model.example_batch = example_batch
    return model


def torchtitan_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Run torchtitan's training step up to its loss: the logits cast to float32, cross-entropy over every token, the
    logits let go before backward (its ``del pred``)."""
    tokens, labels = batch
    pred = model(tokens)
    loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
    del pred  # torchtitan: "need to free to before bwd to avoid peaking memory"
    return loss


class _SoftmaxKeepingInput(torch.autograd.Function):
    """Softmax whose backward keeps its input as well as its output, as torch's did before 1.11 (its derivative named
    ``self`` for double backward: pytorch/pytorch#64000, changed by #65242)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        out = torch.softmax(x, dim)
        ctx.save_for_backward(x, out)
        ctx.dim = dim
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, out = ctx.saved_tensors
        return torch._softmax_backward_data(grad, out, ctx.dim, x.dtype), None


def bert_attention_2022(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute BERT's self-attention as transformers 4.16 ran it under torch 1.10 (January 2022).

    The scores divided by the square root of the head size, the extended attention mask added (float32 zeros of
    (batch, 1, 1, seq) where the batch has no mask, which promotes fp16 scores to float32 under autocast), a softmax
    that keeps its input for backward (:class:`_SoftmaxKeepingInput`), dropout, the values. ``query``, ``key``,
    ``value``: (batch, heads, seq, head_dim); returns the output as (batch, seq, heads, head_dim) and the
    probabilities."""
    scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(query.shape[-1])
    if attention_mask is None:
        attention_mask = torch.zeros(query.shape[0], 1, 1, key.shape[-2], dtype=torch.float32, device=query.device)
    probs = _SoftmaxKeepingInput.apply(scores + attention_mask, -1)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def bert_classifier(seq_len: int = 512, num_labels: int = 2, attention: str = "eager", **config: Any) -> nn.Module:
    """Build ``BertForSequenceClassification`` from a ``BertConfig``, random weights.

    Its defaults are bert-large-uncased's shape (24 layers of width 1024, 16 heads, FFN 4096, vocabulary 30522;
    ``config`` overrides them). The batch is Hugging Face's single-GPU page's: ``seq_len`` token ids drawn from
    100..29999, no attention mask, and a label per sequence (``randint(0, 1)``: all 0). ``attention``: transformers'
    ``eager`` or ``sdpa``, or ``2022``: :func:`bert_attention_2022`, the attention the page's run had."""
    import transformers

    if attention == "2022":
        transformers.AttentionInterface.register("bert-2022", bert_attention_2022)
        attention = "bert-2022"

    shape = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
             "vocab_size": 30522, "max_position_embeddings": 512, **config}
    cfg = transformers.BertConfig(num_labels=num_labels, **shape)
    cfg._attn_implementation = attention
    model = transformers.BertForSequenceClassification(cfg)

    def example_batch(batch_size: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(100, 30000, (batch_size, seq_len)),
                "labels": torch.zeros(batch_size, dtype=torch.long)}

    model.example_batch = example_batch
    return model


def zeroed_grads_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Run the forward pass and loss of a Hugging Face ``Trainer`` step as under torch 1.x.

    Its ``model.zero_grad()`` zeroed the gradients in place (``set_to_none=False``, torch's default before 2.0), so
    every gradient is held through the next forward and backward pass. autotune frees them after each step
    (``set_to_none=True``); here each missing one is made again, as zeros, before the forward pass."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    return model(**batch).loss


class MPTBlock(nn.Module):
    """llm-foundry's MPT block as its benchmark configs build it: pre-norm LayerNorms without biases, fused QKV and
    an output projection, causal attention (FlashAttention there; SDPA, which runs flash on an H100, here), a GELU
    MLP of ``expansion`` x, no biases anywhere (``no_bias``)."""

    def __init__(self, dim: int, heads: int, expansion: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm_1, self.norm_2 = nn.LayerNorm(dim, bias=False), nn.LayerNorm(dim, bias=False)
        self.Wqkv, self.out_proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.up_proj, self.down_proj = (nn.Linear(dim, expansion * dim, bias=False),
                                        nn.Linear(expansion * dim, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.Wqkv(self.norm_1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down_proj(F.gelu(self.up_proj(self.norm_2(x))))


class MPT(nn.Module):
    """llm-foundry's ``mpt_causal_lm``: token and learned position embeddings, the blocks, a final LayerNorm, and
    logits from the token embedding's weight (tied); the batch is ``example_batch``'s ``(tokens, labels)``."""

    def __init__(self, *, dim: int, layers: int, heads: int, expansion: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(MPTBlock(dim, heads, expansion) for _ in range(layers))
        self.norm_f = nn.LayerNorm(dim, bias=False)
        self.vocab, self.seq = vocab, seq

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm_f(x), self.wte.weight)

    def example_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(0, self.vocab, (batch_size, self.seq)),
                torch.randint(0, self.vocab, (batch_size, self.seq)))


# llm-foundry's scripts/train/yamls/pretrain/mpt-{1b,7b}.yaml (commit 8c8dd48): d_model, n_heads, n_layers; both
# expansion_ratio 4, vocab_size 50368, max_seq_len 2048, learned_pos_emb and no_bias by MPTConfig's defaults
MPT_SIZES = {"1b": (2048, 16, 24), "7b": (4096, 32, 32)}


def mpt_foundry(size: str = "7b", seq: int = 2048) -> nn.Module:
    """llm-foundry's MPT of ``size`` ("1b", "7b") as its training benchmarks build it, trained on ``seq`` tokens."""
    dim, heads, layers = MPT_SIZES[size]
    return MPT(dim=dim, layers=layers, heads=heads, expansion=4, vocab=50368, seq=seq)

