"""Memory hygiene under load: N consecutive trials alternating OOM and success, in one process.

    python benchmarks/soak.py [--trials 100] [--out results]

Prints live tensor objects, the tensor meter's weak-reference finalisers and the process's
resident memory before and after, and their differences. A leak of one trial's model,
optimizer or activations per OOM would show as growth in all three.

Writes ``soak-cpu.json`` (the environment, the command, the trials' statuses and wall time, the counts before and
after) and ``.md`` (the table, from the JSON) in ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import weakref

import torch

from autotune.device import backend_for
from autotune.meters import TensorMeter
from autotune.records import Config, TrialSettings
from autotune.execution.trial import run_trial
from autotune.training.workload import Workload

TINY = {"n_layer": 2, "block_size": 16, "n_embd": 16, "n_head": 2, "vocab_size": 32}
BUDGET = 4 * 2**20
LABELS = {"tensors": "live tensor objects", "finalisers": "the tensor meter's finalisers",
          "rss_bytes": "resident memory (bytes)"}


def snapshot() -> dict[str, int]:
    gc.collect()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {
        "tensors": sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor)),
        "finalisers": len(weakref.finalize._registry),
        "rss_bytes": rss,
    }


def markdown(data: dict) -> str:
    env = data["environment"]
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(data["statuses"].items()))
    lines = [f"# Memory hygiene: {data['trials']} trials alternating OOM and success in one process "
             f"({env['device_name']}, torch {env['torch_version']})", "",
             f"Command: `{data['command']}`. TinyGPT shrunk ({', '.join(f'{k}={v}' for k, v in data['model_kwargs'].items())}), "
             f"fp32, no plan, under the tensor "
             f"meter's {data['budget_bytes'] // 2**20} MiB budget: batch 2 (fits) and batch 128 (out of memory) in "
             f"turn, after one of each to load kernels and caches. The trials: {statuses}, in {data['trials_s']:.1f} s (the "
             f"machine's load average {data['load_average']['start']:.1f} at the start, "
             f"{data['load_average']['end']:.1f} at the end, on {env['cpu_count']} cores).",
             "", "| count | before | after | change |", "|---|---:|---:|---:|"]
    for key, label in LABELS.items():
        b, a = data["before"][key], data["after"][key]
        lines.append(f"| {label} | {b:,} | {a:,} | {a - b:+,} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    workload = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=TINY)
    meter = TensorMeter(budget_bytes=BUDGET)
    settings = TrialSettings(warmup_steps=2, measure_steps=1)
    for batch in (2, 128):  # first trials load kernels and caches
        run_trial(workload, Config("fp32", 0, batch), device="cpu", meter=meter, settings=settings)
    before = snapshot()
    start, load = time.monotonic(), os.getloadavg()[0]
    statuses: dict[str, int] = {}
    for i in range(args.trials):
        m = run_trial(workload, Config("fp32", 0, 128 if i % 2 else 2), device="cpu", meter=meter, settings=settings)
        statuses[m.status] = statuses.get(m.status, 0) + 1
    trials_s = time.monotonic() - start
    after = snapshot()
    print(f"{args.trials} trials in {trials_s:.1f} s: {statuses}")
    for key in before:
        print(f"{key:<11} before {before[key]:>12,}  after {after[key]:>12,}  change {after[key] - before[key]:>+10,}")
    data = {"benchmark": "soak", "command": " ".join(["python benchmarks/soak.py", *sys.argv[1:]]),
            "environment": backend_for("cpu").environment(), "model_kwargs": TINY, "budget_bytes": BUDGET,
            "trials": args.trials, "statuses": statuses, "trials_s": round(trials_s, 1),
            "load_average": {"start": round(load, 2), "end": round(os.getloadavg()[0], 2)}, "before": before,
            "after": after, "change": {k: after[k] - before[k] for k in before}}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "soak-cpu")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    with open(stem + ".md", "w") as f:
        f.write(markdown(data))


if __name__ == "__main__":
    main()
