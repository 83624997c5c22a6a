"""Memory hygiene under load: N consecutive trials alternating OOM and success, in one process.

    python benchmarks/soak.py [--trials 100]

Prints live tensor objects, the tensor meter's weak-reference finalisers and the process's
resident memory before and after, and their differences. A leak of one trial's model,
optimizer or activations per OOM would show as growth in all three.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import weakref

import torch

from autotune.meters import TensorMeter
from autotune.records import Config, TrialSettings
from autotune.execution.trial import run_trial
from autotune.training.workload import Workload

TINY = {"n_layer": 2, "block_size": 16, "n_embd": 16, "n_head": 2, "vocab_size": 32}


def snapshot() -> dict[str, int]:
    gc.collect()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {
        "tensors": sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor)),
        "finalisers": len(weakref.finalize._registry),
        "rss_bytes": rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100)
    args = parser.parse_args()
    workload = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=TINY)
    meter = TensorMeter(budget_bytes=4 * 2**20)
    settings = TrialSettings(warmup_steps=2, measure_steps=1)
    for batch in (2, 128):  # first trials load kernels and caches
        run_trial(workload, Config("fp32", 0, batch), device="cpu", meter=meter, settings=settings)
    before = snapshot()
    start = time.monotonic()
    statuses: dict[str, int] = {}
    for i in range(args.trials):
        m = run_trial(workload, Config("fp32", 0, 128 if i % 2 else 2), device="cpu", meter=meter, settings=settings)
        statuses[m.status] = statuses.get(m.status, 0) + 1
    after = snapshot()
    print(f"{args.trials} trials in {time.monotonic() - start:.1f} s: {statuses}")
    for key in before:
        print(f"{key:<11} before {before[key]:>12,}  after {after[key]:>12,}  change {after[key] - before[key]:>+10,}")


if __name__ == "__main__":
    main()
