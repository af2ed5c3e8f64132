"""What the fused host step buys, and what it costs in exactness (issue 62, item 6).

With CPU offload the optimizer steps each rank's fp32 chunks on the host. ``fused_host_step=True``
switches Adam/AdamW/SGD/Adagrad to torch's fused CPU kernel; ``False`` keeps the kernel the user
configured, whose arithmetic is DDP's (a plain ``AdamW()`` runs the per-tensor loop on CPU tensors,
``foreach=True`` the same arithmetic one op at a time over the list). This script measures, in one
process and interleaved (so a busy machine slows every kernel alike):

1. **speed**: one AdamW step over the chunks one rank steps, for the bench's default GPT (N=2) and
   for the 1.2B GPT of ``scripts/offload_gpu.py`` (24 x 2048) sharded over 8 ranks, with each kernel:
   fused, the user's default (for-loop on the CPU), and foreach; median of ``--repeats``;
2. **drift**: the bench's GPT trained on one rank's data by the same AdamW with each kernel from the same
   weights and batches, the largest weight difference to the exact (for-loop) run after each of
   ``--drift-steps`` steps. Training feeds a kernel's rounding back through the gradients, so this is
   the drift a user sees, not one step's rounding.

usage: PYTHONPATH=src python scripts/fused_host_step.py [--repeats 5] [--drift-steps 1,3,10,30]
       [--skip-large] [--threads T] [--out fused_host_step.json]
It prints a markdown table and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lightning_zero.models.gpt import GPT, GPTConfig

KERNELS = {"fused": dict(fused=True, foreach=False), "for-loop": dict(foreach=False), "foreach": dict(foreach=True)}
"""The AdamW kernels compared; "for-loop" is what a plain `AdamW(...)` runs on CPU tensors."""
BENCH_GPT = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=384, dropout=0.0)
"""`lightning-zero bench`'s default shape (src/lightning_zero/bench/options.py)."""
LARGE_GPT = GPTConfig(vocab_size=256, block_size=1024, n_layer=24, n_head=16, n_embd=2048, dropout=0.0)
"""`scripts/offload_gpu.py`'s 1.2B GPT."""


def chunk_sizes(config: GPTConfig, ranks: int) -> list[int]:
    """Elements of each parameter's chunk on one of ``ranks`` ranks (rounded up, as padded chunks are)."""
    with torch.device("meta"):
        model = GPT(config)
    return [-(-p.numel() // ranks) for p in model.parameters()]


def time_steps(sizes: list[int], repeats: int) -> dict[str, float]:
    """Median seconds of one AdamW step over fp32 tensors of ``sizes`` per kernel, interleaved."""
    torch.manual_seed(0)
    runs = {}
    for name, kernel in KERNELS.items():
        params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
        for p in params:
            p.grad = torch.randn(n) if (n := p.numel()) else None
        optimizer = torch.optim.AdamW(params, lr=1e-4, **kernel)
        optimizer.step()  # the state is allocated here, as in a run's first step
        runs[name] = (optimizer, [])
    for _ in range(repeats):
        for name, (optimizer, times) in runs.items():
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, (_, times) in runs.items()}


def drift(steps: list[int], batch_size: int = 4) -> dict[str, list[float]]:
    """The bench GPT trained by each kernel from the same start on the same batches: the largest
    |weight - exact run's weight| after each of ``steps`` steps."""
    torch.manual_seed(0)
    start = GPT(BENCH_GPT).state_dict()
    data = torch.randint(0, BENCH_GPT.vocab_size, (max(steps), batch_size, BENCH_GPT.block_size + 1))
    weights: dict[str, dict[int, list[torch.Tensor]]] = {}
    for name, kernel in KERNELS.items():
        model = GPT(BENCH_GPT)
        model.load_state_dict(start)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **kernel)
        weights[name] = {}
        for step in range(1, max(steps) + 1):
            batch = data[step - 1]
            _, loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step in steps:
                weights[name][step] = [p.detach().clone() for p in model.parameters()]
    exact = weights["for-loop"]
    return {
        name: [max((a - b).abs().max().item() for a, b in zip(weights[name][s], exact[s])) for s in steps]
        for name in KERNELS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--drift-steps", default="1,3,10,30")
    parser.add_argument("--skip-large", action="store_true", help="leave out the 1.2B GPT's chunks (2.4 GB of host memory)")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own)")
    parser.add_argument("--out", default="fused_host_step.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = sorted({int(s) for s in args.drift_steps.split(",")})
    shapes = {"bench GPT (22M), N=2": (BENCH_GPT, 2)}
    if not args.skip_large:
        shapes["1.2B GPT, N=8"] = (LARGE_GPT, 8)
    result = {"threads": torch.get_num_threads(), "torch": torch.__version__, "speed": {}, "drift_steps": steps}
    for label, (config, ranks) in shapes.items():
        sizes = chunk_sizes(config, ranks)
        result["speed"][label] = dict(elements=sum(sizes), tensors=len(sizes), **time_steps(sizes, args.repeats))
    result["drift"] = drift(steps)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"torch {result['torch']}, {result['threads']} threads; AdamW step (median of {args.repeats}):\n")
    print("| chunks one rank steps | elements | fused | for-loop (default) | foreach | for-loop / fused |")
    print("|---|--:|--:|--:|--:|--:|")
    for label, row in result["speed"].items():
        print(
            f"| {label} | {row['elements']:,} | {row['fused'] * 1e3:.1f} ms | {row['for-loop'] * 1e3:.1f} ms |"
            f" {row['foreach'] * 1e3:.1f} ms | {row['for-loop'] / row['fused']:.2f} |"
        )
    print(f"\nlargest |w - exact w| after {', '.join(map(str, steps))} steps (bench GPT, AdamW lr 1e-3):\n")
    print("| kernel | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|" + "--:|" * len(steps))
    for name, values in result["drift"].items():
        print(f"| {name} | " + " | ".join(f"{v:.2e}" for v in values) + " |")


if __name__ == "__main__":
    main()
