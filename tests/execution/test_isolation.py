"""Tasks in fresh worker processes: what comes back, how a death or a hang is told, and what cannot be sent.

Each spawned worker imports torch (seconds): this file starts about twenty of them, one per outcome of
``run_isolated``, and a few warm workers, each serving several trials. The tasks are module-level functions, which the worker imports by name. A worker
killed by SIGKILL inside a search is tested in tests/execution/test_reliability.py.
"""

import multiprocessing
import os
import signal
import sys
import time
import types

import pytest
from torch import nn

from autotune.execution import spawn as isolation
from autotune.errors import UsageError
from autotune.execution.spawn import _exit_cause, check_picklable, run_isolated
from autotune.training.workload import Workload

GPT = {"n_layer": 2, "block_size": 16, "n_embd": 32, "n_head": 2, "vocab_size": 64}


def gpt():
    return Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=GPT)


# --- tasks the workers run ----------------------------------------------------------------------


def task_describe(workload, *, tag):
    model = workload.build_model()
    return {"tag": tag, "name": workload.name, "parameters": sum(p.numel() for p in model.parameters()),
            "pid": os.getpid(), "layers": model.config.n_layer}


def task_exit(workload, *, code):
    os._exit(code)  # dies without a word, as a segfault or the OOM killer would leave it


def task_hang(workload):
    time.sleep(600)


def task_usage(workload):
    raise UsageError("--data 'x' is an empty dataset")


def task_fail(workload):
    raise ValueError("boom in the worker\nsecond line of the message")


# --- outcomes (one spawn each) -------------------------------------------------------------------


def test_a_result_comes_back_from_another_process():
    done = run_isolated(gpt(), task_describe, {"tag": "t1"}, name="autotune-test", timeout_s=None)
    outcome, payload, seconds = done.outcome, done.payload, done.seconds
    assert outcome == "result" and seconds > 0
    assert payload["tag"] == "t1" and payload["name"] == "autotune.examples:TinyGPT" and payload["layers"] == 2
    assert payload["pid"] != os.getpid()  # it ran elsewhere
    assert payload["parameters"] == sum(p.numel() for p in gpt().build_model().parameters())  # the same model, rebuilt
    assert multiprocessing.active_children() == []


def test_a_worker_that_exits_without_a_word_is_crashed_with_its_exit_code():
    done = run_isolated(gpt(), task_exit, {"code": 7}, name="autotune-test", timeout_s=None)
    outcome, payload, seconds = done.outcome, done.payload, done.seconds
    assert (outcome, payload) == ("crashed", "worker process exited with code 7")
    assert multiprocessing.active_children() == []


def test_a_worker_that_hangs_past_its_limit_is_killed_as_a_timeout(monkeypatch):
    # The limit is the trial's time limit plus the start-up grace, read in this process when the task starts.
    monkeypatch.setattr(isolation, "STARTUP_GRACE_S", 1.0)
    done = run_isolated(gpt(), task_hang, {}, name="autotune-test", timeout_s=1.5)
    outcome, payload, seconds = done.outcome, done.payload, done.seconds
    assert outcome == "timeout"
    assert payload == "the worker ran past 2.5 s and was killed (--trial-timeout plus start-up)"
    assert seconds > 2.5  # it was given its whole limit first
    assert multiprocessing.active_children() == []  # and reaped


def test_bad_input_found_in_the_worker_is_raised_here():
    with pytest.raises(UsageError, match=r"^--data 'x' is an empty dataset$"):
        run_isolated(gpt(), task_usage, {}, name="autotune-test", timeout_s=60)
    assert multiprocessing.active_children() == []


def test_an_error_in_the_job_is_failed_with_its_first_line():
    done = run_isolated(gpt(), task_fail, {}, name="autotune-test", timeout_s=60)
    outcome, payload, seconds = done.outcome, done.payload, done.seconds
    assert (outcome, payload) == ("failed", "ValueError: boom in the worker")


# --- without a spawn -----------------------------------------------------------------------------


def test_a_workload_without_a_spec_cannot_be_isolated():
    bare = Workload(model_factory=lambda: nn.Linear(2, 2), name="bare")
    with pytest.raises(UsageError, match="Workload.from_specs"):
        run_isolated(bare, task_describe, {"tag": "x"}, name="autotune-test", timeout_s=None)
    with pytest.raises(UsageError, match="Workload.from_specs"):
        check_picklable(bare)


@pytest.mark.parametrize("code, cause", [
    (None, "did not exit"),
    (0, "exited with code 0"),
    (3, "exited with code 3"),
    (-signal.SIGKILL, "killed by SIGKILL"),
    (-signal.SIGSEGV, "killed by SIGSEGV"),
    (-200, "killed by signal 200"),
])
def test_exit_causes(code, cause):
    assert _exit_cause(code) == cause


# --- warm workers: one worker, trial after trial, while it stays clean -------------------------------------------


def _trial(batch_size, budget=2**30, precision="fp32"):
    from autotune.execution.trial import TrialWork
    from autotune.records import Config, TrialSettings

    return TrialWork(Config(precision, "0", batch_size), TrialSettings(measure_steps=1), budget, asked_at=time.time())


def test_a_warm_worker_serves_trial_after_trial_and_measures_what_this_process_measures():
    import torch

    from autotune.execution.spawn import Spawned
    from autotune.execution.venue import Here

    works = [_trial(2), _trial(8, precision="bf16"), _trial(64, budget=200_000), _trial(4)]  # the third runs out of memory
    with Spawned("cpu") as venue:
        there, pids = [], []
        for work in works:
            there.append(venue.run(gpt(), work))
            pids.append(venue.workers.pid)
        assert venue.describe() == {"workers_started": 1, "workers_replaced_unclean": 0, "trials_per_worker": None}
    assert len(set(pids)) == 1 and pids[0] != os.getpid()  # one worker served all four, an OOM included
    assert multiprocessing.active_children() == []  # and stopped with the venue
    here = [Here(torch.device("cpu")).run(gpt(), work) for work in works]
    assert [m.status for m in there] == [m.status for m in here] == ["ok", "ok", "oom", "ok"]
    assert [m.peak_bytes for m in there] == [m.peak_bytes for m in here]  # a reused worker measures as a fresh one
    assert there[0].setup_s > 0 and all(m.setup_s is not None for m in there)


@pytest.mark.parametrize("when", ["found dead", "dies as it is handed the trial"])
def test_a_worker_killed_between_two_trials_is_replaced_and_the_next_trial_runs(monkeypatch, when):
    from autotune.execution.spawn import Spawned, _Worker

    with Spawned("cpu") as venue:
        assert venue.run(gpt(), _trial(2)).status == "ok"
        pid = venue.workers.pid
        os.kill(pid, signal.SIGKILL)
        if when == "found dead":
            while venue.workers._worker.proc.is_alive():
                time.sleep(0.05)
        else:  # the check before handing over passes: the death is met as the worker should take the trial
            monkeypatch.setattr(_Worker, "serves", lambda self, spec: True)
        m = venue.run(gpt(), _trial(4))
        assert m.status == "ok", m.error  # not recorded as crashed: the trial never ran in the dead worker
        assert venue.workers.started == 2 and venue.workers.pid != pid


def test_a_worker_that_holds_more_than_before_its_first_trial_is_replaced():
    from autotune.execution.spawn import Spawned

    leaky = Workload.from_specs("tests.models:Leaky")
    with Spawned("cpu") as venue:
        first = venue.run(leaky, _trial(2))
        assert first.status == "ok" and venue.describe()["workers_replaced_unclean"] == 0  # its check is on its way
        assert venue.run(leaky, _trial(2)).status == "ok"  # read first: it holds the leaked tensors, so a new worker
        assert venue.describe()["workers_started"] == 2 and venue.describe()["workers_replaced_unclean"] == 1
    later = Workload.from_specs("tests.models:LeaksAtFour")  # clean after its first trial (then frozen), not later
    with Spawned("cpu") as venue:
        for batch_size in (2, 2, 4, 2):
            assert venue.run(later, _trial(batch_size)).status == "ok"
        assert venue.describe()["workers_started"] == 2 and venue.describe()["workers_replaced_unclean"] == 1
    with Spawned("cpu", trials_per_worker=1) as venue:  # a fresh worker per trial, as before warm workers
        for batch_size in (2, 4):
            assert venue.run(gpt(), _trial(batch_size)).status == "ok"
            assert venue.workers.pid is None
        assert venue.describe()["workers_started"] == 2 and venue.describe()["workers_replaced_unclean"] == 0


def test_a_warm_worker_that_hangs_is_killed_after_the_limit_and_a_crashed_one_is_replaced(monkeypatch):
    from autotune.execution.spawn import Workers

    monkeypatch.setattr(isolation, "WARM_GRACE_S", 1.0)
    workers = Workers("cpu")
    try:
        assert workers.run_task(gpt(), task_describe, {"tag": "a"}, name="autotune-test", timeout_s=60).outcome == "result"
        done = workers.run_task(gpt(), task_hang, {}, name="autotune-test", timeout_s=1.5)
        outcome, payload, seconds = done.outcome, done.payload, done.seconds
        assert (outcome, payload) == ("timeout", "the worker ran past 2.5 s and was killed (--trial-timeout plus 1 s)")
        assert workers.pid is None and 2.5 < seconds < 30
        assert workers.run_task(gpt(), task_describe, {"tag": "b"}, name="autotune-test", timeout_s=60).outcome == "result"
        done = workers.run_task(gpt(), task_exit, {"code": 9}, name="autotune-test", timeout_s=60)
        assert (done.outcome, done.payload) == ("crashed", "worker process exited with code 9")
        assert workers.started == 2 and workers.pid is None  # the crashed worker is not waited on for the next
    finally:
        workers.close()
    assert multiprocessing.active_children() == []


# --- check_picklable -----------------------------------------------------------------------------


def test_a_trial_in_a_worker_counts_the_workers_start_as_set_up():
    import torch

    from autotune.execution.spawn import Spawned
    from autotune.execution.trial import TrialWork
    from autotune.records import Config, TrialSettings

    asked = time.time()
    m = Spawned(torch.device("cpu")).run(gpt(), TrialWork(Config("fp32", "0", 2), TrialSettings(measure_steps=1), None,
                                                           asked_at=asked))
    elapsed = time.time() - asked
    assert m.status == "ok" and m.setup_s > 0 and m.steps_s > 0
    assert m.setup_s + m.steps_s <= elapsed  # from the ask, in this process's clock, to the worker's last step


def test_a_module_attr_workload_can_be_sent():
    check_picklable(gpt())
    check_picklable(Workload.from_specs("autotune.examples:ResNetish", model_kwargs={"depth": 1, "channels": 4},
                                        data="autotune.examples:image_dataset"))
    check_picklable(Workload.from_specs(nn.Linear, model_kwargs={"in_features": 2, "out_features": 2}))  # a class


def _local_factory_workload():
    def build():
        return nn.Linear(2, 2)

    return Workload.from_specs(build)


@pytest.mark.parametrize("make", [
    lambda: Workload.from_specs(lambda: nn.Linear(2, 2)),
    lambda: Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=GPT,
                                loss=lambda output, target: output.loss),
    _local_factory_workload,
])
def test_what_cannot_be_pickled_is_one_line_of_bad_input(make):
    with pytest.raises(UsageError) as info:
        check_picklable(make())
    text = str(info.value)
    assert "\n" not in text
    assert "--isolation none" in text and "MODULE:ATTR" in text and "cannot be" in text


def _main_module(monkeypatch, *, file):
    main = types.ModuleType("__main__")
    if file:
        main.__file__ = file
    monkeypatch.setitem(sys.modules, "__main__", main)
    return main


def _in_main(main, obj, name):
    obj.__module__, obj.__qualname__, obj.__name__ = "__main__", name, name
    setattr(main, name, obj)  # where a pickler looks it up: it pickles by reference
    return obj


def _main_class():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

    return Model


def _main_function():
    def build_model():
        return nn.Linear(2, 2)

    return build_model


@pytest.mark.parametrize("make, name", [(_main_class, "NotebookModel"), (_main_function, "build_model")])
def test_an_object_of_a_main_without_a_file_is_refused(monkeypatch, make, name):
    main = _main_module(monkeypatch, file=None)  # a notebook or python -c
    workload = Workload.from_specs(_in_main(main, make(), name))
    with pytest.raises(UsageError) as info:
        check_picklable(workload)
    text = str(info.value)
    assert "\n" not in text
    assert name in text and "__main__" in text and "--isolation none" in text


def test_a_main_object_in_a_loss_is_found_too(monkeypatch):
    main = _main_module(monkeypatch, file=None)

    def my_loss(output, target):
        return output.loss

    _in_main(main, my_loss, "my_loss")
    workload = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=GPT, loss=my_loss)
    with pytest.raises(UsageError, match="my_loss"):
        check_picklable(workload)


def test_an_object_of_a_main_file_can_be_sent(monkeypatch, tmp_path):
    # A script run as `python train.py` is imported again by the worker: its objects can be found there.
    main = _main_module(monkeypatch, file=str(tmp_path / "train.py"))
    check_picklable(Workload.from_specs(_in_main(main, _main_class(), "ScriptModel")))
