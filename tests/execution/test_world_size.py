"""``--dry-run --parallel ddp|fsdp --world-size N``: one rank of an N-rank job predicted in this process, on PyTorch's
fake process group (:mod:`autotune.execution.one_rank`).

What a rank holds is held to parameter counts: under FSDP2 each rank keeps 1/N of every parameter (its first
dimension split in N, padded up as FSDP2 pads it), of its gradient and of AdamW's two moments, to the byte; under
DDP a rank holds what one process holds plus the Reducer's gradient buckets, the gradients' bytes again. The
predicted rank is held to the ranks of a real two-rank gloo job (torchrun, DDP and FSDP2) to the byte, with no
difference to explain: every buffer the wrappers make is made on the rank before its collective writes into it,
and what gloo allocates inside a collective is invisible to the tensor meter on both sides.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import autotune
from autotune.examples import TinyGPT
from autotune.execution.one_rank import one_rank
from autotune.execution.predict import fake_tensors
from autotune.meters import TensorMeter
from autotune.plans.checkpointing import find_chain
from autotune.records import Config
from autotune.training.trainer import Trainer
from autotune.training.workload import Workload

from tests import procs

# Widths FSDP2 must pad: 1001 token rows and 9 positions split in 2, 3, 4 or 8 leave rank 0 the rounded-up share
KWARGS = {"n_layer": 2, "block_size": 9, "n_embd": 96, "n_head": 2, "vocab_size": 1001}
BATCH = 2


@pytest.fixture(scope="module")
def workload() -> Workload:
    workload = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=json.dumps(KWARGS))
    return workload.with_chain(find_chain(workload.build_model()))


def _rank0_elements(model: torch.nn.Module, world_size: int) -> int:
    """Rank 0's elements of every parameter (tied ones once) under FSDP2: its first dimension's rounded-up share."""
    return sum(math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0]) for p in model.parameters())


def _phases(workload: Workload, parallel=None) -> tuple[int, int, int]:
    """A memory trial's step under fake tensors, metered: the bytes live after the backward pass (the weights, their
    gradients and the primed AdamW moments), after the optimizer's step (its zero_grad lets the gradients go), and
    the peak."""
    trainer = Trainer(workload, Config("fp32", "0", BATCH), torch.device("cpu"), parallel=parallel)
    with fake_tensors(), TensorMeter("cpu").measure() as meter:
        trainer.build()
        batch = workload.make_batch(trainer.module, BATCH)
        with trainer.run.autocast():
            loss = workload.loss(trainer.model, batch)
        trainer.run.backward(loss)
        after_backward = meter.live_bytes
        trainer.run.step(trainer.optimizer)
        after_step = meter.live_bytes
    trainer.release()
    return after_backward, after_step, meter.peak_bytes()


def test_fsdp_holds_one_nth_of_the_state_on_each_rank(workload):
    """The state part is exact: 16 bytes of each of rank 0's elements after the backward pass (fp32 weight, gradient
    and AdamW's two moments), 12 after the step; all the rest (the batch, the buffers, AdamW's step counters) is what
    one process holds, plus the device mesh's N int32 ranks. The peak comes in the backward pass: above the state it
    holds the activations and what FSDP2 gathers whole (a block's and the root's weights, their unsharded gradients,
    the reduce-scatter's flat input), less the gradient shards not made yet (which the 16 bytes count): so it shrinks
    as the state does, and what lies above the state grows a little with N as those missing shards shrink."""
    model = workload.build_model()
    one_process = _phases(workload)
    elements = _rank0_elements(model, 1)
    rest_after_backward, rest_after_step = one_process[0] - 16 * elements, one_process[1] - 12 * elements
    activations = one_process[2] - 16 * elements  # one process's peak above its state
    root = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.transformer.h.parameters())
    gathered = 4 * (root + max(sum(p.numel() for p in b.parameters()) for b in model.transformer.h))
    peaks = []
    for n in (1, 2, 4):
        with one_rank("fsdp", n, torch.device("cpu")) as ranks:
            after_backward, after_step, peak = _phases(workload, ranks.wrapping())
        shard = _rank0_elements(model, n)
        assert 0 <= shard - elements / n < sum(p.numel() // p.shape[0] for p in model.parameters())  # 1/N, rounded up
        assert after_backward == 16 * shard + rest_after_backward + 4 * n, n
        assert after_step == 12 * shard + rest_after_step + 4 * n, n
        assert 16 * shard + activations <= peak <= 16 * shard + activations + 3 * gathered, (n, peak)
        peaks.append(peak)
    assert peaks[0] > peaks[1] > peaks[2]
    assert peaks[0] - peaks[2] > 16 * (elements - _rank0_elements(model, 4)) - 3 * gathered


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ddp_holds_one_process_state_and_the_reducers_buckets(workload, world_size):
    """A DDP rank holds everything one process holds, at every point of the step, plus the Reducer's buckets: flat
    buffers as large as the gradients (``gradient_as_bucket_view=False``: the gradients stay separate), whatever N."""
    gradients = 4 * sum(p.numel() for p in workload.build_model().parameters())
    one_process = _phases(workload)
    with one_rank("ddp", world_size, torch.device("cpu")) as ranks:
        rank = _phases(workload, ranks.wrapping())
    assert [r - o for r, o in zip(rank, one_process)] == [gradients] * 3


def test_the_report_says_it_predicted_one_rank_and_the_group_is_gone(tmp_path):
    import torch.distributed as dist

    report = autotune.tune("autotune.examples:TinyGPT", model_kwargs=KWARGS, device="cpu", budget="64MiB",
                           precisions="fp32", segments="0,all", batch_sizes="2,8", dry_run=True, parallel="fsdp",
                           world_size=4, results_dir=str(tmp_path))
    assert not dist.is_initialized()  # the fake group is torn down with the dry run
    assert report.dry_run and all(m.predicted for m in report.trials)
    d = report.distributed
    assert d["predicted"] is True and d["world_size"] == 4 and d["wrapper"] == "fsdp" and d["rank"] == 0
    assert d["backend"] == "fake"
    assert report.search["study"].endswith("-fsdp4-dry-run")
    assert any("one rank of a --parallel fsdp job of 4 ranks" in n for n in report.notices)
    assert "rank 0 predicted on a fake process group" in report.table()


def test_the_dry_run_says_each_precisions_mixed_precision(tmp_path):
    report = autotune.tune("autotune.examples:TinyGPT", model_kwargs=KWARGS, device="cpu", budget="64MiB",
                           precisions="fp32,bf16-fsdp", segments="0,sac-torchtitan", batch_sizes="2", dry_run=True,
                           parallel="fsdp", world_size=2, results_dir=str(tmp_path))
    assert report.distributed["mixed_precision"] == (
        "autocast; bf16-fsdp: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)")
    assert {(m.precision, m.config.plan, m.status) for m in report.trials} == {
        (p, s, "ok") for p in ("fp32", "bf16-fsdp") for s in ("0", "sac-torchtitan")}
    peaks = {(m.precision, m.config.plan): m.peak_bytes for m in report.trials}
    assert peaks[("bf16-fsdp", "0")] < peaks[("fp32", "0")]  # bf16 activations and gathered blocks


# -- through the CLI ----------------------------------------------------------------------------------------------


def _cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return procs.run([sys.executable, "-m", "autotune", *args], cwd=tmp_path, timeout=600,
                     env=_env())


def _env() -> dict:
    from tests.execution.test_distributed import _env as distributed_env

    return distributed_env()


BASE = ["--model", "autotune.examples:TinyGPT", "--device", "cpu", "--budget", "64MiB", "--precisions", "fp32",
        "--segments", "0", "--batch-sizes", "2"]


@pytest.mark.parametrize("args,says", [
    (["--dry-run", "--world-size", "2"], "add --parallel fsdp (or ddp) and --dry-run"),
    (["--dry-run", "--parallel", "fsdp", "--world-size", "0"], "--world-size 0 must be at least 1"),
    (["--parallel", "fsdp", "--world-size", "2"], "--world-size 2 is for --dry-run"),
    (["--dry-run", "--parallel", "ddp"], "say how many ranks with --world-size N"),
])
def test_bad_world_sizes_are_one_line_and_exit_2(tmp_path, args, says):
    done = _cli(tmp_path, *BASE, *args)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("autotune: error")]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_the_rank_count_nothing_fits_suggests_is_checked_by_a_dry_run(tmp_path):
    """The state alone over one card: the answer names the ranks it would fit sharded over and the dry run that
    checks it, whose state check holds 1/N of the state to the budget and whose trials are one rank's.

    The suggestion leaves each rank its share of the state, one block's weights and batch 1's activations. At its
    peak, in the backward pass, a rank also holds what FSDP2 keeps whole there: the root's weights (gathered through
    the backward pass), a block's unsharded gradients and the reduce-scatter's flat input. On this model, whose
    embedding (the root's) is larger than a block, that is more than the suggestion left: the dry run at the
    suggested 2 ranks predicts out of memory at batch 1, says to shard over more, and at 3 ranks it fits."""
    model = ["--model", "autotune.examples:TinyGPT", "--model-kwargs", json.dumps(KWARGS), "--device", "cpu",
             "--precisions", "fp32", "--segments", "0,all", "--batch-sizes", "1,2"]
    state = 16 * sum(p.numel() for p in TinyGPT(**KWARGS).parameters())
    budget = ["--budget", str(int(state * 0.8))]  # usable, less 10% headroom: 0.72 of the state
    alone = _cli(tmp_path, *model, *budget, "--dry-run")
    assert alone.returncode == 3, alone.stderr
    ranks = int(alone.stderr.split("it would fit sharded over ")[1].split()[0])
    assert ranks == 2 and "predict one rank first with --dry-run --parallel fsdp --world-size 2)" in alone.stderr
    outcomes = {}
    for n in (ranks, ranks + 1):
        done = _cli(tmp_path, *model, *budget, "--dry-run", "--parallel", "fsdp", "--world-size", str(n),
                    "--out", f"fsdp{n}.json")
        report = autotune.load(tmp_path / f"fsdp{n}.json")
        assert report.distributed["world_size"] == n and all(m.predicted for m in report.trials)
        outcomes[n] = (done.returncode, {m.status for m in report.trials if m.batch_size == 1})
        if done.returncode == 3:
            assert f"over more than {n} ranks (--world-size in a dry run)" in done.stderr, done.stderr
    assert outcomes == {2: (3, {"oom"}), 3: (0, {"ok"})}


# -- against a real job ---------------------------------------------------------------------------------------------

REAL_KWARGS = {"n_layer": 2, "block_size": 16, "n_embd": 32, "n_head": 2, "vocab_size": 101}
REAL = ["--model", "autotune.examples:TinyGPT", "--model-kwargs", json.dumps(REAL_KWARGS),
        "--device", "cpu", "--budget", "2.5MiB"]
AUTOCAST = ["--precisions", "fp32,bf16", "--segments", "0,all", "--batch-sizes", "2,8,32"]
# FSDP2's own mixed precision and torchtitan's per-op plan (which keeps none of TinyGPT's outputs: biases, bmm)
FSDP_MIXED = ["--precisions", "bf16-fsdp", "--segments", "0,all,sac-torchtitan", "--batch-sizes", "2,8,32,64"]


def _one_rank_both_ways(load: Workload, configs: list, wrapper: str) -> tuple[list, list]:
    """Each configuration's rank 0 of one under ``wrapper``: predicted on the fake process group, then measured on a
    real gloo group in this process (each trial's mesh its own name, as the job's trials have)."""
    import torch.distributed as dist

    from autotune.execution.job import Job
    from autotune.execution.predict import predict_trial
    from autotune.execution.trial import run_trial
    from autotune.records import TrialSettings
    from autotune.training.wrapping import Wrapping

    settings = TrialSettings(measure_steps=1, settle_steps=0)
    with one_rank(wrapper, 1, torch.device("cpu")) as ranks:
        predicted = [predict_trial(load, c, settings=settings, parallel=ranks.wrapping()) for c in configs]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        job = Job(wrapper, 0, 1, 0, "gloo")
        measured = []
        for config in configs:
            job.trials += 1
            measured.append(run_trial(load, config, device="cpu", meter=TensorMeter("cpu"), settings=settings,
                                      parallel=Wrapping(job, dist.group.WORLD, torch.device("cpu"))))
    finally:
        dist.destroy_process_group()
    return predicted, measured


@pytest.mark.parametrize("spec, kwargs", [("tests.zoo:llama", None), ("autotune.examples:TinyGPT", REAL_KWARGS)])
def test_one_rank_under_fsdp2_s_mixed_precision_is_predicted_to_the_byte(spec, kwargs):
    """bf16-fsdp and the selective plans, rank 0 of one: predicted on the fake process group, measured on a real gloo
    group, in this process: the same bytes. On a Llama (no biases: torchtitan's plan alternates its mm, and keeps
    what sac-lean keeps; fused attention), and on TinyGPT, whose LayerNorms get bf16 weights: the CPU's kernel then
    keeps its statistics in bf16 (the predictor counted them in fp32, as with fp32 weights: 2,560 bytes too many
    here, 5 LayerNorms x 128 rows x 2 statistics x 2 bytes)."""
    from tests.optional import needs

    if spec.startswith("tests.zoo"):
        needs("transformers")
    load = Workload.from_specs(spec, model_kwargs=json.dumps(kwargs) if kwargs else None)
    load = load.with_chain(find_chain(load.build_model()))
    configs = [Config(p, s, 8) for p in ("bf16-fsdp", "fp32") for s in ("0", "sac-torchtitan", "sac-lean")]
    predicted, measured = _one_rank_both_ways(load, configs, "fsdp")
    assert [m.status for m in measured] == ["ok"] * len(configs), [m.error for m in measured]
    assert [p.peak_bytes for p in predicted] == [m.peak_bytes for m in measured], (predicted, measured)
    peaks = {(c.precision, c.plan): m.peak_bytes for c, m in zip(configs, measured)}
    assert peaks[("bf16-fsdp", "0")] < peaks[("fp32", "0")]
    if spec.startswith("tests.zoo"):
        for precision in ("bf16-fsdp", "fp32"):
            assert peaks[(precision, "sac-torchtitan")] == peaks[(precision, "sac-lean")] < peaks[(precision, "0")]


def test_a_frozen_models_ddp_rank_peaks_at_the_weights_broadcast_and_is_predicted_so():
    """DDP's construction broadcasts every weight from rank 0, flattened into buckets (one here): the weights twice over,
    for a moment. A step of a model whose weights are frozen (the zoo's LoRA Llama) holds them once and little else,
    so at a small batch with every block recomputed the broadcast is the trial's peak. Predicted on the fake group
    (torch's own broadcast run there) as a real gloo rank measures it, to the byte; before, the prediction skipped
    the broadcast as below a step's peak, which it is not here (plan all: 306,536 bytes predicted, 344,384 measured)."""
    from tests.optional import needs
    from tests.zoo import BY_NAME

    member = BY_NAME["llama_lora"]
    for package in member.needs:
        needs(package)
    load = Workload.from_specs(member.build)
    load = load.with_chain(find_chain(load.build_model()))
    configs = [Config("fp32", plan, 2) for plan in ("0", "all")]
    predicted, measured = _one_rank_both_ways(load, configs, "ddp")
    assert [m.status for m in measured] == ["ok", "ok"], [m.error for m in measured]
    assert [p.peak_bytes for p in predicted] == [m.peak_bytes for m in measured]
    model = load.build_model()
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert measured[1].peak_bytes == 2 * weights  # the broadcast's moment: the weights and their flat copy


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_one_rank_of_bf16_true_is_predicted_to_the_byte(wrapper):
    """bf16-true under each wrapper, rank 0 of one: the model cast to bf16 before the wrap (FSDP2 shards and gathers
    bf16 weights without a policy, and reduces bf16 gradients; DDP's buckets are bf16), predicted on the fake process
    group and measured on a real gloo group: the same bytes."""
    load = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=json.dumps(REAL_KWARGS))
    load = load.with_chain(find_chain(load.build_model()))
    configs = [Config("bf16-true", s, 8) for s in ("0", "all")]
    predicted, measured = _one_rank_both_ways(load, configs, wrapper)
    assert [m.status for m in measured] == ["ok"] * len(configs), [m.error for m in measured]
    assert [p.peak_bytes for p in predicted] == [m.peak_bytes for m in measured], (predicted, measured)


@pytest.mark.serial
@pytest.mark.parametrize("wrapper,offload,grid", [("ddp", "none", AUTOCAST), ("fsdp", "none,state", AUTOCAST),
                                                  ("fsdp", "none", FSDP_MIXED)], ids=["ddp", "fsdp", "fsdp-bf16-fsdp"])
def test_the_predicted_rank_is_a_real_gloo_ranks_peak_to_the_byte(tmp_path, wrapper, offload, grid):
    """Two ranks on gloo under torchrun, every configuration of the grid measured (fits and out-of-memory alike,
    FSDP2's state in host memory too), against rank 0 predicted at world size 2: the statuses and host peaks are the
    prediction's; rank 0's peak is, to the byte, in most configurations; every difference is one of two:

    * Rank 1 holds 256 bytes less under FSDP2. The 101 token rows split unevenly: FSDP2 pads every rank's shard of
      the weight (and of its gradient) to 51 rows, but AdamW's two moments are made like the rank's own shard, 50
      rows on rank 1: 2 x 32 x 4 bytes less wherever the moments are live at the peak.
    * A real rank sometimes holds more, by one unit's flat buffer at most (here a block's weights, 50,816 bytes in
      fp32): the same configuration's peak differs between two identical real runs (up to 46,720 bytes, at batch 2,
      on either rank, in 1 or 2 of 24 configurations a run; once the whole 50,816, fp32 plan all batch 2 under
      FSDP2), so it is timing, not the trial: a gloo collective runs
      on gloo's own thread and holds its buffers until it is done, where the fake group's collectives are done at
      once, so a buffer FSDP2 has let go may still be counted when the step's peak comes. Under bf16-fsdp the
      buffer is a block's bf16 all-gather (25,472 bytes: plan 0 at batch 2, on both ranks in each of four runs) or
      its fp32 reduce-scatter input (up to 50,752 bytes, plan all at batch 8 or 32, rank 0).
    """
    from tests.execution.test_distributed import torchrun

    space = [*REAL, *grid, "--offload", offload, "--parallel", wrapper]
    real = torchrun(*space, "--strategy", "grid", "--measure-steps", "1", "--settle-steps", "0", "--no-probe",
                    "--no-library-compare", "--storage", f"sqlite:///{tmp_path / 'real.db'}", "--out", "real.json",
                    cwd=tmp_path)
    assert real.returncode == 0, real.stderr
    predicted = _cli(tmp_path, *space, "--dry-run", "--world-size", "2", "--out", "predicted.json")
    assert predicted.returncode == 0, predicted.stderr
    measured = autotune.load(tmp_path / "real.json")
    rank = {m.config: m for m in autotune.load(tmp_path / "predicted.json").trials}
    assert {m.status for m in measured.trials} == {"ok", "oom"}
    moments_row = 2 * 32 * 4 if wrapper == "fsdp" else 0  # of the token rows: rank 1 has one fewer (docstring)
    unit = 4 * max(sum(p.numel() for p in b.parameters()) for b in TinyGPT(**REAL_KWARGS).transformer.h)
    exact = 0
    for m in measured.trials:
        p = rank[m.config]
        first, second = m.distributed["ranks"]
        assert (m.status, first["status"], second["status"], m.host_peak_bytes) == (
            p.status, p.status, p.status, p.host_peak_bytes), m.config
        assert 0 <= first["peak_bytes"] - p.peak_bytes <= unit, (m.config, first, p.peak_bytes)
        assert -moments_row <= second["peak_bytes"] - p.peak_bytes <= unit, (m.config, second, p.peak_bytes)
        exact += first["peak_bytes"] == p.peak_bytes
    assert exact >= len(measured.trials) // 2, exact


def test_fsdp2_s_gathers_and_reductions_are_traced_on_its_own_streams(workload):
    """FSDP2 makes each unit's all-gather buffers on its all-gather copy-in stream and the reduced gradients on its
    reduce-scatter stream (``torch.cpu.stream`` here, as ``torch.cuda.stream`` on a GPU): the trace a CUDA plan replays
    says so, and the caching allocator's model reserves more for them than for one stream, as a GPU's does."""
    from autotune.meters.caching_allocator import replay

    trainer = Trainer(workload, Config("fp32", "0", BATCH), torch.device("cpu"))
    with one_rank("fsdp", 2, torch.device("cpu")) as ranks:
        trainer.parallel = ranks.wrapping()
        meter = TensorMeter("cpu", trace=True)
        with fake_tensors(), meter.measure() as handle:
            trainer.build()
            trainer.step(workload.make_batch(trainer.module, BATCH))
            trace = handle.trace
        trainer.release()
    on = {s: sum(1 for e in trace if e[0] > 0 and (e[2] if len(e) > 2 else 0) == s) for s in (1, 2)}
    # a gather's buffer (its input a view of it) for each block in forward and backward and for the root once (it stays
    # gathered from its forward to its backward); a reduction's output for each block and the root
    assert on == {1: 2 * KWARGS["n_layer"] + 1, 2: KWARGS["n_layer"] + 1}
    assert replay(trace).peak_reserved_bytes > replay([e[:2] for e in trace]).peak_reserved_bytes
