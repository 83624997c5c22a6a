"""The docs' tables of the example reports, written from the report files, so that the two cannot drift.

    bash benchmarks/regenerate_examples.sh          # the reports (a few minutes on a quiet machine)
    python benchmarks/example_tables.py             # these tables from them (seconds)
    python benchmarks/sync_docs.py                  # the docs' copies of the tables

Writes, beside the reports in ``--results``:

* ``example-gpt2-cpu.md``: the GPT-2 example's search in figures and the lines the CLI ends with
  (docs/workload.md);
* ``example-gpt2-plans-cpu.md``: every block plan at one precision and batch size, and the library's
  own switch (docs/plans.md);
* ``selective-fronts-cpu.md``: the two 200 MiB grids with the selective plans: every timed trial,
  the front and the recommendation (docs/plans.md);
* ``offload-modes-cpu.md``: plans ``0`` and ``all`` under FSDP2 on one rank with each ``--offload`` mode: device
  and host peaks, step times, the optimizer step's share (docs/plans.md, "The state in host memory").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.vocabulary import Plan  # noqa: E402
from autotune.report import Report, load  # noqa: E402
from autotune.units import format_bytes  # noqa: E402

MiB = 2**20


def example(report: Report, name: str) -> str:
    """The search in figures and the CLI's last lines."""
    search = report.search
    space = search["space"]
    size = len(space["precisions"]) * len(space["segments"]) * len(space["batch_sizes"])
    lines = [line for line in report.table().splitlines() if line.startswith(("recommendation", "library"))]
    return "\n".join([
        f"From `results/{name}` (written by `bash benchmarks/regenerate_examples.sh`): {search['n_trials']} of the "
        f"space's {size} configurations measured ({search['figures']['memory+time']} timed), "
        f"{search['wall_s']:.0f} s of search, on {report.environment.get('device_name') or 'this CPU'}.",
        "", "```", *lines, "```", ""])


def plans(report: Report, name: str) -> str:
    """Every plan's peak and time at the grid's one precision and batch size; the library's switch beside them."""
    blocks = report.search["space"]["blocks"]
    rows = ["| plan | blocks recomputed (of {}) | peak | step | samples/s |".format(blocks),
            "| --- | --- | ---: | ---: | ---: |"]
    for m in sorted(report.trials, key=lambda m: (len(m.plan.get("recomputed_blocks", ())), m.config.plan)):
        recomputed = m.plan.get("recomputed_blocks") or []
        rows.append(f"| `{m.config.plan}` | {_ranges(recomputed)} | {format_bytes(m.peak_bytes)} | {m.step_s:.3f} s | "
                    f"{m.samples_per_s:.1f} |")
    lib = report.library_checkpointing or {}
    if (lib.get("library") or {}).get("status") == "ok":
        ours = lib["library"]
        rows.append(f"| library switch | {_ranges(range(blocks))} | {format_bytes(ours['peak_bytes'])} | "
                    f"{ours['step_s']:.3f} s | {ours['samples_per_s']:.1f} |")
    first = report.trials[0]
    return (f"From `results/{name}` ({first.precision}, batch {first.batch_size}, "
            f"{report.search['measure_steps']} timed steps at most):\n\n" + "\n".join(rows) + "\n")


def fronts(reports: dict[str, Report]) -> str:
    """Each grid's timed trials, marked when on the front or recommended."""
    parts = []
    for name, report in reports.items():
        front = {m.config for m in report.pareto}
        best = report.recommendation
        rows = ["| plan | kind | batch | peak | samples/s | |", "| --- | --- | ---: | ---: | ---: | --- |"]
        timed = sorted((m for m in report.trials if m.samples_per_s is not None),
                       key=lambda m: (m.batch_size, -m.samples_per_s))
        for m in timed:
            mark = "recommended" if best is not None and m.config == best.config else ("front" if m.config in front else "")
            kind = "selective" if Plan(m.config.plan).selective else "blocks"
            rows.append(f"| `{m.config.plan}` | {kind} | {m.batch_size} | {format_bytes(m.peak_bytes)} | "
                        f"{m.samples_per_s:.1f} | {mark} |")
        budget = format_bytes(report.budget_bytes)
        parts.append(f"### {report.workload['model_class']}\n\n`results/{name}`: {budget}, "
                     f"{report.search['space']['precisions'][0]}, {report.search['n_trials']} trials, "
                     f"{report.search['wall_s']:.0f} s; the timed trials:\n\n" + "\n".join(rows) + "\n")
    return "# Selective plans on a 200 MiB grid\n\n" + "\n".join(parts)


def offload_modes(report: Report, name: str) -> str:
    """Each plan with each offload mode: device peak (and its share of plan 0's without offload), host peak, step time
    against the same plan without offload, the optimizer step's share."""
    by = {(m.config.precision, m.config.plan, m.batch_size): m for m in report.trials if m.status == "ok"}
    none = by.get((report.trials[0].precision, "0", report.trials[0].batch_size))
    rows = ["| plan | offload | device peak | vs `0` | host peak | step vs the plan alone | optimizer step |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for m in sorted(by.values(), key=lambda m: (Plan(m.config.plan).base, Plan(m.config.plan).offload, Plan(m.config.plan).state)):
        alone = by.get((m.config.precision, Plan(m.config.plan).base, m.batch_size))
        rows.append(f"| `{m.config.plan}` | {m.offload} | {format_bytes(m.peak_bytes)} | "
                    f"{m.peak_bytes / none.peak_bytes:.2f} | "
                    f"{format_bytes(m.host_peak_bytes) if m.host_peak_bytes is not None else '-'} | "
                    f"{m.step_s / alone.step_s:.2f}x | "
                    f"{f'{m.optimizer_step_share:.0%}' if m.optimizer_step_share is not None else '-'} |")
    first = report.trials[0]
    return (f"From `results/{name}` (written by `bash benchmarks/regenerate_examples.sh`): "
            f"{report.workload['model_class']}, {first.precision}, batch {first.batch_size}, FSDP2 on one rank "
            f"(gloo), both offloads emulated on {report.environment.get('device_name') or 'this CPU'}: host copies "
            f"and the state counted apart from the device, no transfers in the step times.\n\n" + "\n".join(rows) + "\n")


def _ranges(indices) -> str:
    """``[0, 1, 2, 4]`` as ``0-2, 4``; nothing as ``none``."""
    indices = sorted(indices)
    if not indices:
        return "none"
    spans, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(spans)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    results = Path(args.results)
    written = {
        "example-gpt2-cpu.md": example(load(results / "example-gpt2-cpu.json"), "example-gpt2-cpu.json"),
        "example-gpt2-plans-cpu.md": plans(load(results / "example-gpt2-plans-cpu.json"), "example-gpt2-plans-cpu.json"),
        "selective-fronts-cpu.md": fronts({f"selective-front-{m}-cpu.json": load(results / f"selective-front-{m}-cpu.json")
                                           for m in ("gpt2", "TinyGPT")}),
        "offload-modes-cpu.md": offload_modes(load(results / "offload-modes-TinyGPT-cpu.json"),
                                              "offload-modes-TinyGPT-cpu.json"),
    }
    for name, text in written.items():
        (results / name).write_text(text, encoding="utf-8")
        print(f"wrote {results / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
