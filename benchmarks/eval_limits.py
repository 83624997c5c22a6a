"""Do the evaluation limits hold on the bundled models' real data?

    python benchmarks/eval_limits.py [--out results] [--only NAME]

For each bundled model with its bundled data (TinyGPT on ``token_dataset`` and on the long-tailed
``variable_token_loader``, ResNetish on ``image_dataset``) a search (no probe) finds the report's ``eval_limits``.
Then, for every precision and plan, an evaluation written here as a user's loop runs it, not autotune's own pass:
the model built and prepared by ``autotune.apply``; for the limit during training, one real AdamW step on one
training item first (``run.step`` sets the gradients to None, as a Trainer's ``zero_grad`` does before it
evaluates); then a whole evaluation epoch over the dataset, shuffled, through a ``DataLoader`` (the data's own
``collate_fn``), in eval mode under ``torch.no_grad()`` and autocast. The tensor meter counts it with the budget
less the headroom enforced: at the limit L every batch of the epoch must fit, and at L + ``--batch-multiple``
some batch must not.

Writes ``results/eval_limits-cpu.json`` and ``.md``.
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
from autotune.training.workload import dataset_of, load_object
from autotune.units import format_bytes, parse_size

# name: (model, its kwargs, data, budget, batch sizes searched)
CASES = {
    "TinyGPT-tokens": ("autotune.examples:TinyGPT", {}, "token_dataset(size=256)", "64MiB", "1..8"),
    "TinyGPT-long-tailed": ("autotune.examples:TinyGPT", {}, "variable_token_loader(size=512)", "64MiB", "1..8"),
    "ResNetish-images": ("autotune.examples:ResNetish", {}, "image_dataset(size=512)", "32MiB", "1..16"),
}


def _data(text: str):
    import autotune.examples as examples

    name, _, args = text.partition("(")
    return eval(f"examples.{name}({args}", {"examples": examples})  # noqa: S307 - this file's own constants


def _loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """The loss as the bundled models give it: TinyGPT's output holds it, ResNetish's ``loss(output, target)``."""
    if isinstance(batch, dict):
        return model(**batch).loss
    images, labels = batch
    return model.loss(model(images), labels)


def evaluation_epoch(case: tuple, precision: str, plan: str, kind: str, batch_size: int, usable: int) -> dict:
    """One evaluation epoch at ``batch_size`` metered under ``usable`` bytes: ok with its worst batch's peak, or oom
    with what the failing batch needed at least."""
    model_name, kwargs, data, _, _ = case
    loaded = dataset_of(_data(data))
    loader = torch.utils.data.DataLoader(loaded.dataset, batch_size=batch_size, shuffle=True,
                                         collate_fn=loaded.collate_fn,
                                         generator=torch.Generator().manual_seed(1))
    cls = load_object(model_name, flag="--model")
    batches = 0
    try:
        with TensorMeter(budget_bytes=usable).measure() as handle:
            torch.manual_seed(0)
            model = cls(**kwargs)
            run = autotune.apply(model, {"precision": precision, "segments": plan, "batch_size": 1})
            if kind == "during_training":  # the training state: weights, AdamW's moments and steps, no gradients
                optimizer = torch.optim.AdamW(run.model.parameters(), lr=1e-4)
                first = (collate_fn or torch.utils.data.default_collate)([dataset[0]])
                with run.autocast():
                    loss = _loss(run.model, first)
                run.backward(loss)
                run.step(optimizer)  # zero_grad(set_to_none=True)
                del loss, first
            handle.reset_peak()  # the evaluation's peak, from the resident state up
            run.model.eval()
            with torch.no_grad():
                for batch in loader:
                    with run.autocast():
                        loss = _loss(run.model, batch)
                    del loss, batch
                    batches += 1
            peak = handle.peak_bytes()
    except Exception as exc:  # noqa: BLE001 - a batch that does not fit is the finding
        if not is_oom(exc):
            raise
        reading = handle.reading
        return {"status": "oom", "batches_before": batches, "needed_bytes": reading.oom_needed_bytes}
    return {"status": "ok", "batches": batches, "worst_batch_peak_bytes": peak}


def run_case(name: str, case: tuple, storage: str) -> dict:
    model_name, kwargs, data, budget, batch_sizes = case
    started = time.monotonic()
    report = autotune.tune(model_name, model_kwargs=kwargs, data=lambda: _data(data), device="cpu", budget=budget,
                           precisions="fp32,bf16", segments="0,all", batch_sizes=batch_sizes, probe=False,
                           compare_library=False, storage=storage, study=name)
    tune_s = time.monotonic() - started
    print(report.table(), file=sys.stderr)
    usable = int(report.search["eval_limits"]["usable_bytes"])
    multiple = report.search["eval_limits"]["batch_multiple"]
    rows = []
    for row in report.eval_limits:
        for kind in ("during_training", "inference"):
            limit = row[f"{kind}_max_batch_size"]
            print(f"{name} {row['precision']}/{row['segments']} {kind}: epochs at {limit} and {limit + multiple}",
                  file=sys.stderr, flush=True)
            rows.append({"precision": row["precision"], "segments": row["segments"], "kind": kind, "limit": limit,
                         "source": row["source"], "found": row[kind],
                         "at_limit": evaluation_epoch(case, row["precision"], row["segments"], kind, limit, usable),
                         "above": evaluation_epoch(case, row["precision"], row["segments"], kind, limit + multiple,
                                                   usable)})
    training = {f"{r['precision']}/{r['segments']}": r["max_batch_size"] for r in report.limits}
    return {"case": name, "model": model_name, "data": data, "budget_bytes": report.budget_bytes,
            "usable_bytes": usable, "batch_multiple": multiple, "training_limits": training,
            "recommendation": None if report.recommendation is None else str(report.recommendation.config),
            "tune_s": round(tune_s, 1), "eval_limits_s": report.search["eval_limits"]["wall_s"],
            "search_wall_s": report.search["wall_s"], "eval_search": report.search["eval_limits"], "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results")
    parser.add_argument("--only", choices=sorted(CASES), action="append")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    storage = f"sqlite:///{tempfile.mkdtemp()}/eval.db"
    cases = [run_case(name, CASES[name], storage) for name in args.only or CASES]
    result = {"benchmark": "eval_limits", "command": "python benchmarks/eval_limits.py " + " ".join(sys.argv[1:]),
              "environment": backend_for(torch.device("cpu")).environment(), "cases": cases}
    stem = os.path.join(args.out, "eval_limits-cpu")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2, default=str)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result) + "\n")
    print(markdown(result))


def markdown(r: dict) -> str:
    lines = [f"# Evaluation limits against real evaluation epochs ({r['environment']['device_name']})", "",
             f"Command: `{r['command']}`. Each limit is the report's (`eval_limits`); beside it, a whole evaluation "
             f"epoch over the data written as a user's loop (`autotune.apply`, one real AdamW step first for the "
             f"limit during training, then eval mode, `torch.no_grad()`, autocast), metered with the budget less "
             f"headroom enforced, at the limit and at the next size.", ""]
    for case in r["cases"]:
        lines += [f"## {case['case']}: {case['model']} on {case['data']}", "",
                  f"Budget {format_bytes(case['budget_bytes'])}, less 10% headroom {format_bytes(case['usable_bytes'])}; "
                  f"training limits {', '.join(f'{k}: {v}' for k, v in case['training_limits'].items())}; the search "
                  f"took {case['tune_s']} s, of which the evaluation limits {case['eval_limits_s']} s "
                  f"({case['eval_search']['predicted_passes']} passes predicted, "
                  f"{case['eval_search']['measured_passes']} measured).", "",
                  "| precision/plan | evaluation | limit (source) | predicted or measured peak at it | epoch at the limit: worst batch | epoch at the next size |",
                  "|---|---|---:|---:|---:|---|"]
        for row in case["rows"]:
            at, above = row["at_limit"], row["above"]
            worst = format_bytes(at["worst_batch_peak_bytes"]) + f" ({at['batches']} batches)" if at["status"] == "ok" \
                else f"out of memory after {at['batches_before']} batches"
            nxt = (f"out of memory at batch {above['batches_before'] + 1} (needed {format_bytes(above['needed_bytes'])})"
                   if above["status"] == "oom" else f"fits ({format_bytes(above['worst_batch_peak_bytes'])})")
            lines.append(f"| {row['precision']}/{row['segments']} | {row['kind'].replace('_', ' ')} | {row['limit']} "
                         f"({row['source']}) | {format_bytes(row['found']['peak_bytes'])} | {worst} | {nxt} |")
        lines.append("")
    return "\n".join(lines).rstrip()


if __name__ == "__main__":
    main()
