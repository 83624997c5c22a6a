"""Published memory figures, reproduced by a dry run on this CPU: one row per figure a project published.

    python benchmarks/published.py                   # every row; writes results/published-cpu.{json,md}
    python benchmarks/published.py --check           # each row's arguments parsed by autotune's parser; nothing run
    python benchmarks/published.py --only ID[,ID]    # those rows (the files then hold only them)
    python benchmarks/published.py --rows FILE       # rows from a JSON list instead (the fields of :class:`Row`)

A row is data (:data:`ROWS`): where the figure was published, the configuration measured, which statistic it is
(:data:`STATISTICS`: what torch or NVML reported, and the report field a dry run predicts it in), the figure as
printed with its unit, and either the autotune arguments that express the configuration or why none can. Each
expressible row runs ``python -m autotune ARGS --dry-run`` in a process that sees no GPU, reads the statistic from
the report's trial and writes ``predicted / published - 1`` as its error. Every row's arguments are parsed by
autotune's own parser before anything runs: a row naming an option that does not exist is one line and exit 2.

The models the rows name are in ``benchmarks/published_models.py``. About 5 minutes on 2 cores (the two Llama 3 8B
rows take most of it: their processes stay under 1 GiB).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from autotune.cli.parser import build_parser, options_from  # noqa: E402 - after the repository root is importable
from autotune.errors import AutotuneError  # noqa: E402
from autotune.units import format_bytes  # noqa: E402

COMMAND = "python benchmarks/published.py"
UNITS = {"GiB": 1 << 30, "MiB": 1 << 20, "tokens/s per GPU": 1, "samples/s": 1}  # a throughput's unit is itself


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
    published: float  # the figure as printed, in ``unit``
    unit: str  # a key of UNITS
    args: tuple[str, ...] | None = None  # autotune's arguments that express it (without --dry-run and --out)
    why_not: str | None = None  # why no arguments express it
    note: str = ""  # what the prediction does not model, or how the figure was read
    per_sample: float = 1.0  # a throughput row: its unit per predicted sample/s (tokens per sample / GPUs)

    @property
    def published_bytes(self) -> int:
        return round(self.published * UNITS[self.unit])

    @property
    def command(self) -> str | None:
        return None if self.args is None else shlex.join(["python", "-m", "autotune", *self.args, "--dry-run"])


class RowError(Exception):
    """A row that cannot be run as written: one line, exit 2."""


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


LLM_FOUNDRY = ("https://github.com/mosaicml/llm-foundry/blob/c90b9b312c644dbde5c9e6eef75c6f1c117d8782/scripts/train/"
               "benchmarking/README.md (MPT Training Benchmarks, H100 80GB BF16)")
NO_MPT = ("MPT with llm-foundry's own attention (FlashAttention, Triton) and Composer's FSDP: autotune has no such model "
          "among benchmarks/published_models.py, so the row stands unpredicted")


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
            "activation checkpointing", "throughput", 45455, "tokens/s per GPU", why_not=NO_MPT),
        Row("mpt-7b-8-tps", LLM_FOUNDRY, "7b, 2048 tokens, 8 GPUs (Throughput T/s/GPU)",
            "MPT 7B (6,658,859,008 parameters), sequence 2048, 8 H100 80GB, micro batch 6, FULL_SHARD, amp_bf16, no "
            "activation checkpointing", "throughput", 10643, "tokens/s per GPU", why_not=NO_MPT),
    ]


ROWS: tuple[Row, ...] = (*_torchtitan_rows(), *_hugging_face_rows(), *_throughput_rows())
CLI_ADDS = ("--dry-run", "--out", "--quiet")  # what this script adds to each row's arguments


# -- checking and running ---------------------------------------------------------------------------------------------


def check(rows: tuple[Row, ...]) -> None:
    """Raise :class:`RowError` for the first row that cannot run as written: an unknown statistic or unit, neither
    arguments nor a reason, or arguments autotune's parser refuses (an option that does not exist, a bad value)."""
    seen = set()
    for row in rows:
        if row.id in seen:
            raise RowError(f"row {row.id}: a second row has this id")
        seen.add(row.id)
        if row.statistic not in STATISTICS:
            raise RowError(f"row {row.id}: statistic {row.statistic!r} is not one of {', '.join(STATISTICS)}")
        if row.unit not in UNITS:
            raise RowError(f"row {row.id}: unit {row.unit!r} is not one of {', '.join(UNITS)}")
        if (row.args is None) == (row.why_not is None):
            raise RowError(f"row {row.id}: give either the arguments that express it or why none can, not "
                           f"{'both' if row.args is not None else 'neither'}")
        if row.args is not None:
            _parse(row)


def _parse(row: Row) -> None:
    """Parse the row's arguments as ``python -m autotune`` would, with the flags this script adds, into its options."""
    added = [a for a in row.args if a.split("=")[0] in CLI_ADDS]
    if added:
        raise RowError(f"row {row.id}: {added[0]} is added by {COMMAND}: leave it out of the row")
    parser = build_parser()

    def refuse(message: str) -> None:
        raise RowError(f"row {row.id}: autotune refuses its arguments: {message}")

    parser.error = refuse  # one line, ours, instead of argparse's usage and exit
    try:
        options_from(parser.parse_args([*row.args, "--dry-run", "--quiet", "--out", "x.json"]))
    except AutotuneError as exc:  # a value the options refuse (a precision, a size, a combination)
        refuse(str(exc))


def predict(row: Row, folder: str) -> dict[str, Any]:
    """Run the row's dry run in a process that sees no GPU; return the report's trial and the wall seconds."""
    out = os.path.join(folder, f"{row.id}.json")
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "autotune", *row.args, "--dry-run", "--quiet", "--out", out],
                          cwd=ROOT, env=env, text=True, capture_output=True)
    said = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode == 2:
        raise RowError(f"row {row.id}: {said[-1] if said else 'autotune exited 2'}")
    if done.returncode not in (0, 3) or not os.path.exists(out):
        raise RuntimeError(f"row {row.id}: autotune exited {done.returncode}: {said[-1] if said else ''}")
    with open(out) as f:
        trials = json.load(f)["trials"]
    return {"trial": trials[0], "seconds": round(time.monotonic() - started, 1)}


def result(row: Row, predicted: dict[str, Any] | None) -> dict[str, Any]:
    """Return the row as the JSON keeps it: the issue's keys first, then what the table and a reader need."""
    statistic = STATISTICS[row.statistic]
    trial = predicted["trial"] if predicted else None
    value = trial.get(statistic.field) if trial else None
    if value is not None and statistic.kind == "per_s":
        value = round(value * row.per_sample, 2)
    published = row.published if statistic.kind == "per_s" else row.published_bytes  # a throughput is not rounded
    return {"source": row.source, "config": row.config, "statistic": row.statistic,
            f"published_{statistic.kind}": published, f"predicted_{statistic.kind}": value,
            "error": None if value is None else round(value / published - 1, 4), "command": row.command,
            "id": row.id, "where": row.where, "published": f"{row.published:g} {row.unit}", "unit": row.unit,
            "statistic_says": statistic.says, "expressed": row.args is not None, "why_not": row.why_not,
            "note": row.note, "status": trial["status"] if trial else None,
            "predicted_s": predicted["seconds"] if predicted else None}


# -- the files --------------------------------------------------------------------------------------------------------


def _percent(error: float | None) -> str:
    return "-" if error is None else f"{error * 100:+.1f}%"


def _figure(value: int | None, unit: str) -> str:
    """Write bytes in the unit the source printed (MiB whole, GiB to a hundredth), then exactly."""
    if value is None:
        return "-"
    return f"{value / UNITS[unit]:,.{0 if unit == 'MiB' else 2}f} {unit} ({value:,} B)"


def markdown(data: dict[str, Any]) -> str:
    """Return the Markdown file, generated from the JSON's rows."""
    rows = data["rows"]
    expressed = [r for r in rows if r["expressed"]]
    said = []
    for kind, what in (("bytes", "memory"), ("per_s", "throughput")):
        errors = [abs(r["error"]) for r in expressed if r["error"] is not None and f"predicted_{kind}" in r]
        if errors:
            said.append(f"the {len(errors)} {what} rows each within {max(errors) * 100:.1f}% of the published figure")
    lines = [f"# Published memory and throughput figures, predicted by a dry run ({data['environment']['machine']}, "
             f"torch {data['environment']['torch']})", "",
             f"Command: `{data['command']}`. Each row a project published; the ones autotune's options express are "
             "predicted by `python -m autotune ... --dry-run` in a process that sees no GPU: predictions, not "
             f"measurements. {len(rows)} rows, {len(expressed)} expressed" + (f": {'; '.join(said)}." if said else "."),
             "",
             "| row | source | statistic | published | predicted | error |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        url = r["source"].split(" ")[0]
        kind = STATISTICS[r["statistic"]].kind
        value = r[f"predicted_{kind}"]
        figure = _figure(value, r["unit"]) if kind == "bytes" else "-" if value is None else f"{value:,.1f} {r['unit']}"
        predicted = figure if r["expressed"] else "not expressed"
        lines.append(f"| {r['id']} | [{r['where']}]({url}) | {r['statistic']} | {r['published']} | {predicted} | "
                     f"{_percent(r['error'])} |")
    lines += ["", "Statistics: " + "; ".join(f"**{name}**, {s.says}" for name, s in STATISTICS.items()
                                             if any(r["statistic"] == name for r in rows)) + ".", ""]
    for source in dict.fromkeys(r["source"] for r in rows):
        lines += [f"**{source}**", ""]
        for r in (r for r in rows if r["source"] == source):
            said = (f"`{r['command']}` ({r['predicted_s']} s){'; ' + r['note'] if r['note'] else ''}" if r["expressed"]
                    else f"not expressed: {r['why_not']}")
            lines.append(f"- {r['id']} ({r['where']}): {r['config']}. {said}.")
        lines.append("")
    return "\n".join(lines)


def _rows_from(path: str) -> tuple[Row, ...]:
    """Read rows from a JSON list of objects with :class:`Row`'s fields."""
    names = {f.name for f in dataclasses.fields(Row)}
    try:
        with open(path) as f:
            items = json.load(f)
    except (OSError, ValueError) as exc:
        raise RowError(f"--rows {path}: {exc}") from None
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise RowError(f"--rows {path}: not a JSON list of rows (objects with the fields {', '.join(sorted(names))})")
    rows = []
    for item in items:
        unknown = sorted(set(item) - names)
        if unknown:
            raise RowError(f"row {item.get('id', '?')}: unknown field {unknown[0]} (a row has "
                           f"{', '.join(sorted(names))})")
        try:
            rows.append(Row(**{**item, "args": None if item.get("args") is None else tuple(item["args"])}))
        except TypeError as exc:
            raise RowError(f"row {item.get('id', '?')}: {exc}") from None
    return tuple(rows)


def run(rows: tuple[Row, ...], out_dir: str, reports: str | None) -> dict[str, Any]:
    """Predict every expressible row (identical arguments once), write the JSON and the Markdown; return the data."""
    import torch

    done: dict[tuple[str, ...], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = reports or scratch
        os.makedirs(folder, exist_ok=True)
        results = []
        for row in rows:
            if row.args is not None and row.args not in done:
                done[row.args] = predict(row, folder)
            results.append(result(row, done.get(row.args) if row.args is not None else None))
            print(json.dumps({k: v for k, v in results[-1].items() if k in ("id", "error") or k.startswith("p")
                              and k.endswith(("_bytes", "_per_s"))}),
                  flush=True)
    data = {"command": COMMAND, "environment": {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
                                                "torch": torch.__version__}, "rows": results}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "published-cpu.json"), "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    with open(os.path.join(out_dir, "published-cpu.md"), "w") as f:
        f.write(markdown(data))
    return data


def main(argv: list[str] | None = None) -> int:
    """Check the rows, then predict them and write the files; a bad row is one line and exit 2."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "results"), help="where published-cpu.{json,md} go")
    parser.add_argument("--rows", help="a JSON list of rows to run instead of the table's")
    parser.add_argument("--only", help="comma-separated row ids")
    parser.add_argument("--check", action="store_true", help="parse every row's arguments; run nothing")
    parser.add_argument("--reports", help="keep each row's dry-run report in this folder")
    args = parser.parse_args(argv)
    try:
        rows = _rows_from(args.rows) if args.rows else ROWS
        if args.only:
            wanted = args.only.split(",")
            missing = [i for i in wanted if i not in {r.id for r in rows}]
            if missing:
                raise RowError(f"--only: no row {missing[0]}")
            rows = tuple(r for r in rows if r.id in wanted)
        check(rows)
        if not args.check:
            run(rows, args.out, args.reports)
    except RowError as exc:
        print(f"published.py: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a dry run that failed for another reason than its input
        print(f"published.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
