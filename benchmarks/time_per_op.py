"""Where the time model misprices a step, op by op: each op's measured seconds in a real step beside its price.

    python benchmarks/time_per_op.py MODEL [--precision fp32|bf16] [--batch N] [--top K] [--threads 1]

MODEL is one of ``benchmarks/time_model.py``'s models (TinyGPT, ResNetish, gpt2, llama, bert). The step (forward,
loss, backward, AdamW's step) runs a few times to warm up, then three times with every aten op timed (the CPU runs an
op to its end before it returns); the fastest of the three is shown. Each op's price is the time model's own
(``autotune.timing.model``: its roofline on this CPU's calibration, times the op's measured efficiency where the
calibration measured one), without the host's per-op overhead, which the step's total below adds. Ops by measured
seconds, the slowest first; ``x`` is measured over priced: far above 1, the model does not know the op's cost (as
dropout's ``bernoulli_`` was, before the calibration's suite dropped out).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from time_model import MODELS, PRECISIONS, _workload  # noqa: E402

from autotune.timing.calibration import OpTimes, this_cpu  # noqa: E402
from autotune.timing.model import op_seconds  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=list(MODELS))
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = this_cpu()
    spec, kwargs, _ = MODELS[args.model]
    workload = _workload(spec, kwargs)
    model = workload.build_model()
    batch = workload.make_batch(model, args.batch)
    optimizer = torch.optim.AdamW(model.parameters())

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = workload.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        step()
    runs = []
    for _ in range(3):
        runs.append(OpTimes(machine, price=op_seconds))
        with runs[-1]:
            step()
    best = min(runs, key=lambda r: sum(row[0] for row in r.rows.values()))
    began = time.perf_counter()
    step()
    plain = time.perf_counter() - began
    rows = best.rows
    print(f"{args.model} {args.precision} batch {args.batch} on {machine.source}")
    print(f"step {plain:.4f} s untimed; its ops {sum(m for m, _, _ in rows.values()):.4f} s measured one by one, "
          f"priced {sum(p for _, p, _ in rows.values()):.4f} s, {sum(n for _, _, n in rows.values())} ops "
          f"(the host's overhead per op, which the model adds, not in the price)")
    print(f"{'op/dtype':58s} {'ops':>5s} {'measured':>11s} {'priced':>11s} {'x':>7s}")
    for key, (measured, priced, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:args.top]:
        ratio = f"{measured / priced:7.2f}" if priced else "      -"
        print(f"{key:58s} {n:5d} {measured * 1e3:8.2f} ms {priced * 1e3:8.2f} ms {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
