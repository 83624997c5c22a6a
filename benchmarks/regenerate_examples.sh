#!/usr/bin/env bash
# The example reports of results/ that the docs quote, regenerated with today's code (CPU, tensor meter), one
# after the other on a quiet machine: bash benchmarks/regenerate_examples.sh [RESULTS_DIR]
# (the grids and claims: python benchmarks/claims.py --run). Each command is also written beside its figures in docs/.
set -euo pipefail
out=${1:-results}
mkdir -p "$out"
store=$(mktemp -d)
trap 'rm -rf "$store"' EXIT
gpt2=(--model autotune.thirdparty:gpt2 --model-kwargs
      '{"n_layer": 6, "n_embd": 128, "n_head": 4, "n_positions": 128, "vocab_size": 2048}' --device cpu)
step() { echo "== $1"; shift; local start=$SECONDS; python -m autotune "$@"; echo "== $((SECONDS - start)) s"; }

# docs/workload.md (third-party models), docs/report.md (exports and plots)
step example "${gpt2[@]}" --budget 256MiB --precisions fp32,bf16 --batch-sizes 1..64 --plot \
    --export hf,lightning,deepspeed,accelerate --storage "sqlite:///$store/example.db" --out "$out/example-gpt2-cpu.json"
# docs/plans.md: every block plan at one precision and batch size
step plans "${gpt2[@]}" --budget 256MiB --precisions bf16 --batch-sizes 16 --strategy grid \
    --segments 0,every4,every2,2,4,all --measure-steps 9 --storage "sqlite:///$store/plans.db" \
    --out "$out/example-gpt2-plans-cpu.json"
# docs/plans.md (selective plans): a 200 MiB grid with the selective plans, GPT-2 and TinyGPT
front=(--device cpu --budget 200MiB --precisions fp32 --segments auto --batch-sizes 16,32 --strategy grid
       --no-library-compare)
step front-gpt2 "${gpt2[@]}" "${front[@]}" --storage "sqlite:///$store/gpt2.db" --study gpt2 \
    --out "$out/selective-front-gpt2-cpu.json"
step front-TinyGPT --model autotune.examples:TinyGPT "${front[@]}" --storage "sqlite:///$store/TinyGPT.db" \
    --study TinyGPT --out "$out/selective-front-TinyGPT-cpu.json"
# docs/plans.md (the state in host memory): plans 0 and all with each --offload mode, FSDP2 on one rank
echo "== offload-modes"
torchrun --standalone --nproc-per-node 1 -m autotune --model autotune.examples:TinyGPT --device cpu \
    --precisions bf16 --segments 0,all --batch-sizes 16 --strategy grid --measure-steps 9 --no-library-compare \
    --parallel fsdp --offload none,activations,state,activations+state --no-probe \
    --storage "sqlite:///$store/offload.db" --out "$out/offload-modes-TinyGPT-cpu.json"
