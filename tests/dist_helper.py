"""One rank of the distributed checks in test_distributed.py, started with torchrun's environment variables.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.dist_helper OUT.json

Both wrappers, through autotune's own trial code (``Trainer`` with a :class:`Wrapping`, ``run_trial``):

* ``grads``, ``params``: one step's gradients, and the parameters after it, under each wrapper against one
  single-process step on the global batch (each rank trains on its half; the loss is a mean per sample),
  with and without a checkpoint plan. The step is SGD's: AdamW's first step is lr * g / (|g| + eps),
  which turns the 1e-7 rounding of a gradient near eps (summed in another order) into 1e-5 of a weight;

* ``peaks``: each rank's peak at the same micro-batch under DDP and under FSDP2, on a model whose
  parameters, gradients and AdamW state dwarf its activations; ``sgd_peaks`` the same with the
  user's optimizer, SGD with momentum; ``states``: each rank's optimizer state under each wrapper, AdamW's
  and SGD's (one buffer a parameter where AdamW keeps two), as the trial primes it: over the shards under FSDP2;
* ``sharded_builds``: under FSDP2, each rank's peak over the model's build and wrap (before the optimizer's state),
  and whether the model it trains, gathered whole, is the workload's build: parameters (tied ones once) and buffers.

Rank 0 writes what it found to OUT.json.
"""

from __future__ import annotations

import json
import logging
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn

from autotune.execution import job as distributed
from autotune.training.wrapping import Wrapping
from autotune.meters import TensorMeter
from autotune.plans import cache
from autotune.vocabulary import Plan
from autotune.records import Config, TrialSettings
from autotune.execution.trial import run_trial
from autotune.training.trainer import Trainer
from autotune.training.workload import Workload

WIDTH, BLOCKS, GLOBAL_BATCH = 256, 4, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Wide(nn.Module):
    """Parameter-heavy: about 2 MiB of weights per block, a few KiB of activations per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return ((self.head(x).squeeze(-1) - y) ** 2).mean()  # a mean per sample: DDP's average is the global mean

    def example_batch(self, batch_size: int):
        g = torch.Generator().manual_seed(batch_size)
        return ((torch.randn(batch_size, WIDTH, generator=g), torch.randn(batch_size, generator=g)), None)


class Uncopyable(Wide):
    """Wide with an attribute a deep copy refuses: the workload keeps no copy of it on the host to shard from."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


def tokens():
    """The data of the distributed search tests: TinyGPT's sequences, for the tests' small TinyGPT (T=16, V=32)."""
    from autotune.examples import token_dataset

    return token_dataset(size=1280, block_size=16, vocab_size=32)


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, WIDTH, generator=g), torch.randn(GLOBAL_BATCH, generator=g)


def whole(tensors: dict[str, torch.Tensor | None], job) -> dict[str, torch.Tensor]:
    """Each tensor whole: FSDP2's dim-0 shards (DTensors) gathered on the control group, in rank order; a None (a
    frozen parameter's gradient) left out."""
    return {name: torch.cat(job.gather(t.to_local().detach().clone()), dim=0) if hasattr(t, "to_local")
            else t.detach().clone() for name, t in tensors.items() if t is not None}


def one_step(workload: Workload, plan: str, job, group, x=None, y=None, batch_size: int = 0,
             cache_off: bool = False) -> tuple[dict, dict]:
    """The gradients of one step and the parameters after it, through autotune's Trainer (SGD: see the test).

    The batch is ``((x, y), None)``, or the workload's own batch of ``batch_size``. ``cache_off``: the model's
    key/value cache off in training, as a plan that recomputes turns it off (autotune.plans.cache).
    """
    if group is not None:
        job.trials += 1  # each wrapping its own mesh, as autotune's trials have
    trainer = Trainer(workload, Config("fp32", plan, len(x) if x is not None else batch_size), torch.device("cpu"),
                      parallel=None if group is None else Wrapping(job, group, torch.device("cpu")))
    trainer.build()
    model = trainer.run.model
    if cache_off:
        cache.turn_off(trainer.module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = ((x, y), None) if x is not None else workload.make_batch(trainer.module, batch_size)
    with trainer.run.autocast():
        loss = workload.loss(model, batch)
    trainer.run.backward(loss)
    names = [n for n, _ in getattr(model, "module", model).named_parameters()]
    grads = whole(dict(zip(names, (p.grad for p in model.parameters()))), job)
    trainer.run.step(optimizer)
    return grads, whole(dict(zip(names, model.parameters())), job)


def largest_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():  # a gradient made in one step only
        return float("inf")
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) if b[k].abs().max() > 0
               else float((a[k] - b[k]).abs().max()) for k in b)


ZOO = ("cnn_batchnorm", "per_layer_args", "dropout_experts", "t5", "mixtral", "llama_lora")  # BatchNorm, per-layer
# arguments, dropout and experts, an encoder-decoder whose first blocks compute what the others get, routed experts, a
# LoRA adapter over a frozen base (parameters with and without gradients in one FSDP2 unit)
MORE_PLANS = {"llama_lora": {"ddp": ("all+offload",), "fsdp": ("all+offload", "0+state")}}  # offload, FSDP2's host state


def zoo_plans_under_the_wrappers(job, trained: dict[str, list[str]]) -> dict[str, float | str]:
    """Per zoo model, wrapper and plan: one step's gradients against plan 0's under the same wrapper; ``trained``
    gets the parameters with a gradient, per model and wrapper."""
    from autotune.plans.checkpointing import find_chain
    from tests.zoo import BY_NAME

    found: dict[str, float | str] = {}
    for name in ZOO:
        member = BY_NAME[name]
        try:
            for package in member.needs:
                __import__(package)
        except ImportError as exc:
            found[name] = f"skipped: {exc}"
            continue
        workload = Workload.from_specs(member.build)
        workload = workload.with_chain(find_chain(member.build()))
        for wrapper in ("ddp", "fsdp"):
            wjob = distributed.Job(wrapper, job.rank, job.world_size, job.local_rank, job.backend, job.control,
                                   trials=job.trials)
            grads = {}
            plans = ("0", "all", "2", *MORE_PLANS.get(name, {}).get(wrapper, ()))
            for plan in plans:  # plan 0 with the cache off, as the plans that recompute turn it off
                group = dist.new_group(backend="gloo")
                grads[plan] = one_step(workload, plan, wjob, group, batch_size=member.batch_size, cache_off=True)[0]
                dist.destroy_process_group(group)
            job.trials = wjob.trials
            trained[f"{name}/{wrapper}"] = sorted(grads["0"])
            for plan in plans[1:]:
                found[f"{name}/{wrapper}/{plan}"] = largest_relative_difference(grads[plan], grads["0"])
    return found


def optimizer_states(job, workloads: dict[str, Workload]) -> dict[str, list[int]]:
    """Each rank's optimizer state under each wrapper ("ddp/adamw", ...), as the trial primes it before its first step."""
    from autotune.training.optimizer import state_bytes

    states = {}
    for wrapper in ("ddp", "fsdp"):
        wjob = distributed.Job(wrapper, job.rank, job.world_size, job.local_rank, job.backend, job.control,
                               trials=job.trials)
        for name, workload in workloads.items():
            job.trials = wjob.trials = wjob.trials + 1
            group = dist.new_group(backend="gloo")
            trainer = Trainer(workload, Config("fp32", "0", 4), torch.device("cpu"),
                              parallel=Wrapping(wjob, group, torch.device("cpu")))
            trainer.build()
            states[f"{wrapper}/{name}"] = job.gather(state_bytes(trainer.ballast))
            trainer.release()
            dist.destroy_process_group(group)
    return states


SHARDED = {"wide": "0", "tinygpt": "all", "cnn": "all", "uncopyable": "0"}  # the models sharded_builds builds, their plan


def sharded_workload(name: str) -> Workload:
    """A model of :data:`SHARDED`, with its chain. TinyGPT ties its embedding to its head and shards unevenly (101 token
    rows); the CNN has BatchNorm's buffers; Uncopyable is built whole, as before."""
    from autotune.examples import TinyGPT
    from autotune.plans.checkpointing import find_chain
    from tests.zoo import BatchNormCNN

    factory = {"wide": Wide, "tinygpt": TinyGPT, "cnn": BatchNormCNN, "uncopyable": Uncopyable}[name]
    tiny = {"n_layer": 2, "block_size": 16, "n_embd": 32, "n_head": 2, "vocab_size": 101}
    workload = Workload.from_specs(factory, model_kwargs=tiny if factory is TinyGPT else None)
    return workload.with_chain(find_chain(workload.build_model()))


def sharded_builds(job) -> dict[str, list]:
    """Per model of :data:`SHARDED`, under FSDP2: each rank's peak over the build and the wrap (the optimizer's state
    not primed), the model's parameter and buffer bytes, whether the model the rank trains, gathered whole, is bitwise
    the workload's own build (a fresh one, seeded); and the notices said."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("autotune").addHandler(handler)
    wjob = distributed.Job("fsdp", job.rank, job.world_size, job.local_rank, job.backend, job.control, trials=job.trials)
    found: dict[str, list] = {}
    for name, plan in SHARDED.items():
        workload = sharded_workload(name)
        job.trials = wjob.trials = wjob.trials + 1
        group = dist.new_group(backend="gloo")
        trainer = Trainer(workload, Config("fp32", plan, 2), torch.device("cpu"),
                          parallel=Wrapping(wjob, group, torch.device("cpu")))
        with TensorMeter("cpu").measure() as meter:
            trainer.build(prime=False)
        model, built = trainer.module, workload.unwarmed().build_model(seed=0)
        state = whole({**dict(model.named_parameters()), **dict(model.named_buffers())}, job)
        expected = {**dict(built.named_parameters()), **dict(built.named_buffers())}
        same = state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)
        found[name] = [job.gather(meter.peak_bytes()), sum(p.numel() * 4 for p in built.parameters()),
                       sum(b.numel() * b.element_size() for b in built.buffers()), same]
        trainer.release()
        dist.destroy_process_group(group)
    logging.getLogger("autotune").removeHandler(handler)
    found["said"] = said
    return found


def state_offload_trials(job, workload: Workload, batch_size: int) -> dict[str, list]:
    """Trials of plan 0 under FSDP2 without and with the state in host memory: each rank's device and host peaks, the
    optimizer step's share, the losses (every rank's, gathered)."""
    wjob = distributed.Job("fsdp", job.rank, job.world_size, job.local_rank, job.backend, job.control, trials=job.trials)
    found: dict[str, list] = {}
    for plan in ("0", "0+state"):
        job.trials = wjob.trials = wjob.trials + 1
        group = dist.new_group(backend="gloo")
        m = run_trial(workload, Config("fp32", plan, batch_size), device="cpu", meter=TensorMeter("cpu"),
                      settings=TrialSettings(measure_steps=2, settle_steps=0),
                      parallel=Wrapping(wjob, group, torch.device("cpu")))
        dist.destroy_process_group(group)
        found[plan] = job.gather([m.status, m.peak_bytes, m.host_peak_bytes, m.optimizer_step_share, m.loss_final])
    return found


def main(out: str) -> None:
    job = distributed.join("ddp", torch.device("cpu"))
    workload = Workload.from_specs(Wide).with_chain(None)
    from autotune.plans.checkpointing import find_chain

    workload = workload.with_chain(find_chain(Wide()))
    x, y = global_batch()
    half = GLOBAL_BATCH // job.world_size
    mine = slice(job.rank * half, (job.rank + 1) * half)
    found: dict = {"grads": {}, "params": {}, "peaks": {}}
    sgd = Workload.from_specs(Wide, optimizer="torch.optim:SGD", optimizer_kwargs={"lr": 0.1, "momentum": 0.9})
    sgd = sgd.with_chain(workload.chain)
    single = {plan: one_step(workload, plan, job, None, x, y) for plan in ("0", "all")}
    for wrapper in ("ddp", "fsdp"):
        wjob = distributed.Job(wrapper, job.rank, job.world_size, job.local_rank, job.backend, job.control,
                               trials=job.trials)
        # Offloaded activations under both wrappers, the state in host memory under FSDP2 (its CPUOffloadPolicy)
        for plan in ("0", "all", "0+offload", "all+offload", *(("0+state", "all+offload+state") if wrapper == "fsdp"
                                                                 else ())):
            group = dist.new_group(backend="gloo")
            grads, params = one_step(workload, plan, wjob, group, x[mine], y[mine])
            dist.destroy_process_group(group)
            base = Plan(plan).base
            found["grads"][f"{wrapper}/{plan}"] = largest_relative_difference(grads, single[base][0])
            found["params"][f"{wrapper}/{plan}"] = largest_relative_difference(params, single[base][1])
        for name, load in (("peaks", workload), ("sgd_peaks", sgd)):  # AdamW, then the user's SGD over the shards
            job.trials = wjob.trials = wjob.trials + 1
            group = dist.new_group(backend="gloo")
            m = run_trial(load, Config("fp32", "0", half), device="cpu", meter=TensorMeter("cpu"),
                          settings=TrialSettings(), timed=False, parallel=Wrapping(wjob, group, torch.device("cpu")))
            dist.destroy_process_group(group)
            found.setdefault(name, {})[wrapper] = job.gather(m.peak_bytes)
            found.setdefault("status", {})[f"{wrapper}/{name}"] = m.status
    found["state_offload"] = state_offload_trials(job, workload, half)
    found["sharded_builds"] = sharded_builds(job)
    found["states"] = optimizer_states(job, {"adamw": workload, "sgd": sgd})
    found["zoo"] = zoo_plans_under_the_wrappers(job, found.setdefault("zoo_trained", {}))
    if job.rank == 0:
        found["parameter_bytes"] = sum(p.numel() * 4 for p in Wide().parameters())
        found["block_bytes"] = sum(p.numel() * 4 for p in Block().parameters())
        with open(out, "w") as f:
            json.dump(found, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
