import pytest

from autotune.errors import UsageError
from autotune.vocabulary import SELECTIVE, Plan, auto_plans, parse_plans, plan_order


def test_names():
    assert [Plan(n) for n in ("0", 3, " ALL ", "every02", "02")] == ["0", "3", "all", "every2", "2"]
    for bad in ("half", "every0", "-1", "every", "2.5"):
        with pytest.raises(UsageError, match="unknown checkpoint plan"):
            Plan(bad)
    assert parse_plans("auto") is None
    assert parse_plans("0, 2,all,every2,2") == ("0", "2", "all", "every2")
    with pytest.raises(UsageError, match="empty"):
        parse_plans(" , ")


def test_which_blocks_each_plan_recomputes():
    assert Plan("0").blocks(12) == Plan("1").blocks(12) == ()
    assert Plan("2").blocks(12) == tuple(range(6))  # the last of two segments is not recomputed
    assert Plan("3").blocks(10) == tuple(range(7))  # segments of 4, 3, 3
    assert Plan("12").blocks(12) == tuple(range(11))
    assert Plan("all").blocks(5) == (0, 1, 2, 3, 4)
    assert Plan("every4").blocks(10) == (0, 4, 8)  # transformers' every_n_layers: layer_index % n == 0
    assert Plan("all").recompute_share(8) == 1.0 and Plan("every4").recompute_share(8) == 0.25
    assert Plan("every4").recompute_share(None) == 0.25 and Plan("0").recompute_share(None) == 0.0


def test_auto_spreads_from_nothing_to_everything_without_repeats():
    # The block plans, then the selective plans placed by the share of activations they are expected to free.
    assert auto_plans(12) == ["0", "sac-matmul", "sac-lean", "every4", "2", "4", "sac-linear", "8", "all"]
    assert auto_plans(2) == ["0", "sac-matmul", "sac-lean", "sac-linear", "all"]
    assert auto_plans(0) == ["0"]
    for length in range(1, 40):
        plans = [p for p in auto_plans(length) if Plan(p).selective is None]
        sets = [Plan(p).blocks(length) for p in plans]
        assert len(set(sets)) == len(sets) and plans[0] == "0" and plans[-1] == "all"
        assert [len(s) for s in sets] == sorted(len(s) for s in sets)
        assert {n for n, plan in SELECTIVE.items() if plan.auto} <= set(auto_plans(length))
        assert "sac-torchtitan" not in auto_plans(length)  # searched where named (Llama: what sac-lean keeps)


def test_order_and_bounds():
    assert plan_order(["all", "2", "0", "every4"], 12) == ["0", "every4", "2", "all"]
    Plan("every4").fits(4, "blocks")
    with pytest.raises(UsageError, match="at most 3"):
        Plan("4").fits(3, "transformer.h")


@pytest.mark.parametrize("a, b, ordered", [
    ("all", "0", True), ("0", "all", False), ("4", "2", True), ("2", "4", False), ("4", "every4", True),
    ("2", "every4", False), ("every4", "2", False), ("8", "4", True), ("all", "8", True),
    ("all", "sac-matmul", True), ("all", "sac-linear", True), ("8", "sac-lean", False),
    ("sac-linear", "sac-matmul", True), ("sac-lean", "sac-matmul", True), ("sac-lean", "sac-linear", False),
    ("sac-matmul", "0", False), ("0", "sac-matmul", False), ("2", "2", True),
    ("all", "sac-torchtitan", True), ("sac-torchtitan", "sac-lean", False), ("sac-lean", "sac-torchtitan", False),
    ("sac-torchtitan", "sac-matmul", False),  # it keeps abs and max, which sac-matmul recomputes
])
def test_plans_are_partly_ordered_by_the_memory_they_need(a, b, ordered):
    assert Plan(a).needs_no_more_memory_than(b, 12) is ordered


def test_without_the_block_count_no_two_plans_are_ordered():
    assert not Plan("all").needs_no_more_memory_than("0", None) and Plan("all").needs_no_more_memory_than("all", None)
