"""Transformers models as people plan them: every plan's predicted peak against its measured one, on this CPU.

    python benchmarks/transformers_sweep.py [--out results] [--arches llama,bert] [--quick]
    python benchmarks/transformers_sweep.py --from-json results/transformers_sweep-cpu.json   # the .md again

Ten Hugging Face transformers architectures at realistic widths (hidden 1024, 16 heads, 2 layers, 256 tokens,
vocabulary 8192, random weights built from their configs with every other default kept: ``use_cache`` on, dropout
as configured), each run

- with ``sdpa`` and with ``eager`` attention (where the architecture has both),
- with every token real, and with half of each batch right-padded by a quarter of its tokens (labels -100 there),
- in fp32 and bf16,

for every plan ``--segments auto`` offers its 2 blocks (0, the selective plans, all), at batch 1 and batch 4: each
configuration's memory trial measured (the tensor meter) and predicted (the same trial under fake tensors, as
``--dry-run`` predicts it: a model whose build reads values is built once for real and made fake). Written to
``results/transformers_sweep-cpu.json`` and ``.md``: each peak's error (predicted / measured - 1) and the error of
what batch 4 adds over batch 1. ``--quick``: fp32 and plans 0 and all only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autotune.execution.fake_build import fake_buildable  # noqa: E402
from autotune.execution.predict import fake_tensors, predict_trial, quiet_fake_kernels  # noqa: E402
from autotune.execution.trial import run_trial  # noqa: E402
from autotune.meters import TensorMeter  # noqa: E402
from autotune.plans.checkpointing import find_chain  # noqa: E402
from autotune.records import Config, TrialSettings  # noqa: E402
from autotune.training.workload import Workload  # noqa: E402
from autotune.vocabulary import auto_plans  # noqa: E402

HIDDEN, HEADS, LAYERS, TOKENS, VOCAB, MLP = 1024, 16, 2, 256, 8192, 2816
# Each architecture's config beyond the shared widths: (model type, masked LM?, its own settings)
ARCHES = {
    "llama": ("llama", False, {"num_key_value_heads": 4}),
    "mistral": ("mistral", False, {"num_key_value_heads": 4}),
    "qwen2": ("qwen2", False, {"num_key_value_heads": 4}),
    "qwen3": ("qwen3", False, {"num_key_value_heads": 4, "head_dim": 64}),
    "gemma3": ("gemma3_text", False, {"num_key_value_heads": 4, "head_dim": 64, "sliding_window": 128,
                                      "query_pre_attn_scalar": 64}),
    "phi3": ("phi3", False, {}),
    "gpt_neox": ("gpt_neox", False, {}),
    "opt": ("opt", False, {"ffn_dim": MLP, "word_embed_proj_dim": HIDDEN}),
    "bert": ("bert", True, {}),
    "modernbert": ("modernbert", True, {"global_attn_every_n_layers": 1, "cls_token_id": 1, "sep_token_id": 2}),
}
ATTENTION = ("sdpa", "eager")
PRECISIONS = ("fp32", "bf16")
BATCHES = (1, 4)


def build(arch: str = "llama", attention: str = "sdpa", padded: bool = False) -> torch.nn.Module:
    """The sweep's model of ``arch`` with ``attention``, and an ``example_batch`` (padded: half its rows end in a
    quarter of padding)."""
    import transformers

    model_type, masked, own = ARCHES[arch]
    config = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
              "intermediate_size": MLP, "vocab_size": VOCAB, "max_position_embeddings": 2048, "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": 2, **own}
    if "ffn_dim" in own:
        del config["intermediate_size"]
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    auto = transformers.AutoModelForMaskedLM if masked else transformers.AutoModelForCausalLM
    model = auto.from_config(cfg, attn_implementation=attention)

    def example_batch(self: torch.nn.Module, batch_size: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(batch_size)
        ids = torch.randint(5, VOCAB, (batch_size, TOKENS), generator=generator)
        mask = torch.ones_like(ids)
        if padded:
            mask[: max(1, batch_size // 2), -TOKENS // 4:] = 0
        labels = torch.where(mask.bool(), ids, -100)
        if masked:  # 15% of the real tokens predicted
            chosen = (torch.rand(ids.shape, generator=generator) < 0.15) & mask.bool()
            labels = torch.where(chosen, ids, -100)
            ids = torch.where(chosen, torch.full_like(ids, 4), ids)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    model.example_batch = types.MethodType(example_batch, model)
    return model


def _supported(arch: str, attention: str) -> str | None:
    """Why ``arch`` cannot run ``attention`` in this transformers (None where it can)."""
    try:
        build(arch, attention)
    except ValueError as exc:
        return str(exc).split(".")[0]
    return None


def variant(arch: str, attention: str, padded: bool, precisions: tuple[str, ...], plans: list[str] | None) -> list[dict]:
    """Every plan of one model, each precision, measured and predicted at each batch size: one row each."""
    workload = Workload.from_specs(f"{__name__}:build" if __name__ != "__main__" else "benchmarks.transformers_sweep:build",
                                   model_kwargs={"arch": arch, "attention": attention, "padded": padded},
                                   optimizer="torch.optim:AdamW")
    workload = workload.with_chain(find_chain(workload.build_model()))
    mode = fake_tensors()
    with quiet_fake_kernels():
        predicting = fake_buildable(workload, mode).workload
    rows = []
    for precision in precisions:
        for plan in plans or auto_plans(workload.chain.length):
            for batch in BATCHES:
                config = Config(precision, plan, batch)
                measured = run_trial(workload.unwarmed(), config, device="cpu", meter=TensorMeter("cpu"),
                                     timed=False, settings=TrialSettings(timeout_s=None))
                with quiet_fake_kernels():
                    predicted = predict_trial(predicting, config, mode=mode)
                rows.append({"arch": arch, "attention": attention, "padded": padded, "precision": precision,
                             "plan": str(plan), "batch_size": batch, "measured_status": str(measured.status),
                             "predicted_status": str(predicted.status), "measured_peak_bytes": measured.peak_bytes,
                             "predicted_peak_bytes": predicted.peak_bytes,
                             "error": _error(predicted.peak_bytes, measured.peak_bytes),
                             "note": measured.error or predicted.error})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _error(predicted: int | None, measured: int | None) -> float | None:
    return None if not predicted or not measured else round(predicted / measured - 1, 6)


def growths(rows: list[dict]) -> list[dict]:
    """What batch 4 adds over batch 1, measured and predicted, per model, precision and plan."""
    by = {(r["arch"], r["attention"], r["padded"], r["precision"], r["plan"], r["batch_size"]): r for r in rows}
    out = []
    for (arch, attention, padded, precision, plan, batch), four in by.items():
        one = by.get((arch, attention, padded, precision, plan, 1))
        if batch != 4 or one is None or None in (one["measured_peak_bytes"], four["measured_peak_bytes"]):
            continue
        measured = four["measured_peak_bytes"] - one["measured_peak_bytes"]
        predicted = four["predicted_peak_bytes"] - one["predicted_peak_bytes"]
        out.append({"arch": arch, "attention": attention, "padded": padded, "precision": precision, "plan": plan,
                    "measured_growth_bytes": measured, "predicted_growth_bytes": predicted,
                    "error": _error(predicted, measured)})
    return out


def markdown(data: dict) -> str:
    rows, grown = data["rows"], data["growths"]
    worst = max((abs(r["error"]) for r in rows if r["error"] is not None), default=0.0)
    worst_growth = max((abs(g["error"]) for g in grown if g["error"] is not None), default=0.0)
    exact = sum(r["predicted_peak_bytes"] == r["measured_peak_bytes"] for r in rows)
    lines = [f"# Transformers models, predicted against measured ({data['environment']['machine']}, torch "
             f"{data['environment']['torch']}, transformers {data['environment']['transformers']})", "",
             f"`{data['command']}`: {len(rows)} configurations ({data['seconds']:.0f} s). Hidden {HIDDEN}, {HEADS} "
             f"heads, {LAYERS} layers, {TOKENS} tokens, vocabulary {VOCAB}, AdamW; every plan `--segments auto` "
             f"offers; batches 1 and 4. {exact} of {len(rows)} peaks predicted equal to the byte; largest peak error "
             f"{worst:.2%}; largest error of what batch 4 adds over batch 1 {worst_growth:.2%}.", "",
             "| architecture | attention | padded | precision | plans | statuses equal | largest peak error | "
             "largest growth error |", "|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["arch"], r["attention"], r["padded"], r["precision"]), []).append(r)
    for (arch, attention, padded, precision), members in groups.items():
        errors = [abs(r["error"]) for r in members if r["error"] is not None]
        grow = [abs(g["error"]) for g in grown if (g["arch"], g["attention"], g["padded"], g["precision"])
                == (arch, attention, padded, precision) and g["error"] is not None]
        same = all(r["measured_status"] == r["predicted_status"] for r in members)
        plans = ", ".join(dict.fromkeys(r["plan"] for r in members))
        lines.append(f"| {arch} | {attention} | {'yes' if padded else 'no'} | {precision} | {plans} | "
                     f"{'yes' if same else 'NO'} | {max(errors, default=0.0):.2%} | {max(grow, default=0.0):.2%} |")
    if data["unsupported"]:
        lines += ["", "Not run (the architecture has no such attention in this transformers): "
                  + "; ".join(f"{k}: {v}" for k, v in data["unsupported"].items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "results"))
    parser.add_argument("--arches", default=",".join(ARCHES))
    parser.add_argument("--quick", action="store_true", help="fp32, plans 0 and all")
    parser.add_argument("--from-json", metavar="FILE", help="write only the .md again, from a JSON this wrote")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        with open(os.path.join(args.out, "transformers_sweep-cpu.md"), "w") as f:
            f.write(markdown(data))
        return
    import transformers

    torch.manual_seed(0)
    started, rows, unsupported = time.monotonic(), [], {}
    precisions, plans = (("fp32",), ["0", "all"]) if args.quick else (PRECISIONS, None)
    for arch in args.arches.split(","):
        for attention in ATTENTION:
            why = _supported(arch, attention)
            if why:
                unsupported[f"{arch} {attention}"] = why
                continue
            for padded in (False, True):
                rows += variant(arch, attention, padded, precisions, plans)
    command = "python benchmarks/transformers_sweep.py" + ("" if args.arches == ",".join(ARCHES) else
                                                           f" --arches {args.arches}") + (" --quick" if args.quick else "")
    data = {"command": command, "seconds": round(time.monotonic() - started, 1),
            "environment": {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
                            "transformers": transformers.__version__},
            "unsupported": unsupported, "rows": rows, "growths": growths(rows)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "transformers_sweep-cpu.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(args.out, "transformers_sweep-cpu.md"), "w") as f:
        f.write(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
