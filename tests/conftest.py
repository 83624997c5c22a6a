import os

# One intra-op thread, here and in every process a test starts (CLIs, parallel workers, isolated trials, torchrun's
# ranks inherit it): on two cores, two workers of two threads each, or a trial beside a CPU hog or CI's install,
# left OpenMP's threads spinning for each other (two workers on one study: 41-56 s of wall time and 54-70 s of CPU
# with the default of two threads, 13-15 s and 14 s with one, on a loaded machine). The models here are too small
# to gain from a second thread. Set before torch is imported; OMP_NUM_THREADS=N in the environment overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.procs import Started  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A TinyGPT small enough that a trial takes a fraction of a second on two CPU cores.
TINY_GPT = {"n_layer": 4, "block_size": 32, "n_embd": 32, "n_head": 4, "vocab_size": 64}


# The modules that take longest on CI's two processes, most first (after each, its CPU seconds in one run of
# `-m "not serial"`; test_compile.py's alone). pytest-xdist's loadscope hands modules out by
# test count, most first, which left modules of few but slow tests (test_integrations, test_world_size,
# test_end_to_end) to the end, where one process finished its last module alone while the other sat idle. Here the
# processes take these modules first, then the rest in file order, where the quick ones even out the end. A module
# missing here only runs later; a list out of date costs seconds, never a test.
SLOWEST_FIRST = ("test_dry_run.py",  # 148
                 "test_reliability.py",  # 75: the tests not marked serial
                 "test_compile.py",  # 50
                 "test_zoo.py",  # 49
                 "test_integrations.py",  # 36
                 "test_isolation.py",  # 35
                 "test_world_size.py",  # 24: the tests not marked serial
                 "test_cli.py",  # 24
                 "test_predicted_search.py", "test_end_to_end.py", "test_data.py", "test_probe.py",  # 15-17 each
                 "test_examples.py", "test_tuner.py", "test_thirdparty.py", "test_offload.py")  # 11-14 each


def pytest_configure(config):
    """Under ``--dist loadscope``, hand modules out in collection order (SLOWEST_FIRST's), not by test count: what
    pytest-xdist 3.7 and later do with ``--no-loadscope-reorder``."""
    if getattr(config.option, "dist", None) == "loadscope" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """On pytest-xdist's processes, the slowest modules first (SLOWEST_FIRST); each module's tests stay in order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _global_state() -> dict:
    """torch's process-wide settings a test could leave changed: the module after it would run under them."""
    import sys

    state = {"threads": torch.get_num_threads(), "default_dtype": torch.get_default_dtype(),
             "deterministic": torch.are_deterministic_algorithms_enabled(), "grad": torch.is_grad_enabled(),
             "matmul_precision": torch.get_float32_matmul_precision()}
    for name in ("torch._inductor.config", "torch._dynamo.config", "torch._functorch.config"):
        config = sys.modules.get(name)  # imported by a test that compiles: compared from then on
        if config is not None:
            state.update({f"{name}.{key}": value for key, value in config.get_config_copy().items()
                          if not callable(value)})
    return state


@pytest.fixture(autouse=True, scope="module")
def _global_state_put_back():
    """Every module leaves torch's global configuration as it found it, so that the suite passes in any order and
    in one process (a module that changed inductor's config broke the next one that compiled)."""
    before = _global_state()
    yield
    after = _global_state()
    changed = {key: (before[key], after[key]) for key in before if key in after and before[key] != after[key]}
    assert not changed, f"this module left torch's global configuration changed: {changed}"


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


@pytest.fixture
def processes():
    """A list for the processes a test starts: killed, reaped and their pipes closed when the test ends, passed,
    failed or timed out, so that a failing test leaves nothing running (and no unclosed pipe) for the tests after
    it. A process that leads a process group of its own (``start_new_session=True``) is killed with its group: what
    it started too, such as a CLI's isolated workers, also after the process itself has exited."""
    started = Started()
    yield started
    started.stop_all()


def pytest_collection_finish(session):
    """Freeze what exists once the tests are collected (torch, pytest, the test modules): the full collection that
    ends every trial (``Backend.release``) then walks only what the tests make, as a search's does (search.py)."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (what a DeviceMesh needs), destroyed afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
