"""All-gather traffic per optimizer step of a frozen base under gradient accumulation, with and
without stage 3's ``keep_frozen_units_mb`` (issue 64, item 2).

The model is the example GPT (``lightning_zero.models.gpt``) with every weight frozen and a trainable
low-rank adapter before each block (LoRA's shape, the adapters being units of their own, so that each
block is an all-frozen unit whose output needs a gradient: its weights are gathered in forward and in
backward). Two CPU ranks on gloo run ``--steps`` optimizer steps of ``--micro-batches`` micro-batches
each, the way the strategies drive the engine, for each budget: 0 (regather per use, the default),
room for half the blocks, and ``inf`` (every all-frozen unit). Per optimizer step it reports the
all-gathers issued (calls and MiB, from the engine's collective counter), the frozen units' full
weights kept at the end of the first micro-batch (``memory_report().kept_frozen_units``) and the
median wall time of a step after the first, and checks that every budget trains to bitwise the same
weights.

usage: PYTHONPATH=src python scripts/bench_frozen_gathers.py [--micro-batches 4] [--steps 3]
       [--layers 6] [--width 256]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_zero.models.adapter import Adapter
from lightning_zero.models.gpt import GPT, GPTConfig

MiB = 2**20


class AdaptedGPT(nn.Module):
    """The GPT, frozen, with an adapter before each of its blocks."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(config).requires_grad_(False)
        self.adapters = nn.ModuleList(Adapter(config.n_embd, rank=8) for _ in range(config.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        gpt = self.gpt
        x = gpt.wte(idx) + gpt.wpe(torch.arange(idx.shape[1]))  # (B, T, C)
        for adapter, block in zip(self.adapters, gpt.blocks):
            x = block(adapter(x))
        logits = gpt.lm_head(gpt.ln_f(x))  # (B, T, V)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _run(rank: int, world_size: int, port: int, args: argparse.Namespace, budgets: dict, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS

    config = GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.width)
    results, weights = {}, {}
    for label, budget_mb in budgets.items():
        torch.manual_seed(0)
        model = AdaptedGPT(config)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, keep_frozen_units_mb=budget_mb))
        data = torch.Generator().manual_seed(rank)
        calls, nbytes, seconds, kept = [], [], [], 0
        for step in range(args.steps):
            COLLECTIVE_STATS.reset()
            start = time.perf_counter()
            for micro in range(args.micro_batches):
                engine.sync_gradients = micro == args.micro_batches - 1
                tokens = torch.randint(0, config.vocab_size, (4, config.block_size + 1), generator=data)
                engine.begin_step()
                loss = model(tokens[:, :-1], tokens[:, 1:])
                engine.before_backward()
                loss.backward()
                engine.finish_backward()
                engine.end_step()
                if micro == 0:
                    kept = engine.memory_report().kept_frozen_units
            optimizer.step()
            engine.after_optimizer_step(optimizer)
            optimizer.zero_grad()
            seconds.append(time.perf_counter() - start)
            calls.append(COLLECTIVE_STATS.calls["all_gather"])
            nbytes.append(COLLECTIVE_STATS.bytes["all_gather"])
        weights[label] = engine.full_state_dict(model)
        engine.close()
        results[label] = dict(calls=calls[-1], mib=nbytes[-1] / MiB, kept_mib=kept / MiB, step_s=statistics.median(seconds[1:] or seconds))
    first = next(iter(weights.values()))
    bitwise = all(all(torch.equal(first[k], w[k]) for k in first) for w in weights.values())
    if rank == 0:
        out.update(results=results, bitwise=bitwise)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.width)
    block_mib = sum(p.numel() * p.element_size() for p in GPT(config).blocks[0].parameters()) / MiB
    half = args.layers // 2
    budgets = {"0 (default)": 0.0, f"{half * block_mib + 0.01:.2f} MiB ({half} blocks)": half * block_mib + 0.01, "inf": math.inf}
    world_size, port = 2, 29500 + os.getpid() % 1000
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_run, args=(world_size, port, args, budgets, out), nprocs=world_size)
        results, bitwise = dict(out["results"]), out["bitwise"]
    print(
        f"GPT {args.layers} x {args.width} (each block {block_mib:.2f} MiB fp32, frozen; an adapter before each),"
        f" 2 CPU ranks (gloo), {args.micro_batches} micro-batches per optimizer step; figures of step {args.steps}, rank 0"
    )
    print("| keep_frozen_units_mb | all-gathers / step | all-gather MiB / step | kept MiB (mid-step) | s / step (median) |")
    print("|---|---|---|---|---|")
    for label, r in results.items():
        print(f"| {label} | {r['calls']} | {r['mib']:.2f} | {r['kept_mib']:.2f} | {r['step_s']:.3f} |")
    print(f"bitwise the same weights after {args.steps} steps with every budget: {bitwise}")


if __name__ == "__main__":
    main()
