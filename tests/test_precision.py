import pytest
import torch

from autotune.errors import UsageError
from autotune.training.precision import PRECISIONS, get_mode


def test_modes():
    assert get_mode("fp32").autocast_dtype is None and get_mode("fp32").grad_scaler("cpu") is None
    assert get_mode("bf16").autocast_dtype is torch.bfloat16 and get_mode("bf16").grad_scaler("cpu") is None
    scaler = get_mode("fp16").grad_scaler("cpu")
    assert scaler.is_enabled() and scaler.get_scale() == 2.0**16
    with pytest.raises(UsageError, match="fp32, fp16, bf16"):
        get_mode("int8")


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_autocast_computes_matmuls_in_the_mode(name):
    lin = torch.nn.Linear(8, 8)
    with PRECISIONS[name].autocast("cpu"):
        assert lin(torch.randn(2, 8)).dtype == PRECISIONS[name].autocast_dtype
    assert lin(torch.randn(2, 8)).dtype == torch.float32
