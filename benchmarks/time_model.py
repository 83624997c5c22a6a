"""The time model against measurement on this CPU: every configuration's step predicted, then measured.

    python benchmarks/time_model.py [--out results] [--threads 1] [--quick] [--passes 2]

This CPU is calibrated first (``autotune.timing.calibration``, measured afresh, at ``--threads``). Then for each
model (the bundled TinyGPT and ResNetish, and Hugging Face GPT-2, Llama and BERT shapes built from their configs), and
each configuration of its grid (fp32 and bf16, plans 0 and all, three batch sizes), its step is predicted (the dry
run's trial under fake tensors, its ops counted and priced) and then timed for real (``run_trial``), in ``--passes``
passes over the grid (2: a slow spell of the machine falls on one pass of a configuration, not on all its steps),
its fastest step of all passes its measurement. Reported: per model and over all, Spearman's rank correlation of predicted and
measured step times, the median absolute error of the prediction, and the measured throughput of the configuration
the prediction recommends (as a dry run does: the fastest predicted, those within the model's median error of it not
told apart and the largest batch among them chosen, ``autotune.analysis.pareto.predicted_choice``) against the
measured best.

Writes ``results/time_model-cpu.json`` and ``.md``, and ``autotune/timing/checked.json`` (the error a dry run quotes);
``--cards`` writes ``results/time_model-cards.md`` (the card table, from ``autotune/timing/cards.json``) only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autotune.analysis.pareto import predicted_choice  # noqa: E402
from autotune.execution.predict import predict_trial  # noqa: E402
from autotune.execution.trial import run_trial  # noqa: E402
from autotune.meters import TensorMeter  # noqa: E402
from autotune.plans.checkpointing import find_chain  # noqa: E402
from autotune.records import Config, TrialSettings  # noqa: E402
from autotune.timing.calibration import this_cpu  # noqa: E402
from autotune.training.workload import Workload  # noqa: E402
from autotune.vocabulary import Plan, Status  # noqa: E402

_HF = {"seq_len": 128, "vocab_size": 1024}
MODELS = {  # name -> (spec, model kwargs, batch sizes)
    "TinyGPT": ("autotune.examples:TinyGPT", None, (1, 4, 16)),
    "ResNetish": ("autotune.examples:ResNetish", None, (4, 16, 64)),
    "gpt2": ("autotune.thirdparty:hf_causal_lm", {"model_type": "gpt2", "n_layer": 4, "n_embd": 128, "n_head": 4,
                                                   **_HF}, (2, 8, 32)),
    "llama": ("autotune.thirdparty:hf_causal_lm", {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 128,
                                                    "intermediate_size": 344, "num_attention_heads": 4,
                                                    "num_key_value_heads": 4, **_HF}, (2, 8, 32)),
    "bert": ("autotune.thirdparty:hf_masked_lm", {"model_type": "bert", "num_hidden_layers": 4, "hidden_size": 128,
                                                  "intermediate_size": 512, "num_attention_heads": 4, **_HF},
             (2, 8, 32)),
}
PRECISIONS, PLANS = ("fp32", "bf16"), ("0", "all")
STEPS = 8  # timed steps per configuration and pass; the fastest is the measurement (others only slow a step down)
PASSES = 2  # each configuration timed in two passes over its model's grid


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 1.0


def _workload(spec: str, kwargs: dict | None) -> Workload:
    workload = Workload.from_specs(spec, model_kwargs=kwargs)
    return workload.with_chain(find_chain(workload.build_model()))


def _rows(name: str, machine, quick: bool, passes: int) -> list[dict]:
    """Each configuration of ``name``'s grid predicted, then timed in ``passes`` passes over the grid (the second
    after every configuration's first: a slow spell of the machine falls on one pass of a configuration, not on all
    its steps); its measurement is its fastest step of all passes, its median over all their steps."""
    spec, kwargs, sizes = MODELS[name]
    workload = _workload(spec, kwargs)
    configs = [Config(precision, Plan(plan), b) for precision in PRECISIONS for plan in PLANS
               for b in (sizes[:2] if quick else sizes)]
    predicted = {config: predict_trial(workload, config, time_model=machine) for config in configs}
    steps: dict[Config, list[float]] = {config: [] for config in configs}
    failed: set[Config] = {c for c, p in predicted.items() if p.status != Status.OK}
    for _ in range(passes):
        for config in configs:
            if config in failed:
                continue
            measured = run_trial(workload, config, device="cpu", meter=TensorMeter("cpu"),
                                 settings=TrialSettings(measure_steps=STEPS, settle_steps=0, timeout_s=None))
            if measured.status != Status.OK:
                failed.add(config)
                print(f"  {name} {config}: {predicted[config].status} / {measured.status}", flush=True)
                continue
            steps[config] += measured.step_times_s
    rows = []
    for config in configs:
        if config in failed:
            continue
        times, b, p = steps[config], config.batch_size, predicted[config]
        fastest, median = min(times), statistics.median(times)
        rows.append({"model": name, **config.to_dict(), "predicted_step_s": p.step_s, "measured_step_s": fastest,
                     "measured_median_step_s": median, "measured_step_s_spread": (max(times) - min(times)) / median,
                     "measured_steps": len(times), "predicted_per_s": p.samples_per_s, "measured_per_s": b / fastest,
                     "measured_median_per_s": b / median, "error": p.step_s / fastest - 1,
                     "error_median": p.step_s / median - 1})
        print(f"  {name} {config}: predicted {p.step_s:.4f} s, measured {fastest:.4f} s fastest, "
              f"{median:.4f} s median ({rows[-1]['error']:+.0%})", flush=True)
    return rows


def summary(rows: list[dict], tie: float, median: bool = False) -> dict:
    """Spearman, median absolute error and the recommendation's measured throughput against the best's, against
    each configuration's fastest timed step (``median``: its median step, the search's figure). ``tie``: the error a
    dry run will quote after this run (the pooled median error against fastest steps, ``checked.json``)."""
    step, per_s, error = (("measured_median_step_s", "measured_median_per_s", "error_median") if median else
                          ("measured_step_s", "measured_per_s", "error"))
    predicted, measured = [r["predicted_step_s"] for r in rows], [r[step] for r in rows]
    # what a dry run recommends from the predictions: the fastest predicted, those within the model's error of it not
    # told apart and the largest batch among them chosen
    chosen = predicted_choice(rows, lambda r: r["predicted_per_s"], lambda r: r["batch_size"], tie=tie)
    best = max(rows, key=lambda r: r[per_s])
    return {"configurations": len(rows), "spearman": spearman(predicted, measured),
            "median_abs_error": statistics.median(abs(r[error]) for r in rows),
            "recommended": f"{chosen['precision']}/{chosen['segments']}/{chosen['batch_size']}",
            "measured_best": f"{best['precision']}/{best['segments']}/{best['batch_size']}",
            "recommended_over_best": chosen[per_s] / best[per_s]}


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# The time model against measured steps ({env['machine']}, {env['threads']} threads, torch "
             f"{env['torch']})", "",
             f"Command: `{result['command']}`. Each configuration's step predicted (the dry run's trial under fake "
             f"tensors, its ops' FLOPs and bytes priced on this CPU, calibrated: {result['machine']}) and then timed "
             f"for real: {STEPS} timed steps in each of {result.get('passes', 1)} passes over the model's grid (the second "
             f"after every configuration's first), the fastest step of all its measurement (the machine is shared: "
             f"other processes only "
             f"slow a step down; the calibration takes the fastest runs too), the median beside it. Load average when "
             f"it ran (1, 5, 15 min): {env['load']}. The recommendation is a dry run's: the fastest predicted, the "
             f"predictions within the model's median error ({result['near_tie']:.1%}) of it not told apart and the "
             f"largest batch among them chosen.", "",
             "| model | configurations | Spearman | median abs error | recommended (predicted) | measured best | "
             "recommended / best (measured samples/s) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in [*result["models"].items(), ("all", result["all"]),
                    ("all, against median steps", result["all_against_median_steps"])]:
        lines.append(f"| {name} | {s['configurations']} | {s['spearman']:.3f} | {s['median_abs_error']:.1%} | "
                     f"{s['recommended']} | {s['measured_best']} | {s['recommended_over_best']:.1%} |")
    lines += ["", "| model | precision | segments | batch | predicted step | measured step (fastest) | error | "
              "measured step (median) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | {r['precision']} | {r['segments']} | {r['batch_size']} | "
                     f"{r['predicted_step_s']:.4f} s | {r['measured_step_s']:.4f} s | {r['error']:+.1%} | "
                     f"{r['measured_median_step_s']:.4f} s |")
    return "\n".join(lines) + "\n"


def cards_markdown() -> str:
    """The card table of ``autotune/timing/cards.json`` as the docs show it (``--cards``)."""
    from autotune.timing.cards import cards

    lines = ["# The cards a dry run plans for (`--card NAME`)", "",
             "From `autotune/timing/cards.json` (`python benchmarks/time_model.py --cards`): dense peaks (the data "
             "sheets' figures with sparsity halved), memory as the data sheet gives it, one direction of the host "
             "link, NVLink's total; each row's values from the data sheet named.", "",
             "| card | capability | fp32 | tf32 | bf16 | fp16 TFLOPS | memory | bandwidth | host link | NVLink | "
             "source |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in cards().values():
        tf = [f"{c.peak_flops[d] / 1e12:g}" if c.peak_flops[d] else "-" for d in ("fp32", "tf32", "bf16", "fp16")]
        cap = ".".join(map(str, c.capability)) if c.capability else "- (ROCm)"
        link = f"{c.nvlink_bytes_per_s / 1e9:g} GB/s" if c.nvlink_bytes_per_s else "-"
        url = c.source[c.source.index("https://"):].split()[0].rstrip("):,;")
        lines.append(f"| `{c.name}` ({c.title}) | {cap} | {' | '.join(tf)} | {c.memory_bytes / 2**30:g} GiB | "
                     f"{c.memory_bytes_per_s / 1e9:g} GB/s | {c.host_link}, {c.host_link_bytes_per_s / 1e9:g} GB/s | "
                     f"{link} | [data sheet]({url}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "results"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="two batch sizes per model")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--cards", action="store_true", help="write results/time_model-cards.md only")
    parser.add_argument("--passes", type=int, default=PASSES, help="passes over each grid, each timing every "
                        "configuration (default %(default)s)")
    args = parser.parse_args(argv)
    if args.cards:
        with open(os.path.join(args.out, "time_model-cards.md"), "w") as f:
            f.write(cards_markdown())
        return 0
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    machine = this_cpu(refresh=True)
    rows = []
    for name in args.models.split(","):
        rows += _rows(name, machine, args.quick, args.passes)
    tie = statistics.median(abs(r["error"]) for r in rows)  # the error a dry run quotes after this run
    models = {name: summary([r for r in rows if r["model"] == name], tie)
              for name in dict.fromkeys(r["model"] for r in rows)}
    pooled, against_median = summary(rows, tie), summary(rows, tie, median=True)
    for figures, per_model in ((pooled, models), (against_median, {n: summary([r for r in rows if r["model"] == n],
                                                                              tie, median=True) for n in models})):
        # a recommendation is one model's: over all, the worst model's recommendation against its best
        worst = min(per_model, key=lambda n: per_model[n]["recommended_over_best"])
        figures.update(recommended=f"worst: {worst}, {per_model[worst]['recommended']}",
                       measured_best=per_model[worst]["measured_best"],
                       recommended_over_best=per_model[worst]["recommended_over_best"])
    result = {"command": "python benchmarks/time_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "threads": args.threads,
                              "torch": torch.__version__, "load": " ".join(f"{x:.2f}" for x in os.getloadavg())},
              "machine": machine.source, "models": models, "all": pooled,
              "all_against_median_steps": against_median, "near_tie": round(tie, 4), "passes": args.passes,
              "rows": rows,
              "wall_s": round(time.monotonic() - started, 1)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "time_model-cpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "time_model-cpu.md"), "w") as f:
        f.write(markdown(result))
    checked = {"cpu": {"median_abs_error": round(result["all"]["median_abs_error"], 4),
                       "spearman": round(result["all"]["spearman"], 4), "source": "results/time_model-cpu.md"}}
    with open(os.path.join(ROOT, "autotune", "timing", "checked.json"), "w") as f:
        json.dump(checked, f, indent=1)
        f.write("\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
