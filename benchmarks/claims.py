"""The practitioner's claims about mixed precision and checkpointing, measured on the bundled models.

    python benchmarks/claims.py [--reports results/grid-TinyGPT-cpu.json,results/grid-ResNetish-cpu.json]

Reads grid reports (``benchmarks/search_efficiency.py`` writes them; with ``--run`` this script
runs its own grids, budget 1GiB, fp32,bf16, segments auto, batch sizes 1..256, and writes them as
``results/grid-<model>-cpu.json``) and measures:

* **AMP's larger batch** (claimed 2-4x): the largest batch that fits in bf16 vs fp32, without
  checkpointing, at the resolution of the batch sizes and from the fitted memory lines
  (``(budget - fixed) / per_sample``, a continuous capacity).
* **Checkpointing on top** (claimed 1.5-3x): the largest batch with the best plan vs without
  checkpointing.
* **Memory saved and time added** (claimed 80%+ less memory for 20-40% more time): per plan, at
  the largest batch every plan of a precision ran, peak memory and activation memory
  (peak less the fitted fixed part) relative to no checkpointing, and step time relative to it.
* **The plan that minimises memory** (the guide's sqrt(L) segments was the optimum for grouped
  segments; autotune recomputes each block on its own).

Writes ``results/claims-<device>.json`` and ``.md``.

    python benchmarks/claims.py --selective [--rounds 3]

**Selective vs block plans**: per bundled model and zoo transformer (tests/zoo.py, tiny configs),
every block plan and selective plan at one precision and batch size: each plan's check on the
model (exact?), its peak, the activation memory it saves (peak less the fixed state, 4 x the
parameter bytes: weights, gradients, AdamW's two moments) and its step time relative to no
checkpointing, timed side by side in ``--rounds`` interleaved rounds (the median of the rounds'
medians); and which block plans each selective plan dominates (no more memory, no more time).
Writes ``results/selective-<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

import torch

import autotune
from autotune.device import backend_for
from autotune.vocabulary import plan_order
from autotune.units import format_bytes


def _capacity(model_row, budget):
    return (budget - model_row["fixed_bytes"]) / model_row["per_sample_bytes"]


def claims(report) -> dict:
    budget = report.budget_bytes
    limits = {(r["precision"], r["segments"]): r["max_batch_size"] for r in report.limits}
    lines = {(r["precision"], r["segments"]): r for r in report.memory_model.to_list()}
    trials = {m.config: m for m in report.trials}
    chain = (report.workload.get("chain") or {}).get("length")
    segments = plan_order(report.search["space"]["segments"], chain)  # least recompute first
    out: dict = {"model": report.workload["model"], "parameter_count": report.workload["parameter_count"],
                 "chain_length": chain, "budget_bytes": budget, "limits": report.limits}
    if ("fp32", "0") in limits and ("bf16", "0") in limits and limits[("fp32", "0")]:
        out["amp_batch_ratio"] = {
            "claimed": "2-4x",
            "fp32_max_batch": limits[("fp32", "0")], "bf16_max_batch": limits[("bf16", "0")],
            "ratio_at_batch_sizes": round(limits[("bf16", "0")] / limits[("fp32", "0")], 2),
            "ratio_of_fitted_capacity": round(_capacity(lines[("bf16", "0")], budget) / _capacity(lines[("fp32", "0")], budget), 2),
        }
    per_precision = {}
    for precision in report.search["space"]["precisions"]:
        plans = [s for s in segments if limits.get((precision, s))]
        if "0" not in plans:
            continue
        best = max(plans, key=lambda s: (_capacity(lines[(precision, s)], budget), -plans.index(s)))
        # The largest batch that every plan of this precision ran to the end: a like-for-like comparison.
        common = min(limits[(precision, s)] for s in plans)
        base = trials[autotune.Config(precision, "0", common)]
        fixed = lines[(precision, "0")]["fixed_bytes"]
        rows = []
        for s in plans:
            m = trials[autotune.Config(precision, s, common)]
            rows.append({
                "segments": s,
                "peak_bytes": m.peak_bytes,
                "peak_vs_no_checkpointing": round(m.peak_bytes / base.peak_bytes, 3),
                "activation_bytes_saved": round(1 - (m.peak_bytes - fixed) / (base.peak_bytes - fixed), 3),
                "step_time_vs_no_checkpointing": round(m.step_s / base.step_s, 3),
                "per_sample_bytes": lines[(precision, s)]["per_sample_bytes"],
                "max_batch_size": limits[(precision, s)],
            })
        per_precision[precision] = {
            "at_batch_size": common,
            "plans": rows,
            "checkpointing_batch_ratio": {
                "claimed": "1.5-3x",
                "best_segments": best,
                "ratio_at_batch_sizes": round(limits[(precision, best)] / limits[(precision, "0")], 2),
                "ratio_of_fitted_capacity": round(_capacity(lines[(precision, best)], budget)
                                                  / _capacity(lines[(precision, "0")], budget), 2),
            },
            "min_memory_segments": min(plans, key=lambda s: lines[(precision, s)]["per_sample_bytes"]),
            "sqrt_chain_length": None if not chain else round(math.sqrt(chain), 2),
        }
    out["checkpointing"] = per_precision
    return out


def markdown(data) -> str:
    env = data["environment"]
    lines = [f"# The practitioner's claims, measured ({env['device_name']}, torch {env['torch_version']})", "",
             f"Command: `{data['command']}`", ""]
    for c in data["models"]:
        lines += [f"## {c['model']} ({c['parameter_count']:,} parameters, chain of {c['chain_length']}), "
                  f"budget {format_bytes(c['budget_bytes'])}", ""]
        amp = c.get("amp_batch_ratio")
        if amp:
            lines.append(f"- AMP (bf16) vs fp32, largest batch without checkpointing (claimed 2-4x): {amp['bf16_max_batch']} vs "
                         f"{amp['fp32_max_batch']} = {amp['ratio_at_batch_sizes']}x at powers of two, "
                         f"{amp['ratio_of_fitted_capacity']}x by the fitted memory lines")
        for precision, p in c["checkpointing"].items():
            ck = p["checkpointing_batch_ratio"]
            lines.append(f"- {precision}: checkpointing on top (claimed 1.5-3x): plan {ck['best_segments']} fits "
                         f"{ck['ratio_at_batch_sizes']}x the batch at powers of two, {ck['ratio_of_fitted_capacity']}x by the "
                         f"fitted lines; least memory per sample with plan {p['min_memory_segments']} "
                         f"(L = {c['chain_length']}, sqrt(L) = {p['sqrt_chain_length']})")
        for precision, p in c["checkpointing"].items():
            lines += ["", f"{precision}, batch {p['at_batch_size']} (claimed: 80%+ memory saved for 20-40% more time):", "",
                      "| plan | peak | peak vs none | activations saved | step time vs none | largest batch |",
                      "|---:|---:|---:|---:|---:|---:|"]
            for r in p["plans"]:
                lines.append(f"| {r['segments']} | {format_bytes(r['peak_bytes'])} | {r['peak_vs_no_checkpointing']:.2f} | "
                             f"{r['activation_bytes_saved']:.0%} | {r['step_time_vs_no_checkpointing']:.2f} | {r['max_batch_size']} |")
        lines.append("")
    return "\n".join(lines)


# (name, model spec, kwargs, precision, batch size): the bundled models at their defaults, the README's GPT-2, the zoo.
SELECTIVE_MODELS = [
    ("TinyGPT", "autotune.examples:TinyGPT", None, "fp32", 16),
    ("ResNetish", "autotune.examples:ResNetish", None, "fp32", 32),
    ("GPT-2 (6 x 128)", "autotune.thirdparty:gpt2",
     {"n_layer": 6, "n_embd": 128, "n_head": 4, "n_positions": 128, "vocab_size": 2048}, "fp32", 16),
    *[(f"zoo {n}", f"tests.zoo:{n}", None, "fp32", 32)
      for n in ("gpt2", "llama", "gemma2", "mixtral", "gpt_neox", "opt", "bert", "t5", "bart")],
]
BLOCK_PLANS = ("every4", "2", "4", "all")


def selective_rows(spec: str, kwargs: dict | None, precision: str, batch_size: int, rounds: int) -> dict:
    """Every plan of one model side by side: check, peak, activations saved, step time vs none; dominance."""
    from autotune.plans.checkpointing import find_chain
    from autotune.meters import TensorMeter
    from autotune.execution.plan_check import check_plans
    from autotune.vocabulary import SELECTIVE, Plan
    from autotune.records import Config, TrialSettings
    from autotune.execution.trial import run_trial
    from autotune.training.workload import Workload

    w = Workload.from_specs(spec, model_kwargs=kwargs)
    model = w.build_model()
    w, params = w.with_chain(find_chain(model)), sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    plans = ["0"]
    for name in (*BLOCK_PLANS, *SELECTIVE):
        try:
            Plan(name).fits(w.chain.length, "the model")
            plans.append(name)
        except autotune.UsageError:
            pass
    checks = {c.plan: c.status for c in check_plans(w, plans, batch_size=2, device="cpu")}
    settings = TrialSettings(measure_steps=5, timeout_s=None)
    peaks, times = {}, {p: [] for p in plans}
    for r in range(rounds):  # interleaved, each round in another order: drift spreads over every plan
        for plan in plans[r % len(plans):] + plans[:r % len(plans)]:
            m = run_trial(w, Config(precision, plan, batch_size), device="cpu", meter=TensorMeter(), settings=settings)
            if m.status != "ok":
                raise SystemExit(f"{spec} {plan}: {m.status} {m.error}")
            peaks[plan] = m.peak_bytes
            times[plan].append(m.step_s)
    step = {p: sorted(v)[len(v) // 2] for p, v in times.items()}
    fixed = 4 * params
    rows = [{"plan": p, "check": checks.get(p, "-"), "peak_bytes": peaks[p], "peak_vs_none": peaks[p] / peaks["0"],
             "activations_saved": 1 - (peaks[p] - fixed) / (peaks["0"] - fixed), "step_s": step[p],
             "step_vs_none": step[p] / step["0"]} for p in plans]
    by = {r["plan"]: r for r in rows}
    for r in rows:
        if r["plan"] in SELECTIVE:
            r["dominates"] = [b for b in BLOCK_PLANS if b in by and r["peak_bytes"] <= by[b]["peak_bytes"]
                              and r["step_s"] <= by[b]["step_s"]]
    return {"model": spec, "model_kwargs": kwargs, "precision": precision, "batch_size": batch_size,
            "parameter_bytes": params, "chain_length": w.chain.length, "rounds": rounds, "plans": rows}


def selective_markdown(data: dict) -> str:
    env = data["environment"]
    lines = [f"# Selective vs block checkpoint plans, measured ({env['device_name']}, torch {env['torch_version']})", "",
             f"Command: `{data['command']}`. Peak: tensor meter (deterministic). Step time: median of "
             f"{data['models'][0]['rounds']} interleaved rounds' medians of 5 steps, relative to no checkpointing "
             f"in the same run. Activations saved: (peak - 4 x parameter bytes) relative to no checkpointing's.", ""]
    for name, c in zip(data["names"], data["models"]):
        lines += [f"## {name}: {c['precision']}, batch {c['batch_size']}, {c['chain_length']} blocks", "",
                  "| plan | check | peak | peak vs none | activations saved | step time vs none | dominates |",
                  "|---|---|---:|---:|---:|---:|---|"]
        for r in c["plans"]:
            lines.append(f"| {r['plan']} | {r['check']} | {format_bytes(r['peak_bytes'])} | {r['peak_vs_none']:.2f} | "
                         f"{r['activations_saved']:.0%} | {r['step_vs_none']:.2f} | {', '.join(r.get('dominates', [])) or ''} |")
        lines.append("")
    return "\n".join(lines)


def run_selective(args: argparse.Namespace) -> None:
    wanted = [m for m in SELECTIVE_MODELS if not args.only or any(o in m[0] for o in args.only.split(","))]
    data = {"benchmark": "selective", "command": " ".join(["python benchmarks/claims.py", *sys.argv[1:]]),
            "environment": backend_for(torch.device("cpu")).environment(), "names": [m[0] for m in wanted],
            "models": []}
    for name, spec, kwargs, precision, batch in wanted:
        print(f"{name} ...", file=sys.stderr, flush=True)
        data["models"].append(selective_rows(spec, kwargs, precision, batch, args.rounds))
    stem = os.path.join(args.out, "selective-cpu")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=2, default=str)
    with open(stem + ".md", "w") as f:
        f.write(selective_markdown(data) + "\n")
    print(selective_markdown(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reports", default="results/grid-TinyGPT-cpu.json,results/grid-ResNetish-cpu.json")
    parser.add_argument("--run", action="store_true", help="run the grids instead of reading reports")
    parser.add_argument("--batch-sizes", default="1..256", help="the grids' batch sizes with --run")
    parser.add_argument("--models", default="TinyGPT,ResNetish",
                        help="with --run, the bundled models to run grids for; the others' grid reports are read")
    parser.add_argument("--out", default="results")
    parser.add_argument("--selective", action="store_true", help="the selective-vs-block table instead of the claims")
    parser.add_argument("--rounds", type=int, default=3, help="with --selective: interleaved timing rounds")
    parser.add_argument("--only", default="", help="with --selective: only models whose name contains one of these")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)  # a folder that does not exist yet is made, not a crash at the first write
    if args.selective:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.zoo
        return run_selective(args)
    if args.run:
        reports = []
        store = tempfile.mkdtemp(prefix="autotune-claims-")  # a file: the trial heartbeat writes from a thread
        for name in ("TinyGPT", "ResNetish"):
            path = os.path.join(args.out, f"grid-{name}-cpu.json")  # what the claims are computed from
            if name not in args.models.split(","):
                reports.append(autotune.load(path))
                continue
            reports.append(autotune.tune(f"autotune.examples:{name}", device="cpu", budget="1GiB",
                                         precisions="fp32,bf16", segments="auto", batch_sizes=args.batch_sizes,
                                         strategy="grid", probe=False, storage=f"sqlite:///{store}/{name}.db", study=name))
            reports[-1].to_json(path)
    else:
        missing = [p for p in args.reports.split(",") if not os.path.exists(p)]
        if missing:
            sys.exit(f"claims: {', '.join(missing)} not found: run benchmarks/search_efficiency.py first, or pass --run")
        reports = [autotune.load(p) for p in args.reports.split(",")]
    device = reports[0].environment["device_type"]
    data = {"benchmark": "claims", "command": " ".join(["python benchmarks/claims.py", *sys.argv[1:]]),
            "environment": reports[0].environment if not args.run else backend_for(torch.device(device)).environment(),
            "sources": None if args.run else args.reports.split(","),
            "models": [claims(r) for r in reports]}
    stem = os.path.join(args.out, f"claims-{device}")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=2, default=str)
    with open(stem + ".md", "w") as f:
        f.write(markdown(data) + "\n")
    print(markdown(data))


if __name__ == "__main__":
    main()
