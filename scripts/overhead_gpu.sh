#!/usr/bin/env bash
# Issues 11, 51 and 60's GPU check: engine overhead at world size 1 on one CUDA device, 124M GPT (12 x 768,
# 148 parameter tensors), batch 16 x 512, AdamW, fp32 and bf16-mixed: step time, aten ops, host
# syncs and host work per step of DDP, zero1/2/3, zero3_offload and FSDP2 (fsdp2_z3), stepped
# round-robin in the same processes (--paired), our collectives kept at one rank (the bench does that).
# Targets (bf16-mixed, issues 51 and 60): zero1/zero2 <= 1.05x DDP, zero3 <= 1.15x, zero3_offload
# <= 1.05x zero3.
# Runs from a checkout without installing (PYTHONPATH=src); a few minutes on an H200.
#   bash scripts/overhead_gpu.sh [OUT_DIR [BENCH_OPTION...]]
# Options after OUT_DIR are added to every run and win over the ones below (e.g. --steps 10);
# OVERHEAD_PRECISIONS="fp32" runs one precision, PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-gpu-overhead}
shift $(($# > 0 ? 1 : 0))
for precision in ${OVERHEAD_PRECISIONS:-fp32 bf16-mixed}; do
  PYTHONPATH=src "${PYTHON:-python3}" -m lightning_zero bench --device cuda --devices 1 \
    --n-layer 12 --n-embd 768 --n-head 12 --block-size 512 --batch-size 16 \
    --warmup 3 --steps 20 --variants ddp,zero1,zero2,zero3,zero3_offload,fsdp2_z3 --paired --precision "$precision" \
    --timeout 300 --out "$out/$precision" "$@"
done
