"""A PEFT LoRA model of a transformers Llama, tuned end to end on this CPU, and predicted by a dry run.

    python benchmarks/lora.py [--out results]   # about 3 minutes on two CPU cores
    python benchmarks/sync_docs.py              # the docs' copies

The model is ``autotune.thirdparty:hf_lora``: a Llama of 2 layers, hidden 256, 128 tokens, a vocabulary of 1,024,
random weights, under a LoRA adapter of rank 8 on ``q_proj`` and ``v_proj`` (PEFT's defaults otherwise; the base
frozen). Two commands, each as a user types it, in a fresh directory:

1. **the search**: fp32 and bf16, ``--segments auto``, batches 1..16 under 64 MiB, ``--export hf,lightning``: its
   exit code, its plan checks, every trial, the limits, the recommendation and the exports it wrote;
2. **the dry run**: the same command with ``--dry-run``.

Then every configuration the search measured, beside the dry run's prediction of it (peaks, statuses), and both
limits per precision and plan. Writes ``lora-cpu.json`` (this summary) and ``lora-cpu.md``, and the two reports and
the exports as ``lora-search-cpu.json`` (``.hf.json``, ``.lightning.json``) and ``lora-dry_run-cpu.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's autotune in this process too, as in the commands' (PYTHONPATH)

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 1024, "max_position_embeddings": 128, "r": 8}
SEARCH = ["--model", "autotune.thirdparty:hf_lora", "--model-kwargs", json.dumps(MODEL), "--device", "cpu",
          "--budget", "64MiB", "--precisions", "fp32,bf16", "--segments", "auto", "--batch-sizes", "1..16"]
NAMES = {"search": "lora-search-cpu", "dry_run": "lora-dry_run-cpu"}
EXPORTS = ("hf", "lightning")


def run(args: list[str], name: str, where: Path) -> dict:
    """``python -m autotune ARGS --out NAME.json`` in ``where``; its exit code, output and wall time."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("COLUMNS", None)
    args = [*args, "--out", f"{name}.json"]
    load = os.getloadavg()[0]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "autotune", *args], cwd=where, env=env, capture_output=True,
                          text=True, timeout=3600)
    return {"command": "python -m autotune " + shlex.join(args), "returncode": done.returncode,
            "wall_s": round(time.monotonic() - started, 1), "load": round(load, 1),
            "stdout": done.stdout.rstrip("\n"), "stderr": done.stderr.rstrip("\n")}


def _key(trial: dict) -> tuple[str, str, int]:
    return trial["precision"], trial["segments"], trial["batch_size"]


def compare(search: dict, dry_run: dict) -> list[dict]:
    """Each configuration the search measured (a trial of its own, ok or out of memory) beside its prediction."""
    predicted = {_key(t): t for t in dry_run["trials"]}
    rows = []
    for trial in search["trials"]:
        if trial["memory_source"] != "tensor" or trial["peak_bytes"] is None:
            continue
        guess = predicted.get(_key(trial))
        row = {"precision": trial["precision"], "segments": trial["segments"], "batch_size": trial["batch_size"],
               "measured_status": trial["status"], "measured_peak_bytes": trial["peak_bytes"],
               "predicted_status": guess and guess["status"], "predicted_peak_bytes": guess and guess["peak_bytes"]}
        if guess and trial["status"] == "ok" and guess["peak_bytes"]:
            row["error"] = (guess["peak_bytes"] - trial["peak_bytes"]) / trial["peak_bytes"]
        rows.append(row)
    return rows


def limits(report: dict) -> dict[str, list]:
    """``precision/plan: [largest batch that fits, the smallest that does not]`` of a report."""
    return {f"{r['precision']}/{r['segments']}": [r["max_batch_size"], r["min_oom_batch_size"]] for r in report["limits"]}


def limits_tried(dry_run: dict) -> list[dict]:
    """Each exact limit L of the dry run tried for real: memory trials at L and at L + 1 (where the dry run says it does
    not fit), on the tensor meter enforcing the budget, as a limit is judged against it."""
    from autotune.execution.trial import run_trial
    from autotune.meters import TensorMeter
    from autotune.plans.checkpointing import find_chain
    from autotune.records import Config, TrialSettings
    from autotune.training.workload import Workload

    workload = Workload.from_specs("autotune.thirdparty:hf_lora", model_kwargs=MODEL)
    workload = workload.with_chain(find_chain(workload.build_model()))
    predicted = {_key(t): t for t in dry_run["trials"]}
    rows = []
    for variant, (most, oom) in limits(dry_run).items():
        precision, plan = variant.split("/")
        for batch in (b for b in (most, oom) if b is not None):
            m = run_trial(workload.unwarmed(), Config(precision, plan, batch), device="cpu", timed=False,
                          meter=TensorMeter("cpu", budget_bytes=dry_run["budget_bytes"]),
                          settings=TrialSettings(timeout_s=None))
            guess = predicted[(precision, plan, batch)]
            rows.append({"variant": variant, "batch_size": batch, "predicted_fits": batch == most,
                         "status": str(m.status), "peak_bytes": m.peak_bytes,
                         "fits": str(m.status) == "ok" and m.peak_bytes <= dry_run["budget_bytes"],
                         "predicted_status": guess["status"], "predicted_peak_bytes": guess["peak_bytes"]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def summary(runs: dict[str, dict], reports: dict[str, dict], exports: list[str], tried: list[dict]) -> dict:
    search, dry = reports["search"], reports["dry_run"]
    workload = search["workload"]
    rows = compare(search, dry)
    errors = [abs(r["error"]) for r in rows if "error" in r]
    return {
        "command": "python benchmarks/lora.py", "date": datetime.date.today().isoformat(),
        "environment": {k: search["environment"].get(k) for k in ("device_name", "torch_version", "python_version")},
        "cpu_count": os.cpu_count(), "model": workload["model"], "model_class": workload["model_class"],
        "model_kwargs": MODEL, "runs": runs,
        "parameter_count": workload["parameter_count"], "trainable_parameter_count": workload["trainable_parameter_count"],
        "parameter_bytes": workload["parameter_bytes"], "trainable_parameter_bytes": workload["trainable_parameter_bytes"],
        "optimizer_state_bytes": workload["optimizer"]["state_bytes"], "fixed_bytes": workload["fixed_bytes"],
        "chain": workload["chain"], "training_cache": workload["training_cache"],
        "plan_checks": [(c["plan"], c["status"]) for c in search["plan_checks"]],
        "recommendation": {k: search["recommendation"][k] for k in ("precision", "segments", "batch_size",
                                                                    "peak_bytes", "samples_per_s")}
        if search["recommendation"] else None,
        "library_checkpointing": search["library_checkpointing"], "exports": exports,
        "configurations": rows, "largest_error": max(errors, default=None),
        "statuses_agree": sum(r["measured_status"] == r["predicted_status"] for r in rows),
        "limits": {"search": limits(search), "dry_run": limits(dry)},
        "search_batch_sizes": search["search"]["space"]["batch_sizes"], "budget_bytes": search["budget_bytes"],
        "limits_tried": tried, "limits_hold": sum(r["fits"] == r["predicted_fits"] for r in tried),
        # each limit of the search is the largest size of its space at or below the dry run's exact one
        "search_limits_agree": sum(most == max((b for b in search["search"]["space"]["batch_sizes"]
                                                if b <= (limits(dry)[v][0] or 0)), default=None)
                                   for v, (most, _) in limits(search).items()),
        "predictions": len(dry["trials"]),
    }


def markdown(data: dict) -> str:
    from autotune.units import format_bytes

    search, dry = data["runs"]["search"], data["runs"]["dry_run"]
    env = data["environment"]
    total, trainable = data["parameter_count"], data["trainable_parameter_count"]
    rows = data["configurations"]
    lines = [
        f"From `{data['command']}` on {env['device_name']} ({data['cpu_count']} cores), torch {env['torch_version']}, "
        f"{data['date']}: `{data['model']}` ({data['model_class']}), a Llama of {MODEL['num_hidden_layers']} layers, "
        f"hidden {MODEL['hidden_size']}, {MODEL['max_position_embeddings']} tokens, under a LoRA adapter of rank "
        f"{MODEL['r']} on q_proj and v_proj: {trainable:,} of its {total:,} parameters train "
        f"({trainable / total:.2%}); its blocks are `{', '.join(data['chain']['containers'])}`. Step times and "
        f"samples/s move from run to run; peaks and limits do not.", "",
        f"**The search** (`{search['command']}`): exit {search['returncode']} in {search['wall_s']} s (the machine's load "
        f"average {search['load']} as it started); plans checked "
        f"{', '.join(f'{p} {s}' for p, s in data['plan_checks'])}; exports written: "
        f"{', '.join(f'`{e}`' for e in data['exports'])}.", "", "```", search["stdout"], "```", "",
        f"**The dry run** (the same command with `--dry-run`): exit {dry['returncode']} in {dry['wall_s']} s, "
        f"{data['predictions']} configurations predicted under fake tensors. Every configuration the search measured, "
        f"beside its prediction: statuses agree in {data['statuses_agree']} of {len(rows)}; the largest difference "
        f"of a peak is {data['largest_error']:.4%}." if data["largest_error"] is not None else "", "",
        "| precision | plan | batch | measured | predicted (dry run) | difference |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        predicted = (f"{r['predicted_status']}, {format_bytes(r['predicted_peak_bytes'])}"
                     if r["predicted_peak_bytes"] is not None else str(r["predicted_status"]))
        diff = f"{r['error']:+.4%}" if "error" in r else "-"
        lines.append(f"| {r['precision']} | {r['segments']} | {r['batch_size']} | {r['measured_status']}, "
                     f"{format_bytes(r['measured_peak_bytes'])} ({r['measured_peak_bytes']:,} B) | {predicted} | {diff} |")
    lines += _limit_lines(data)
    return "\n".join(lines) + "\n"


def _limit_lines(data: dict) -> list[str]:
    from autotune.units import format_bytes

    sizes = data["search_batch_sizes"]
    tried = {(r["variant"], r["batch_size"]): r for r in data["limits_tried"]}
    lines = ["", f"**Limits** (the largest batch that fits the budget of {format_bytes(data['budget_bytes'])}; in "
                 f"brackets the smallest that does not). The search's space is batches "
                 f"{', '.join(map(str, sizes))}; the dry run's limits are exact in steps of 1, each tried for real "
                 f"(memory trials at L and L + 1): {data['limits_hold']} of {len(data['limits_tried'])} trials fit "
                 f"where the dry run said and not where it said not; {data['search_limits_agree']} of {len(data['limits']['search'])} "
                 f"limits of the search are the largest size of its space at or below the dry run's.", "",
             "| precision/plan | search | dry run (predicted) | real trial at L | real trial at L + 1 |",
             "| --- | --- | --- | --- | --- |"]

    def trial(variant: str, batch: int | None) -> str:
        r = tried.get((variant, batch))
        if r is None:
            return "-"
        return (f"{r['status']}, {format_bytes(r['peak_bytes'])} ({'fits' if r['fits'] else 'does not fit'}; "
                f"predicted {format_bytes(r['predicted_peak_bytes'])})")

    for variant, (most, oom) in data["limits"]["search"].items():
        p_most, p_oom = data["limits"]["dry_run"].get(variant, [None, None])
        lines.append(f"| {variant} | {most} ({oom or '-'}) | {p_most} ({p_oom or '-'}) | {trial(variant, p_most)} | "
                     f"{trial(variant, p_oom)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as where:
        runs = {"search": run([*SEARCH, "--export", ",".join(EXPORTS)], NAMES["search"], Path(where)),
                "dry_run": run([*SEARCH, "--dry-run"], NAMES["dry_run"], Path(where))}
        for name, done in runs.items():
            if done["returncode"] != 0:
                print(done["stderr"][-3000:], file=sys.stderr)
                return 1
        files = [f"{NAMES['search']}.json", *(f"{NAMES['search']}.{e}.json" for e in EXPORTS), f"{NAMES['dry_run']}.json"]
        for file in files:
            shutil.copy(Path(where) / file, out / file)
    reports = {name: json.loads((out / f"{NAMES[name]}.json").read_text()) for name in NAMES}
    data = summary(runs, reports, files[1:1 + len(EXPORTS)], limits_tried(reports["dry_run"]))
    (out / "lora-cpu.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / "lora-cpu.md").write_text(markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
