"""A zoo of tiny models, built offline, for checking checkpoint plans architecture by architecture.

Every member is a factory returning a module with an ``example_batch(batch_size)`` method whose
loss comes out of :meth:`autotune.training.workload.Workload.loss` (a scalar, or an output with
``.loss``), so each is also a workload (``Workload.from_specs(member.build)``). Hugging Face
models are built from their config classes with random weights (nothing is downloaded); the
timm ViT needs timm, which does not import beside the CPU build of torch (see tests/optional.py).

All sizes are tiny: a few layers, hidden 16-64, sequences of 8-16 tokens, vocabularies of 64,
so that a forward and backward pass takes milliseconds on two CPU cores.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 64
SEQ = 16


def _with_batch(model: nn.Module, example_batch: Callable[[int], Any]) -> nn.Module:
    model.example_batch = types.MethodType(lambda self, batch_size: example_batch(batch_size), model)
    return model


# --- Hugging Face transformers --------------------------------------------------------------------


def _config(model_type: str, **config: Any) -> Any:
    import transformers

    return transformers.AutoConfig.for_model(model_type, **config)


def _causal_batch(batch_size: int) -> dict[str, torch.Tensor]:
    """Random tokens; the last row is right-padded (3 tokens masked, not predicted), so masks are real tensors."""
    ids = torch.randint(1, VOCAB, (batch_size, SEQ))
    mask = torch.ones_like(ids)
    mask[-1, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


def _causal_lm(model_type: str, **config: Any) -> nn.Module:
    import transformers

    cfg = _config(model_type, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, **config)
    return _with_batch(transformers.AutoModelForCausalLM.from_config(cfg), _causal_batch)


_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)


def gpt2() -> nn.Module:
    """GPT-2: dropout 0.1 in embeddings, attention and residuals (the defaults); lm_head tied to wte."""
    return _causal_lm("gpt2", n_layer=5, n_embd=32, n_head=4, n_positions=64)


def llama() -> nn.Module:
    return _causal_lm("llama", **_DECODER)


def llama_lora() -> nn.Module:
    """The Llama above under a PEFT LoRA adapter (rank 4 on q_proj and v_proj, dropout 0.1): the base frozen, its
    blocks inside PEFT's wrappers. B starts random (PEFT's init_lora_weights=False), not zero: A's gradients are not
    all zero, so comparing them means something."""
    import peft

    adapter = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1,
                              init_lora_weights=False, task_type="CAUSAL_LM")
    return peft.get_peft_model(llama(), adapter)


def gemma2() -> nn.Module:
    """Gemma 2: layers alternate sliding-window (4 tokens, shorter than SEQ) and full attention."""
    return _causal_lm("gemma2", **{**_DECODER, "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4})


def mixtral() -> nn.Module:
    """Mixtral: a sparse mixture of experts per layer; the router's load-balancing loss is in the loss."""
    return _causal_lm("mixtral", **{**_DECODER, "num_hidden_layers": 3}, num_local_experts=4, num_experts_per_tok=2,
                      output_router_logits=True, router_aux_loss_coef=0.1)


def qwen2_moe() -> nn.Module:
    """Qwen2-MoE: routed experts plus a gated shared expert; router logits on."""
    return _causal_lm("qwen2_moe", **_DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, output_router_logits=True, router_aux_loss_coef=0.1)


def gpt_neox() -> nn.Module:
    """GPT-NeoX: parallel attention and MLP residuals, partial rotary embeddings."""
    return _causal_lm("gpt_neox", hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      max_position_embeddings=64, rotary_pct=0.5)


def opt() -> nn.Module:
    """OPT: learned positions, dropout 0.1 (the default)."""
    return _causal_lm("opt", hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4,
                      max_position_embeddings=64, word_embed_proj_dim=32)


def qwen2_hooked() -> nn.Module:
    """Qwen2 whose second layer carries an accelerate hook (doubles its input) and a forward hook (records outputs).

    Both are added before any plan, as accelerate and user code would. The records are on
    ``model.zoo_records``; the layer's forward as accelerate set it on ``model.zoo_hooked_forward``.
    """
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Doubler(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            module.zoo_pre_forward_calls += 1
            if args:
                return (args[0] * 2, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 2}

    model = _causal_lm("qwen2", **_DECODER)
    layer = model.model.layers[1]
    layer.zoo_pre_forward_calls = 0
    add_hook_to_module(layer, Doubler())
    records: list[torch.Tensor] = []

    def record(module, args, output):
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        records.append(hidden.detach().clone())

    layer.register_forward_hook(record)
    model.zoo_records = records
    model.zoo_hooked_forward = layer.__dict__["forward"]
    return model


def bert() -> nn.Module:
    """BERT for sequence classification (3 classes); dropout 0.1 in attention and hidden states (the defaults)."""
    import transformers

    cfg = _config("bert", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, max_position_embeddings=64, num_labels=3)
    model = transformers.AutoModelForSequenceClassification.from_config(cfg)

    def batch(batch_size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, VOCAB, (batch_size, SEQ))
        mask = torch.ones_like(ids)
        mask[-1, -4:] = 0
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": (torch.arange(SEQ) >= SEQ // 2).long().expand(batch_size, -1),
                "labels": torch.randint(0, 3, (batch_size,))}

    return _with_batch(model, batch)


def distilbert() -> nn.Module:
    """DistilBERT masked LM: the vocabulary projector is tied to the word embeddings."""
    import transformers

    cfg = _config("distilbert", vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=3, n_heads=4, max_position_embeddings=64,
                  pad_token_id=0)
    model = transformers.AutoModelForMaskedLM.from_config(cfg)

    def batch(batch_size: int) -> dict[str, torch.Tensor]:
        labels = torch.randint(1, VOCAB, (batch_size, SEQ))
        masked = torch.rand(batch_size, SEQ) < 0.3
        masked[:, 0] = True
        return {"input_ids": torch.where(masked, torch.zeros_like(labels), labels), "attention_mask": torch.ones_like(labels),
                "labels": torch.where(masked, labels, -100)}

    return _with_batch(model, batch)


def _seq2seq_batch(batch_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (batch_size, SEQ))
    mask = torch.ones_like(ids)
    mask[-1, -3:] = 0
    labels = torch.randint(3, VOCAB, (batch_size, SEQ // 2))
    labels[-1, -2:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def t5() -> nn.Module:
    """T5: 3 encoder and 2 decoder blocks; the first block of each stack computes the relative position bias the others get."""
    import transformers

    cfg = _config("t5", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0)
    return _with_batch(transformers.AutoModelForSeq2SeqLM.from_config(cfg), _seq2seq_batch)


def bart() -> nn.Module:
    """BART: encoder and decoder layers are different classes; dropout 0.1 (the default)."""
    import transformers

    cfg = _config("bart", vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    return _with_batch(transformers.AutoModelForSeq2SeqLM.from_config(cfg), _seq2seq_batch)


# --- timm ------------------------------------------------------------------------------------------


def vit() -> nn.Module:
    """A timm ViT (needs timm): 4 blocks of width 32 on 16x16 images in 4x4 patches."""
    from autotune.thirdparty import timm_model

    return timm_model("vit_tiny_patch16_224", num_classes=5, img_size=16, patch_size=4, depth=4, embed_dim=32, num_heads=2)


# --- Models of our own -------------------------------------------------------------------------------


class ResBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input, then ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def _down(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class BatchNormCNN(nn.Module):
    """A ResNet-like CNN: a stem, 3 stages of 2 residual blocks with BatchNorm, strided downsampling between stages."""

    def __init__(self, widths: tuple[int, int, int] = (8, 16, 16), classes: int = 5, image: int = 16) -> None:
        super().__init__()
        self.image, self.classes = image, classes
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        self.stage1 = nn.Sequential(ResBlock(widths[0]), ResBlock(widths[0]))
        self.down1 = _down(widths[0], widths[1])
        self.stage2 = nn.Sequential(ResBlock(widths[1]), ResBlock(widths[1]))
        self.down2 = _down(widths[1], widths[2])
        self.stage3 = nn.Sequential(ResBlock(widths[2]), ResBlock(widths[2]))
        self.head = nn.Linear(widths[2], classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stage1(self.stem(images))
        x = self.stage3(self.down2(self.stage2(self.down1(x))))
        return F.cross_entropy(self.head(x.mean(dim=(2, 3))), labels)

    def example_batch(self, batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        images = torch.randn(batch_size, 3, self.image, self.image)
        return (images, torch.randint(0, self.classes, (batch_size,))), None


class MaskedBlock(nn.Module):
    """Attention under the mask it is given, scaled by the scale it is given; returns (hidden, attention entropy)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, h: torch.Tensor, *, scale: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = h.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(self.ln(h)).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads) + mask
        probs = att.softmax(dim=-1)
        entropy = -(probs * probs.clamp_min(1e-9).log()).sum(-1).mean()
        h = h + scale * self.proj((probs @ v).transpose(1, 2).reshape(B, T, C))
        return h + self.mlp(h), entropy


class PerLayerArgs(nn.Module):
    """Every block gets its own learned scale and one of two masks; norms between blocks; the loss reads every hidden state."""

    def __init__(self, width: int = 32, depth: int = 6, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(MaskedBlock(width, heads) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.scales = nn.Parameter(torch.linspace(0.5, 1.5, depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        local = causal & ~torch.ones(T, T, dtype=torch.bool).tril(-3)  # the last 3 tokens only
        masks = [torch.zeros(T, T).masked_fill(~m, float("-inf")) for m in (causal, local)]
        h = self.embed(ids)
        hiddens, entropies = [], []
        for i, block in enumerate(self.blocks):
            h, entropy = block(h, scale=self.scales[i], mask=masks[i % 2])
            h = self.norms[i](h)
            hiddens.append(h)
            entropies.append(entropy)
        deep = torch.stack([x.pow(2).mean() for x in hiddens]).mean()
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten()) + 0.01 * deep + 0.01 * sum(entropies)

    def example_batch(self, batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        ids = torch.randint(0, VOCAB, (batch_size, SEQ))
        return (ids[:, :-1], ids[:, 1:]), None


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class DropoutExpertsBlock(nn.Module):
    """Dropout (p=0.2 as a module, 0.1 functional) and a dense mixture of experts kept in a ModuleList."""

    def __init__(self, width: int, experts: int = 3) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.dropout(self.ln(x), p=0.1, training=self.training)
        gates = self.router(h).softmax(dim=-1)
        out = sum(gates[..., e:e + 1] * expert(h) for e, expert in enumerate(self.experts))
        balance = gates.mean(dim=(0, 1)).pow(2).sum() * gates.shape[-1]
        return x + self.drop(out), balance


class DropoutExperts(nn.Module):
    """Blocks with dropout and experts; more dropout between the blocks, so the model's loop draws random numbers too."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(DropoutExpertsBlock(width) for _ in range(depth))
        self.between = nn.Dropout(0.1)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        balance = 0.0
        for block in self.blocks:
            h, b = block(self.between(h))
            balance = balance + b
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten()) + 0.01 * balance

    def example_batch(self, batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        ids = torch.randint(0, VOCAB, (batch_size, SEQ))
        return (ids[:, :-1], ids[:, 1:]), None


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.drop(torch.tanh(self.fc(self.ln(x))))


class CompiledBlock(nn.Module):
    """Four residual MLP blocks; the second is compiled (``block.compile(backend="aot_eager")``)."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.blocks[1].compile(backend="aot_eager")
        self.head = nn.Linear(width, 1)
        self.width = width

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, scale=0.5 + 0.25 * i)
        return F.mse_loss(self.head(x).squeeze(-1), y)

    def example_batch(self, batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        return (torch.randn(batch_size, 8, self.width), torch.randn(batch_size, 8)), None


class TorchTransformer(nn.Module):
    """PyTorch's own ``nn.Transformer`` (encoder and decoder layers of ``torch.nn``'s classes, dropout, a causal target
    mask and a padding mask): its blocks are ``torch.nn``'s, which autotune once did not count as blocks, and it clones
    its layers with ``copy.deepcopy`` as it is built (under a dry run's fake tensors too)."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.transformer = nn.Transformer(width, heads, num_encoder_layers=2, num_decoder_layers=3,
                                          dim_feedforward=2 * width, dropout=0.1, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        padding = src == 0  # token 0 pads
        # tgt_is_causal: else nn.TransformerDecoder compares the mask with a causal one by value, which fake tensors
        # cannot (the dry run would measure the model for real instead)
        h = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=causal, src_key_padding_mask=padding,
                             memory_key_padding_mask=padding, tgt_is_causal=True)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())

    def example_batch(self, batch_size: int) -> tuple[tuple[torch.Tensor, ...], None]:
        src = torch.randint(1, VOCAB, (batch_size, SEQ))
        src[:, -2:] = 0  # padded
        ids = torch.randint(0, VOCAB, (batch_size, SEQ))
        return (src, ids[:, :-1], ids[:, 1:]), None


class SequentialMLP(nn.Module):
    """An ``nn.Sequential`` of ``nn.Sequential(LayerNorm, Linear, GELU, Dropout, Linear)`` blocks: no class of its own."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                                  nn.Dropout(0.1), nn.Linear(2 * width, width)) for _ in range(depth)))
        self.width = width

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.body(x).sum(-1), y)

    def example_batch(self, batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        return (torch.randn(batch_size, 8, self.width), torch.randn(batch_size, 8)), None


# --- The zoo ---------------------------------------------------------------------------------------

# Dynamo reads .grad of non-leaf tensors while it traces a compiled block; the test settings turn that warning into an error.
_DYNAMO_GRAD_WARNING = "ignore:The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"


@dataclasses.dataclass(frozen=True)
class Member:
    """A zoo model and the chain autotune must find in it."""

    name: str
    build: Callable[[], nn.Module]
    containers: tuple[str, ...]
    length: int
    block_types: tuple[str, ...]
    needs: tuple[str, ...] = ("transformers",)  # packages it imports
    library: bool = True  # its library has a per-layer checkpointing switch of its own
    batch_size: int = 2
    warnings: tuple[str, ...] = ()  # pytest filterwarnings specs its steps need

    def marks(self) -> list:
        return [pytest.mark.filterwarnings(w) for w in self.warnings]


ZOO = [
    Member("gpt2", gpt2, ("transformer.h",), 5, ("GPT2Block",)),
    Member("llama", llama, ("model.layers",), 4, ("LlamaDecoderLayer",)),
    Member("llama_lora", llama_lora, ("base_model.model.model.layers",), 4, ("LlamaDecoderLayer",),
           needs=("transformers", "peft")),
    Member("gemma2", gemma2, ("model.layers",), 4, ("Gemma2DecoderLayer",)),
    Member("mixtral", mixtral, ("model.layers",), 3, ("MixtralDecoderLayer",)),
    Member("qwen2_moe", qwen2_moe, ("model.layers",), 4, ("Qwen2MoeDecoderLayer",)),
    Member("gpt_neox", gpt_neox, ("gpt_neox.layers",), 4, ("GPTNeoXLayer",)),
    Member("opt", opt, ("model.decoder.layers",), 4, ("OPTDecoderLayer",)),
    Member("qwen2_hooked", qwen2_hooked, ("model.layers",), 4, ("Qwen2DecoderLayer",), needs=("transformers", "accelerate")),
    Member("bert", bert, ("bert.encoder.layer",), 4, ("BertLayer",)),
    Member("distilbert", distilbert, ("distilbert.transformer.layer",), 3, ("TransformerBlock",)),
    Member("t5", t5, ("encoder.block", "decoder.block"), 5, ("T5Block",)),
    Member("bart", bart, ("model.encoder.layers", "model.decoder.layers"), 5, ("BartEncoderLayer", "BartDecoderLayer")),
    Member("vit", vit, ("blocks",), 4, ("Block",), needs=("timm",), batch_size=4),
    Member("cnn_batchnorm", BatchNormCNN, ("stage1", "stage2", "stage3"), 6, ("ResBlock",), needs=(), library=False,
           batch_size=4),
    Member("per_layer_args", PerLayerArgs, ("blocks",), 6, ("MaskedBlock",), needs=(), library=False),
    Member("dropout_experts", DropoutExperts, ("blocks",), 4, ("DropoutExpertsBlock",), needs=(), library=False),
    Member("compiled_block", CompiledBlock, ("blocks",), 4, ("MLPBlock",), needs=(), library=False,
           warnings=(_DYNAMO_GRAD_WARNING,)),
    Member("torch_transformer", TorchTransformer, ("transformer.encoder.layers", "transformer.decoder.layers"), 5,
           ("TransformerEncoderLayer", "TransformerDecoderLayer"), needs=(), library=False),
    Member("sequential_mlp", SequentialMLP, ("body",), 4, ("Sequential",), needs=(), library=False),
]
BY_NAME = {m.name: m for m in ZOO}
