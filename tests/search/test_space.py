import pytest

from autotune.errors import UsageError
from autotune.records import Config
from autotune.vocabulary import parse_plans as parse_segments
from autotune.search.space import SearchSpace, parse_batch_sizes, parse_precisions


def test_batch_size_range_is_powers_of_two():
    assert parse_batch_sizes("1..512") == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert parse_batch_sizes("3..40") == (4, 8, 16, 32)


def test_batch_size_list_is_sorted_and_unique():
    assert parse_batch_sizes("24,8,16,8") == (8, 16, 24)


@pytest.mark.parametrize("text", ["5..7", "", "a,b", "0,4", "64..1"])
def test_bad_batch_sizes(text):
    with pytest.raises(UsageError, match="batch-sizes|batch sizes"):
        parse_batch_sizes(text)


def test_segments_and_precisions():
    assert parse_segments("auto") is None
    assert parse_segments("4,0,2, ALL,every2,4") == ("4", "0", "2", "all", "every2")  # as given, once each
    assert parse_precisions("auto") is None
    assert parse_precisions("FP32, bf16") == ("fp32", "bf16")
    for bad in ("x", "-1", "", "every0"):
        with pytest.raises(UsageError):
            parse_segments(bad)
    with pytest.raises(UsageError, match="fp8"):
        parse_precisions("fp32,fp8")


def test_space_enumerates_every_point_in_order():
    space = SearchSpace(("fp32", "bf16"), (0, 2), (2, 1))
    configs = space.configs()
    assert len(configs) == len(space) == 8
    assert configs[0] == Config("fp32", "0", 1) and configs[1] == Config("fp32", "0", 2)
    assert configs[-1] == Config("bf16", "2", 2)


def test_empty_space_is_bad_input():
    with pytest.raises(UsageError, match="empty"):
        SearchSpace(("fp32",), (), (1,))
