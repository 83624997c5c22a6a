"""Measure a committed report's trials again and compare their peaks: does this code train the same steps?

    python benchmarks/reproduce_peaks.py results/example-gpt2-cpu.json [--max-batch-size 32]

For each trial of each report (on the CPU, tensor meter), the same workload (model, kwargs, data,
loss, blocks in the report's order), precision, plan and batch size train again under the same
budget, with one timed step (peaks come from the metered warm-up steps). Prints one line per
report: trials compared, how many peaks are equal to the byte, and the largest difference. A
refactor that changes nothing of what a step allocates reproduces every peak exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import autotune
from autotune.plans.checkpointing import Chain
from autotune.options import Options
from autotune.execution.trial import run_trial
from autotune.tuner import resolve


def reproduce(path: str, max_batch_size: int | None) -> tuple[int, int, list[str]]:
    """Return (trials compared, peaks equal, lines describing each difference) for the report at ``path``."""
    report = autotune.load(path)
    if report.environment.get("device_type") != "cpu":
        raise SystemExit(f"{path}: measured on {report.environment.get('device')}; this script compares tensor-meter peaks")
    w = report.workload
    space = report.search["space"]
    options = Options(model=w["model"], model_kwargs=w["model_kwargs"] or None, data=w["data"], loss=w["loss"],
                      device="cpu", budget=report.budget_bytes, budgets=report.budgets, batch_sizes=space["batch_sizes"],
                      precisions=space["precisions"], warmup_steps=report.search["warmup_steps"], measure_steps=1,
                      clip_grad_norm=report.guard.clip_grad_norm, fp32_modules=report.guard.fp32_modules)
    target = resolve(options)
    workload = target.workload.with_chain(Chain.from_dict(w["chain"]) if w.get("chain") else None)
    settings = options.trial_settings
    compared, equal, differences = 0, 0, []
    for old in report.trials:
        if old.peak_bytes is None or (max_batch_size and old.batch_size > max_batch_size):
            continue
        new = run_trial(workload, old.config, device="cpu", meter=target.backend.meter(target.budget.enforced),
                        settings=dataclasses.replace(settings, timeout_s=None))
        compared += 1
        if (new.status, new.peak_bytes) == (old.status, old.peak_bytes):
            equal += 1
        else:
            differences.append(f"  {old.config}: was {old.status} {old.peak_bytes}, now {new.status} {new.peak_bytes}")
    return compared, equal, differences


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--max-batch-size", type=int, default=None, help="compare only trials up to this batch size")
    args = parser.parse_args(argv)
    failed = False
    for path in args.reports:
        compared, equal, differences = reproduce(path, args.max_batch_size)
        print(f"{path}: {equal} of {compared} peaks equal to the byte")
        print("\n".join(differences)) if differences else None
        failed |= bool(differences)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
