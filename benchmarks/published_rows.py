"""The rows of ``benchmarks/published.py``: each published memory figure, where it was published, the configuration
it was measured in, the statistic, and the autotune arguments that express it (or why none can).

The models the rows name are in ``benchmarks/published_models.py`` and ``benchmarks/litgpt_models.py``.
"""

from __future__ import annotations

import dataclasses
import json
import shlex

__all__ = ["ROWS", "STATISTICS", "UNITS", "Row", "Statistic"]

UNITS = {"GiB": 1 << 30, "MiB": 1 << 20, "GB": 10**9, "tokens/s per GPU": 1, "samples/s": 1}  # a throughput's unit is itself


@dataclasses.dataclass(frozen=True)
class Statistic:
    """A published statistic: what its publisher read, and the trial field of a dry run's report that predicts it."""

    says: str
    field: str  # a trial's field in the report
    kind: str = "bytes"  # the row's keys: published_<kind>, predicted_<kind> (a later "per_s" for throughput rows)


STATISTICS = {
    "max_memory_reserved": Statistic("torch.cuda's peak reserved bytes (the caching allocator's segments)",
                                     "peak_reserved_bytes"),
    "max_memory_allocated": Statistic("torch.cuda's peak allocated bytes (tensors, rounded to 512 bytes)",
                                      "peak_allocated_bytes"),
    "NVML used": Statistic("NVML's used device memory: what the caching allocator reserved and the CUDA context",
                           "peak_nvml_bytes"),
    "throughput": Statistic("training throughput: the dry run's predicted samples/s (its time model, --card), times "
                            "the row's tokens per sample over its GPUs where the figure is tokens/s per GPU",
                            "samples_per_s", kind="per_s"),
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One published figure and the configuration it was measured in."""

    id: str
    source: str  # where it was published (a URL, and the file of its repository)
    where: str  # which table or section of the source
    config: str  # the configuration, in words
    statistic: str  # a key of STATISTICS
    published: float | None  # the figure as printed, in ``unit``; None where it ran out of memory (``ran_out``)
    unit: str  # a key of UNITS
    args: tuple[str, ...] | None = None  # autotune's arguments that express it (without --dry-run and --out)
    why_not: str | None = None  # why no arguments express it
    note: str = ""  # what the prediction does not model, or how the figure was read
    ran_out: bool = False  # the source printed OOM: the configuration ran out of its device's memory (the budget)
    per_sample: float = 1.0  # a throughput row: its unit per predicted sample/s (tokens per sample / GPUs)

    @property
    def published_bytes(self) -> int | None:
        return None if self.published is None else round(self.published * UNITS[self.unit])

    @property
    def command(self) -> str | None:
        return None if self.args is None else shlex.join(["python", "-m", "autotune", *self.args, "--dry-run"])


# -- the rows ---------------------------------------------------------------------------------------------------------

TORCHTITAN = ("https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/"
              "llama3_h100_202412_torchtitan.md (runs of December 2024: torchtitan 9dec370, torch 1963fc8)")
TT_SETUP = ("Llama 3.1 8B (torchtitan's model: dim 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocab 128256) "
            "on H100s (96 GB HBM2e), FSDP2 with bf16 parameters and fp32 reduction")
TT_ADAMW = {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1, "foreach": True}


def _torchtitan_args(world_size: int) -> tuple[str, ...]:
    return ("--model", "benchmarks.published_models:llama3_torchtitan", "--step",
            "benchmarks.published_models:torchtitan_step", "--device", "cuda", "--cuda-capability", "9.0", "--budget",
            "95GiB", "--precisions", "bf16-fsdp", "--segments", "sac-torchtitan", "--batch-sizes", "2", "--optimizer",
            "torch.optim:AdamW", "--optimizer-kwargs", json.dumps(TT_ADAMW), "--clip-grad-norm", "1.0", "--parallel",
            "fsdp", "--world-size", str(world_size))


TT_NOTE = ("not modelled: torchtitan keeps the last block gathered from its forward to its backward "
           "(reshard_after_forward=False), autotune reshards every block; the prediction runs this torch's FSDP2, not "
           "December 2024's")
NO_COMPILE = "torch.compile: a dry run does not predict compiled training (--compile with --dry-run exits 2)"
NO_FLOAT8 = "Float8 linear layers (torchao): autotune has no float8 training precision"
NO_CP = "context parallelism: autotune's --parallel has ddp and fsdp, no context parallelism"
NO_TP = "tensor parallelism (and AsyncTP): autotune's --parallel has ddp and fsdp only"
NO_PP = "pipeline parallelism: autotune's --parallel has ddp and fsdp only"


def _tt(id: str, where: str, config: str, gib: float, *, world_size: int | None = None,
        why_not: str | None = None) -> Row:
    expressed = why_not is None
    return Row(id, TORCHTITAN, where, config, "max_memory_reserved", gib, "GiB",
               args=_torchtitan_args(world_size) if expressed else None, why_not=why_not,
               note=TT_NOTE if expressed else "")


def _torchtitan_rows() -> list[Row]:
    t1 = (f"{TT_SETUP}, 8 GPUs, local batch 2 of 8192 tokens, selective per-op activation checkpointing, AdamW "
          f"(foreach), gradient clipping at 1.0, cross-entropy on float32 logits")
    t3 = t1.replace("8 GPUs", "128 GPUs")
    t2 = "Llama 3.1 8B, FSDP + CP + torch.compile + Float8, 8 GPUs, local batch 1, full activation checkpointing"
    t6 = ("Llama 3.1 405B, 4D (FSDP + TP 8 + PP 8 + CP) + torch.compile + Float8 + AsyncTP + 1F1B, 512 GPUs, "
          "local batch 8")
    rows = [_tt("torchtitan-8b-fsdp-8", "Table 1, FSDP", t1, 82.4, world_size=8),
            _tt("torchtitan-8b-fsdp-compile-8", "Table 1, FSDP + torch.compile", t1 + ", torch.compile", 77.0,
                why_not=NO_COMPILE),
            _tt("torchtitan-8b-fsdp-compile-float8-8", "Table 1, FSDP + torch.compile + Float8",
                t1 + ", torch.compile, Float8", 76.8, why_not=f"{NO_COMPILE}; {NO_FLOAT8}")]
    for fsdp, cp, seq, gib in ((8, 1, 32768, 83.9), (4, 2, 65536, 84.2), (2, 4, 131072, 84.0), (1, 8, 262144, 84.5)):
        rows.append(_tt(f"torchtitan-8b-fsdp{fsdp}-cp{cp}", f"Table 2, FSDP {fsdp}, CP {cp}",
                        f"{t2}, FSDP {fsdp} x CP {cp}, {seq} tokens", gib,
                        why_not=f"{NO_COMPILE}; {NO_FLOAT8}" + (f"; {NO_CP}" if cp > 1 else "")))
    rows += [_tt("torchtitan-8b-fsdp-128", "Table 3, FSDP", t3, 67.0, world_size=128),
             _tt("torchtitan-8b-fsdp-compile-128", "Table 3, FSDP + torch.compile", t3 + ", torch.compile", 62.0,
                 why_not=NO_COMPILE),
             _tt("torchtitan-8b-fsdp-compile-float8-128", "Table 3, FSDP + torch.compile + Float8",
                 t3 + ", torch.compile, Float8", 61.8, why_not=f"{NO_COMPILE}; {NO_FLOAT8}")]
    t4 = ("Llama 3.1 70B, FSDP 32 x TP 8 + torch.compile + Float8, 256 GPUs, local batch 16, full activation "
          "checkpointing")
    t5 = "Llama 3.1 405B, FSDP 8 x TP 8 x PP 8 + torch.compile + Float8 + AsyncTP, 512 GPUs, local batch 32"
    rows += [_tt("torchtitan-70b-2d", "Table 4, 2D", t4, 71.9, why_not=f"{NO_TP}; {NO_COMPILE}; {NO_FLOAT8}"),
             _tt("torchtitan-70b-2d-asynctp", "Table 4, 2D + AsyncTP", t4 + ", AsyncTP", 67.6,
                 why_not=f"{NO_TP}; {NO_COMPILE}; {NO_FLOAT8}"),
             _tt("torchtitan-405b-3d-1f1b", "Table 5, 1F1B", t5 + ", 1F1B", 82.5,
                 why_not=f"{NO_PP}; {NO_TP}; {NO_COMPILE}; {NO_FLOAT8}"),
             _tt("torchtitan-405b-3d-interleaved", "Table 5, Interleaved 1F1B", t5 + ", interleaved 1F1B", 72.7,
                 why_not=f"{NO_PP}; {NO_TP}; {NO_COMPILE}; {NO_FLOAT8}")]
    for fsdp, cp, seq, gib in ((8, 1, 32768, 75.3), (4, 2, 65536, 75.9), (2, 4, 131072, 77.1), (1, 8, 262144, 84.9)):
        rows.append(_tt(f"torchtitan-405b-4d-fsdp{fsdp}-cp{cp}", f"Table 6, FSDP {fsdp}, CP {cp}",
                        f"{t6}, FSDP {fsdp} x CP {cp}, {seq} tokens", gib,
                        why_not=f"{NO_PP}; {NO_TP}; " + (f"{NO_CP}; " if cp > 1 else "")
                        + f"{NO_COMPILE}; {NO_FLOAT8}"))
    return rows


HUGGING_FACE = ("https://huggingface.co/docs/transformers/v4.27.2/en/perf_train_gpu_one (huggingface/transformers "
                "docs/source/en/perf_train_gpu_one.mdx; measured in January 2022 on a V100-SXM2 16 GB)")
HF_SETUP = ("bert-large-uncased, AutoModelForSequenceClassification, 512 random token ids and a label per sample, "
            "the Trainer (transformers 4.16, torch 1.10) on a V100 16 GB (compute capability 7.0), its CUDA context "
            "1343 MiB as the page measured it")
HF_ARGS = ("--model", "benchmarks.published_models:bert_classifier", "--model-kwargs", '{"attention": "2022"}',
           "--step", "benchmarks.published_models:zeroed_grads_step", "--device", "cuda", "--cuda-capability", "7.0",
           "--cuda-context", "1343MiB", "--budget", "16160MiB", "--clip-grad-norm", "1.0")
ADAMW_HF = ("--optimizer", "torch.optim:AdamW", "--optimizer-kwargs",
            '{"lr": 5e-05, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.0, "foreach": false}')
ADAFACTOR = ("--optimizer", "transformers.optimization:Adafactor", "--optimizer-kwargs",
             '{"lr": 5e-05, "scale_parameter": false, "relative_step": false, "warmup_init": false}')
HF_NOTE = ("the Trainer of 2022 under torch 1.x, expressed: --step zeroed_grads_step holds every gradient through the "
           "next step (torch 1.x's zero_grad set them to zero, not None); --model-kwargs attention 2022 is BERT's "
           "attention of transformers 4.16 under torch 1.10 (the float32 extended mask added to the scores, a softmax "
           "that keeps its input for backward); the Trainer's max_grad_norm 1.0 is --clip-grad-norm 1.0. MB on the "
           "page is MiB (NVML's used bytes // 1024**2)")
ADAMW_NOTE = ("; adamw_hf, transformers' own AdamW of then (gone from transformers 5), stepped parameter by parameter: "
              "torch's AdamW with foreach false")
NO_BNB = ("bitsandbytes' Adam8bit (passed to the Trainer as its optimizer): bitsandbytes is not installed here and its "
          "8-bit optimizers run CUDA kernels; autotune builds the optimizer to plan its state")


def _hf(id: str, where: str, config: str, mib: float, *args: str, why_not: str | None = None) -> Row:
    expressed = why_not is None
    note = HF_NOTE + (ADAMW_NOTE if "torch.optim:AdamW" in args else "") if expressed else ""
    return Row(id, HUGGING_FACE, where, f"{HF_SETUP}; {config}", "NVML used", mib, "MiB",
               args=(*HF_ARGS, *args) if expressed else None, why_not=why_not, note=note)


def _hugging_face_rows() -> list[Row]:
    one = ("--batch-sizes", "1", "--target-batch-size", "4")
    return [
        _hf("hf-bert-load", "Load Model", "the weights loaded, no training step", 2631,
            why_not="the weights alone, before any training step: autotune predicts training steps"),
        _hf("hf-bert-b4", "Vanilla Training", "batch 4, fp32, AdamW (adamw_hf)", 14949, *ADAMW_HF, "--precisions",
            "fp32", "--segments", "0", "--batch-sizes", "4"),
        _hf("hf-bert-b1-ga4", "Gradient Accumulation", "batch 1, gradient_accumulation_steps 4, fp32, AdamW", 8681,
            *ADAMW_HF, "--precisions", "fp32", "--segments", "0", *one),
        _hf("hf-bert-b1-ga4-gc", "Gradient Checkpointing", "batch 1, accumulation 4, gradient checkpointing, fp32, "
            "AdamW", 6775, *ADAMW_HF, "--precisions", "fp32", "--segments", "all", *one),
        _hf("hf-bert-b4-fp16", "FP16 Training", "batch 4, fp16, AdamW", 13939, *ADAMW_HF, "--precisions", "fp16",
            "--segments", "0", "--batch-sizes", "4"),
        _hf("hf-bert-b1-ga4-gc-fp16", "FP16 Training", "batch 1, accumulation 4, gradient checkpointing, fp16, AdamW",
            7275, *ADAMW_HF, "--precisions", "fp16", "--segments", "all", *one),
        _hf("hf-bert-b4-adafactor", "Adafactor", "batch 4, fp32, Adafactor (optim adafactor)", 12295, *ADAFACTOR,
            "--precisions", "fp32", "--segments", "0", "--batch-sizes", "4"),
        _hf("hf-bert-b1-ga4-gc-fp16-adafactor", "Adafactor", "batch 1, accumulation 4, gradient checkpointing, fp16, "
            "Adafactor", 4847, *ADAFACTOR, "--precisions", "fp16", "--segments", "all", *one),
        _hf("hf-bert-b4-adam8bit", "8-bit Adam", "batch 4, fp32, 8-bit Adam (bitsandbytes)", 13085, why_not=NO_BNB),
        _hf("hf-bert-b1-ga4-gc-fp16-adam8bit", "8-bit Adam", "batch 1, accumulation 4, gradient checkpointing, fp16, "
            "8-bit Adam (bitsandbytes)", 5363, why_not=NO_BNB),
        _hf("hf-bert-accelerate-adam8bit", "Using Accelerate", "the same in an Accelerate loop: batch 1, "
            "accumulation 4, gradient checkpointing, fp16, 8-bit Adam (bitsandbytes)", 5363, why_not=NO_BNB),
    ]


LITGPT = ("https://github.com/Lightning-AI/litgpt/blob/26857050fe3ff627cd714fe92f5838f51a3d5efa/tutorials/"
          "resource-tables.md (runs of October 2023: lit-gpt 8641822, torch 2.1.0, an A100-SXM4-40GB)")
LIT_SETUP = ("lit-gpt's finetune/lora.py (8641822) on an A100 40 GB: LoRA of rank 8, alpha 16, dropout 0.05 on the query "
             "and value (lit-gpt's fused LoRAQKVLinear), the rest frozen, bf16-true (Fabric), AdamW (lr 3e-4, weight "
             "decay 0.01), minibatch 128 by gradient accumulation, the head in chunks of 128 tokens and the loss "
             "chunked, on the longest Alpaca sample of the model's tokenizer")
LIT_MODELS = {"phi-1_5": ("phi-1.5", "phi-1.5 (24 layers, width 2048, 32 heads, MLP 8192, vocabulary 51200, "
                                     "parallel residual, LayerNorm), 1,044 tokens"),
              "stablelm-base-alpha-3b": ("StableLM Alpha 3B", "StableLM Alpha 3B (stablelm-base-alpha-3b: 16 layers, "
                                         "width 4096, 32 heads, MLP 16384, vocabulary 50688, GPT-NeoX), 1,034 tokens"),
              "Llama-2-7b-hf": ("Llama 2 7B", "Llama 2 7B (32 layers, width 4096, 32 heads, SwiGLU 11008, vocabulary "
                                "32000, RMSNorm), 1,304 tokens")}
LIT_NOTE = ("lit-gpt's model written from its architecture (benchmarks/litgpt_models.py: its bf16 RMSNorm, the rotary "
            "cache in float32 as the script rebuilds it after Fabric's cast, the head's chunks cast to float32 by "
            "Fabric's convert_output and held through backward); GB is 10**9 bytes (the script prints "
            "max_memory_allocated() / 1e9); the budget is the card's 39.59 GiB less the 512 MiB CUDA context "
            "autotune assumes. The peak is the first iteration's (the longest sample, forced first): no gradient is "
            "held from an earlier micro-batch yet, and AdamW's state (primed here) is 4 bytes a LoRA parameter, at "
            "most 17 MB; torch's flash kernel where lit-gpt used flash-attn 2 if installed (the same tensors kept)")

LLAMA_GAP = (". Not found: the Llama 2 rows are low by 0.67 GB at micro-batch 1 and 1.36 GB at 2, about 0.68 GB a "
             "sample, where phi-1.5 and StableLM (LayerNorm, GELU) agree within 0.4% at every micro-batch: 0.68 GB is "
             "two bf16 tensors of (1304, 4096) a layer, the size of one more tensor kept by each of a layer's two "
             "RMSNorms (lit-gpt's own, in bf16; what torch 2.1 kept for it is not checked here: this CPU has torch "
             "2.13 only)")


def _litgpt_rows() -> list[Row]:
    rows = []
    for name, published in (("phi-1_5", (4.82, 6.76, 10.68)), ("stablelm-base-alpha-3b", (9.69, 12.10, 16.92)),
                            ("Llama-2-7b-hf", (21.30, 29.07, None))):
        short, shape = LIT_MODELS[name]
        for micro, gb in zip((1, 2, 4), published):
            args = ("--model", "benchmarks.litgpt_models:litgpt_lora", "--model-kwargs", json.dumps({"name": name}),
                    "--step", "benchmarks.litgpt_models:litgpt_step", "--device", "cuda", "--cuda-capability", "8.0",
                    "--budget", "40028MiB", "--precisions", "bf16-true", "--segments", "0", "--batch-sizes",
                    str(micro), "--optimizer", "torch.optim:AdamW", "--optimizer-kwargs",
                    '{"lr": 0.0003, "weight_decay": 0.01}', "--no-eval-limits")
            note = LIT_NOTE + (LLAMA_GAP if name.startswith("Llama") and gb is not None else "")
            rows.append(Row(f"litgpt-lora-{name.lower()}-mb{micro}", LITGPT,
                            f"LoRA on 1 GPU, {short}, micro-batch {micro}", f"{LIT_SETUP}; {shape}, micro-batch "
                            f"{micro}", "max_memory_allocated", gb, "GB", args=args, note=note, ran_out=gb is None))
    return rows


LLM_FOUNDRY = ("https://github.com/mosaicml/llm-foundry/blob/c90b9b312c644dbde5c9e6eef75c6f1c117d8782/scripts/train/"
               "benchmarking/README.md (MPT Training Benchmarks, H100 80GB BF16)")
# llm-foundry's pretraining yamls (scripts/train/yamls/pretrain/mpt-{1b,7b}.yaml at 8c8dd48): decoupled AdamW, lr 2e-4
# (1b) and 1.2e-4 (7b), betas 0.9 and 0.95, eps 1e-8, no weight decay; gradient clipping by norm at 1.0
MPT_ADAMW = {"betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
MPT_LR = {"1b": 2e-4, "7b": 1.2e-4}
MPT_NOTE = ("the benchmark's model built from llm-foundry's yamls (benchmarks.published_models:mpt_foundry: "
            "{params} parameters against the table's {published}, -{gap}), trained as the table's row says (FULL_SHARD, "
            "amp_bf16 with Composer's DEFAULT mixed precision: bf16 compute, fp32 gradient reduction; no activation "
            "checkpointing), predicted as FSDP2's bf16-fsdp with causal SDPA (flash on an H100) where llm-foundry "
            "ran FlashAttention under Composer's FSDP1; the card: h100-sxm's data sheet")


def _mpt_args(size: str, batch: int) -> tuple[str, ...]:
    return ("--model", "benchmarks.published_models:mpt_foundry", "--model-kwargs", json.dumps({"size": size}),
            "--step", "benchmarks.published_models:torchtitan_step", "--device", "cuda", "--cuda-capability", "9.0",
            "--budget", "80GiB", "--precisions", "bf16-fsdp", "--segments", "0", "--batch-sizes", str(batch),
            "--optimizer", "torch.optim:AdamW", "--optimizer-kwargs", json.dumps({"lr": MPT_LR[size], **MPT_ADAMW}),
            "--clip-grad-norm", "1.0", "--parallel", "fsdp", "--world-size", "8", "--card", "h100-sxm")


TT_A100 = ("https://github.com/pytorch/torchtitan/blob/041336434916bdc0f88c1f89fda176fd3c2092e4/docs/performance.md "
           "(Llama 3 performance numbers: FSDP2 on 64 A100 80GB)")


def _a100_args() -> tuple[str, ...]:
    """torchtitan's 8B on 64 A100s: the H100 rows' job at local batch 1, planned for an a100-80gb."""
    args = list(_torchtitan_args(64))
    args[args.index("--batch-sizes") + 1] = "1"
    args[args.index("--budget") + 1] = "80GiB"
    return (*args, "--card", "a100-80gb")


def _throughput_rows() -> list[Row]:
    """Published training throughputs, predicted by a dry run's time model for the card each was measured on."""
    tt = _torchtitan_args(8)
    bert = next(r for r in _hugging_face_rows() if r.id == "hf-bert-b4")
    return [
        Row("torchtitan-8b-fsdp-8-tps", TORCHTITAN, "Table 1, FSDP (TPS/GPU)",
            f"{TT_SETUP}, 8 GPUs, local batch 2 of 8192 tokens, selective per-op activation checkpointing",
            "throughput", 5762, "tokens/s per GPU", args=(*tt, "--card", "h100-sxm"), per_sample=8192 / 8,
            note=TT_NOTE + "; the card: h100-sxm's data sheet (torchtitan's H100s had 96 GB: --budget says so)"),
        Row("torchtitan-8b-a100-64-tps", TT_A100, "8B, batch size 1, selective op (WPS)",
            "Llama 3 8B (torchtitan's model), 64 A100 80GB, FSDP2 with bf16 parameters, local batch 1 of 8192 tokens, "
            "selective per-op activation checkpointing (58.2% MFU as published)", "throughput", 2973,
            "tokens/s per GPU", args=_a100_args(), per_sample=8192 / 64,
            note="the job of the H100 rows at local batch 1; torchtitan and torch of mid 2024, not these. A miss "
                 "left in the file: the cards' efficiencies are assumed, one set for every card (GPU_EFFICIENCY), and "
                 "torchtitan's A100s reached 58.2% MFU where its December 2024 H100s reached about 28% (5,762 tokens/s "
                 "x 6 x 8.03e9 FLOPs over 989.5 TFLOPS): one set of efficiencies sits between them"),
        Row("hf-bert-b4-samples", HUGGING_FACE, "Vanilla Training (samples/second)", bert.config, "throughput", 8.86,
            "samples/s", args=(*bert.args, "--card", "v100"), note=bert.note + "; the card: v100's data sheet"),
        Row("mpt-1b-8-tps", LLM_FOUNDRY, "1b, 2048 tokens, 8 GPUs (Throughput T/s/GPU)",
            "MPT 1B (1,315,950,592 parameters), sequence 2048, 8 H100 80GB, micro batch 14, FULL_SHARD, amp_bf16, no "
            "activation checkpointing", "throughput", 45455, "tokens/s per GPU", args=_mpt_args("1b", 14),
            per_sample=2048 / 8, note=MPT_NOTE.format(params="1,315,407,872", published="1,315,950,592", gap="0.04%")),
        Row("mpt-7b-8-tps", LLM_FOUNDRY, "7b, 2048 tokens, 8 GPUs (Throughput T/s/GPU)",
            "MPT 7B (6,658,859,008 parameters), sequence 2048, 8 H100 80GB, micro batch 6, FULL_SHARD, amp_bf16, no "
            "activation checkpointing", "throughput", 10643, "tokens/s per GPU", args=_mpt_args("7b", 6),
            per_sample=2048 / 8, note=MPT_NOTE.format(params="6,657,413,120", published="6,658,859,008", gap="0.02%")),
    ]


ROWS: tuple[Row, ...] = (*_torchtitan_rows(), *_hugging_face_rows(), *_litgpt_rows(), *_throughput_rows())
