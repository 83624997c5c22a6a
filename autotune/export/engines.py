"""The DeepSpeed config and the accelerate settings of a recommendation (autotune.export's two engines)."""

from __future__ import annotations

import math
from typing import Any

from autotune.export.context import ACCELERATE_PRECISION, MP_POLICY, Context
from autotune.vocabulary import GROWTH_INTERVAL, INIT_LOSS_SCALE, Parallel

__all__ = ["deepspeed", "accelerate"]


def deepspeed(ctx: Context, notes: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": ctx.micro,
        "gradient_accumulation_steps": ctx.steps,
        "bf16": {"enabled": ctx.mode.compute_dtype == "bfloat16"},
        "fp16": {"enabled": ctx.fp16_flag},
    }
    if ctx.fsdp_mixed:
        config["communication_data_type"] = "fp32"  # the gradients reduced in fp32, as FSDP2's reduce_dtype did
    if ctx.true:  # no fp32 master weights: DeepSpeed 0.19's bf16 options, which its ZeRO optimizer (stage 1-3) reads
        config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        if not ctx.wrapper:
            config["zero_optimization"] = {"stage": 1}
    if ctx.fp16_flag:
        # Dynamic loss scaling as autotune's GradScaler does it: start at 2**16, halve on every overflow
        # (hysteresis 1), double after growth_interval clean steps. DeepSpeed's factors are fixed at 2 and 1/2,
        # GradScaler's defaults; it floors the scale at min_loss_scale, GradScaler has no floor.
        config["fp16"].update(loss_scale=0, initial_scale_power=int(math.log2(INIT_LOSS_SCALE)),
                              loss_scale_window=GROWTH_INTERVAL, hysteresis=1, min_loss_scale=1)
    if ctx.clip is not None:
        config["gradient_clipping"] = ctx.clip
    if ctx.fsdp_mixed:
        notes.append(
            f"measured {ctx.precision}: FSDP2's {MP_POLICY} without autocast. DeepSpeed's bf16 section computes with "
            f"bf16 weights over fp32 master weights in the optimizer, and communication_data_type fp32 reduces the "
            f"gradients in fp32: the same arithmetic, with DeepSpeed's own buffers (its memory differs)")
    elif ctx.true:
        notes.append(
            "measured bf16-true: DeepSpeed's bf16 section with bf16_master_weights_and_grads and bf16_optimizer_states "
            "keeps the weights, gradients and optimizer state in bf16 (DeepSpeed 0.19; no fp32 master weights), and "
            "ZeRO's optimizer, which they need, with its own buffers: stage 1 on one process shards nothing"
            + ("" if not ctx.wrapper else "; set a zero_optimization stage (1 to 3) for them"))
    elif ctx.sixteen_bit:
        notes.append(
            f"DeepSpeed's {ctx.precision} section casts the model's weights to 16 bits (fp32 master weights in the "
            f"optimizer) instead of autocasting an fp32 model as the trials did, so memory and speed differ from the "
            f"measurement. Its torch_autocast section ({{\"enabled\": true, \"dtype\": ...}}) autocasts as the trials "
            f"did, for the module types it lists"
        )
    notes.append("train_batch_size is left out: DeepSpeed derives it as micro-batch x accumulation steps x "
                 "data-parallel processes")
    if ctx.wrapper:  # no ZeRO stage was measured: DeepSpeed's own engine is not DDP or FSDP2
        notes.append(
            f"autotune measured {ctx.wrapper.upper()} on {ctx.world_size} ranks; no zero_optimization stage is set, "
            f"because none was measured: " + (
                "stage 0 is DeepSpeed's plain data parallelism, the nearest to DDP, with buckets of its own"
                if ctx.wrapper == Parallel.DDP else
                "stage 3 shards parameters, gradients and optimizer state as FSDP does, with its own prefetching and "
                "buffers, so its memory and speed differ from the measurement" + (
                    "; its offload_param and offload_optimizer (device cpu) are the nearest to the state in host "
                    "memory that was measured" if ctx.plan.state else "")))
    return {"config": config}


def accelerate(ctx: Context, notes: list[str]) -> dict[str, Any]:
    if ctx.clip is not None:
        notes.append(f"clip as measured with accelerator.clip_grad_norm_(model.parameters(), {ctx.clip}) before each "
                     f"optimizer step")
    if ctx.device_type == "cpu" and ctx.fp16_flag:
        notes.append("on a CPU, Accelerator(mixed_precision='fp16') neither autocasts nor scales the loss: "
                     "it trains in fp32")
    out: dict[str, Any] = {"accelerator": {"mixed_precision": ACCELERATE_PRECISION[ctx.precision],
                                           "gradient_accumulation_steps": ctx.steps},
                           "batch_size": ctx.micro, **({"eval_batch_size": ctx.eval_batch} if ctx.eval_batch else {})}
    if ctx.true:
        notes.append("measured bf16-true: accelerate has no mixed_precision for it ('no', set): cast the model with "
                     "model.to(torch.bfloat16) before accelerator.prepare, so the optimizer made over it keeps its "
                     "state in bf16, and feed it bf16 inputs; mixed_precision='bf16' would autocast over it (and under "
                     "FSDP2 upcast the parameters to fp32)")
    if ctx.wrapper == Parallel.FSDP:  # FullyShardedDataParallelPlugin(**fsdp_plugin): FSDP2, each block and the root
        out["fsdp_plugin"] = {"fsdp_version": 2, "reshard_after_forward": True,
                              **({"cpu_offload": True} if ctx.plan.state else {}),
                              **({"auto_wrap_policy": "transformer_based_wrap",
                                  "transformer_cls_names_to_wrap": ctx.block_types} if ctx.block_types else {})}
        notes.append("pass Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**fsdp_plugin), ...) and launch "
                     f"with accelerate launch --num_processes {ctx.world_size} (or torchrun)")
        _accelerate_fsdp_precision(ctx, out, notes)
    elif ctx.wrapper == Parallel.DDP:
        notes.append(f"accelerate wraps the model in DistributedDataParallel when launched on {ctx.world_size} "
                     f"processes (accelerate launch --num_processes {ctx.world_size}, or torchrun): as measured")
    return out


def _accelerate_fsdp_precision(ctx: Context, out: dict[str, Any], notes: list[str]) -> None:
    """The FSDP2 policy as measured (accelerate 1.16: an Accelerator's own mixed_precision gives the plugin a policy
    that casts parameters and reduction to it, unless the plugin already has one)."""
    if ctx.fsdp_mixed:  # a dtype is no JSON: the policy by name, for the plugin as an object
        out["mixed_precision_policy"] = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
        notes.append(f"measured {ctx.precision}: FSDP2's {MP_POLICY} without autocast, so mixed_precision is 'no' and "
                     f"the policy is the plugin's: FullyShardedDataParallelPlugin(**fsdp_plugin, "
                     f"mixed_precision_policy={MP_POLICY}) (mixed_precision_policy above, by name). mixed_precision="
                     f"'bf16' instead would reduce the gradients in bf16 and autocast as well")
    elif ctx.sixteen_bit and not ctx.true:  # autocast over fp32 FSDP2, as measured: the plugin's policy fp32
        out["fsdp_plugin"]["mixed_precision_policy"] = "fp32"
        notes.append(f"the plugin's mixed_precision_policy 'fp32' keeps FSDP2's gathered parameters and reduction in "
                     f"fp32 under the Accelerator's {ctx.precision} autocast, as measured; without it accelerate would "
                     f"cast both to {ctx.precision}")
