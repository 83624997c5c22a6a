"""Export a recommendation as the configuration Hugging Face, Lightning, DeepSpeed and accelerate expect.

    report = autotune.load("results/TinyGPT-cpu.json")
    args = TrainingArguments(output_dir="out", **export(report, "hf")["training_arguments"])
    write_exports(report, "results/TinyGPT-cpu.json", ("hf", "lightning"))  # results/TinyGPT-cpu.hf.json, ...

Each export holds the measured ``autotune_recommendation``, the framework's own keyword arguments
(micro-batch, accumulation steps from the report's accumulation plan, precision) and ``notes``: what the
framework cannot express. Hugging Face's per-layer switch expresses the plans ``all`` (every
layer) and ``everyN`` (``every_n_layers``) exactly; no framework has a setting for the other plans
(the blocks of the first N-1 of N segments); the notes say what the export does instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable

from autotune.errors import UsageError
from autotune.vocabulary import EAGER, GROWTH_INTERVAL, INIT_LOSS_SCALE, PRECISIONS, Plan, compile_mode, is_static

if TYPE_CHECKING:
    from autotune.report import Report

__all__ = ["FRAMEWORKS", "export", "write_exports", "parse_frameworks", "lightning_trainer_kwargs"]

FRAMEWORKS = ("hf", "lightning", "deepspeed", "accelerate")

# bf16-fsdp does not autocast: the Trainer's and the Accelerator's own setting is fp32's, and FSDP2's policy is the
# strategy's or the plugin's (the notes say how to pass it)
LIGHTNING_PRECISION = {"fp32": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed", "bf16-fsdp": "32-true"}
ACCELERATE_PRECISION = {"fp32": "no", "fp16": "fp16", "bf16": "bf16", "bf16-fsdp": "no"}
# FSDP2's MixedPrecisionPolicy of bf16-fsdp, as Python writes it (FullyShardedDataParallelPlugin takes it as an object)
MP_POLICY = "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
NAMES = {"hf": "Hugging Face", "lightning": "Lightning", "deepspeed": "DeepSpeed", "accelerate": "accelerate"}
# The switches TrainingArguments(gradient_checkpointing=True) calls; "unknown": a report from before the tuner looked.
HF_SWITCHES = ("activation_checkpointing_enable", "gradient_checkpointing_enable", "unknown")
APPLY_HINT = "autotune.apply(model, report)"  # apply(model, recommendation, *, device_type=None) -> Applied


@dataclasses.dataclass(frozen=True)
class _Context:
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

    @property
    def compile_call(self) -> str:
        """The call that compiles the model as measured (after the plan is applied: autotune.apply's model)."""
        mode = compile_mode(self.compile)  # a static measurement too: see STATIC_NOTE
        return "model = torch.compile(model" + ("" if mode == "default" else f", mode={mode!r}") + ")"

    @property
    def fsdp_mixed(self) -> bool:
        """Whether the precision is FSDP2's MixedPrecisionPolicy (bf16-fsdp), not autocast."""
        return PRECISIONS[self.precision].fsdp_only

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


def parse_frameworks(text: str | Iterable[str]) -> tuple[str, ...]:
    """Return the framework names in ``text`` ("hf,lightning", or values already split), in order, once each."""
    parts = [text] if isinstance(text, str) else list(text)
    names = [name.strip() for part in parts for name in part.split(",") if name.strip()]
    unknown = [name for name in names if name not in FRAMEWORKS]
    if unknown:
        raise UsageError(f"unknown framework {', '.join(map(repr, unknown))}: choose from {', '.join(FRAMEWORKS)}")
    if not names:
        raise UsageError(f"no framework given: choose from {', '.join(FRAMEWORKS)}")
    return tuple(dict.fromkeys(names))


# A static measurement (MODE+static) is trained with plain torch.compile: at one batch size it builds the same graph
# as dynamic=False, and where a batch of another size comes it compiles one dynamic graph, not one more per size.
STATIC_NOTE = ("measured compiled static (torch.compile(model, dynamic=False)) at batch size {batch}: plain "
               "torch.compile builds that graph while every batch has this size, so drop the last, shorter batch "
               "({drop}); a batch of another size compiles again (a dynamic graph, slower or faster: the report's "
               "search.static_compile compares the two)")


def export(report: Report, framework: str) -> dict[str, Any]:
    """Return ``report``'s recommendation as ``framework``'s configuration, a JSON-safe dict with ``notes``."""
    if framework not in FRAMEWORKS:
        raise UsageError(f"unknown framework {framework!r}: choose from {', '.join(FRAMEWORKS)}")
    rec = report.recommendation
    if rec is None:
        raise UsageError("nothing to export: the report has no recommendation")
    if report.dry_run:
        raise UsageError("nothing to export: a dry run's recommendation is an estimate (predicted, not measured): "
                         "search without --dry-run to export a measured one")
    accumulation = report.accumulation or {}
    ctx = _Context(
        precision=rec.precision,
        plan=rec.config.plan,
        micro=rec.batch_size,
        steps=int(accumulation.get("accumulation_steps") or 1),
        chain=report.workload.get("chain") or {},
        device_type=report.environment.get("device_type"),
        clip=report.guard.clip_grad_norm,
        library=report.workload.get("library_checkpointing", "unknown"),
        wrapper=(report.distributed or {}).get("wrapper"),
        world_size=int((report.distributed or {}).get("world_size", 1)),
        compile=rec.config.compile,
        cache=tuple(report.workload.get("training_cache") or ()),
    )
    data: dict[str, Any] = {"framework": framework, "autotune_recommendation": {
        "precision": rec.precision, "segments": rec.config.plan, "batch_size": rec.batch_size,
        "compile": rec.config.compile}}
    notes: list[str] = []
    data.update(_BUILDERS[framework](ctx, notes))
    if ctx.compile != EAGER and framework != "hf":  # TrainingArguments compiles itself (torch_compile)
        notes.append(f"measured compiled: {ctx.compile_call} after the checkpoint plan is applied (autotune.apply(model, "
                     f"report) compiles run.model so), before the framework wraps it"
                     + ("; in a LightningModule, compile in configure_model" if framework == "lightning" else ""))
    if is_static(ctx.compile):
        notes.append(STATIC_NOTE.format(batch=rec.batch_size, drop="dataloader_drop_last=True" if framework == "hf"
                                        else "DataLoader(..., drop_last=True)"))
    notes += _common_notes(ctx, report, framework)
    if accumulation.get("lr_note"):
        notes.append(accumulation["lr_note"])
    data["notes"] = notes
    return data


def lightning_trainer_kwargs(report: Report) -> dict[str, Any]:
    """The keyword arguments of a Lightning ``Trainer`` that trains the recommendation (precision, accumulation,
    clipping; the strategy of a --parallel report): what an existing trainer cannot take after it is made."""
    return dict(export(report, "lightning")["trainer"])


def write_exports(report: Report, json_path: str | os.PathLike, frameworks: str | Iterable[str]) -> list[str]:
    """Write ``<stem>.<framework>.json`` next to the report at ``json_path`` for each framework; return the paths."""
    stem = os.path.splitext(os.fspath(json_path))[0]
    exports = {f"{stem}.{name}.json": export(report, name) for name in parse_frameworks(frameworks)}  # all or none
    for path, data in exports.items():
        with open(path, "w") as f:
            f.write(json.dumps(data, indent=2, allow_nan=False) + "\n")
    return list(exports)


def _hf(ctx: _Context, notes: list[str]) -> dict[str, Any]:
    args: dict[str, Any] = {
        "per_device_train_batch_size": ctx.micro,
        "gradient_accumulation_steps": ctx.steps,
        "bf16": ctx.precision in ("bf16", "bf16-fsdp"),  # bf16-fsdp: the nearest (its note)
        "fp16": ctx.precision == "fp16",
        "gradient_checkpointing": ctx.recomputes and ctx.library in HF_SWITCHES and not ctx.offloads,
    }
    if ctx.offloads:
        pass  # the common note says how to train it: no TrainingArguments setting offloads activations
    elif ctx.recomputes and ctx.library not in HF_SWITCHES:
        notes.append(
            f"autotune measured {ctx.plan_text}, but the model has no transformers checkpointing switch (found: "
            f"{ctx.library or 'none'}), which TrainingArguments' gradient_checkpointing calls: it is left off. Apply the "
            f"measured plan with {APPLY_HINT} before building the Trainer"
        )
    elif ctx.recomputes:
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": False}  # autotune's checkpoints are non-reentrant
        if ctx.plan.every and ctx.plan.every > 1:
            args["gradient_checkpointing_kwargs"]["every_n_layers"] = ctx.plan.every
            notes.append("every_n_layers needs transformers 5.24 or later: earlier releases pass it on to "
                         "torch.utils.checkpoint, which refuses it")
        elif not ctx.plan.every:
            notes.append(
                f"autotune measured {ctx.plan_text}; TrainingArguments has no setting for it, so this export turns "
                f"on gradient_checkpointing, which checkpoints every layer of a transformers model (plan all): the "
                f"same or lower peak memory, more recompute (slower) than measured. To train exactly as measured, set "
                f"it to false and call {APPLY_HINT} before building the Trainer"
            )
        notes.append("newer transformers call these two arguments activation_checkpointing(_kwargs) and warn on the "
                     "old names, which v6 removes")
    if ctx.clip is not None:
        args["max_grad_norm"] = ctx.clip
    if ctx.device_type == "cpu" and ctx.precision in ("bf16", "bf16-fsdp"):
        notes.append("without a GPU, TrainingArguments refuses bf16=True unless use_cpu=True is passed too")
    if ctx.fsdp_mixed:
        notes.append(f"measured {ctx.precision}: FSDP2's {MP_POLICY}, without autocast. TrainingArguments has no "
                     f"setting for it: bf16=True (set) makes accelerate's FSDP2 gather the parameters in bf16 as "
                     f"measured, but reduce the gradients in bf16 and autocast too. To train as measured, set "
                     f"bf16=False and, once the Trainer is made and before train(), "
                     f"trainer.accelerator.state.fsdp_plugin.mixed_precision_policy = {MP_POLICY}")
    elif ctx.wrapper == "fsdp" and ctx.precision != "fp32":
        notes.append(f"measured {ctx.precision}: autocast over FSDP2's fp32 parameters; with {ctx.precision}=True "
                     f"accelerate's FSDP2 also gathers the parameters and reduces the gradients in {ctx.precision}")
    if ctx.wrapper == "fsdp":  # FSDP2 on each block (transformers' auto-wrap by layer class) and the root
        args["fsdp"] = "full_shard auto_wrap" + (" offload" if ctx.plan.state else "")
        args["fsdp_config"] = {"version": 2, "reshard_after_forward": True,
                               **({"transformer_layer_cls_to_wrap": ctx.block_types} if ctx.block_types else {})}
    if ctx.compile != EAGER:
        args["torch_compile"] = True
        if compile_mode(ctx.compile) != "default":
            args["torch_compile_mode"] = compile_mode(ctx.compile)
    return {"training_arguments": args}


def _lightning(ctx: _Context, notes: list[str]) -> dict[str, Any]:
    trainer: dict[str, Any] = {"precision": LIGHTNING_PRECISION[ctx.precision], "accumulate_grad_batches": ctx.steps}
    if ctx.clip is not None:
        trainer["gradient_clip_val"] = ctx.clip
    if ctx.device_type == "cpu" and ctx.precision == "fp16":
        notes.append("on a CPU, Lightning replaces precision '16-mixed' with 'bf16-mixed' (with a warning)")
    if ctx.wrapper == "ddp":
        trainer["strategy"] = "ddp"
    elif ctx.wrapper == "fsdp":
        trainer["strategy"] = "fsdp"
        notes.append(
            f"strategy 'fsdp' is Lightning's FSDPStrategy, which wraps with FSDP1 (FullyShardedDataParallel); autotune "
            f"measured FSDP2 (fully_shard on each {' / '.join(ctx.block_types) or 'block'} and the root). For FSDP1's "
            f"nearest equivalent pass FSDPStrategy(auto_wrap_policy={{{', '.join(ctx.block_types) or 'BlockClass'}}}, "
            f"sharding_strategy='FULL_SHARD'" + (", cpu_offload=True" if ctx.plan.state else "") + "); for the "
            f"wrapper measured, ModelParallelStrategy with fully_shard called in the LightningModule's configure_model"
            + (" with offload_policy=CPUOffloadPolicy()" if ctx.plan.state else "")
            + (f" and mp_policy={MP_POLICY}" if ctx.fsdp_mixed else ""))
        notes.append(_lightning_fsdp_precision(ctx))
    return {"trainer": trainer, "batch_size": ctx.micro}


def _lightning_fsdp_precision(ctx: _Context) -> str:
    """What Lightning's FSDP precision does against what was measured under FSDP2 (Lightning 2.6: FSDPPrecision)."""
    if ctx.fsdp_mixed:
        return (f"measured {ctx.precision}: FSDP2's {MP_POLICY} without autocast. No Trainer precision says it (under "
                f"FSDPStrategy 'bf16-mixed' gathers, reduces and keeps buffers in bf16 and autocasts as well; "
                f"'bf16-true' also makes the weights bf16): precision is '32-true', and the policy is the strategy's, "
                f"FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) "
                f"with FSDP1, or the mp_policy above with ModelParallelStrategy")
    if ctx.precision == "fp32":
        return "precision '32-true' under FSDPStrategy gathers, reduces and computes in fp32, as measured"
    return (f"measured {ctx.precision}: autocast over FSDP2's fp32 parameters. Under FSDPStrategy "
            f"'{LIGHTNING_PRECISION[ctx.precision]}' autocasts and also casts the gathered parameters, the gradients' "
            f"reduction and the buffers to 16 bits (FSDP1's MixedPrecision); to keep them in fp32 as measured pass "
            f"FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, "
            f"buffer_dtype=torch.float32))")


def _deepspeed(ctx: _Context, notes: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": ctx.micro,
        "gradient_accumulation_steps": ctx.steps,
        "bf16": {"enabled": ctx.precision in ("bf16", "bf16-fsdp")},
        "fp16": {"enabled": ctx.precision == "fp16"},
    }
    if ctx.fsdp_mixed:
        config["communication_data_type"] = "fp32"  # the gradients reduced in fp32, as FSDP2's reduce_dtype did
    if ctx.precision == "fp16":
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
    elif ctx.precision != "fp32":
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
                if ctx.wrapper == "ddp" else
                "stage 3 shards parameters, gradients and optimizer state as FSDP does, with its own prefetching and "
                "buffers, so its memory and speed differ from the measurement" + (
                    "; its offload_param and offload_optimizer (device cpu) are the nearest to the state in host "
                    "memory that was measured" if ctx.plan.state else "")))
    return {"config": config}


def _accelerate(ctx: _Context, notes: list[str]) -> dict[str, Any]:
    if ctx.clip is not None:
        notes.append(f"clip as measured with accelerator.clip_grad_norm_(model.parameters(), {ctx.clip}) before each "
                     f"optimizer step")
    if ctx.device_type == "cpu" and ctx.precision == "fp16":
        notes.append("on a CPU, Accelerator(mixed_precision='fp16') neither autocasts nor scales the loss: "
                     "it trains in fp32")
    out: dict[str, Any] = {"accelerator": {"mixed_precision": ACCELERATE_PRECISION[ctx.precision],
                                           "gradient_accumulation_steps": ctx.steps},
                           "batch_size": ctx.micro}
    if ctx.wrapper == "fsdp":  # FullyShardedDataParallelPlugin(**fsdp_plugin): FSDP2, each block and the root
        out["fsdp_plugin"] = {"fsdp_version": 2, "reshard_after_forward": True,
                              **({"cpu_offload": True} if ctx.plan.state else {}),
                              **({"auto_wrap_policy": "transformer_based_wrap",
                                  "transformer_cls_names_to_wrap": ctx.block_types} if ctx.block_types else {})}
        notes.append("pass Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**fsdp_plugin), ...) and launch "
                     f"with accelerate launch --num_processes {ctx.world_size} (or torchrun)")
        _accelerate_fsdp_precision(ctx, out, notes)
    elif ctx.wrapper == "ddp":
        notes.append(f"accelerate wraps the model in DistributedDataParallel when launched on {ctx.world_size} "
                     f"processes (accelerate launch --num_processes {ctx.world_size}, or torchrun): as measured")
    return out


def _accelerate_fsdp_precision(ctx: _Context, out: dict[str, Any], notes: list[str]) -> None:
    """The FSDP2 policy as measured (accelerate 1.16: an Accelerator's own mixed_precision gives the plugin a policy
    that casts parameters and reduction to it, unless the plugin already has one)."""
    if ctx.fsdp_mixed:  # a dtype is no JSON: the policy by name, for the plugin as an object
        out["mixed_precision_policy"] = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
        notes.append(f"measured {ctx.precision}: FSDP2's {MP_POLICY} without autocast, so mixed_precision is 'no' and "
                     f"the policy is the plugin's: FullyShardedDataParallelPlugin(**fsdp_plugin, "
                     f"mixed_precision_policy={MP_POLICY}) (mixed_precision_policy above, by name). mixed_precision="
                     f"'bf16' instead would reduce the gradients in bf16 and autocast as well")
    elif ctx.precision != "fp32":  # autocast over fp32 FSDP2, as measured: the plugin's policy fp32, set before
        out["fsdp_plugin"]["mixed_precision_policy"] = "fp32"
        notes.append(f"the plugin's mixed_precision_policy 'fp32' keeps FSDP2's gathered parameters and reduction in "
                     f"fp32 under the Accelerator's {ctx.precision} autocast, as measured; without it accelerate would "
                     f"cast both to {ctx.precision}")


_BUILDERS: dict[str, Callable[[_Context, list[str]], dict[str, Any]]] = {
    "hf": _hf, "lightning": _lightning, "deepspeed": _deepspeed, "accelerate": _accelerate,
}


def _common_notes(ctx: _Context, report: Report, framework: str) -> list[str]:
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
    if ctx.device_type == "cpu" and ctx.precision != "fp32":
        notes.append(f"the trials ran on a CPU: the {ctx.precision} setting asks for the same "
                     f"{'mixed precision' if ctx.fsdp_mixed else 'autocast mode'} on the device you train on (a GPU), "
                     f"where peak memory and speed differ; run autotune there to measure them")
    return notes
