#!/usr/bin/env bash
# Issue 26's one command for a GPU machine: the CUDA test tier (with issue 59's concurrency checks),
# overhead_gpu.sh, offload_gpu.py, NVMe offload's step time against CPU offload's (issue 28), the
# capacity benchmark on the GPU and zeropp_gpu.py (issue 63: qwZ's kernels against the link time
# their bytes save), then summary.md: every target, its measured value, its verdict.
# Runs from a plain checkout against the installed torch and Lightning (PYTHONPATH=src), in at most
# 10 minutes on one H200: each step has a time limit (the table below), and a step that fails or runs
# out of time is recorded in the summary while the next one runs.
#   bash scripts/gpu_check.sh [--dry-run] [--pack]
# Writes under $OUT (default ./gpu-check): summary.md, summary.json, gpu-check.log (this output)
# and detail/ (each step's log and figures), or with --pack detail.tar.gz instead of detail/, so
# the folder holds four files. --dry-run: the same steps with tiny sizes on the CPU (the CUDA tier
# is collected and skipped), under a minute on 2 cores; tests/test_gpu_check_script.py runs it.
# PYTHON picks the interpreter (default python3). Exit status 0 when every step ran to its end;
# targets missed show in the summary, not in the status.
set -uo pipefail
dry_run=0 pack=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    --pack) pack=1 ;;
    -h | --help) sed -n '2,14p' "$0" | cut -c3-; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "${OUT:-gpu-check}" && out=$(cd "${OUT:-gpu-check}" && pwd)
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
detail="$out/detail"
# GPU_CHECK_DETAIL: where tier modules leave figures for the summary (test_cuda_concurrency.py: concurrency/)
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 GPU_CHECK_DETAIL="$detail"

# Steps, sizes and time limits (seconds). On the GPU the limits add up to 600 s, sized from an H200
# run (2026-12-04: 196 s in all against 460 s of limits then, the longest step 31 s). Issue 59's
# concurrency step (75 s, for ~60 s expected on an H200: a spawned rank, ~20 engine runs and 10 Trainer
# fits of small GPTs, inductor compiling one block, and a second process for expandable segments;
# not yet timed on a GPU) took its 75 s from the others: the lightning tier 75 -> 55 (1.8x that longest
# step), offload 100 -> 90, capacity 55 -> 45, the overhead 50 -> 45 per precision (its bench's own
# --timeout is 40, as the NVMe step's, left at 45), and 5 s from each of engine, checkpoint, compile,
# nccl_contracts and reduce_stream. The summary says how long each step took.
if [ "$dry_run" = 1 ]; then
  # one pytest for the tier and one precision for the overhead: the same code paths, half the processes
  tier_steps=("cuda-tier:engine host_work unreached lightning checkpoint compile nccl_contracts reduce_stream concurrency:60") overhead_precisions=(fp32)
  overhead_limit=60 offload_limit=60 nvme_limit=60 capacity_limit=60 zeropp_limit=30
  zeropp_args=(--device cpu --tiny)
  overhead_args=(--device cpu --n-layer 1 --n-embd 32 --n-head 2 --block-size 16 --batch-size 2 --warmup 0 --steps 1 --timeout 50)
  offload_args=(--device cpu --n-layer 2 --n-embd 64 --n-head 4 --block-size 32 --batch-size 2 --warmup 1 --steps 2)
  # one variant (the one that reads and writes the most): the pipeline, not a ratio (test_gpu_check_script.py judges those)
  nvme_args=(--device cpu --variants zero3_offload_nvme_params --n-layer 2 --n-embd 64 --n-head 4 --block-size 16
             --batch-size 2 --warmup 0 --steps 1 --timeout 50)
  # the CPU budget is the whole process (~300 MB of Python and torch): one try, over it, ends the search
  capacity_args=(--device cpu --memory-budget 100MB --n-layer 1 --n-embd 256 --n-head 4 --block-size 16 --batch-size 1 --variants zero3 --timeout 50)
else
  # NAME:MODULES:LIMIT: a step of its own per module, so one that runs out of time loses only its results
  # zeropp (15 s, for ~8 s expected: torch and CUDA start, then 2 units x 46 kernel rounds of a few ms; not
  # yet timed on a GPU) took 5 s from each of the lightning tier (55 -> 50), compile (55 -> 50) and offload
  # (90 -> 85, its own --time-budget-s stays 60)
  tier_steps=("cuda-tier-engine:engine host_work unreached:40" "cuda-tier-lightning:lightning:50" "cuda-tier-checkpoint:checkpoint:35"
              "cuda-tier-compile:compile:50" "cuda-tier-nccl-contracts:nccl_contracts:35"
              "cuda-tier-reduce-stream:reduce_stream:35" "cuda-tier-concurrency:concurrency:75")
  overhead_precisions=(fp32 bf16-mixed) overhead_limit=45 offload_limit=85 nvme_limit=45 capacity_limit=45 zeropp_limit=15
  zeropp_args=()  # units of 50M and 200M bf16 elements, 8 ranks, int8, 100 Gb/s
  overhead_args=(--warmup 1 --steps 6 --timeout 40)  # the script's 124M GPT, 5 variants round-robin in one process
  offload_args=(--warmup 1 --steps 3 --time-budget-s 60)  # the default 1.2B GPT, bf16-mixed
  # a GPT of 8 x 1024 (101M parameters, 1.6 GB of fp32 states), 4 x 256 tokens: the optimizer step
  # streams 0.8 GB of moments (and 0.4 GB of chunks, read 3 times) per step through the local disk
  nvme_args=(--device cuda --variants zero3_offload,zero3_offload_nvme,zero3_offload_nvme_params --n-layer 8
             --n-embd 1024 --n-head 16 --block-size 256 --batch-size 4 --warmup 1 --steps 3 --timeout 40)
  # The budget caps the caching allocator (torch.cuda.set_per_process_memory_fraction, bench/budget.py;
  # the CUDA context is outside it), which also serves cuBLAS's workspaces: 32 MiB per thread and
  # stream on an H200 (sm90, torch's default), one for forward and one for autograd's backward
  # thread, 67 MB; ~85 MB with cuBLASLt's and the small tensors' 2 MiB segments. (Under 96 MB both
  # variants ran out of memory at 1 block asking for the second workspace.) So the blocks are wide
  # and the batch large, for a block's cost to stand well apart from that fixed part and from what
  # is only estimated: a block of 12.6M parameters (GPT 1024 wide: 202 MB of DDP's fp32
  # states, 50 MB as one gathered unit) and 134 MB of activations at 8 x 256 tokens (bench/footprint.py
  # counts them). That leaves ~665 MB of the 750: DDP needs ~400 MB at 1 block and 730-770 at 2
  # (fits 1); zero3_offload 19 MB + 134 MB a block + 240-320 MB of gathered units, pool buffers and
  # backward's temporaries: 560-630 at 2 blocks, ~700 at 3, ~830 at 4 (fits 2, 3 at most). So 2
  # tries for DDP (1, 2) and 4 for zero3_offload (1, 2, 4, 3), each in fresh processes
  # (bench/capacity.py), a few seconds each on the H200 (2 tries took 10 s with the bench's start).
  capacity_args=(--device cuda --memory-budget 750MB --n-embd 1024 --n-head 16 --block-size 256 --batch-size 8
                 --variants ddp,zero3_offload --timeout 25)
fi

run_step() {  # NAME LIMIT_S COMMAND...: run COMMAND for at most LIMIT_S seconds, its output in logs/NAME.log
  local name=$1 limit=$2 start=$SECONDS status
  shift 2
  echo "== $name (at most $limit s): $*"
  if command -v timeout >/dev/null; then
    timeout --kill-after=5 "$limit" "$@" >"$detail/logs/$name.log" 2>&1
  else
    "$@" >"$detail/logs/$name.log" 2>&1
  fi
  status=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" $((SECONDS - start)) "$limit" >>"$detail/steps.tsv"
  if [ "$status" = 0 ]; then
    echo "   ok in $((SECONDS - start)) s"
  else
    echo "   FAILED (exit $status) in $((SECONDS - start)) s; the end of detail/logs/$name.log:"
    tail -n 12 "$detail/logs/$name.log" | sed 's/^/   | /'
  fi
}

check() {
  local flags=() entry name modules limit files module precision failed
  [ "$dry_run" = 1 ] && flags=(--dry-run)
  "$python" scripts/gpu_summary.py versions "$detail" ${flags[@]+"${flags[@]}"} || echo "(the versions could not be read)"
  for entry in "${tier_steps[@]}"; do
    IFS=: read -r name modules limit <<<"$entry"
    files=()
    for module in $modules; do files+=("tests/test_cuda_$module.py"); done
    run_step "$name" "$limit" "$python" -m pytest -q -p no:cacheprovider -m cuda "${files[@]}" --junitxml "$detail/$name.xml"
  done
  for precision in "${overhead_precisions[@]}"; do
    run_step "overhead-$precision" "$overhead_limit" env OVERHEAD_PRECISIONS="$precision" PYTHON="$python" \
      bash scripts/overhead_gpu.sh "$detail/overhead" "${overhead_args[@]}"
  done
  run_step offload "$offload_limit" "$python" scripts/offload_gpu.py "${offload_args[@]}" --search-sizes "" \
    --out "$detail/offload_gpu.json"
  nvme_files=$(mktemp -d)  # the disk the check runs on, as a user's nvme_path would be; not under $OUT
  run_step nvme "$nvme_limit" "$python" -m lightning_zero bench --devices 1 --nvme-path "$nvme_files" \
    "${nvme_args[@]}" --out "$detail/nvme"
  rm -rf "$nvme_files"
  run_step capacity "$capacity_limit" "$python" -m lightning_zero bench --capacity model --devices 1 \
    "${capacity_args[@]}" --out "$detail/capacity"
  run_step zeropp "$zeropp_limit" "$python" scripts/zeropp_gpu.py ${zeropp_args[@]+"${zeropp_args[@]}"} \
    --out "$detail/zeropp_gpu.json"
  "$python" scripts/gpu_summary.py summary "$out" ${flags[@]+"${flags[@]}"}
  failed=$(awk -F'\t' '$2 != 0' "$detail/steps.tsv" | wc -l)
  if [ "$pack" = 1 ]; then
    tar -czf "$out/detail.tar.gz" -C "$out" detail && rm -rf "$detail"
  fi
  echo "$failed step(s) failed; summary: $out/summary.md"
  [ "$failed" -eq 0 ]
}

rm -rf "$detail" "$out/detail.tar.gz"
mkdir -p "$detail/logs"
check 2>&1 | tee "$out/gpu-check.log"
exit "${PIPESTATUS[0]}"
