"""Time configurations again in alternating fresh trials: how far one trial's samples/s is from another's.

    python benchmarks/alternate_timing.py --model autotune.examples:ResNetish --configs bf16:0:16,bf16:0:32 --rounds 4

Each round runs one fresh trial of every configuration, in the order given, in this process (as the
search does on the CPU), with the default trial settings and a 1 GiB tensor meter. A single trial's
steps agree with each other far better than two trials of the same configuration agree: this shows
by how much, and which configuration is faster on the median of the rounds.

Writes ``results/alternate_timing-<model>-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from autotune.device import backend_for
from autotune.meters import TensorMeter
from autotune.records import Config, TrialSettings
from autotune.execution.trial import run_trial
from autotune.training.workload import Workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="autotune.examples:ResNetish")
    parser.add_argument("--configs", default="bf16:0:16,bf16:0:32", help="PRECISION:PLAN:BATCH,...")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    configs = [Config(p, s, int(b)) for p, s, b in (c.split(":") for c in args.configs.split(","))]
    workload = Workload.from_specs(args.model)
    runs: dict[str, list[dict]] = {str(c): [] for c in configs}
    for r in range(args.rounds):
        for c in configs:
            m = run_trial(workload, c, device="cpu", meter=TensorMeter(budget_bytes=2**30), settings=TrialSettings())
            runs[str(c)].append({"samples_per_s": m.samples_per_s, "step_s_spread": m.step_s_spread,
                                 "step_times_s": list(m.step_times_s)})
            print(f"round {r}: {c}: {m.samples_per_s:.1f} samples/s, spread {m.step_s_spread:.1%}", file=sys.stderr)
    summary = {}
    for name, trials in runs.items():
        speeds = [t["samples_per_s"] for t in trials]
        summary[name] = {"median_samples_per_s": statistics.median(speeds), "min": min(speeds), "max": max(speeds),
                         "trial_to_trial_range": (max(speeds) - min(speeds)) / statistics.median(speeds),
                         "median_within_trial_spread": statistics.median(t["step_s_spread"] for t in trials)}
        print(f"{name}: median {summary[name]['median_samples_per_s']:.1f} samples/s over {len(speeds)} trials, "
              f"range {summary[name]['trial_to_trial_range']:.0%} of it; within a trial the steps spread "
              f"{summary[name]['median_within_trial_spread']:.0%}")
    os.makedirs(args.out, exist_ok=True)
    model = args.model.rpartition(":")[2]
    path = os.path.join(args.out, f"alternate_timing-{model}-cpu.json")
    with open(path, "w") as f:
        json.dump({"benchmark": "alternate_timing", "command": "python benchmarks/alternate_timing.py " + " ".join(sys.argv[1:]),
                   "environment": backend_for(torch.device("cpu")).environment(),
                   "rounds": args.rounds, "runs": runs, "summary": summary}, f, indent=2)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
