"""bf16-true and the optimizers with less state on the bundled models: the state by part, what rounds away, why not fp16.

    python benchmarks/true_precision.py [--out results] [--steps 20]

1. **The state by part**, bf16 (autocast over fp32) against bf16-true (the model in bf16), measured on a Trainer
   after one step: weights, gradients, AdamW's moments and its step counts, in bytes.
2. **The updates bf16 rounds away**, counted as the probe counts them (of up to 1,024 evenly spaced entries of each
   parameter with a nonzero gradient, those the step left unchanged), over ``--steps`` steps of bf16-true on the
   model's example batches, at learning rates 1e-4 (the trials') and 1e-3, beside bf16's last loss (autocast over
   fp32 master weights, the same batches).
3. **The optimizer's state** of each model: AdamW (fp32 and bf16 parameters, measured by twins), bitsandbytes'
   AdamW8bit (from its layout; measured too where bitsandbytes is installed) and torch.optim.Adafactor (measured).
4. **fp16-true, refused**: the model and AdamW in fp16 without a loss scale, one step: how many weights are inf/NaN.

Writes ``results/true_precision-cpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform

import torch

from autotune.plans.checkpointing import find_chain
from autotune.records import Config
from autotune.training.optimizer import OptimizerSpec, measure_state_bytes
from autotune.training.state import eight_bit_state_bytes
from autotune.training.trainer import Trainer
from autotune.training.workload import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"TinyGPT": "autotune.examples:TinyGPT", "ResNetish": "autotune.examples:ResNetish"}
BATCH = 8


def _workload(spec: str) -> Workload:
    load = Workload.from_specs(spec)
    return load.with_chain(find_chain(load.build_model()))


def state_by_part(load: Workload, precision: str, batch: int = BATCH) -> dict:
    """One step of a Trainer in ``precision``: the bytes of its weights, gradients, AdamW's moments and step counts
    (tests/training/test_precision.py holds bf16-true's to half of bf16's with it)."""
    trainer = Trainer(load, Config(precision, "0", batch), torch.device("cpu"))
    trainer.build(prime=False)
    with trainer.run.autocast():
        loss = load.loss(trainer.model, load.make_batch(trainer.module, batch))
    trainer.run.backward(loss)
    params = list(trainer.model.parameters())
    parts = {"weights": sum(p.numel() * p.element_size() for p in params),
             "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)}
    trainer.run.step(trainer.optimizer)
    state = [(k, t) for s in trainer.optimizer.state.values() for k, t in s.items()]
    parts["moments"] = sum(t.numel() * t.element_size() for k, t in state if k != "step")
    parts["step_counts"] = sum(t.numel() * t.element_size() for k, t in state if k == "step")
    trainer.release()
    return parts


def lost_updates(load: Workload, lr: float, steps: int) -> dict:
    trainer = Trainer(load, Config("bf16-true", "0", BATCH), torch.device("cpu"), lr=lr, record_grad_norm=True)
    trainer.build()
    for i in range(steps):
        trainer.step(load.make_batch(trainer.module, BATCH))
    said = {"lr": lr, "steps": steps, **trainer.lost_updates, "loss_first": trainer.losses[0],
            "loss_last": trainer.losses[-1]}
    trainer.release()
    mixed = Trainer(load, Config("bf16", "0", BATCH), torch.device("cpu"), lr=lr)  # fp32 master weights
    mixed.build()
    for i in range(steps):
        mixed.step(load.make_batch(mixed.module, BATCH))
    said["bf16_loss_last"] = mixed.losses[-1]
    mixed.release()
    return said


def optimizer_states(load: Workload) -> dict:
    model = load.build_model()
    trained = [p for p in model.parameters() if p.requires_grad]
    out = {"parameters": sum(p.numel() for p in trained),
           "AdamW": measure_state_bytes(OptimizerSpec(), model, 1e-4),
           "AdamW, bf16 parameters": measure_state_bytes(OptimizerSpec(), model, 1e-4, dtype=torch.bfloat16),
           "bitsandbytes AdamW8bit (layout)": eight_bit_state_bytes(p.numel() for p in trained),
           "torch.optim.Adafactor": measure_state_bytes(OptimizerSpec(torch.optim.Adafactor), model, 1e-3)}
    if importlib.util.find_spec("bitsandbytes") is not None:
        import bitsandbytes

        out["bitsandbytes AdamW8bit (measured)"] = measure_state_bytes(
            OptimizerSpec(bitsandbytes.optim.AdamW8bit), model, 1e-4)
    return out


def fp16_true(load: Workload) -> dict:
    """The model and AdamW in fp16, no loss scale (what fp16-true would be), one step on an example batch."""
    model = load.build_model(seed=0).to(torch.float16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = load.make_batch(model, BATCH)
    batch = [t.half() if t.is_floating_point() else t for t in batch] if isinstance(batch, (list, tuple)) else batch
    loss = load.loss(model, batch)
    loss.backward()
    optimizer.step()
    params = list(model.parameters())
    return {"loss": float(loss.detach()), "weights": sum(p.numel() for p in params),
            "nonfinite_weights": sum(int((~torch.isfinite(p)).sum()) for p in params)}


def markdown(data: dict) -> str:
    env = data["environment"]
    lines = [f"# bf16-true and optimizers with less state ({env['machine']}, torch {env['torch']})", "",
             f"Command: `{data['command']}`. Batch {BATCH}, the models' example batches.", "",
             "**The state by part after one step** (bytes; bf16 autocasts over fp32 weights, bf16-true holds the model "
             "in bf16):", "", "| model | precision | weights | gradients | AdamW moments | AdamW step counts |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, rows in data["state"].items():
        for precision, p in rows.items():
            lines.append(f"| {name} | {precision} | {p['weights']:,} | {p['gradients']:,} | {p['moments']:,} | "
                         f"{p['step_counts']:,} |")
        half = all(2 * rows["bf16-true"][k] == rows["bf16"][k] for k in ("weights", "gradients", "moments"))
        lines.append(f"| {name} | bf16-true / bf16 | {'half' if half else 'not half'} | | | "
                     f"{'equal' if rows['bf16-true']['step_counts'] == rows['bf16']['step_counts'] else 'differ'} |")
    lines += ["", f"**The updates bf16 rounds away** (bf16-true, {data['lost'][0]['steps']} steps; of the sampled "
                  f"entries with a nonzero gradient, those the step left unchanged, as the probe counts them):", "",
              "| model | lr | lost | sampled | share | loss first, last | bf16 (autocast) loss last |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['model']} | {r['lr']:g} | {r['lost']:,} | {r['sampled']:,} | {r['share']:.1%} | "
              f"{r['loss_first']:.4f}, {r['loss_last']:.4f} | {r['bf16_loss_last']:.4f} |" for r in data["lost"]]
    names = list(next(iter(data["optimizers"].values())))[1:]
    lines += ["", "**The optimizer's state** (bytes; twins measure it, the 8-bit one from bitsandbytes' layout):", "",
              "| model | parameters | " + " | ".join(names) + " |", "| --- " * (len(names) + 2) + "|"]
    lines += [f"| {m} | {o['parameters']:,} | " + " | ".join(f"{o[n]:,}" if n in o else "-" for n in names) + " |"
              for m, o in data["optimizers"].items()]
    lines += ["", "**fp16-true, refused** (the model and AdamW in fp16 without a loss scale, one step at lr 1e-4):", ""]
    lines += [f"- {m}: loss {r['loss']:.4f}, then {r['nonfinite_weights']:,} of {r['weights']:,} weights inf or NaN"
              for m, r in data["fp16_true"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "results"))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    loads = {name: _workload(spec) for name, spec in MODELS.items()}
    data = {"command": "python benchmarks/true_precision.py" + (f" --steps {args.steps}" if args.steps != 20 else ""),
            "environment": {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__},
            "state": {name: {p: state_by_part(load, p) for p in ("bf16", "bf16-true")} for name, load in loads.items()},
            "lost": [{"model": name, **lost_updates(load, lr, args.steps)} for name, load in loads.items()
                     for lr in (1e-4, 1e-3)],
            "optimizers": {name: optimizer_states(load) for name, load in loads.items()},
            "fp16_true": {name: fp16_true(load) for name, load in loads.items()}}
    with open(os.path.join(args.out, "true_precision-cpu.json"), "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "true_precision-cpu.md"), "w") as f:
        f.write(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
