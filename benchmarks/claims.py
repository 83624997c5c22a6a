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
from autotune.plans import plan_order
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reports", default="results/grid-TinyGPT-cpu.json,results/grid-ResNetish-cpu.json")
    parser.add_argument("--run", action="store_true", help="run the grids instead of reading reports")
    parser.add_argument("--batch-sizes", default="1..256", help="the grids' batch sizes with --run")
    parser.add_argument("--models", default="TinyGPT,ResNetish",
                        help="with --run, the bundled models to run grids for; the others' grid reports are read")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
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
    data = {"benchmark": "claims", "command": "python benchmarks/claims.py " + " ".join(sys.argv[1:]),
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
