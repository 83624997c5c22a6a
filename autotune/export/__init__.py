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

import json
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable

from autotune.errors import UsageError
from autotune.export.context import APPLY_HINT, HF_SWITCHES, LIGHTNING_PRECISION, MP_POLICY, Context
from autotune.export.engines import accelerate, deepspeed
from autotune.export.notes import common_notes, eval_notes
from autotune.vocabulary import DEFAULT, EAGER, Parallel, compile_mode, is_static

if TYPE_CHECKING:
    from autotune.report import Report

__all__ = ["FRAMEWORKS", "LIGHTNING_PRECISION", "export", "write_exports", "parse_frameworks", "lightning_trainer_kwargs"]

FRAMEWORKS = ("hf", "lightning", "deepspeed", "accelerate")


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
    ctx = Context(
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
        eval_limit=report.eval_limit(rec.precision, rec.config.plan),
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
    notes += common_notes(ctx, report, framework) + eval_notes(ctx, framework)
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


# bf16-true in transformers' terms (transformers 5.25; the dtype argument was torch_dtype before 4.56)
HF_TRUE_NOTE = (
    "measured bf16-true: the model itself in bf16 (weights, gradients, AdamW's state), without autocast. "
    "TrainingArguments has no setting that casts the model: load it in bf16, from_pretrained(..., "
    "dtype=torch.bfloat16) (from_pretrained above; torch_dtype= before transformers 4.56), or call "
    "model.to(torch.bfloat16) before making the Trainer, and leave bf16 and fp16 False (set): the Trainer then trains "
    "the bf16 weights as they are and its optimizer keeps its state in their dtype, as measured; bf16=True would "
    "autocast over them too. from_pretrained keeps a model class's _keep_in_fp32_modules in fp32 (autotune cast every "
    "module); transformers 5's default dtype='auto' already loads a checkpoint saved in bf16 in bf16, so pass "
    "dtype=torch.float32 for the autocast precisions")


def _hf(ctx: Context, notes: list[str]) -> dict[str, Any]:
    args: dict[str, Any] = {
        "per_device_train_batch_size": ctx.micro,
        "gradient_accumulation_steps": ctx.steps,
        "bf16": ctx.bf16_flag,  # bf16-fsdp: the nearest (its note)
        "fp16": ctx.fp16_flag,
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
    if ctx.device_type == "cpu" and ctx.bf16_flag:
        notes.append("without a GPU, TrainingArguments refuses bf16=True unless use_cpu=True is passed too")
    if ctx.fsdp_mixed:
        notes.append(f"measured {ctx.precision}: FSDP2's {MP_POLICY}, without autocast. TrainingArguments has no "
                     f"setting for it: bf16=True (set) makes accelerate's FSDP2 gather the parameters in bf16 as "
                     f"measured, but reduce the gradients in bf16 and autocast too. To train as measured, set "
                     f"bf16=False and, once the Trainer is made and before train(), "
                     f"trainer.accelerator.state.fsdp_plugin.mixed_precision_policy = {MP_POLICY}")
    elif ctx.wrapper == Parallel.FSDP and ctx.sixteen_bit:
        notes.append(f"measured {ctx.precision}: autocast over FSDP2's fp32 parameters; with {ctx.precision}=True "
                     f"accelerate's FSDP2 also gathers the parameters and reduces the gradients in {ctx.precision}")
    if ctx.true:
        notes.append(HF_TRUE_NOTE)
    if ctx.wrapper == Parallel.FSDP:  # FSDP2 on each block (transformers' auto-wrap by layer class) and the root
        args["fsdp"] = "full_shard auto_wrap" + (" offload" if ctx.plan.state else "")
        args["fsdp_config"] = {"version": 2, "reshard_after_forward": True,
                               **({"transformer_layer_cls_to_wrap": ctx.block_types} if ctx.block_types else {})}
    if ctx.eval_batch:
        args["per_device_eval_batch_size"] = ctx.eval_batch
    if ctx.compile != EAGER:
        args["torch_compile"] = True
        if compile_mode(ctx.compile) != DEFAULT:
            args["torch_compile_mode"] = compile_mode(ctx.compile)
    return {"training_arguments": args, **({"from_pretrained": {"dtype": "bfloat16"}} if ctx.true else {})}


def _lightning(ctx: Context, notes: list[str]) -> dict[str, Any]:
    trainer: dict[str, Any] = {"precision": LIGHTNING_PRECISION[ctx.precision], "accumulate_grad_batches": ctx.steps}
    if ctx.clip is not None:
        trainer["gradient_clip_val"] = ctx.clip
    if ctx.device_type == "cpu" and ctx.fp16_flag:
        notes.append("on a CPU, Lightning replaces precision '16-mixed' with 'bf16-mixed' (with a warning)")
    if ctx.true:
        notes.append("precision 'bf16-true' trains as measured: Lightning casts the module's floating weights and "
                     "buffers to bf16 (and makes them in bf16 in the Trainer's init_module), casts the batch's "
                     "floating tensors, and neither autocasts nor scales the loss. It also makes bf16 the default "
                     "dtype inside the step, so a tensor the forward creates without a dtype is bf16 there and was "
                     "fp32 in the trials (autotune.apply's too)")
    if ctx.wrapper == Parallel.DDP:
        trainer["strategy"] = "ddp"
    elif ctx.wrapper == Parallel.FSDP:
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
    return {"trainer": trainer, "batch_size": ctx.micro, **({"val_batch_size": ctx.eval_batch} if ctx.eval_batch else {})}


def _lightning_fsdp_precision(ctx: Context) -> str:
    """What Lightning's FSDP precision does against what was measured under FSDP2 (Lightning 2.6: FSDPPrecision)."""
    if ctx.fsdp_mixed:
        return (f"measured {ctx.precision}: FSDP2's {MP_POLICY} without autocast. No Trainer precision says it (under "
                f"FSDPStrategy 'bf16-mixed' gathers, reduces and keeps buffers in bf16 and autocasts as well; "
                f"'bf16-true' also makes the weights bf16): precision is '32-true', and the policy is the strategy's, "
                f"FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) "
                f"with FSDP1, or the mp_policy above with ModelParallelStrategy")
    if not ctx.sixteen_bit:
        return "precision '32-true' under FSDPStrategy gathers, reduces and computes in fp32, as measured"
    if ctx.true:
        return ("precision 'bf16-true' under FSDPStrategy gathers, reduces and computes in bf16 over bf16 weights, as "
                "FSDP2 did over the bf16 model measured")
    return (f"measured {ctx.precision}: autocast over FSDP2's fp32 parameters. Under FSDPStrategy "
            f"'{LIGHTNING_PRECISION[ctx.precision]}' autocasts and also casts the gathered parameters, the gradients' "
            f"reduction and the buffers to 16 bits (FSDP1's MixedPrecision); to keep them in fp32 as measured pass "
            f"FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, "
            f"buffer_dtype=torch.float32))")


_BUILDERS: dict[str, Callable[[Context, list[str]], dict[str, Any]]] = {
    "hf": _hf, "lightning": _lightning, "deepspeed": deepspeed, "accelerate": accelerate,
}
