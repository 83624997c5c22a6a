"""The notes every export carries: what the framework cannot express of the measured plan, and the evaluation batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.export.context import APPLY_HINT, NAMES, Context
from autotune.vocabulary import EAGER

if TYPE_CHECKING:
    from autotune.report import Report

__all__ = ["eval_notes", "common_notes"]


# Where each framework takes the evaluation batch (DeepSpeed's config has none: the evaluation loader's)
EVAL_SETTING = {"hf": "per_device_eval_batch_size", "lightning": "val_batch_size: the validation DataLoader's batch_size",
                "accelerate": "eval_batch_size: the evaluation DataLoader's batch_size",
                "deepspeed": "no config key: the evaluation DataLoader's batch_size"}


def eval_notes(ctx: Context, framework: str) -> list[str]:
    """What the evaluation batch is (and what it is not) where the report found it."""
    limit = ctx.eval_limit
    if not limit:
        return []
    if limit["during_training_max_batch_size"] is None:
        return [f"no evaluation batch fits during training within the budget less headroom ({limit['source']}); "
                f"{EVAL_SETTING[framework].split(':')[0]} is left as it was"]
    notes = [f"evaluation batch ({EVAL_SETTING[framework]}) {ctx.eval_batch}: the largest whose forward pass and loss "
             f"under torch.no_grad(), with the weights and optimizer state resident (gradients freed), fit the budget "
             f"less headroom on the worst evaluation batch ({limit['source']}); for inference alone (no optimizer "
             f"state) {limit['inference_max_batch_size']}. It is not sized for generate() (token by token, with a "
             f"key/value cache)"]
    if ctx.compile != EAGER:
        notes.append("the evaluation batch was sized for the model evaluated eager, not compiled")
    if framework == "hf":
        notes.append("with compute_metrics the Trainer keeps every evaluation batch's logits on the device until "
                     "eval_accumulation_steps batches have passed: the evaluation batch is sized for one batch, so set "
                     "eval_accumulation_steps (e.g. 1) where the evaluation set's logits would not fit beside it")
    return notes


def common_notes(ctx: Context, report: Report, framework: str) -> list[str]:
    notes = []
    if ctx.plan == "1":
        notes.append("segments 1 recomputes nothing (the last segment is never recomputed): "
                     "no checkpointing is exported")
    name = NAMES[framework]
    if ctx.plan.state:
        notes.append("the state is in host memory, as measured (FSDP2's CPUOffloadPolicy): the optimizer steps on the "
                     "CPU, whose arithmetic equals the GPU's within float rounding")
    if ctx.offloads:
        notes.append(
            f"autotune measured {ctx.plan_text}; {name} has no setting that keeps activations in host memory, so this "
            f"export sets no checkpointing. Apply the measured plan in the model with {APPLY_HINT}: it installs the "
            f"checkpoint plan and the offload's saved-tensor hooks together. Without them the activations stay on the "
            f"device, a higher peak than measured")
    elif ctx.recomputes and framework != "hf":
        extra = (" (its activation_checkpointing section only configures the deepspeed.checkpointing.checkpoint calls "
                 "the model code makes itself)" if framework == "deepspeed" else "")
        notes.append(
            f"autotune measured {ctx.plan_text}; {name} has no setting for gradient checkpointing{extra}. Apply "
            f"the measured plan in the model with {APPLY_HINT} (use only its model; {name} handles precision and "
            f"accumulation), or the library's per-layer switch (transformers' model.gradient_checkpointing_enable(), "
            f"activation_checkpointing_enable() in newer releases; timm's model.set_grad_checkpointing()), which "
            f"checkpoints every block: the same or lower peak memory, more recompute (slower) than measured"
        )
    if ctx.recomputes and ctx.cache:
        notes.append(f"{', '.join(dict.fromkeys(ctx.cache))}: its key/value cache was off in training under the plan, as "
                     f"measured (a recompute would write it again): {APPLY_HINT} turns it off so, and transformers does "
                     f"itself under its own gradient checkpointing; applied any other way, pass use_cache=False in "
                     f"training")
    trainable, total = report.workload.get("trainable_parameter_count"), report.workload.get("parameter_count")
    if trainable is not None and total and trainable < total:
        notes.append(f"the model trains {trainable:,} of its {total:,} parameters (the rest frozen: an adapter's, as a "
                     f"PEFT model's), as measured: train the model your factory returns, as it is; the adapter's own "
                     f"settings (its rank, alpha, target modules) are the model's, which this export neither reads nor "
                     f"changes, and another adapter is another model to tune")
    if report.guard.fp32_modules:
        notes.append(f"the trials kept {', '.join(report.guard.fp32_modules)} in fp32; this export does not: "
                     f"{APPLY_HINT} does")
    if ctx.wrapper:
        notes.append(f"the batch size is per rank: {ctx.micro} on each of {ctx.world_size} ranks "
                     f"({ctx.micro * ctx.world_size} per micro-step) under {ctx.wrapper.upper()}, with "
                     f"{ctx.steps} accumulation step(s); the peak holds on every rank")
    if ctx.device_type == "cpu" and ctx.sixteen_bit:
        kind = "mixed precision" if ctx.fsdp_mixed else "bf16 weights" if ctx.true else "autocast mode"
        notes.append(f"the trials ran on a CPU: the {ctx.precision} setting asks for the same {kind} on the device you "
                     f"train on (a GPU), "
                     f"where peak memory and speed differ; run autotune there to measure them")
    return notes
