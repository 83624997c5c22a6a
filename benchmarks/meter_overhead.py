"""How much the CPU tensor meter slows a training step: metered vs plain steps, side by side in one run.

    python benchmarks/meter_overhead.py [--batch-size 8] [--steps 5] [--out results]

Prints, per precision, the median plain step time, the median metered step time and their ratio.
This is why trials time their steps outside the meter (see autotune/execution/trial.py).

Writes ``meter_overhead-cpu.json`` (the environment, the command, its wall time, every step's time) and ``.md``
(the table, from the JSON) in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from autotune.device import backend_for
from autotune.meters import TensorMeter
from autotune.training.precision import get_mode
from autotune.training.workload import Workload


def measure(workload: Workload, name: str, batch_size: int, steps: int) -> dict:
    """Plain and metered steps of one precision, interleaved, so drift in machine load hits both alike."""
    mode = get_mode(name)
    torch.manual_seed(0)
    model = workload.build_model()
    opt = torch.optim.AdamW(model.parameters())
    batch = workload.make_batch(model, batch_size)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with mode.autocast("cpu"):
            loss = workload.loss(model, batch)
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    step()  # warm up
    plain, metered = [], []
    for _ in range(steps):
        plain.append(step())
        with TensorMeter().measure() as h:
            h.track(model.parameters())
            metered.append(step())
    p, m = statistics.median(plain), statistics.median(metered)
    return {"precision": name, "plain_s": round(p, 4), "metered_s": round(m, 4), "ratio": round(m / p, 3),
            "plain_steps_s": [round(t, 4) for t in plain], "metered_steps_s": [round(t, 4) for t in metered]}


def markdown(data: dict) -> str:
    env = data["environment"]
    lines = [f"# The tensor meter's cost: metered vs plain steps ({env['device_name']}, torch {env['torch_version']}, "
             f"{env['torch_threads']} threads)", "",
             f"Command: `{data['command']}` ({data['wall_s']:.0f} s; the machine's load average "
             f"{data['load_average']['start']:.1f} at the start, {data['load_average']['end']:.1f} at the end, on "
             f"{env['cpu_count']} cores). {data['model']}, batch {data['batch_size']}, "
             f"AdamW; per precision {data['steps']} plain and {data['steps']} metered steps, interleaved, after one "
             f"warm-up step; the medians.", "",
             "| precision | plain s/step | metered s/step | metered vs plain |",
             "|---|---:|---:|---:|"]
    lines += [f"| {r['precision']} | {r['plain_s']:.3f} | {r['metered_s']:.3f} | {r['ratio']:.2f}x |" for r in data["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="autotune.examples:TinyGPT")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    workload = Workload.from_specs(args.model)
    print(f"{args.model}, batch {args.batch_size}, {args.steps} steps each, {torch.get_num_threads()} threads")
    print(f"{'precision':<9} {'plain s/step':>12} {'metered s/step':>14} {'ratio':>6}")
    data = {"benchmark": "meter_overhead", "command": " ".join(["python benchmarks/meter_overhead.py", *sys.argv[1:]]),
            "environment": backend_for("cpu").environment(), "model": args.model, "batch_size": args.batch_size,
            "steps": args.steps, "rows": []}
    started, load = time.monotonic(), os.getloadavg()[0]  # other jobs on the machine slow both kinds of step
    for name in ("fp32", "bf16"):
        row = measure(workload, name, args.batch_size, args.steps)
        data["rows"].append(row)
        print(f"{name:<9} {row['plain_s']:>12.4f} {row['metered_s']:>14.4f} {row['ratio']:>6.2f}")
    data["wall_s"] = round(time.monotonic() - started, 1)
    data["load_average"] = {"start": round(load, 2), "end": round(os.getloadavg()[0], 2)}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "meter_overhead-cpu")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    with open(stem + ".md", "w") as f:
        f.write(markdown(data))


if __name__ == "__main__":
    main()
