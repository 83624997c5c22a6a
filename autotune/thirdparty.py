"""Third-party models built offline from a configuration: Hugging Face transformers and timm.

Each factory builds a model with random weights (nothing is downloaded) and gives it an
``example_batch(batch_size)`` method, so it runs under autotune with no ``--data``::

    python -m autotune --model autotune.thirdparty:gpt2 --model-kwargs '{"n_layer": 12, "seq_len": 512}'
    python -m autotune --model autotune.thirdparty:timm_model --model-kwargs '{"name": "vit_small_patch16_224"}'
    python -m autotune --model autotune.thirdparty:hf_lora --model-kwargs '{"model_type": "llama", "r": 8}'

With ``--data`` the user's own batches are used instead. Transformers take a dict batch with
``labels`` and return an output with ``.loss``; timm models take ``(images, labels)`` and get a
cross-entropy ``loss(output, target)`` method. autotune finds the checkpoint chain in their block
lists (``transformer.h``, ``bert.encoder.layer``, ``blocks``) like any other model. :func:`hf_lora` puts a PEFT LoRA
adapter on a causal language model (the base frozen): autotune trains it as it is, its blocks found inside PEFT's
wrappers (``base_model.model.model.layers``).

:func:`library_checkpointing` turns on the library's own per-layer checkpointing
(``activation_checkpointing_enable()``, timm's ``set_grad_checkpointing()``), which the tuner
measures beside autotune's plans.
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Sequence

import torch
from torch import nn

from autotune.errors import UsageError, first_line

__all__ = ["INSTALLABLE", "not_found", "hf_causal_lm", "hf_masked_lm", "hf_lora", "gpt2", "bert", "timm_model",
           "library_checkpointing", "training_caches"]


# Packages users name in --optimizer (or --model, --data), by the names pip installs them under: the optimizers with
# less state (bitsandbytes' 8-bit AdamW, torchao's low-bit and stochastic-rounding AdamW, transformers' Adafactor)
INSTALLABLE = {"bitsandbytes": "bitsandbytes", "torchao": "torchao", "transformers": "transformers", "peft": "peft",
               "timm": "timm"}


def not_found(exc: ModuleNotFoundError, module_name: str) -> str:
    """Why ``module_name`` did not import, in words: a package of :data:`INSTALLABLE` not installed (``pip install
    NAME``), a module not found (its spelling), or the import that failed inside it."""
    package = (exc.name or "").split(".")[0]
    if package in INSTALLABLE and module_name.split(".")[0] == package:
        return f"needs {package}, which is not installed here: pip install {INSTALLABLE[package]}"
    if exc.name and module_name.startswith(exc.name):
        return f"no module named {exc.name!r} (check the spelling and that it is importable from here)"
    return f"importing {module_name!r} failed: {exc}"


def _require(package: str, extra: str | None = None) -> Any:
    """Import ``package``, or say in one line what to install (``extra``: autotune's optional extra that brings it)."""
    try:
        return __import__(package)
    except ImportError as exc:
        also = f" (autotune's extra {extra!r} brings it)" if extra else ""
        raise UsageError(f"this model needs {package} ({exc}): pip install {package}{also}") from None


def _hf_config(model_type: str, config: dict[str, Any]) -> Any:
    transformers = _require("transformers")
    try:
        return transformers.AutoConfig.for_model(model_type, **config)
    except ValueError as exc:  # an unknown model_type
        raise UsageError(f"transformers: {str(exc).splitlines()[0]}") from None


def _seq_len(config: Any, seq_len: int | None) -> int:
    longest = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if seq_len is None:
        return longest or 512
    if longest is not None and seq_len > longest:
        raise UsageError(f"seq_len {seq_len} is longer than the model's {longest} positions: lower it or raise the config's")
    return seq_len


def hf_causal_lm(model_type: str = "gpt2", seq_len: int | None = None, **config: Any) -> nn.Module:
    """A causal language model (``AutoModelForCausalLM``) from its config, trained on random tokens.

    ``config`` goes to the model type's config class (for GPT-2: ``n_layer``, ``n_embd``, ...);
    ``seq_len`` defaults to the model's context length. The key/value cache is off: training
    does not use it.
    """
    transformers = _require("transformers")
    cfg = _hf_config(model_type, {"use_cache": False, **config})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    length, vocab = _seq_len(cfg, seq_len), cfg.vocab_size

    def example_batch(self: nn.Module, batch_size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch_size, length))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    model.example_batch = types.MethodType(example_batch, model)
    return model


def hf_masked_lm(model_type: str = "bert", seq_len: int | None = None, mask_share: float = 0.15, **config: Any) -> nn.Module:
    """A masked language model (``AutoModelForMaskedLM``) from its config: ``mask_share`` of the tokens are predicted."""
    transformers = _require("transformers")
    cfg = _hf_config(model_type, config)
    model = transformers.AutoModelForMaskedLM.from_config(cfg)
    length, vocab = _seq_len(cfg, seq_len), cfg.vocab_size

    def example_batch(self: nn.Module, batch_size: int) -> dict[str, torch.Tensor]:
        labels = torch.randint(0, vocab, (batch_size, length))
        masked = torch.rand(batch_size, length) < mask_share
        masked[torch.arange(batch_size), torch.randint(0, length, (batch_size,))] = True  # no row without a target
        ids = torch.where(masked, torch.zeros_like(labels), labels)  # token 0 stands for [MASK]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.where(masked, labels, -100)}

    model.example_batch = types.MethodType(example_batch, model)
    return model


def hf_lora(model_type: str = "llama", seq_len: int | None = None, *, r: int = 8, lora_alpha: int = 16,
            target_modules: Sequence[str] = ("q_proj", "v_proj"), lora_dropout: float = 0.0, **config: Any) -> nn.Module:
    """A causal language model (:func:`hf_causal_lm`) with a PEFT LoRA adapter: the base frozen, the adapter trained.

    ``r``, ``lora_alpha``, ``target_modules`` and ``lora_dropout`` are PEFT's ``LoraConfig`` fields (the defaults:
    rank 8 on the attention's query and value projections, as LitGPT's and PEFT's examples train); ``config`` goes to
    the model type's config class. Needs peft (``pip install peft``, or autotune's ``peft`` extra).
    """
    peft = _require("peft", extra="peft")
    model = hf_causal_lm(model_type, seq_len, **config)
    adapter = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
                              lora_dropout=lora_dropout, task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, adapter)
    except ValueError as exc:  # target modules the model lacks
        raise UsageError(f"peft: {first_line(exc)}") from None


def gpt2(seq_len: int | None = None, **config: Any) -> nn.Module:
    """GPT-2 (``GPT2LMHeadModel``) from a ``GPT2Config``: e.g. ``{"n_layer": 12, "n_embd": 768}``."""
    return hf_causal_lm("gpt2", seq_len, **config)


def bert(seq_len: int | None = None, **config: Any) -> nn.Module:
    """BERT (``BertForMaskedLM``) from a ``BertConfig``: e.g. ``{"num_hidden_layers": 12}``."""
    return hf_masked_lm("bert", seq_len, **config)


def timm_model(name: str = "vit_small_patch16_224", num_classes: int = 1000, **kwargs: Any) -> nn.Module:
    """A timm model (``timm.create_model(name, pretrained=False, ...)``) trained on random images.

    ``kwargs`` go to ``create_model`` (for a ViT: ``img_size``, ``patch_size``, ``depth``,
    ``embed_dim``, ...); the image size comes from the model's ``pretrained_cfg`` or ``img_size``.
    """
    timm = _require("timm")
    try:
        model = timm.create_model(name, pretrained=False, num_classes=num_classes, **kwargs)
    except RuntimeError as exc:  # timm's "Unknown model (...)"
        raise UsageError(f"timm: {exc}") from None
    channels, height, width = model.pretrained_cfg.get("input_size", (3, 224, 224))
    size = kwargs.get("img_size")
    if size is not None:
        height, width = (size, size) if isinstance(size, int) else size

    def example_batch(self: nn.Module, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch_size, channels, height, width), torch.randint(0, num_classes, (batch_size,))

    def loss(self: nn.Module, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    model.example_batch = types.MethodType(example_batch, model)
    model.loss = types.MethodType(loss, model)
    return model


def library_checkpointing(model: nn.Module) -> str | None:
    """Turn on the model's own per-layer checkpointing, if its library has one; return its name, or None.

    Hugging Face: ``activation_checkpointing_enable`` (transformers 5; before it,
    ``gradient_checkpointing_enable``), non-reentrant; timm: ``set_grad_checkpointing(True)``.
    Both recompute every layer, the last one included.
    """
    if getattr(model, "supports_gradient_checkpointing", False):
        for name, keyword in (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
                              ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")):
            if callable(getattr(model, name, None)):
                getattr(model, name)(**{keyword: {"use_reentrant": False}})
                return name
    if callable(getattr(model, "set_grad_checkpointing", None)):
        try:
            model.set_grad_checkpointing(True)
        except (AssertionError, NotImplementedError):  # timm models without support assert
            return None
        return "set_grad_checkpointing"
    return None


def training_caches(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that build a key/value cache in training where their config says so.

    A transformers model keeps ``use_cache=True`` in its config as ``from_config`` and ``from_pretrained`` give it, and
    its forward then writes every layer's keys and values into a cache; a recompute writes them again (a checkpoint
    plan fails: the cache grows between the forward and its replay). transformers turns the cache off while its own
    gradient checkpointing trains (``merge_with_config_defaults``, ``GradientCheckpointingLayer``). These are the
    modules whose ``forward`` takes ``use_cache`` and whose ``config.use_cache`` is on, outermost first.
    """
    found = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True and _takes(module.forward, "use_cache"):
            found.append(module)
    return found


def _takes(function: Any, name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
