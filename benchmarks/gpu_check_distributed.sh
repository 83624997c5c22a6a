#!/usr/bin/env bash
# Distributed GPU check: run from the repository root on a machine with NVIDIA GPUs (a few minutes).
# With one GPU it checks the NCCL branches at world size 1 (the wrapper on cuda:LOCAL_RANK, a NCCL trial
# group per trial, the CUDA meter on every rank); with two or more it also runs an OOM on rank 1 alone and
# shows how long rank 0 waited for it (the store watch aborting rank 0's NCCL group). Exits non-zero on
# the first failed check.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps -e . 2>/dev/null || true
python3 -m pip install -q optuna pandas nvidia-ml-py 2>/dev/null || true
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
out=${TMPDIR:-/tmp}/autotune-gpu-dist
rm -rf "$out" && mkdir -p "$out"
space=(--model autotune.examples:TinyGPT --device cuda --precisions bf16 --segments 0,all --batch-sizes 8,32,128
       --strategy grid --measure-steps 3 --no-library-compare --trial-timeout 120)
check() {  # check NAME NPROC [ENV=VALUE ...] -- autotune flags: run under torchrun, then read the report
    local name=$1 nproc=$2; shift 2
    local env=()
    while [ "$1" != "--" ]; do env+=("$1"); shift; done; shift
    local started=$SECONDS
    env ${env[@]+"${env[@]}"} PYTHONUNBUFFERED=1 timeout 900 torchrun --standalone --nproc-per-node "$nproc" -m autotune \
        "${space[@]}" --storage "sqlite:///$out/$name.db" --study "$name" --out "$out/$name.json" "$@"
    echo "$name: finished in $((SECONDS - started)) s"
    python3 - "$out/$name.json" "$nproc" <<'EOF'
import json, sys
data = json.load(open(sys.argv[1]))
d = data["distributed"]
assert d["backend"] == "nccl" and d["world_size"] == int(sys.argv[2]), d
for t in data["trials"]:
    ranks = t.get("distributed", {}).get("ranks", [])
    print(f"  {t['segments']:>4} batch {t['batch_size']:>4} {t['status']:<7} peak {t['peak_bytes']} "
          f"per rank {[r['peak_bytes'] for r in ranks]} {t.get('error') or ''}")
    assert t["status"] in ("ok", "oom"), t
print("  recommendation:", {k: data["recommendation"][k] for k in ("segments", "batch_size", "samples_per_s")})
EOF
}
check ddp1 1 -- --parallel ddp
check fsdp1 1 -- --parallel fsdp
if [ "$gpus" -ge 2 ]; then
    check ddp2 2 -- --parallel ddp
    check fsdp2 2 -- --parallel fsdp
    # Rank 1 gets 1 GiB, rank 0 the whole GPU: the larger batches run out of memory on rank 1 alone. Each such
    # trial must end in seconds (the store watch), not at --trial-timeout + 60 s (the group's timeout).
    check uneven2 2 AUTOTUNE_RANK_BUDGETS=1=1GiB -- --parallel ddp --budget 40GiB
    python3 - "$out/uneven2.json" <<'EOF'
import json, sys
trials = json.load(open(sys.argv[1]))["trials"]
ooms = [t for t in trials if t["status"] == "oom"]
assert ooms and all(t["error"].startswith("rank 1: ") for t in ooms), ooms
print("uneven2: oom trials' wall seconds:", [round(t["wall_s"], 1) for t in ooms], "(far below 180 s: rank 0 was woken)")
EOF
else
    echo "one GPU: the two-rank checks (a one-rank OOM waking the other through the store) need two"
fi
# The training state in host memory (FSDP2's CPUOffloadPolicy) on one rank, searched (--offload state): each plan's
# device peak with the state on the host below the same plan's without it, its host bytes and the optimizer step's
# share of the step; then the same lever alone, beside the plain FSDP2 step (step time ratio, losses)
check fsdp1state 1 -- --parallel fsdp --offload none,state,activations+state --precisions bf16,fp16 --batch-sizes 8,32 --no-probe
python3 - "$out/fsdp1state.json" <<'EOF'
import json, sys
trials = {(t["precision"], t["segments"], t["batch_size"]): t for t in json.load(open(sys.argv[1]))["trials"]}
for (precision, plan, batch), t in sorted(trials.items()):
    if "+state" not in plan or t["status"] != "ok":
        continue
    plain = trials[(precision, plan.replace("+offload", "").replace("+state", ""), batch)]
    print(f"  {plan:>18} batch {batch:>3}: device {t['peak_bytes'] / 2**20:.1f} MiB against {plain['peak_bytes'] / 2**20:.1f}"
          f" MiB, host {t['host_peak_bytes'] / 2**20:.1f} MiB, step {t['step_s'] / plain['step_s']:.2f}x, optimizer "
          f"step {t['optimizer_step_share']:.0%} of it")
    assert t["peak_bytes"] < plain["peak_bytes"] and t["host_peak_bytes"] > 0 and t["optimizer_step_share"], t
EOF
PYTHONUNBUFFERED=1 timeout 600 torchrun --standalone --nproc-per-node 1 benchmarks/state_offload.py
echo "distributed GPU check passed"
