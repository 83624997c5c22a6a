"""How much the CPU tensor meter slows a training step: metered vs plain steps, side by side in one run.

    python benchmarks/meter_overhead.py [--batch-size 8] [--steps 5]

Prints, per precision, the median plain step time, the median metered step time and their ratio.
This is why trials time their steps outside the meter (see autotune/execution/trial.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from autotune.meters import TensorMeter
from autotune.training.precision import get_mode
from autotune.training.workload import Workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="autotune.examples:TinyGPT")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    workload = Workload.from_specs(args.model)
    print(f"{args.model}, batch {args.batch_size}, {args.steps} steps each, {torch.get_num_threads()} threads")
    print(f"{'precision':<9} {'plain s/step':>12} {'metered s/step':>14} {'ratio':>6}")
    for name in ("fp32", "bf16"):
        mode = get_mode(name)
        torch.manual_seed(0)
        model = workload.build_model()
        opt = torch.optim.AdamW(model.parameters())
        batch = workload.make_batch(model, args.batch_size)

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
        for _ in range(args.steps):  # interleaved, so drift in machine load hits both alike
            plain.append(step())
            with TensorMeter().measure() as h:
                h.track(model.parameters())
                metered.append(step())
        p, m = statistics.median(plain), statistics.median(metered)
        print(f"{name:<9} {p:>12.4f} {m:>14.4f} {m / p:>6.2f}")


if __name__ == "__main__":
    main()
