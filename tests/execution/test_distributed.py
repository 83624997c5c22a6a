"""--parallel ddp|fsdp for real: two CPU ranks on gloo, through torchrun and through ranks started by hand.

torchrun reports its own exit code (1 when a rank fails), so the ranks' own codes are tested on
processes started with torchrun's environment variables; the success path goes through torchrun.
Every subprocess runs under a timeout: a hang fails the test instead of the CI job.
"""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from autotune.execution.agreement import combine
from autotune.execution.job import Job, RankInterrupted as _Interrupted, RankRefused as _Refused, rank_budget
from autotune.errors import UsageError
from autotune.options import Options
from autotune.records import Config, Measurement, accumulation_plan

from tests import procs
from tests.dist_helper import SHARDED, sharded_workload
from tests.optional import needs
from tests.execution.test_reliability import ROOT, TINY, _default_sigint, wait_for_trials

# Run alone (marker serial): two ranks a job, jobs stopped mid-search by a signal; CI runs these tests in a pytest
# call of their own, after the rest runs on two processes (.ci/run).
pytestmark = pytest.mark.serial

SPACE = ["--model", "autotune.examples:TinyGPT", "--model-kwargs", TINY, "--device", "cpu", "--precisions", "fp32",
         "--segments", "0,all", "--batch-sizes", "2,8,32", "--strategy", "grid", "--measure-steps", "2",
         "--settle-steps", "0", "--no-library-compare"]
LIMIT_S = 240  # no run here takes a tenth of this; a hang is what it catches


def _env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", **extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "AUTOTUNE_RANK_BUDGETS"):
        if key not in extra:
            env.pop(key, None)
    return env


def torchrun(*args: str, cwd, **env: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "autotune", *args]
    return procs.run(command, env=_env(**env), cwd=cwd, timeout=LIMIT_S, preexec_fn=_default_sigint)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(*args: str, cwd, processes: list, module: str = "autotune") -> list[subprocess.Popen]:
    """Two ranks started as torchrun would start them (its environment variables), without torchrun; added to
    ``processes`` (the fixture that kills them when the test ends)."""
    port = str(free_port())
    processes.extend(subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=cwd, preexec_fn=_default_sigint,
                                      start_new_session=True,
                                      env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                               MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
                     for r in range(2))
    return processes[-2:]


def finish(ranks: list[subprocess.Popen]) -> list[tuple[int, str]]:
    said = [p.communicate(timeout=LIMIT_S)[1] for p in ranks]
    return [(p.returncode, err) for p, err in zip(ranks, said)]


# -- through torchrun ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """A DDP search with data and the probe, where rank 1 has 1.2 MiB and rank 0 the machine: batch 32 without a
    plan fits rank 0 only."""
    tmp = tmp_path_factory.mktemp("ddp")
    out = tmp / "ddp.json"
    args = (*SPACE, "--data", "tests.dist_helper:tokens", "--parallel", "ddp", "--storage", f"sqlite:///{tmp}/t.db",
            "--study", "t", "--out", str(out))
    done = torchrun(*args, cwd=tmp, AUTOTUNE_RANK_BUDGETS="1=1.2MiB")
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    # The same command again: every trial comes from rank 0's store, and the answer is the same (the probe and the
    # evaluation batch's search, which the first run ran on both ranks, left out)
    again = torchrun(*args, "--no-probe", "--no-eval-limits", cwd=tmp, AUTOTUNE_RANK_BUDGETS="1=1.2MiB")
    assert again.returncode == 0, again.stderr[-3000:]
    return data, done, json.loads(out.read_text())


def test_running_the_job_again_reuses_every_trial(ddp_run):
    data, _, again = ddp_run
    assert again["search"]["n_run"] == 0 and again["search"]["n_reused"] == len(data["trials"])
    assert [t["status"] for t in again["trials"]] == [t["status"] for t in data["trials"]]


def test_torchrun_ddp_reports_world_size_2(ddp_run):
    data, done, _ = ddp_run
    assert data["distributed"]["world_size"] == 2 and data["distributed"]["wrapper"] == "ddp"
    assert data["distributed"]["backend"] == "gloo"
    assert "world size 2" in done.stdout
    ok = [t for t in data["trials"] if t["status"] == "ok"]
    assert ok and all(len(t["distributed"]["ranks"]) == 2 for t in ok)
    for t in ok:  # samples/s count both ranks' micro-batches over the slowest rank's step
        assert t["samples_per_s"] == pytest.approx(2 * t["batch_size"] / t["step_s"])
        assert t["peak_bytes"] == max(r["peak_bytes"] for r in t["distributed"]["ranks"])
    rec = data["recommendation"]
    assert data["distributed"]["rank_peak_bytes"] == [r["peak_bytes"] for r in rec["distributed"]["ranks"]]


def test_an_oom_on_rank_1_only_is_the_trials_outcome_and_the_search_goes_on(ddp_run):
    data, _, _ = ddp_run
    trials = {(t["segments"], t["batch_size"]): t for t in data["trials"]}
    oom = trials[("0", 32)]
    assert oom["status"] == "oom" and oom["error"].startswith("rank 1: ")
    assert oom["distributed"]["outcome_rank"] == 1
    assert oom["distributed"]["ranks"][1]["status"] == "oom"
    assert oom["distributed"]["ranks"][0]["status"] != "ok"  # rank 0 fit, but left when rank 1 left the group
    assert len(data["trials"]) == 6  # every other trial ran after it
    assert trials[("all", 32)]["status"] == "ok"  # the plan fits rank 1's 1.2 MiB
    assert data["recommendation"] is not None


def test_the_probe_trains_each_ranks_share_of_the_slice_under_the_wrapper(ddp_run):
    data, _, _ = ddp_run
    candidates = data["probe"]["candidates"]
    assert candidates and data["probe"]["chosen"] is not None
    slice_size = 128  # 10% of the 1280 items, 64 on each rank
    for c in candidates:
        ranks = c["distributed"]["ranks"]
        assert [r["samples"] for r in ranks] == [slice_size // 2] * 2 and c["samples"] == slice_size
        assert c["peak_bytes_max"] == max(r["peak_bytes_max"] for r in ranks)
        assert c["accepted"] == all(r["accepted"] for r in ranks)
        if not c["accepted"]:
            assert c["reason"].startswith("rank ")


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """An FSDP search with an accumulation target and the lightning and accelerate exports (which need neither)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    out = tmp / "fsdp.json"
    # --clip-grad-norm runs DTensor ops on the sharded gradients: a later trial must not meet an earlier one's group
    done = torchrun(*SPACE, "--parallel", "fsdp", "--batch-sizes", "4", "--target-batch-size", "32",
                    "--clip-grad-norm", "1.0", "--storage",
                    f"sqlite:///{tmp}/t.db", "--study", "t", "--out", str(out), "--export", "lightning,accelerate",
                    cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp


def test_torchrun_fsdp_reports_world_size_2(fsdp_run):
    data = json.loads((fsdp_run / "fsdp.json").read_text())
    assert data["distributed"]["world_size"] == 2 and data["distributed"]["wrapper"] == "fsdp"
    assert data["distributed"]["mixed_precision"] == "autocast"
    assert all(t["status"] == "ok" for t in data["trials"])
    assert data["accumulation"] == {**data["accumulation"], "micro_batch_size": 4, "world_size": 2,
                                    "accumulation_steps": 4, "effective_batch_size": 32}
    lightning = json.loads((fsdp_run / "fsdp.lightning.json").read_text())
    assert lightning["trainer"]["accumulate_grad_batches"] == 4 and lightning["trainer"]["strategy"] == "fsdp"
    assert lightning["batch_size"] == 4 and any("FSDP2" in n for n in lightning["notes"])
    accelerate = json.loads((fsdp_run / "fsdp.accelerate.json").read_text())
    assert accelerate["fsdp_plugin"]["fsdp_version"] == 2
    assert accelerate["fsdp_plugin"]["transformer_cls_names_to_wrap"] == ["Block"]


def test_accelerate_takes_the_fsdp_export_as_it_is(fsdp_run):
    plugin = needs("accelerate.utils", "the frameworks extra").FullyShardedDataParallelPlugin
    accelerate = json.loads((fsdp_run / "fsdp.accelerate.json").read_text())
    plugin(**accelerate["fsdp_plugin"])


def test_the_state_in_host_memory_is_searched_under_fsdp_and_exported_as_measured(tmp_path):
    # --offload state: every plan also as PLAN+state (FSDP2's CPUOffloadPolicy, emulated on the CPU)
    out = tmp_path / "state.json"
    done = torchrun(*SPACE, "--parallel", "fsdp", "--offload", "state", "--batch-sizes", "8", "--storage",
                    f"sqlite:///{tmp_path}/t.db", "--study", "t", "--out", str(out), "--export", "accelerate",
                    cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(t["segments"], t["status"], t["offload"]) for t in data["trials"]] == [
        ("0+state", "ok", "state"), ("all+state", "ok", "state")]
    for t in data["trials"]:
        assert t["host_peak_bytes"] > 0 and 0 < t["optimizer_step_share"] < 1
        assert [r["host_peak_bytes"] > 0 for r in t["distributed"]["ranks"]] == [True, True]
    assert "host_budget_bytes" in data["search"] and "shared by the 2 ranks" in data["search"]["host_budget_source"]
    assert any("CPUOffloadPolicy" in n and "emulated" in n for n in data["notices"])
    assert "state: with the state in host memory (PLAN+state) the optimizer's step on the CPU took" in done.stdout
    accelerate = json.loads((tmp_path / "state.accelerate.json").read_text())
    assert accelerate["fsdp_plugin"]["cpu_offload"] is True
    plugin = needs("accelerate.utils", "the frameworks extra").FullyShardedDataParallelPlugin
    plugin(**accelerate["fsdp_plugin"])


# -- ranks started by hand: each rank's own exit code ---------------------------------------------------------------


def test_bad_input_is_one_line_from_rank_0_and_exit_2_on_every_rank(tmp_path, processes):
    jobs = []  # both jobs at once, each in a folder of its own
    bad_inputs = (["--budget", "lots"], ["--out", str(tmp_path / "missing" / "r.json")])  # every rank's; rank 0's only
    for i, bad in enumerate(bad_inputs):
        (tmp_path / str(i)).mkdir()
        jobs.append(start_ranks(*SPACE, "--parallel", "ddp", *bad, cwd=tmp_path / str(i), processes=processes))
    for ranks in jobs:
        results = finish(ranks)
        assert [code for code, _ in results] == [2, 2], results
        (_, said), (_, quiet) = results
        assert said.count("autotune: error:") == 1 and "Traceback" not in said
        assert quiet.strip() == "", quiet


def test_parallel_outside_torchrun_is_bad_input(tmp_path):
    done = procs.run([sys.executable, "-m", "autotune", *SPACE, "--parallel", "fsdp"], env=_env(), cwd=tmp_path,
                     timeout=LIMIT_S)
    assert done.returncode == 2 and "torchrun --nproc-per-node" in done.stderr


@pytest.mark.parametrize("signum, to, codes", [
    (signal.SIGINT, (0, 1), [130, 130]),  # a terminal's Ctrl-C reaches every rank
    (signal.SIGTERM, (0, 1), [143, 143]),  # torchrun passes its SIGTERM to every rank
    (signal.SIGTERM, (1,), [130, 143]),  # one rank stopped alone: the job stops at its trial
])
def test_a_stopped_job_exits_with_the_signals_code_on_every_rank_and_keeps_its_trials(tmp_path, processes, signum,
                                                                                      to, codes):
    storage, out = f"sqlite:///{tmp_path}/t.db", tmp_path / "r.json"
    slow = [a if a != "2" or i != SPACE.index("--measure-steps") + 1 else "200" for i, a in enumerate(SPACE)]
    ranks = start_ranks(*slow, "--batch-sizes", "2,4,8,16,32,64", "--parallel", "ddp", "--storage", storage,
                        "--study", "t", "--out", str(out), cwd=tmp_path, processes=processes)
    wait_for_trials(storage, "t", 1, timeout=LIMIT_S)
    time.sleep(0.5)
    for rank in to:
        ranks[rank].send_signal(signum)
    results = finish(ranks)
    assert [c for c, _ in results] == codes, results
    assert "Traceback" not in results[0][1]
    data = json.loads(out.read_text())
    assert data["search"]["partial"] is True and data["trials"]
    import optuna

    trials = optuna.load_study(study_name="t", storage=storage).trials
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]


def test_a_rank_that_dies_ends_the_job_with_one_line_and_no_trial_left_running(tmp_path, processes):
    storage = f"sqlite:///{tmp_path}/t.db"
    slow = [a if a != "2" or i != SPACE.index("--measure-steps") + 1 else "200" for i, a in enumerate(SPACE)]
    ranks = start_ranks(*slow, "--batch-sizes", "2,4,8,16,32,64", "--parallel", "ddp", "--storage", storage,
                        "--study", "t", "--out", str(tmp_path / "r.json"), cwd=tmp_path, processes=processes)
    wait_for_trials(storage, "t", 1, timeout=LIMIT_S)
    ranks[1].kill()  # SIGKILL: out of host memory, a node lost
    (code, said), _ = finish(ranks)
    assert code == 1 and "a rank of the job is gone" in said and "Traceback" not in said, said
    import optuna

    trials = optuna.load_study(study_name="t", storage=storage).trials
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]  # re-run on the next start


def test_a_rank_that_dies_before_the_trials_group_is_made_is_not_waited_for(tmp_path, processes):
    # The moment that made the test above hang now and then: rank 1 took the command, rank 0 went on to make the
    # trial's group, which waits for every rank until its timeout (660 s here, past LIMIT_S)
    ranks = start_ranks(cwd=tmp_path, processes=processes, module="tests.dist_dead_rank")
    said = ranks[0].communicate(timeout=LIMIT_S)[0]
    assert ranks[0].returncode == 0 and "a rank of the job is gone" in said, said


# -- the wrappers themselves: exact steps, sharded memory -----------------------------------------------------------


def test_ddp_and_fsdp_steps_match_one_process_and_fsdp_shards_memory(tmp_path, processes):
    out = tmp_path / "found.json"
    results = finish(start_ranks(str(out), cwd=tmp_path, processes=processes, module="tests.dist_helper"))
    assert [c for c, _ in results] == [0, 0], results
    found = json.loads(out.read_text())
    assert set(found["status"].values()) == {"ok"} and len(found["status"]) == 4, found["status"]
    for key, diff in {**found["grads"], **found["params"]}.items():
        assert diff < 1e-6, (key, diff)  # relative to the tensor's largest value, plan "all" included
    # offloaded activations under both wrappers; under FSDP2 the state in host memory too (before, an offloading
    # plan under FSDP2 failed every step: it read a DTensor's storage)
    assert {"ddp/all+offload", "fsdp/0+offload", "fsdp/0+state", "fsdp/all+offload+state"} <= set(found["grads"])
    ddp, fsdp = found["peaks"]["ddp"], found["peaks"]["fsdp"]
    assert max(fsdp) < 0.6 * min(ddp), found["peaks"]  # parameters, gradients and AdamW state: half on each rank
    # The user's optimizer under both wrappers, over the parameters each rank holds: SGD keeps one buffer a
    # parameter, AdamW two (and a step counter a tensor); FSDP2's ranks hold half of each. The peaks differ by at
    # least that buffer (AdamW's step makes temporaries too): under FSDP2 too, now that the tensor meter counts a
    # DTensor's local shard (the state FSDP2's optimizer makes was counted nowhere before) and sees FSDP2 free each
    # gathered block (resize_(0): before, every block stayed counted). On gloo a rank's FSDP2 peak may include a
    # collective's buffer or not, as gloo's worker thread lets it go (measured: 0.5 MB in one run of four): the
    # comparisons of FSDP2 peaks allow one block
    params, states, block = found["parameter_bytes"], found["states"], found["block_bytes"]
    for wrapper, share in (("ddp", 1.0), ("fsdp", 0.5)):
        for sgd, adamw in zip(states[f"{wrapper}/sgd"], states[f"{wrapper}/adamw"]):
            assert abs(sgd - share * params) <= 0.01 * params and abs(adamw - 2 * sgd) <= 1024, (wrapper, states)
        for adamw, sgd in zip(found["peaks"][wrapper], found["sgd_peaks"][wrapper]):
            assert adamw - sgd >= 0.99 * share * params - (block if wrapper == "fsdp" else 0), (wrapper, adamw, sgd)
    # The state in host memory (FSDP2's CPUOffloadPolicy, emulated on the CPU): each rank's device peak falls by at
    # least its share of the weights and AdamW's moments, the host holds its share of weights, gradients and moments,
    # the losses are the same, and the optimizer's step has a share of the step time
    for plain, host in zip(found["state_offload"]["0"], found["state_offload"]["0+state"]):
        assert plain[0] == host[0] == "ok" and plain[2] is None, (plain, host)
        assert host[1] <= plain[1] - 3 * 0.5 * params * 0.99 + block, (plain, host, params)
        assert abs(host[2] - 4 * 0.5 * params) <= 0.01 * params, (host, params)
        assert host[4] == plain[4] and 0 < host[3] < 1, (plain, host)
    # A plan never changes the model under a wrapper either: BatchNorm, per-layer arguments, dropout with experts,
    # T5's encoder-decoder, Mixtral's routed experts; plans all and 2 against plan 0, each under DDP and FSDP2
    zoo = found["zoo"]
    transformers_here = importlib.util.find_spec("transformers") is not None
    assert not [k for k, v in zoo.items() if isinstance(v, str) and (transformers_here or "transformers" not in v)]
    exact = {k: v for k, v in zoo.items() if not isinstance(v, str)}
    assert len(exact) >= 12 and all(v == 0.0 for v in exact.values()), exact
    # The LoRA adapter over a frozen Llama, under DDP and under FSDP2 (frozen and trained parameters in one unit):
    # plans all and 2, all+offload, and FSDP2's state in host memory (0+state) train as plan 0 does, and only the
    # adapter gets gradients, 2 matrices on 2 projections in each of 4 layers
    if "llama_lora" not in zoo:
        assert {"llama_lora/ddp/all+offload", "llama_lora/fsdp/0+state"} <= exact.keys(), exact
        for wrapper in ("ddp", "fsdp"):
            trained = found["zoo_trained"][f"llama_lora/{wrapper}"]
            assert len(trained) == 16 and all("lora_" in p for p in trained), (wrapper, trained)
    # Under FSDP2 a rank's build never holds the whole model: it is sharded on the meta device and only the rank's
    # shards and the buffers are made (measured: 2.11 MB of Wide's 4.22 MB of weights on each rank; built whole, as
    # before, 4.74 MB: the whole model and the first block's shard), and they get the workload's own values, bitwise,
    # tied weights and BatchNorm's buffers too. A model autotune keeps no copy of is built whole, as before, with a
    # notice. The dry run's rank (the fake process group) predicts each build's peak on rank 0 to the byte
    builds = found["sharded_builds"]
    for name in SHARDED:
        peaks, params, buffers, same = builds[name]
        assert same, name
        if name == "uncopyable":
            assert min(peaks) > params, (name, peaks, params)
        else:  # a half of each parameter, rounded up to whole rows, with the padding of an uneven shard for a moment
            assert max(peaks) < 0.6 * params + buffers, (name, peaks, params)
        assert peaks[0] == _predicted_build(name), (name, peaks)
    assert [s.split()[0] for s in builds["said"] if "built whole" in s] == ["Uncopyable"], builds["said"]


def _predicted_build(name: str) -> int:
    """Rank 0's peak over the build and wrap of :func:`tests.dist_helper.sharded_builds`, predicted under fake tensors
    on a fake process group of 2 ranks."""
    import torch

    from autotune.execution.one_rank import one_rank
    from autotune.execution.predict import fake_tensors
    from autotune.meters import TensorMeter
    from autotune.training.trainer import Trainer

    workload = sharded_workload(name).unwarmed()
    with one_rank("fsdp", 2, torch.device("cpu")) as ranks:
        trainer = Trainer(workload, Config("fp32", SHARDED[name], 2), torch.device("cpu"), parallel=ranks.wrapping())
        with fake_tensors(), TensorMeter("cpu").measure() as meter:
            trainer.build(prime=False)
        trainer.release()
    return meter.peak_bytes()


def test_a_hugging_face_trainer_is_tuned_on_every_rank_of_a_torchrun_job(tmp_path, processes):
    # Each rank calls tune_trainer on its own trainer (its objects stay on it); rank 0 searches, every rank trains
    # every trial under DDP, and every rank's trainer gets the same answer, keeping the global batch of
    # 8 a device x 2 accumulation steps x 2 ranks
    needs("transformers")
    results = finish(start_ranks(str(tmp_path), cwd=tmp_path, processes=processes, module="tests.dist_trainer_helper"))
    # A rank aborted (-6) at exit twice in CI: a gloo worker of a group that outlived the script met the
    # interpreter's finalization (dist_trainer_helper.end_job says how). Should one abort again, each rank's
    # stderr's end, with the Python stacks faulthandler writes on SIGABRT, says where
    written = sorted(p.name for p in tmp_path.glob("rank*.json"))
    assert [c for c, _ in results] == [0, 0], "\n".join(
        [f"rank files written: {written}"] + [f"--- rank {r}: exit {c}\n{err[-4000:]}" for r, (c, err) in enumerate(results)])
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert found[0]["world_size"] == 2 and found[0]["distributed"]["world_size"] == 2, found[0]
    same = ("per_device_train_batch_size", "gradient_accumulation_steps", "recommendation", "global_step", "trials")
    assert [found[0][k] for k in same] == [found[1][k] for k in same], found
    assert found[0]["per_device_train_batch_size"] * found[0]["gradient_accumulation_steps"] * 2 == 32
    assert found[0]["global_step"] == 64 // 32  # one epoch of the example's 64 examples
    # no group outlives the job: its gloo threads were joined before the interpreter began to finalize
    assert [f["gloo_threads_left"] for f in found] == ([0, 0] if sys.platform == "linux" else [None, None]), found


# -- the agreement, without processes ------------------------------------------------------------------------------


JOB = Job("ddp", 0, 2, 0, "gloo")


def m(status="ok", peak=100, times=(0.5, 0.5), error=None):
    return Measurement(Config("fp32", "0", 4), status, peak_bytes=peak, step_times_s=times if status == "ok" else (),
                       step_s=0.5 if status == "ok" else None, error=error)


def test_the_outcome_is_the_ranks_in_the_order_oom_crashed_timeout_failed():
    gone = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    agreed = combine([m("failed", 80, error=gone), m("oom", 120, error="out of memory")], JOB)
    assert agreed.status == "oom" and agreed.error == "rank 1: out of memory" and agreed.peak_bytes == 120
    assert agreed.distributed["outcome_rank"] == 1
    assert combine([m("timeout", error="late"), m("crashed", error="dead")], JOB).status == "crashed"
    # a rank's own failure outranks one that only says the other rank left
    agreed = combine([m("failed", error=gone), m("failed", error="ValueError: bad shape")], JOB)
    assert agreed.error == "rank 1: ValueError: bad shape"
    assert isinstance(combine([m(), _Interrupted(1)], JOB), _Interrupted)
    # bad input met in one rank's trial (a module another node lacks) stops the job on every rank
    assert combine([m(), _Refused(1, "--data: no module named 'mine'")], JOB) == _Refused(1, "--data: no module named 'mine'")
    assert isinstance(combine([_Refused(0, "x"), _Interrupted(1)], JOB), _Interrupted)


def test_a_probe_candidate_is_accepted_only_when_every_rank_accepts_it():
    from autotune.execution.agreement import combine_probe
    from autotune.records import ProbeResult

    def r(accepted=True, reason=None, peak=100, samples=64, rate=50.0):
        return ProbeResult(Config("fp32", "0", 4), accepted, reason, samples=samples, peak_bytes_max=peak,
                           samples_per_s=rate if accepted else None)

    agreed = combine_probe([r(peak=100), r(peak=250)], JOB)
    assert agreed.accepted and agreed.peak_bytes_max == 250 and agreed.samples == 128
    assert agreed.samples_per_s == 100.0  # each rank's share over the same, slowest, step times
    gone = "failed: RuntimeError: Connection closed by peer"
    agreed = combine_probe([r(False, gone), r(False, "oom: out of memory", peak=900)], JOB)
    assert not agreed.accepted and agreed.reason == "rank 1: oom: out of memory" and agreed.samples_per_s is None
    verdict = "non-finite loss in 3 of 8 steps"
    assert combine_probe([r(), r(False, verdict)], JOB).reason == f"rank 1: {verdict}"


def test_agreed_throughput_counts_every_ranks_micro_batch():
    agreed = combine([m(peak=100), m(peak=300)], JOB)
    assert agreed.status == "ok" and agreed.peak_bytes == 300
    assert agreed.samples_per_s == pytest.approx(2 * 4 / 0.5) and agreed.world_size == 2
    assert [r["peak_bytes"] for r in agreed.distributed["ranks"]] == [100, 300]
    assert Measurement.from_dict(agreed.to_dict()) == agreed


def test_rank_budgets_and_the_accumulation_plan_for_the_world():
    assert rank_budget(10 << 20, 1, "1=1MiB,3=2GiB") == 1 << 20
    assert rank_budget(10 << 20, 0, "1=1MiB") == 10 << 20
    assert rank_budget(None, 3, "1=1MiB,3=2GiB") == 2 << 30
    with pytest.raises(UsageError, match="RANK=SIZE"):
        rank_budget(None, 0, "lots")
    plan = accumulation_plan(4, 64, world_size=2)
    assert plan["accumulation_steps"] == 8 and plan["effective_batch_size"] == 64 and plan["world_size"] == 2


def test_parallel_trials_run_in_each_ranks_own_process():
    with pytest.raises(UsageError, match="--isolation"):
        Options(model="autotune.examples:TinyGPT", parallel="ddp", isolation="process")
    with pytest.raises(UsageError, match="choose none, ddp or fsdp"):
        Options(model="autotune.examples:TinyGPT", parallel="deepspeed")

