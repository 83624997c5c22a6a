"""autotune.report.shortfall: what a report that recommends nothing says about why, from a committed grid's trials
(``results/grid-TinyGPT-cpu.json``, TinyGPT on the CPU) read with another space, budget and floor."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from autotune.records import usable_bytes
from autotune.report import Report
from autotune.report.shortfall import Shortfall, shortfall
from autotune.units import format_bytes
from tests.paths import ROOT

GRID = ROOT / "results" / "grid-TinyGPT-cpu.json"
MIB = 2**20


@pytest.fixture(scope="module")
def grid() -> dict:
    return json.loads(GRID.read_text(encoding="utf-8"))


def report_of(grid: dict, *, budget_bytes: int | None = None, floor: dict | None = None, **space) -> Report:
    """The grid's report with another budget, ``workload.floor`` and search space (its trials as measured)."""
    data = copy.deepcopy(grid)
    data["search"]["space"].update(space)
    data["workload"]["floor"] = floor
    if budget_bytes is not None:
        data["budget_bytes"] = budget_bytes
    return Report.from_dict(data)


def test_the_figures_come_from_the_trials_and_the_workload(grid):
    short = report_of(grid).shortfall()
    memory = [t for t in grid["trials"] if t["peak_bytes"] is not None]
    least = min(memory, key=lambda t: t["peak_bytes"])
    assert short.statuses == ("ok", "oom")
    assert short.smallest[0] == least["peak_bytes"] and short.smallest[2] == least["status"]
    assert short.smallest[1].startswith(least["precision"])
    assert short.state_bytes == grid["workload"]["fixed_bytes"] and short.state_share == short.state_bytes
    assert not short.state_over_half  # 10 MB of state in 1 GiB
    assert short.untried == ()  # both precisions, every plan, batch 1: nothing left out (and no offload on the CPU)
    why = short.why()
    assert why.startswith(f"nothing fits within {format_bytes(grid['budget_bytes'])} less 10% headroom")
    assert "(trial outcomes: ok, oom)" in why and format_bytes(least["peak_bytes"]) in why


def test_the_levers_the_space_left_out_are_named(grid):
    short = report_of(grid, precisions=["fp32"], segments=["0"], batch_sizes=[4, 8]).shortfall()
    assert short.untried == ("half", "checkpointing", "batch 1")


def test_a_state_over_half_the_budget_names_the_half_state_lever(grid):
    state = grid["workload"]["fixed_bytes"]
    budget = int(1.5 * state)  # usable: 1.35x the state, so the state is over half of it
    short = report_of(grid, budget_bytes=budget).shortfall()
    assert short.state_over_half and state > 0.5 * usable_bytes(budget, 0.1)
    assert "half state" in short.untried  # bf16-true was not searched
    roomy = report_of(grid, budget_bytes=4 * state).shortfall()
    assert not roomy.state_over_half and "half state" not in roomy.untried


@pytest.mark.parametrize("activations_mib, offered", [(1, True), (64, False)])
def test_recomputing_every_block_is_offered_only_where_its_floor_fits(grid, activations_mib, offered):
    """The floor (batch 1, every block recomputed) is the state plus the activations measured; where it fits the
    usable budget and the space had no plan that recomputes every block, "all blocks" is the first lever."""
    state = grid["workload"]["fixed_bytes"]
    budget = state + 32 * MIB
    floor = {"kept": activations_mib * MIB, "recompute": 0, "block_weights": MIB, "precision": "bf16",
             "activations": activations_mib * MIB}
    short = report_of(grid, budget_bytes=budget, floor=floor, segments=["0", "2"]).shortfall()
    assert short.floor_need() == state + activations_mib * MIB
    assert (short.untried[:1] == ("all blocks",)) is offered
    assert (f"at batch 1 with every block recomputed a step needs about {format_bytes(state + activations_mib * MIB)}"
            in short.why())
    with_all = report_of(grid, budget_bytes=budget, floor=floor, segments=["0", "all"]).shortfall()
    assert "all blocks" not in with_all.untried  # searched already


def test_a_sharded_state_counts_one_ranks_share():
    short = Shortfall(8 * MIB, 0.1, ("oom",), state_bytes=64 * MIB, sharded_ranks=4,
                      floor={"activations": 2 * MIB, "block_weights": MIB, "precision": "fp32"})
    assert short.state_share == 16 * MIB and short.floor_need() == 18 * MIB
    assert f"{format_bytes(16 * MIB)} of weights, gradients and optimizer state on each rank" in short.why()
    assert Shortfall(8 * MIB, 0.1, ("oom",)).floor_need() is None  # no state measured: no floor


def test_a_state_in_host_memory_says_what_the_device_still_holds():
    short = Shortfall(8 * MIB, 0.1, ("oom",), state_bytes=64 * MIB, hosted=True,
                      floor={"activations": 2 * MIB, "block_weights": 3 * MIB, "precision": "fp32"})
    assert f"with the state in host memory the activations and the gathered block's weights, {format_bytes(5 * MIB)}" \
        in short.why()


def test_rejected_probe_candidates_are_the_reason():
    short = Shortfall(MIB, 0.1, ("ok",), probe_rejections=(("fp16 segments=0 batch=8", "non-finite loss"),))
    assert short.why() == "every probed candidate was rejected (fp16 segments=0 batch=8: non-finite loss)"


def test_the_function_and_the_reports_method_agree(grid):
    report = report_of(grid, precisions=["fp32"])
    assert shortfall(report) == report.shortfall()
