"""What every exporter reads from a report (Context), and the frameworks' names for autotune's settings."""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune.vocabulary import DEFAULT, EAGER, PRECISIONS, Plan, Precision, PrecisionName, compile_mode

__all__ = ["Context", "LIGHTNING_PRECISION", "ACCELERATE_PRECISION", "MP_POLICY", "NAMES", "HF_SWITCHES", "APPLY_HINT"]

# bf16-fsdp does not autocast: the Trainer's and the Accelerator's own setting is fp32's, and FSDP2's policy is the
# strategy's or the plugin's (the notes say how to pass it)
# bf16-true is Lightning's own "bf16-true"; accelerate has none (its "no", with the model cast by hand: the note)
_N = PrecisionName
LIGHTNING_PRECISION = {_N.FP32: "32-true", _N.FP16: "16-mixed", _N.BF16: "bf16-mixed", _N.BF16_FSDP: "32-true",
                       _N.BF16_TRUE: "bf16-true"}  # Lightning's words
ACCELERATE_PRECISION = {_N.FP32: "no", _N.FP16: "fp16", _N.BF16: "bf16", _N.BF16_FSDP: "no",
                        _N.BF16_TRUE: "no"}  # accelerate's words
# FSDP2's MixedPrecisionPolicy of bf16-fsdp, as Python writes it (FullyShardedDataParallelPlugin takes it as an object)
MP_POLICY = "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
NAMES = {"hf": "Hugging Face", "lightning": "Lightning", "deepspeed": "DeepSpeed", "accelerate": "accelerate"}
# The switches TrainingArguments(gradient_checkpointing=True) calls; "unknown": a report from before the tuner looked.
HF_SWITCHES = ("activation_checkpointing_enable", "gradient_checkpointing_enable", "unknown")
APPLY_HINT = "autotune.apply(model, report)"  # apply(model, recommendation, *, device_type=None) -> Applied


@dataclasses.dataclass(frozen=True)
class Context:
    """What every exporter needs from the report."""

    precision: str
    plan: Plan  # the checkpoint plan
    micro: int  # the recommendation's batch size, one micro-batch
    steps: int  # gradient accumulation steps: the report's accumulation plan, else 1
    chain: dict[str, Any]
    device_type: str | None  # where the trials ran
    clip: float | None
    library: str | None  # the model's own checkpointing switch the tuner found; "unknown" in reports before it looked
    wrapper: str | None = None  # --parallel: "ddp" or "fsdp" (FSDP2's fully_shard on each block and the root)
    world_size: int = 1
    compile: str = EAGER  # the torch.compile mode measured ("none": eager)
    cache: tuple[str, ...] = ()  # the modules whose key/value cache a recomputing plan turned off (plans.cache)
    eval_limit: dict[str, Any] | None = None  # the recommendation's evaluation limits (Report.eval_limit), if found

    @property
    def eval_batch(self) -> int | None:
        """The largest evaluation batch during training (the training state resident), if found."""
        return (self.eval_limit or {}).get("during_training_max_batch_size")

    @property
    def compile_call(self) -> str:
        """The call that compiles the model as measured (after the plan is applied: autotune.apply's model)."""
        mode = compile_mode(self.compile)  # a static measurement too: see STATIC_NOTE
        return "model = torch.compile(model" + ("" if mode == DEFAULT else f", mode={mode!r}") + ")"

    @property
    def mode(self) -> Precision:
        """What the measured precision is (the ground floor's record: its dtypes, its scaler)."""
        return PRECISIONS[self.precision]

    @property
    def sixteen_bit(self) -> bool:
        """Whether the passes ran in 16 bits at all (autocast, FSDP2's policy or the weights'): not fp32."""
        return self.mode.compute_dtype is not None

    @property
    def bf16_flag(self) -> bool:
        """Whether a trainer's ``bf16`` switch (autocast, or FSDP2's bf16 parameters) is the nearest to what was
        measured: not for bf16-true, whose model is cast instead."""
        return self.mode.compute_dtype == "bfloat16" and not self.true

    @property
    def fp16_flag(self) -> bool:
        """Whether a trainer's ``fp16`` switch (autocast in fp16 with a GradScaler) is what was measured."""
        return self.mode.autocast_dtype == "float16"

    @property
    def fsdp_mixed(self) -> bool:
        """Whether the precision is FSDP2's MixedPrecisionPolicy (bf16-fsdp), not autocast."""
        return PRECISIONS[self.precision].fsdp_only

    @property
    def true(self) -> bool:
        """Whether the precision holds the model itself in 16 bits (bf16-true), not autocast."""
        return PRECISIONS[self.precision].true

    @property
    def block_types(self) -> list[str]:
        """The class names of the repeated blocks (what FSDP wraps one by one)."""
        return list(dict.fromkeys(self.chain.get("block_types") or []))

    @property
    def recomputes(self) -> bool:
        """Whether the plan recomputes any block (``0`` and ``1`` do not, offloaded or not)."""
        return not self.plan.base.off

    @property
    def offloads(self) -> bool:
        """Whether the plan keeps its saved tensors in host memory (``PLAN+offload``): no framework setting does."""
        return self.plan.offload

    @property
    def plan_text(self) -> str:
        length = self.chain.get("length")
        where = " + ".join(self.chain.get("containers") or [self.chain.get("path") or ""]) or "the model"
        return self.plan.describe(f"the {length} blocks of {where}" if length else "the model's blocks")
