"""The ground floor's enums and tables: each member its own string, and what the parts above read from them."""

import json

import pytest

from autotune.vocabulary.attention import Attention
from autotune.vocabulary.autocast import AutocastPolicy
from autotune.vocabulary.modes import Isolation, Parallel
from autotune.vocabulary.precision import FSDP_ONLY, HALF, PRECISIONS, SIXTEEN_BIT, TRUE, runs_where


@pytest.mark.parametrize("enum", [Parallel, Isolation, AutocastPolicy, Attention])
def test_every_member_is_its_own_string_in_the_json_and_reads_back(enum):
    for member in enum:
        assert member == member.value and str(member) == member.value
        assert json.loads(json.dumps({"m": member}))["m"] == member.value and enum(member.value) is member


def test_the_flags_choices_are_the_enums_members():
    from autotune.options import ISOLATION_MODES, PARALLEL_MODES

    assert PARALLEL_MODES == ("none", "ddp", "fsdp") and ISOLATION_MODES == ("auto", "process", "none")
    assert [p for p in Parallel if p.sharded] == [Parallel.FSDP]


def test_each_cuda_autocast_policy_has_its_kernel_and_every_listed_op_a_policy():
    from autotune.execution.cuda_rules import _APPLY, CUDA_POLICIES

    assert set(_APPLY) == set(AutocastPolicy)  # one small function per policy
    assert set(CUDA_POLICIES.values()) == set(AutocastPolicy)
    assert CUDA_POLICIES["mm"] is AutocastPolicy.LOWER and CUDA_POLICIES["binary_cross_entropy"] is AutocastPolicy.BANNED


def test_the_precision_tables_follow_from_each_mode():
    assert HALF == ("fp16", "bf16") and TRUE == ("bf16-true",) and FSDP_ONLY == ("bf16-fsdp",)
    assert set(SIXTEEN_BIT) == set(PRECISIONS) - {"fp32"}
    assert [PRECISIONS[n].state_bytes_per_element for n in ("fp32", "bf16", "bf16-true")] == [4, 4, 2]
    assert PRECISIONS["bf16-fsdp"].policy.startswith("MixedPrecisionPolicy(param_dtype=bfloat16")
    assert runs_where(["bf16"]) and not runs_where([])
