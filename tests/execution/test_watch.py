"""autotune.execution.watch: a rank that leaves a trial says so in the job's store, and the other ranks' watch aborts
their trial group when it reads that (on a real gloo group of one rank in this process, and its real store)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from autotune.execution.job import Job
from autotune.execution.watch import Watch, say_left

JOB = Job(wrapper="ddp", rank=0, world_size=1, local_rank=0, backend="gloo", trials=3)


def _alive(group) -> bool:
    """Whether ``group`` is still a process group of this process (aborting one takes it out of the world's map)."""
    return group in dist.distributed_c10d._world.pg_map


def test_a_rank_that_leaves_says_so_under_its_trials_key(one_rank_group):
    say_left(dataclasses.replace(JOB, rank=5))
    assert _get_default_store().get("autotune/trial-3/left") == b"5"
    assert not _get_default_store().check(["autotune/trial-4/left"])


def test_saying_it_without_a_process_group_is_no_error():
    assert not dist.is_initialized()
    say_left(JOB)  # nothing to tell: a rank of no job


def test_the_watch_aborts_the_trial_group_when_a_rank_left(one_rank_group):
    group = dist.new_group(backend="gloo")
    watch = Watch(JOB, group, every_s=0.01)
    try:
        dist.all_reduce(torch.ones(2), group=group)  # the group works while no rank has left
        assert _alive(group)
        say_left(JOB)
        watch.thread.join(timeout=30)
        assert not watch.thread.is_alive()  # it returned after aborting
        assert not _alive(group)
    finally:
        watch.stop()


def test_the_watch_stops_without_aborting_where_no_rank_left_this_trial(one_rank_group):
    group = dist.new_group(backend="gloo")
    watch = Watch(JOB, group, every_s=0.01)
    say_left(dataclasses.replace(JOB, trials=JOB.trials + 1))  # another trial's rank: not this one's
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline and watch.thread.is_alive():  # let it read the store a few times
        time.sleep(0.02)
    watch.stop()
    assert not watch.thread.is_alive()
    assert _alive(group)
    dist.all_reduce(torch.ones(2), group=group)  # still usable


@pytest.fixture(autouse=True)
def _no_group_left():
    yield
    assert not dist.is_initialized()
