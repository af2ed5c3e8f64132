"""Device memory and step time of ZeRO-3 with and without CPU offload on one device.

The check issue 6 asks for on a lent GPU (``--device cuda``); it runs on the CPU too, where host and
device memory are the same and only the code path is exercised. One process, world size 1: offload
is what lets a single device train a model larger than its memory.

    python scripts/offload_one_device.py --device cuda --n-layer 24 --n-embd 2048 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.gradients.norms import clip_grads_by_global_norm_
from lightning_zero.models.gpt import GPT, GPTConfig

VARIANTS = {
    "zero3": ZeroConfig(stage=3),
    "zero3_offload": ZeroConfig(stage=3, offload_optimizer=True, offload_params=True),
    # the host step after backward, as before issue 53 (the comparison for the step during backward)
    "zero3_offload_after_backward": ZeroConfig(stage=3, offload_optimizer=True, offload_params=True, overlap_host_step=False),
    # torch's fused CPU kernel for the host step: faster there, not DDP's rounding (host_step.py)
    "zero3_offload_fused": ZeroConfig(stage=3, offload_optimizer=True, offload_params=True, fused_host_step=True),
}


def timed_step(
    engine: ZeroEngine, model: GPT, optimizer: torch.optim.Optimizer, data: torch.Tensor, amp=None, clip_norm: Optional[float] = None
) -> tuple[float, float]:
    """One training step through the engine API (under ``amp`` when given; ``clip_norm``: gradients
    clipped by their global norm before the step, as Lightning's ``gradient_clip_val``): seconds, loss."""
    start = time.perf_counter()
    engine.begin_step()
    with amp if amp is not None else contextlib.nullcontext():
        _, loss = model(data[:, :-1], data[:, 1:])
    loss.backward()
    engine.finish_backward()
    engine.end_step()
    if clip_norm is not None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grads_by_global_norm_(params, clip_norm, data.device, group=engine.group)
    optimizer.step()
    engine.after_optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    if data.device.type == "cuda":
        torch.cuda.synchronize(data.device)
    return time.perf_counter() - start, loss.item()


def measure(config: ZeroConfig, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused or None)
    engine = ZeroEngine(model, [optimizer], config, device=device)
    data = torch.randint(0, 256, (args.batch_size, args.block_size + 1), device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        seconds, loss = timed_step(engine, model, optimizer, data)
        times.append(seconds)
        losses.append(loss)
    report = engine.memory_report()
    engine.close()
    return {
        "params": sum(p.layout.numel for p in engine.params),
        "median_step_s": statistics.median(times[args.warmup :]),
        "peak_device_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "model_state_device_bytes": report.device.total,
        "model_state_host_bytes": report.host.total,
        # offload keeps each bucket's gradient row on the host for good, also between steps
        "host_gradient_bytes": report.host.gradients,
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fused", action="store_true", help="fused AdamW (the CPU step of the offloaded run)")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        results = {name: measure(config, args) for name, config in VARIANTS.items()}
    finally:
        dist.destroy_process_group()
    text = json.dumps({"device": args.device, "args": vars(args), "results": results}, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
