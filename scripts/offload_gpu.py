"""Issue 12's GPU check: CPU offload at the speed of the CPU optimizer, on one GPU.

At world size 1, with the engine API directly, bf16-mixed (autocast, fp32 parameters) and the user's
plain ``torch.optim.AdamW(model.parameters(), lr=1e-4)``:

1. step time of ``zero3`` and of ``zero3_offload`` (optimizer and parameter chunks on the host) for
   a 1.2B GPT (24 x 2048, batch 8 x 1024), the median of a few steps after warm-up; ``zero3_offload``
   four ways: the host step during backward (the default, issue 53), the same with clipping by
   norm 1.0 (a step where it applies is rolled back and redone), the host step after backward, and
   the host step with torch's fused CPU kernel (``fused_host_step=True``, issue 62);
2. the CPU optimizer step alone over fp32 host tensors of the model's sizes, gradients set, with
   the user's AdamW kernel (the default host step's) and with the fused one; target (issue 53):
   each zero3_offload variant <= 1.25 x max(zero3 step, its kernel's CPU step), each variant's
   share of zero3's speed and of the host step that ran before backward ended;
3. the device model state of zero3_offload (``engine.memory_report().device.total``; target 0 B);
4. the largest GPT (n_layer grown at n_embd 2048) that trains 3 steps under zero3_offload, each try
   in a child process (a host out-of-memory kill ends the child, not the check), next to the
   estimator's prediction for the GPU's memory and the host's (``lightning_zero.estimate``).

It prints timings as it goes, then one JSON summary and a markdown table, and writes the JSON to
``$OUT/offload_gpu.json`` (or ``--out``). The whole check keeps to ``--time-budget-s`` (default 240 s, then the report):
the search starts no try it cannot finish. On CPU (``--device cpu``, tiny sizes) it exercises the
same code, which is what CI runs::

    PYTHONPATH=src python scripts/offload_gpu.py
    python scripts/offload_gpu.py --device cpu --n-layer 2 --n-embd 64 --n-head 4 --block-size 32 \\
        --batch-size 2 --steps 2 --search-sizes ''
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from lightning_zero import estimate as est
from lightning_zero import sizing
from lightning_zero.engine import ZeroConfig, ZeroEngine, ZeroStage
from lightning_zero.estimate_schemes import SCHEMES, Layout
from lightning_zero.models.gpt import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload_one_device import VARIANTS, timed_step  # noqa: E402  (shared with issue 6's check)

RATIO_TARGET = 1.25
"""zero3_offload step <= 1.25 x max(zero3 step, CPU optimizer step alone): the host step during
backward hides the shorter of the two (issue 53; before it, the target was 1.25 x their sum)."""

OFFLOAD_VARIANTS = {
    # name: (engine config, clip_norm): the step during backward (default), with clipping by norm,
    # and the host step after backward (as before issue 53)
    "zero3_offload": ("zero3_offload", None),
    "zero3_offload_clip": ("zero3_offload", 1.0),
    "zero3_offload_after_backward": ("zero3_offload_after_backward", None),
    "zero3_offload_fused": ("zero3_offload_fused", None),
}
FUSED_VARIANTS = ("zero3_offload_fused",)
"""The variants whose host step is torch's fused CPU kernel: their floor is the fused step's."""

OFFLOAD_LAYOUT = Layout(ZeroStage.PARAMETERS, offload_optimizer=True, offload_params=True)
SCHEME = SCHEMES["fp32"]
"""bf16-mixed keeps fp32 model states (autocast casts activations), and so does 32-true."""

START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", flush=True)


# ---- one rank, one model ----------------------------------------------------------------------


def init_single_rank(device: torch.device) -> None:
    store = os.path.join(tempfile.mkdtemp(), "store")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


def gpt_config(args: argparse.Namespace, n_layer: int) -> GPTConfig:
    return GPTConfig(block_size=args.block_size, n_layer=n_layer, n_head=args.n_head, n_embd=args.n_embd)


def gpt_params(args: argparse.Namespace, n_layer: int) -> int:
    with torch.device("meta"):
        return GPT(gpt_config(args, n_layer)).num_parameters()


def free_memory(device: torch.device) -> None:
    """Give back what the last run cached: the device's and torch's pinned host blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)  # pinned blocks torch keeps for reuse
        if host_empty_cache is not None:
            host_empty_cache()


def pinned_bytes(device: torch.device) -> Optional[int]:
    """Bytes torch's caching host allocator holds pinned (each block rounded up to a power of two)."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except Exception:  # an older torch without the statistic
        return None


def train(
    config: ZeroConfig, n_layer: int, batch_size: int, steps: int, args: argparse.Namespace, clip_norm: Optional[float] = None
) -> dict:
    """Build a GPT on the meta device and train ``steps`` steps; timings, losses and memory. The
    engine materializes it unit by unit on the device with each layer's ``reset_parameters()`` (as
    under Lightning's ``configure_model``), so no model ever exists whole on the host; the values
    differ from GPT-2's init (hence the high losses), which timings and memory do not depend on."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(gpt_config(args, n_layer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = ZeroEngine(model, [optimizer], config, device=device)
    data = torch.randint(0, 256, (batch_size, args.block_size + 1), device=device)  # (B, T + 1) bytes
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16-mixed" else nullcontext()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    try:
        for step in range(steps):
            seconds, loss = timed_step(engine, model, optimizer, data, amp, clip_norm)
            times.append(seconds)
            losses.append(loss)
            log(f"  {n_layer} layers, step {step}: {times[-1]:.3f} s, loss {losses[-1]:.4f}")
        report = engine.memory_report()
        host_steps = engine.host_step_report()
        return {
            "host_step": None if host_steps is None else {
                "ahead": host_steps.ahead, "redone": host_steps.redone, "after_backward": host_steps.after_backward,
                "reasons": host_steps.reasons, "rollback_bytes": host_steps.rollback_bytes,
                "last_overlap": host_steps.last.overlap if host_steps.last else None,
                "last_host_step_s": host_steps.last.host_step_s if host_steps.last else None,
            },  # fmt: skip
            "params": sum(p.layout.numel for p in engine.params),
            "step_times_s": times,
            "losses": losses,
            "model_state_device_bytes": report.device.total,
            "model_state_host_bytes": report.host.total,
            "comm_buffer_bytes": report.comm_buffers,
            "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "pinned_host_bytes": pinned_bytes(device),
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
    finally:
        engine.close()


def measure_variant(name: str, args: argparse.Namespace) -> dict:
    log(f"{name}: {args.n_layer} x {args.n_embd}, batch {args.batch_size} x {args.block_size}, {args.precision}")
    config_name, clip_norm = OFFLOAD_VARIANTS.get(name, (name, None))
    try:
        result = train(VARIANTS[config_name], args.n_layer, args.batch_size, args.warmup + args.steps, args, clip_norm)
    except Exception as error:  # report it with the rest; main() exits non-zero
        log(f"{name} FAILED: {type(error).__name__}: {error}")
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        free_memory(torch.device(args.device))
    result["median_step_s"] = statistics.median(result["step_times_s"][args.warmup :])
    log(f"{name}: median step {result['median_step_s']:.3f} s")
    return result


def time_cpu_adamw(numels: list[int], args: argparse.Namespace, fused: bool = False) -> dict:
    """The host's share of an offloaded step, alone: CPU AdamW over fp32 tensors of the model's
    parameter sizes (the engine steps each parameter's chunk), gradients set; the user's plain
    ``AdamW`` (the default host step's kernel) or, with ``fused``, torch's fused CPU kernel."""
    kernel = "fused" if fused else "as configured"
    log(f"CPU AdamW ({kernel}) over {sum(numels):,} fp32 elements, {torch.get_num_threads()} threads")
    params = [torch.nn.Parameter(torch.full((n,), 0.1)) for n in numels]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = torch.optim.AdamW(params, lr=1e-4, **(dict(fused=True) if fused else {}))
    times = []
    for step in range(args.warmup + args.steps):  # the first step allocates the moments
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
        log(f"  CPU AdamW step {step}: {times[-1]:.3f} s")
    del params, optimizer
    gc.collect()
    return {"elements": sum(numels), "threads": torch.get_num_threads(), "step_times_s": times,
            "median_step_s": statistics.median(times[args.warmup :])}


# ---- the largest model ------------------------------------------------------------------------


def read_meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (psutil may be missing); empty where there is no such file."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return values


def predict(args: argparse.Namespace, gpu_memory: int, host_memory: int, num_params: int) -> dict:
    """The estimator's largest model for this GPU and host: with zero3_offload, and with the best
    layout; as parameters and as layers of this GPT's width. Also its bytes for the measured model."""
    base = gpt_params(args, 1)
    per_layer = gpt_params(args, 2) - base
    topology = est.Topology(devices=1)

    def as_dict(largest: sizing.LargestModel) -> dict:
        layers = (largest.num_params - base) // per_layer + 1 if largest.num_params >= base else 0
        return {
            "params": largest.num_params,
            "n_layer": layers,
            "layout": largest.estimate.layout.label if largest.estimate else None,
            "message": largest.message,
        }

    measured = est.estimate(num_params, OFFLOAD_LAYOUT, SCHEME, topology)
    return {
        "gpu_memory_bytes": gpu_memory,
        "host_memory_bytes": host_memory,
        "measured_model_zero3_offload": {
            "device_bytes": measured.device.total, "host_bytes": measured.host.total, "pinned_bytes": measured.pinned,
        },
        "zero3_offload": as_dict(sizing.largest_model(SCHEME, topology, gpu_memory, host_memory, layouts=[OFFLOAD_LAYOUT])),
        "best_layout": as_dict(sizing.largest_model(SCHEME, topology, gpu_memory, host_memory)),
    }


def try_size(n_layer: int, args: argparse.Namespace, timeout_s: float) -> dict:
    """Train ``n_layer`` layers for ``--search-steps`` steps under zero3_offload in a child process;
    its verdict, "ok" or why not."""
    command = [sys.executable, __file__, "--try-n-layer", str(n_layer)] + child_arguments(args)
    log(f"try {n_layer} layers ({gpt_params(args, n_layer):,} parameters), at most {timeout_s:.0f} s")
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"n_layer": n_layer, "status": "timeout", "seconds": time.perf_counter() - start}
    verdicts = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if verdicts:
        result = json.loads(verdicts[-1])
    elif done.returncode < 0:  # a signal; SIGKILL is what the kernel's out-of-memory killer sends
        result = {"status": "killed", "error": f"signal {-done.returncode} (host out of memory?)"}
    else:
        result = {"status": "error", "error": done.stderr[-2000:]}
    result.update(n_layer=n_layer, seconds=time.perf_counter() - start)
    log(f"  {n_layer} layers: {result['status']} in {result['seconds']:.1f} s")
    return result


def child_arguments(args: argparse.Namespace) -> list[str]:
    return [
        "--device", args.device, "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
        "--block-size", str(args.block_size), "--batch-size", str(args.search_batch_size),
        "--steps", str(args.search_steps), "--precision", args.precision,
    ]  # fmt: skip


def run_try(args: argparse.Namespace) -> None:
    """The child's side of `try_size`: one line ``RESULT {json}``."""
    device = torch.device(args.device)
    init_single_rank(device)
    try:
        result = train(VARIANTS["zero3_offload"], args.try_n_layer, args.batch_size, args.steps, args)
        result["status"] = "ok"
    except torch.cuda.OutOfMemoryError as error:
        result = {"status": "device out of memory", "error": str(error)[:500]}
    except (MemoryError, RuntimeError) as error:  # a failed pinned (page-locked) allocation
        text = str(error).lower()
        host_oom = isinstance(error, MemoryError) or "out of memory" in text or "can't allocate memory" in text
        status = "host out of memory" if host_oom else "error"
        result = {"status": status, "error": f"{type(error).__name__}: {str(error)[:500]}"}
    finally:
        dist.destroy_process_group()
    result["params"] = gpt_params(args, args.try_n_layer)
    print("RESULT " + json.dumps(result), flush=True)


def search_largest(args: argparse.Namespace, prediction: dict, deadline: float) -> dict:
    """The largest n_layer that trains, by bisection between one that does (the measured model) and
    one whose model states alone exceed the host (the prediction + 1), starting from a guess below
    the prediction; or the sizes of ``--search-sizes``, largest first. Stops at the deadline."""
    tries: list[dict] = []
    explicit = args.search_sizes not in ("auto", "")
    if args.search_sizes == "" or (not explicit and args.device != "cuda"):
        return {"tries": tries, "largest_ok": None, "smallest_failed": None,
                "skipped": "no sizes" if args.search_sizes == "" else "the automatic search needs a GPU"}
    # auto: `bad` starts where model states alone exceed the host, so it needs no try
    good, bad = args.n_layer, sys.maxsize if explicit else prediction["zero3_offload"]["n_layer"] + 1
    queue = sorted({int(s) for s in args.search_sizes.split(",")}, reverse=True) if explicit else None
    next_size = queue.pop(0) if explicit else max(good + 1, int(args.search_guess * (bad - 1)))
    slowest = 0.0
    while next_size is not None:
        left = deadline - time.perf_counter()
        if left < max(30.0, 1.2 * slowest):
            log(f"search stopped: {left:.0f} s left")
            break
        result = try_size(next_size, args, timeout_s=left - 5)
        tries.append(result)
        slowest = max(slowest, result["seconds"])
        if result["status"] == "ok":
            good = max(good, next_size)
        elif result["status"] != "timeout":
            bad = min(bad, next_size)
        else:
            break  # neither verdict, and no time for another
        if explicit:
            next_size = next((s for s in queue if s > good and s < bad), None)
            queue = [s for s in queue if s != next_size]
        else:
            next_size = (good + bad) // 2 if bad - good > max(1, good // 50) else None
    ok = [t for t in tries if t["status"] == "ok"]
    failed = [t for t in tries if t["status"] not in ("ok", "timeout")]
    return {
        "tries": tries,
        "largest_ok": max(ok, key=lambda t: t["n_layer"]) if ok else None,
        "smallest_failed": min(failed, key=lambda t: t["n_layer"]) if failed else None,
    }


# ---- the report -------------------------------------------------------------------------------


def summarize(args: argparse.Namespace, results: dict) -> dict:
    zero3, offload = results["zero3"], results["zero3_offload"]
    ratio, ratios = None, {}
    if "median_step_s" in zero3:
        def floor(name: str) -> float:
            cpu = results["cpu_adamw_fused" if name in FUSED_VARIANTS else "cpu_adamw"]
            return max(zero3["median_step_s"], cpu["median_step_s"])

        ratios = {name: results[name]["median_step_s"] / floor(name) for name in OFFLOAD_VARIANTS if "median_step_s" in results[name]}
        ratio = ratios.get("zero3_offload")
        for name in OFFLOAD_VARIANTS:
            if "median_step_s" in results[name]:
                results[name]["share_of_zero3_speed"] = zero3["median_step_s"] / results[name]["median_step_s"]
    device_state = offload.get("model_state_device_bytes")
    return {
        **results,
        "ratio": ratio,
        "ratios_to_max_of_zero3_and_cpu_step": ratios,
        "ratio_target": RATIO_TARGET,
        "ratio_met": None if ratio is None else ratio <= RATIO_TARGET,
        "offload_device_model_state_bytes": device_state,
        "device_model_state_met": None if device_state is None else device_state == 0,
        "elapsed_s": time.perf_counter() - START,
    }


def markdown_table(summary: dict) -> str:
    def seconds(result: dict) -> str:
        return f"{result['median_step_s']:.3f} s" if "median_step_s" in result else result.get("error", "—")

    def trained(entry: Optional[dict]) -> str:
        if not entry:
            return "—"
        text = f"{entry['n_layer']} layers, {sizing.format_count(entry['params'])} params"
        return text + (f" ({entry['status']})" if entry.get("status") not in (None, "ok") else "")

    prediction, search = summary["prediction"], summary["largest"]
    ratio = "—" if summary["ratio"] is None else f"{summary['ratio']:.2f}"
    state = summary["offload_device_model_state_bytes"]
    pinned = summary["zero3_offload"].get("pinned_host_bytes")
    pinned_estimate = sizing.format_bytes(prediction["measured_model_zero3_offload"]["pinned_bytes"])
    def overlap(result: dict) -> str:
        host_step = result.get("host_step") or {}
        shown = host_step.get("last_overlap")
        counts = f"ahead {host_step.get('ahead', 0)}, redone {host_step.get('redone', 0)}, after backward {host_step.get('after_backward', 0)}"
        return "—" if shown is None else f"{shown:.0%} of the host step before backward's end ({counts})"

    rows = [
        ("zero3 step", seconds(summary["zero3"]), ""),
        ("zero3_offload step (host step during backward)", seconds(summary["zero3_offload"]), overlap(summary["zero3_offload"])),
        ("zero3_offload step, clipping by norm 1.0", seconds(summary["zero3_offload_clip"]), overlap(summary["zero3_offload_clip"])),
        ("zero3_offload step, host step after backward", seconds(summary["zero3_offload_after_backward"]), ""),
        ("zero3_offload step, fused host step", seconds(summary["zero3_offload_fused"]), overlap(summary["zero3_offload_fused"])),
        ("CPU AdamW step alone (as configured: the default host step's kernel)", seconds(summary["cpu_adamw"]), ""),
        ("CPU AdamW step alone (fused)", seconds(summary["cpu_adamw_fused"]), ""),
        ("zero3_offload / max(zero3, CPU step)", ratio, f"≤ {RATIO_TARGET}"),
        *[(f"{name} / max(zero3, CPU step)", f"{value:.2f}", f"≤ {RATIO_TARGET}")
          for name, value in summary["ratios_to_max_of_zero3_and_cpu_step"].items() if name != "zero3_offload"],
        ("device model state, zero3_offload", "—" if state is None else sizing.format_bytes(state), "0 B"),
        ("pinned host memory, zero3_offload (torch's allocator)", "—" if pinned is None else sizing.format_bytes(pinned),
         f"estimator: {pinned_estimate} before rounding"),
        ("largest GPT trained, zero3_offload", trained(search["largest_ok"]), ""),
        ("smallest GPT that failed", trained(search["smallest_failed"]), ""),
        ("estimator's largest, zero3_offload", trained(prediction["zero3_offload"]), ""),
        (f"estimator's largest, best layout ({prediction['best_layout']['layout']})", trained(prediction["best_layout"]), ""),
    ]
    lines = ["| measure | value | target |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {target} |" for name, value, target in rows]
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=("bf16-mixed", "32-true"), default="bf16-mixed")
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--n-embd", type=int, default=2048)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (they allocate state)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps; the median is reported")
    parser.add_argument(
        "--search-sizes",
        default="auto",
        help="n_layer values to try for the largest model, comma-separated; 'auto' (default): bisect from "
        "the estimator's prediction (GPU only); '' skips the search",
    )
    parser.add_argument("--search-guess", type=float, default=0.85, help="'auto' tries this share of the prediction first")
    parser.add_argument("--search-batch-size", type=int, default=1)
    parser.add_argument("--search-steps", type=int, default=3)
    parser.add_argument(
        "--time-budget-s", type=float, default=240.0, help="seconds from start; the search starts no try it cannot end by then"
    )
    parser.add_argument("--out", help="write the JSON here (default: $OUT/offload_gpu.json when $OUT is set)")
    parser.add_argument("--try-n-layer", type=int, help=argparse.SUPPRESS)  # a search child (see try_size)
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.try_n_layer is not None:
        run_try(args)
        return 0
    device = torch.device(args.device)
    deadline = START + args.time_budget_s
    meminfo = read_meminfo()
    host_memory = meminfo.get("MemTotal", 0)
    if device.type == "cuda":
        gpu_memory = torch.cuda.get_device_properties(device).total_memory
    else:
        gpu_memory = host_memory  # one memory: the prediction only exercises the code
    environment = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "host_mem_total_bytes": host_memory,
        "host_mem_available_bytes": meminfo.get("MemAvailable"),
    }
    log(f"{environment}")
    results: dict = {"environment": environment, "args": vars(args)}
    with torch.device("meta"):
        numels = [p.numel() for p in GPT(gpt_config(args, args.n_layer)).parameters()]
    results["model"] = {"n_layer": args.n_layer, "n_embd": args.n_embd, "params": sum(numels)}

    init_single_rank(device)
    try:
        results["zero3"] = measure_variant("zero3", args)
        for name in OFFLOAD_VARIANTS:
            results[name] = measure_variant(name, args)
    finally:
        dist.destroy_process_group()
    results["cpu_adamw"] = time_cpu_adamw(numels, args)
    results["cpu_adamw_fused"] = time_cpu_adamw(numels, args, fused=True)
    results["prediction"] = predict(args, gpu_memory, host_memory, sum(numels))
    log(results["prediction"]["zero3_offload"]["message"])
    results["largest"] = search_largest(args, results["prediction"], deadline)

    summary = summarize(args, results)
    text = json.dumps(summary, indent=1)
    print(text)
    print(markdown_table(summary))
    out = args.out or (os.path.join(os.environ["OUT"], "offload_gpu.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(text)
        log(f"wrote {out}")
    failed = [name for name in ("zero3", *OFFLOAD_VARIANTS) if "error" in summary[name]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
