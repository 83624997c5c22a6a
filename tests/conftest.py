import os
import signal
import subprocess

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


@pytest.fixture
def processes():
    """A list for the processes a test starts: killed, reaped and their pipes closed when the test ends, passed or
    failed, so that a failing test leaves nothing running (and no unclosed pipe) for the tests after it."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            if os.getpgid(proc.pid) == proc.pid:  # it leads a group of its own: its isolated workers too
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def pytest_collection_finish(session):
    """Freeze what exists once the tests are collected (torch, pytest, the test modules): the full collection that
    ends every trial (``Backend.release``) then walks only what the tests make, as a search's does (search.py)."""
    import gc

    gc.collect()
    gc.freeze()
