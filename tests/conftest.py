import pytest
import torch

# A TinyGPT small enough that a trial takes a fraction of a second on two CPU cores.
TINY_GPT = {"n_layer": 4, "block_size": 32, "n_embd": 32, "n_head": 4, "vocab_size": 64}


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tiny_gpt_kwargs():
    return dict(TINY_GPT)


@pytest.fixture
def storage(tmp_path):
    return f"sqlite:///{tmp_path / 'trials.db'}"
