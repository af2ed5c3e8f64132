#!/usr/bin/env bash
# Issue 14's GPU check: hybrid sharding against flat sharding on one machine with N >= 2 GPUs
# (NCCL), 124M GPT (12 x 768), batch 16 x 512, bf16-mixed: step time, and our collective bytes
# within a shard group and across groups (the report's "Hybrid sharding" table) with K = N/2, next
# to the same variants sharded over all N. On one machine both kinds of link are fast, so this
# checks correctness and the traffic split on NCCL; the time a slow inter-node network saves needs
# two nodes. Runs from a checkout without installing (PYTHONPATH=src); a few minutes.
#   bash scripts/hybrid_gpu.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-gpu-hybrid}
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
  echo "hybrid sharding needs at least 2 GPUs (found $gpus): groups of N/2 replicated across 2" >&2
  exit 2
fi
common=(--device cuda --devices "$gpus" --n-layer 12 --n-embd 768 --n-head 12 --block-size 512
        --batch-size 16 --warmup 3 --steps 20 --precision bf16-mixed --timeout 300)
PYTHONPATH=src python -m lightning_zero bench "${common[@]}" --variants ddp,zero2,zero3 --out "$out/flat"
PYTHONPATH=src python -m lightning_zero bench "${common[@]}" --variants ddp,zero2,zero3 \
  --shard-group-size $((gpus / 2)) --out "$out/hybrid"
