"""Planning for CUDA on a machine without a GPU: what CUDA's rules change in a prediction (``--device cuda --dry-run``).

1. **The bundled models**, each configuration predicted twice on this CPU: with the CPU's rules (what a CPU dry run
   predicts, and what the CPU measures to the byte: ``results/dry_run-cpu.md``) and with CUDA's (CUDA's autocast op
   lists; the caching allocator's model over the allocation trace, two cuBLAS workspaces first). No GPU checks the
   second column here: ``benchmarks/gpu_check.py`` does when one is lent.
2. **A Llama-shaped 1.1B model at 2048 tokens planned for a 24 GiB card** (``docs/examples/llama_factory.py``):
   ``--device cuda --dry-run`` in a process that sees no GPU, its wall time and its own peak memory.

    python benchmarks/cuda_plan.py     # writes results/cuda_plan-cpu.{json,md} (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dry_run import LLAMA, MODELS, ROOT, _cli, _workload  # noqa: E402 - the dry run's benchmark: its models, its CLI runner

from autotune.execution.cuda_rules import CudaFindings, CudaRules  # noqa: E402
from autotune.execution.predict import predict_trial  # noqa: E402
from autotune.records import Config  # noqa: E402
from autotune.units import format_bytes, parse_size  # noqa: E402

PRECISIONS, PLANS, BATCH = ("fp32", "fp16", "bf16"), ("0", "all"), 16
BUDGET = parse_size("24GiB")


def bundled() -> list[dict]:
    rows = []
    rules = CudaRules(torch.device("cpu"))
    workspaces = 2 * rules.describe(CudaFindings())["cublas_workspace_bytes"]
    for name, spec in MODELS.items():
        workload = _workload(spec)
        for precision in PRECISIONS:
            for plan in PLANS:
                config = Config(precision, plan, BATCH)
                cpu, cuda = predict_trial(workload, config, budget_bytes=BUDGET), \
                    predict_trial(workload, config, budget_bytes=BUDGET, cuda=rules)
                rows.append({"model": name, "precision": precision, "plan": plan, "batch_size": BATCH,
                             "cpu_bytes": cpu.peak_bytes, "cuda_allocated_bytes": cuda.peak_allocated_bytes,
                             "cuda_tensors_bytes": cuda.peak_allocated_bytes - workspaces,
                             "cuda_reserved_bytes": cuda.peak_reserved_bytes, "cuda_nvml_bytes": cuda.peak_nvml_bytes})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def llama(out_dir: str) -> dict:
    out = os.path.join(out_dir, ".tmp", "tinyllama-cuda-dry-run.json")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the plan of a machine without a GPU, whatever this one has
    run = _cli(["--model", LLAMA, "--device", "cuda", "--budget", "24GiB", "--precisions", "bf16", "--segments",
                "0,4,all", "--batch-sizes", "1..64", "--dry-run"], out)
    with open(out) as f:
        report = json.load(f)
    run["limits"] = {d["segments"]: [d["max_batch_size"], d["min_oom_batch_size"]] for d in report["limits"]}
    run["predictions"] = len(report["trials"])
    run["cuda"] = report["search"]["cuda"]
    fits = [t for t in report["trials"] if t["status"] == "ok"]
    top = max(fits, key=lambda t: t["peak_reserved_bytes"]) if fits else None
    run["largest_fit"] = None if top is None else {k: top[k] for k in ("precision", "segments", "batch_size",
                                                                         "peak_allocated_bytes", "peak_reserved_bytes",
                                                                         "peak_nvml_bytes")}
    print(json.dumps(run), flush=True)
    return run


def markdown(data: dict) -> str:
    env = data["environment"]
    lines = [f"# Planning for CUDA without a GPU ({env['machine']}, torch {env['torch']})", "",
             f"Command: `{data['command']}`. No GPU checked these figures: `benchmarks/gpu_check.py` compares both "
             "ways of predicting with measurements when one is lent.", "",
             f"**The bundled models at batch {BATCH}**, predicted on this CPU with the CPU's rules and with CUDA's "
             "(tensors: allocated less the two cuBLAS workspaces of 32 MiB; reserved and NVML: the caching "
             "allocator's model, the CUDA context assumed at 512 MiB):", "",
             "| model | precision | plan | CPU's rules | CUDA's: tensors | CUDA's: reserved | CUDA's: NVML |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["bundled"]:
        lines.append(f"| {r['model']} | {r['precision']} | {r['plan']} | {format_bytes(r['cpu_bytes'])} | "
                     f"{format_bytes(r['cuda_tensors_bytes'])} | {format_bytes(r['cuda_reserved_bytes'])} | "
                     f"{format_bytes(r['cuda_nvml_bytes'])} |")
    run = data["llama"]
    limits = ", ".join(f"{plan}: {fit} ({over})" for plan, (fit, over) in run["limits"].items())
    top = run["largest_fit"]
    lines += ["", f"**A Llama-shaped 1.1B model at 2048 tokens, planned for a 24 GiB card in a process that sees no "
              f"GPU** (`{run['command']}`): exit {run['exit']}, {run['predictions']} predictions in {run['wall_s']} s "
              f"of wall time; the process peaked at {format_bytes(run['max_rss_bytes'])}. Limits (largest batch that "
              f"fits, the next one): {limits}."]
    if top:
        lines.append(f"The largest predicted fit, {top['precision']}/{top['segments']} at batch {top['batch_size']}: "
                     f"allocated {format_bytes(top['peak_allocated_bytes'])}, reserved "
                     f"{format_bytes(top['peak_reserved_bytes'])}, NVML {format_bytes(top['peak_nvml_bytes'])}.")
    return "\n".join(lines) + "\n"


def main() -> int:
    out_dir = os.path.join(ROOT, "results")
    data = {"command": "python benchmarks/cuda_plan.py",
            "environment": {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__},
            "bundled": bundled(), "llama": llama(out_dir)}
    with open(os.path.join(out_dir, "cuda_plan-cpu.json"), "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    with open(os.path.join(out_dir, "cuda_plan-cpu.md"), "w") as f:
        f.write(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
