"""Bundled example models and datasets, sized so that CPU trials take seconds.

Both models follow autotune's workload protocol: ``example_batch(batch_size)`` returns a batch
to train on, and the loss comes from the output (``TinyGPT``) or the model's ``loss(output,
target)`` method (``ResNetish``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "TinyGPT", "GPTOutput", "ResNetish", "token_dataset", "image_dataset", "variable_token_loader", "pad_collate", "train_tinygpt"]


# --- TinyGPT -----------------------------------------------------------------------------------


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 512  # small vocabulary: the LM head stays cheap next to the blocks
    block_size: int = 160  # sequence length T; attention memory grows with T^2
    n_layer: int = 12  # blocks in the chain that checkpoint plans cut into segments
    n_head: int = 8
    n_embd: int = 64
    dropout: float = 0.0


@dataclasses.dataclass
class GPTOutput:
    logits: torch.Tensor  # (B, T, vocab_size)
    loss: torch.Tensor | None  # mean cross-entropy over all tokens, when targets are given


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        # Attention written out rather than fused (scaled_dot_product_attention): the (B, nh, T, T)
        # score matrices are the activation memory that precision and checkpointing trade against.
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        att = self.dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A GPT-style language model whose blocks live in an ``nn.ModuleList`` (``transformer.h``)."""

    def __init__(self, **overrides: object) -> None:
        super().__init__()
        self.config = cfg = GPTConfig(**overrides)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> GPTOutput:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return GPTOutput(logits, loss)

    def example_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        """Return a batch of ``batch_size`` sequences from :func:`token_dataset`'s distribution."""
        idx = _token_sequences(batch_size, self.config.block_size + 1, self.config.vocab_size, seed=batch_size)
        return {"idx": idx[:, :-1], "targets": idx[:, 1:]}


def _token_sequences(n: int, length: int, vocab_size: int, *, seed: int) -> torch.Tensor:
    """Sequences with learnable structure: each counts up from a random start with a random stride."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(vocab_size, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    return (start + stride * torch.arange(length)) % vocab_size


class _TokenDataset(torch.utils.data.Dataset):
    def __init__(self, sequences: torch.Tensor | list[torch.Tensor]) -> None:  # a list when lengths vary
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        seq = self.sequences[i]
        return {"idx": seq[:-1], "targets": seq[1:]}


def token_dataset(size: int = 2048, block_size: int = 160, vocab_size: int = 512) -> torch.utils.data.Dataset:
    """Return a map-style dataset of ``size`` dict items ``{"idx", "targets"}`` for :class:`TinyGPT`."""
    return _TokenDataset(_token_sequences(size, block_size + 1, vocab_size, seed=0))


# --- ResNetish ---------------------------------------------------------------------------------


class ResidualBlock(nn.Module):
    """Pre-activation residual block with a depthwise-separable convolution (cheap FLOPs, real activations)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False),  # depthwise 3x3
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 1, bias=False),  # pointwise 1x1
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ResNetish(nn.Sequential):
    """A convolutional classifier built as an ``nn.Sequential``: stem, residual blocks, head."""

    def __init__(self, depth: int = 8, channels: int = 64, image_size: int = 32, num_classes: int = 10) -> None:
        super().__init__(
            nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()),
            *(ResidualBlock(channels) for _ in range(depth)),
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)),
        )
        self.image_size = image_size
        self.num_classes = num_classes

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the logits ``output`` (B, num_classes) against class indices ``target`` (B,)."""
        return F.cross_entropy(output.float(), target)

    def example_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(images, labels)``: ``batch_size`` images (B, 3, H, W) from :func:`image_dataset`'s distribution."""
        return _images(batch_size, self.image_size, self.num_classes, seed=batch_size)


def _images(n: int, image_size: int, num_classes: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy images whose class shifts the mean of one colour channel: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(num_classes, (n,), generator=g)
    images = torch.randn(n, 3, image_size, image_size, generator=g)
    images[:, 0] += (labels.float() / num_classes - 0.5).view(-1, 1, 1) * 4
    return images, labels


def image_dataset(size: int = 2048, image_size: int = 32, num_classes: int = 10) -> torch.utils.data.Dataset:
    """Return a map-style dataset of ``size`` items ``(image, label)`` for :class:`ResNetish`."""
    images, labels = _images(size, image_size, num_classes, seed=0)
    return torch.utils.data.TensorDataset(images, labels)


# --- variable-length text ----------------------------------------------------------------------


def pad_collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad a list of ``{"idx", "targets"}`` items to the longest; padded targets are -100 (ignored by the loss)."""
    length = max(item["idx"].numel() for item in items)
    idx = torch.zeros(len(items), length, dtype=torch.long)
    targets = torch.full((len(items), length), -100, dtype=torch.long)
    for row, item in enumerate(items):
        n = item["idx"].numel()
        idx[row, :n] = item["idx"]
        targets[row, :n] = item["targets"]
    return {"idx": idx, "targets": targets}


def variable_token_loader(size: int = 2048, block_size: int = 160, vocab_size: int = 512, batch_size: int = 8
                          ) -> torch.utils.data.DataLoader:
    """Return a DataLoader of variable-length token sequences for :class:`TinyGPT`, padded by :func:`pad_collate`.

    Lengths have a long tail, as in real text: most sequences hold a quarter of ``block_size``
    tokens or fewer, one in twenty the full ``block_size``. A short trial on the first batch sees
    short sequences; a real epoch meets the long ones, and the memory they take.
    """
    g = torch.Generator().manual_seed(0)
    short = torch.randint(block_size // 8, block_size // 4 + 1, (size,), generator=g)
    long = torch.rand(size, generator=g) < 0.05
    long[:64] = False  # the first items, which short trials train on, are typical ones
    lengths = torch.where(long, torch.full_like(short, block_size), short)
    full = _token_sequences(size, block_size + 1, vocab_size, seed=0)
    sequences = [full[i, : int(n) + 1] for i, n in enumerate(lengths)]
    return torch.utils.data.DataLoader(_TokenDataset(sequences), batch_size=batch_size, collate_fn=pad_collate)


# --- training with a recommendation ------------------------------------------------------------


def train_tinygpt(recommendation, *, steps: int = 20, lr: float = 3e-3, device: str = "cpu", **model_kwargs) -> list[float]:
    """Train a TinyGPT as ``recommendation`` says (a Report, its JSON, or a trial); return the loss per optimizer step.

    The complete loop a user writes with :func:`autotune.apply`: micro-batches of the recommended
    size, gradient accumulation from the plan, autocast, the GradScaler and clipping when asked.
    """
    import autotune

    torch.manual_seed(0)
    model = TinyGPT(**model_kwargs).to(device)
    run = autotune.apply(model, recommendation)
    optimizer = torch.optim.AdamW(run.model.parameters(), lr=lr)
    cfg = model.config
    loader = torch.utils.data.DataLoader(
        token_dataset(size=steps * run.micro_batch_size * run.accumulation_steps, block_size=cfg.block_size,
                      vocab_size=cfg.vocab_size),
        batch_size=run.micro_batch_size, shuffle=True)
    losses, total = [], 0.0
    for i, batch in enumerate(loader):
        batch = {k: v.to(device) for k, v in batch.items()}
        with run.autocast():
            loss = run.model(**batch).loss / run.accumulation_steps
        run.backward(loss)
        total += loss.item()
        if (i + 1) % run.accumulation_steps == 0:
            run.step(optimizer)
            losses.append(total)
            total = 0.0
    return losses
