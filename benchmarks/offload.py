"""Activation offload, measured: each plan with and without ``+offload``, side by side at one batch.

    python benchmarks/offload.py [--device cpu] [--rounds 3] [--out results]

Per bundled model (TinyGPT, and ResNetish with its BatchNorm), in fp32, for the plans 0, 2, all and
sac-linear and each one offloaded: the plan check (exact?), the device peak (the tensor meter on
the CPU, allocated bytes on CUDA), the host peak (``host_peak_bytes``: what the host copies held
at once), the device peak against the plan without offload and against no plan at all, and the
step time against the plan without offload, timed side by side in ``--rounds`` interleaved rounds
(the median of the rounds' medians). The guide's claim is "80%+ of the memory saved" when
checkpointing and offloading combine; the table's last columns measure it.

On the CPU, device and host are one memory: offloading is emulated (host copies made outside the
meter), so the device peaks are real for a machine where they would be apart, and the step times
include a memory copy where a GPU would move the bytes over PCIe: they understate offload's cost.
``benchmarks/gpu_check.py`` measures it on CUDA.

Writes ``results/offload-<device>.json`` (the environment, the command, its wall time and every figure) and ``.md``
(the tables, from the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from autotune.device import backend_for, make_meter
from autotune.execution.trial import run_trial
from autotune.execution.plan_check import check_plans
from autotune.plans.checkpointing import find_chain
from autotune.records import Config, TrialSettings
from autotune.training.workload import Workload
from autotune.units import format_bytes

MODELS = [
    ("TinyGPT", "autotune.examples:TinyGPT", None, 16),
    ("ResNetish", "autotune.examples:ResNetish", None, 32),
]
PLANS = ["0", "2", "all", "sac-linear"]


def rows(spec: str, kwargs: dict | None, batch_size: int, device: torch.device, rounds: int) -> dict:
    """Every plan and its offloaded twin: check, device and host peaks, step time, side by side."""
    workload = Workload.from_specs(spec, model_kwargs=kwargs)
    workload = workload.with_chain(find_chain(workload.build_model(seed=0)))
    plans = [p for base in PLANS for p in (base, base + "+offload")]
    checks = {c.plan: c.status for c in check_plans(workload, plans, batch_size=2, device=device)}
    settings = TrialSettings(measure_steps=5, timeout_s=None)
    peaks, hosts, times = {}, {}, {p: [] for p in plans}
    for r in range(rounds):  # interleaved, each round starting elsewhere: drift spreads over every plan
        for plan in plans[r % len(plans):] + plans[:r % len(plans)]:
            m = run_trial(workload, Config("fp32", plan, batch_size), device=device, meter=make_meter(device),
                          settings=settings)
            if m.status != "ok":
                raise SystemExit(f"{spec} {plan}: {m.status} {m.error}")
            peaks[plan], hosts[plan] = m.peak_bytes, m.host_peak_bytes
            times[plan].append(m.step_s)
    step = {p: sorted(v)[len(v) // 2] for p, v in times.items()}
    out = []
    for plan in plans:
        base = plan.removesuffix("+offload")
        out.append({"plan": plan, "check": checks.get(plan, "-"), "peak_bytes": peaks[plan], "host_peak_bytes": hosts[plan],
                    "peak_vs_plan": peaks[plan] / peaks[base], "peak_vs_none": peaks[plan] / peaks["0"],
                    "step_s": step[plan], "step_vs_plan": step[plan] / step[base]})
    return {"model": spec, "model_kwargs": kwargs, "batch_size": batch_size, "chain_length": workload.chain.length,
            "rounds": rounds, "plans": out}


def markdown(data: dict) -> str:
    env = data["environment"]
    lines = [f"# Activation offload, measured ({env['device_name']}, torch {env['torch_version']})", "",
             f"Command: `{data['command']}` ({data['wall_s']:.0f} s; the machine's load average "
             f"{data['load_average']['start']:.1f} at the start, {data['load_average']['end']:.1f} at the end, on "
             f"{env['cpu_count']} cores). fp32. Device peak: "
             f"{'the tensor meter, host copies made outside it (offload emulated: one memory)' if env['device_type'] == 'cpu' else 'allocated bytes'}. "
             f"Host peak: what the host copies held at once. Step time: median of {data['models'][0]['rounds']} "
             f"interleaved rounds' medians of up to 5 steps, against the same plan without offload"
             f"{' (on the CPU a memory copy, not a PCIe transfer: it understates the cost)' if env['device_type'] == 'cpu' else ''}.", ""]
    for name, model in zip(data["names"], data["models"]):
        lines += [f"## {name}: batch {model['batch_size']}, {model['chain_length']} blocks", "",
                  "| plan | check | device peak | host peak | device peak vs the plan | vs no plan | step time vs the plan |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in model["plans"]:
            host = format_bytes(r["host_peak_bytes"]) if r["host_peak_bytes"] else "-"
            lines.append(f"| `{r['plan']}` | {r['check']} | {format_bytes(r['peak_bytes'])} | {host} | {r['peak_vs_plan']:.2f} | "
                         f"{r['peak_vs_none']:.2f} | {r['step_vs_plan']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    device = torch.device(args.device)
    data = {"benchmark": "offload", "command": " ".join(["python benchmarks/offload.py", *sys.argv[1:]]),
            "environment": backend_for(device).environment(), "names": [m[0] for m in MODELS], "models": []}
    started, load = time.monotonic(), os.getloadavg()[0]  # other jobs on the machine slow the step times
    for name, spec, kwargs, batch in MODELS:
        print(f"{name} ...", file=sys.stderr, flush=True)
        data["models"].append(rows(spec, kwargs, batch, device, args.rounds))
    data["wall_s"] = round(time.monotonic() - started, 1)
    data["load_average"] = {"start": round(load, 2), "end": round(os.getloadavg()[0], 2)}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"offload-{device.type}")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=2, default=str)
    with open(stem + ".md", "w") as f:
        f.write(markdown(data) + "\n")
    print(markdown(data))


if __name__ == "__main__":
    main()
