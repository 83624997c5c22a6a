"""Do the reported limits and speeds hold for whole epochs of long-tailed data?

    python benchmarks/real_data.py [--size 2048] [--budget 256MiB] [--out results]

Tunes the bundled TinyGPT on ``variable_token_loader`` (sequences padded per batch, one in
twenty four times the typical length), then trains one shuffled epoch over the whole dataset for
the recommendation and for every reported limit whose trial fits the budget less headroom:
metered (the epoch's worst step peak, under the budget) and timed (samples/s over the epoch,
unmetered). Beside each, what the trial measured, and what a trial on the dataset's first b items
(how autotune measured before it looked for the worst batch) would have reported.

Writes ``results/real_data-<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

import autotune
from autotune.device import backend_for
from autotune.errors import is_oom
from autotune.meters import TensorMeter
from autotune.records import Config, TrialSettings
from autotune.execution.trial import run_trial
from autotune.training.trainer import Trainer
from autotune.units import format_bytes, parse_size
from autotune.training.workload import Workload, to_device

LOADER = "autotune.examples:variable_token_loader"


def epoch(workload: Workload, config: Config, budget: int | None, *, metered: bool) -> dict:
    """One shuffled epoch over the whole dataset: samples/s, or (metered) the worst step's peak."""
    loader = torch.utils.data.DataLoader(workload.dataset, batch_size=config.batch_size, shuffle=True,
                                         collate_fn=workload.collate_fn, generator=torch.Generator().manual_seed(1))
    trainer = Trainer(workload, config, torch.device("cpu"))
    steps, seconds, peak = 0, 0.0, None
    try:
        if metered:
            with TensorMeter(budget_bytes=budget).measure() as handle:
                trainer.build()
                for batch in loader:
                    trainer.step(to_device(batch, torch.device("cpu")))
                    steps += 1
            peak = handle.reading.peak_bytes
        else:
            trainer.build()
            for batch in loader:
                seconds += trainer.timed_step(to_device(batch, torch.device("cpu")))
                steps += 1
    except Exception as exc:  # noqa: BLE001 - an epoch that runs out of memory is the finding
        if not is_oom(exc):
            raise
        return {"status": "oom", "steps_before_oom": steps}
    finally:
        trainer.release()
    out = {"status": "ok", "steps": steps}
    if metered:
        out["peak_bytes"] = peak
    else:
        out["samples_per_s"] = round(len(workload.dataset) / seconds, 2)
    return out


def first_items_peak(workload: Workload, config: Config) -> int | None:
    """The peak of a trial on the dataset's first b items: what a trial measured before the worst batch."""
    first = tuple(range(config.batch_size))
    m = run_trial(workload.with_worst_batches({config.batch_size: first}), config, device="cpu", meter=TensorMeter(),
                  settings=TrialSettings(measure_steps=1))
    return m.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=2048, help="items in the dataset")
    parser.add_argument("--budget", default="256MiB")
    parser.add_argument("--batch-sizes", default="1..128")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)  # made before the run: a missing folder must not lose its results
    budget = parse_size(args.budget)
    started = time.monotonic()
    report = autotune.tune("autotune.examples:TinyGPT", data=lambda: _loader(args.size), device="cpu",
                           budget=budget, precisions="fp32,bf16", segments="0,2,all", batch_sizes=args.batch_sizes,
                           storage=f"sqlite:///{tempfile.mkdtemp()}/real.db", study="real")
    tune_s = time.monotonic() - started
    print(report.table())
    workload = Workload.from_specs("autotune.examples:TinyGPT", data=lambda: _loader(args.size))
    limit = budget * (1 - report.headroom)
    trials = {m.config: m for m in report.trials}
    rows = []
    candidates = [Config(r["precision"], r["segments"], r["max_batch_size"], r.get("compile", "none")) for r in report.limits
                  if r["max_batch_size"]]
    rec = report.recommendation
    for config in dict.fromkeys([rec.config] + candidates if rec else candidates):
        trial = trials[config]
        if config != (rec.config if rec else None) and trial.peak_bytes > limit:
            continue
        print(f"{config}: epochs ...", file=sys.stderr, flush=True)
        rows.append({**{k: v for k, v in vars(config).items()}, "recommended": rec is not None and config == rec.config,
                     "trial_peak_bytes": trial.peak_bytes, "trial_samples_per_s": trial.samples_per_s,
                     "trial_step_s_spread": trial.step_s_spread, "trial_tokens_per_s": trial.tokens_per_s,
                     "first_items_peak_bytes": first_items_peak(workload, config),
                     "epoch_metered": epoch(workload, config, budget, metered=True),
                     "epoch_timed": epoch(workload, config, budget, metered=False)})
    result = {"benchmark": "real_data", "command": "python benchmarks/real_data.py " + " ".join(sys.argv[1:]),
              "environment": backend_for(torch.device("cpu")).environment(), "dataset": f"{LOADER}(size={args.size})",
              "budget_bytes": budget, "headroom": report.headroom, "data": report.data, "tune_s": round(tune_s, 1),
              "recommendation": None if rec is None else vars(rec.config), "rows": rows}
    stem = os.path.join(args.out, "real_data-cpu")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2, default=str)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result) + "\n")
    print(markdown(result))


def _loader(size: int) -> torch.utils.data.DataLoader:
    from autotune.examples import variable_token_loader

    return variable_token_loader(size=size)


def markdown(r: dict) -> str:
    d = r["data"]
    lines = [f"# Limits over whole epochs of long-tailed data ({r['environment']['device_name']})", "",
             f"Command: `{r['command']}`; {r['dataset']}: item sizes p50 {d['p50']}, p90 {d['p90']}, max {d['max']} "
             f"({d['size_unit']}); budget {format_bytes(r['budget_bytes'])}, headroom {r['headroom']:.0%}; "
             f"the tune took {r['tune_s']} s.", "",
             "| configuration | trial peak (worst batch) | first-b-items peak | epoch worst step | trial samples/s (spread) | "
             "epoch samples/s |", "|---|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        metered, timed = row["epoch_metered"], row["epoch_timed"]
        worst = format_bytes(metered["peak_bytes"]) if metered["status"] == "ok" else "out of memory"
        speed = f"{timed['samples_per_s']:.1f}" if timed["status"] == "ok" else "out of memory"
        spread = f" (±{row['trial_step_s_spread'] / 2:.0%})" if row["trial_step_s_spread"] is not None else ""
        name = f"{row['precision']}, plan {row['segments']}, batch {row['batch_size']}" + (
            " (recommended)" if row["recommended"] else "")
        # a limit found by a memory trial (the auto strategy's bracket) was metered, not timed
        trial_speed = "not timed" if row["trial_samples_per_s"] is None else f"{row['trial_samples_per_s']:.1f}{spread}"
        lines.append(f"| {name} | {format_bytes(row['trial_peak_bytes'])} | {format_bytes(row['first_items_peak_bytes'])} "
                     f"| {worst} | {trial_speed} | {speed} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
