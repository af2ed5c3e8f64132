#!/usr/bin/env bash
# Issue 11's GPU check: engine overhead at world size 1 on one CUDA device, 124M GPT (12 x 768,
# 148 parameter tensors), batch 16 x 512, AdamW, fp32 and bf16-mixed: step time, aten ops and host
# syncs per step of DDP and zero1/2/3. Targets: zero1/zero2 <= 1.03x DDP, zero3 <= 1.15x.
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
    --warmup 3 --steps 20 --variants ddp,zero1,zero2,zero3 --precision "$precision" \
    --timeout 300 --out "$out/$precision" "$@"
done
