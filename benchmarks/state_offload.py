"""The training state in host memory (FSDP2's CPUOffloadPolicy) against the same FSDP2 step without it, on one rank.

    torchrun --standalone --nproc-per-node 1 benchmarks/state_offload.py [--device cuda] [--steps 5]

autotune searches this lever with ``--offload state`` under ``--parallel fsdp`` (plans ``PLAN+state``); this
script measures it outside autotune, as a check on those trials, where a GPU is lent: TinyGPT (8 x 512, T=256) at batch 8, every
block and the root under ``fully_shard``, AdamW; for each variant the device's allocated peak, the state held
in host memory (the sharded parameters, their gradients and the optimizer's state on the CPU), the median
step time, the optimizer step's share of it, and the losses (the offloaded step runs AdamW on the CPU: equal
within float rounding, not bitwise). On the CPU (gloo, no pinned memory) both variants live in one memory:
the script then only shows that the offloaded step trains as the other does. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from autotune.examples import TinyGPT

try:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
except ImportError:  # torch < 2.6, as autotune.training.wrapping imports it
    from torch.distributed._composable.fsdp import CPUOffloadPolicy, fully_shard


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """What the state holds on the CPU: sharded parameters, their gradients, the optimizer's state (each DTensor's
    local shard)."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local if t.device.type == "cpu")


def run(device: torch.device, offload: bool, steps: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=8, n_embd=512, n_head=8, block_size=256).to(device)
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")} if offload else {}
    for block in model.transformer.h:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = {k: v.to(device) for k, v in model.example_batch(8).items()}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, step_s, opt_s = [], [], []
    for i in range(2 + steps):  # two warm-up steps
        _sync(device)
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        _sync(device)
        mid = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        _sync(device)
        end = time.perf_counter()
        losses.append(loss.item())
        if i >= 2:
            step_s.append(end - start)
            opt_s.append(end - mid)
    return {"offload": offload, "losses": losses, "step_s": statistics.median(step_s),
            "optimizer_share": statistics.median(o / s for o, s in zip(opt_s, step_s)),
            "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "host_state_bytes": _host_bytes(model, optimizer) if device.type == "cuda" else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        plain, offloaded = run(device, False, args.steps), run(device, True, args.steps)
    finally:
        dist.destroy_process_group()
    for r in (plain, offloaded):
        peak = f"{r['device_peak_bytes'] / 2**20:.1f} MiB" if r["device_peak_bytes"] is not None else "n/a (CPU)"
        host = f"{r['host_state_bytes'] / 2**20:.1f} MiB" if r["host_state_bytes"] is not None else "n/a (CPU)"
        print(f"{'state offloaded' if r['offload'] else 'state on device'}: device peak {peak}, state in host memory "
              f"{host}, step {r['step_s'] * 1e3:.1f} ms (optimizer {r['optimizer_share']:.0%}), "
              f"losses {[round(v, 5) for v in r['losses']]}")
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(plain["losses"], offloaded["losses"]))
    ok = worst < 1e-4 and (device.type != "cuda" or offloaded["device_peak_bytes"] < plain["device_peak_bytes"])
    print(json.dumps({"device": str(device), "step_ratio": offloaded["step_s"] / plain["step_s"],
                      "loss_max_rel_diff": worst, "plain": plain, "offloaded": offloaded, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
