"""Where a step's host time goes, phase by phase, for DDP and the engine at stages 1-3.

The benchmark's launch-bound shape (12 blocks x 64 wide, batch 1 x 32: the step is host time, the
CPU's stand-in for a fast GPU) at world size 1 on the sharded path of N >= 2 ranks
(``LIGHTNING_ZERO_COLLECTIVES_AT_ONE_RANK=path``, as the benchmark runs it), one thread. Every
variant is stepped in turn in the same process (as ``--paired``), each call of the step timed on
its own; prints the median of each phase over the rounds after the warm-up, in ms.

    PYTHONPATH=src python scripts/step_phases.py [--rounds 60] [--warmup 10]

DDP here keeps its own gradients (no ``gradient_as_bucket_view``), as a Lightning user's DDP does;
the benchmark's DDP uses bucket views, which makes its backward cheaper.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.comm.collectives import COLLECTIVES_AT_ONE_RANK
from lightning_zero.models.gpt import GPT, GPTConfig

LAUNCH_BOUND = GPTConfig(n_layer=12, n_embd=64, n_head=4, block_size=32)
Phase = tuple[str, Callable[[dict], None]]


def phases(stage: int, idx: torch.Tensor, targets: torch.Tensor) -> list[Phase]:
    """The step of DDP (``stage`` 0) or the engine at ``stage``, as named calls sharing a dict."""
    torch.manual_seed(0)
    model = GPT(LAUNCH_BOUND)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if stage == 0:
        ddp = nn.parallel.DistributedDataParallel(model)
        return [
            ("forward", lambda s: s.__setitem__("loss", ddp(idx, targets)[1])),
            ("backward", lambda s: s["loss"].backward()),
            ("optimizer", lambda s: optimizer.step()),
            ("zero_grad", lambda s: optimizer.zero_grad()),
        ]
    # stage 3 with the GPU's setting for the unit tags, as the benchmark (one read per backward)
    config = ZeroConfig(stage=stage, check_units_every_gather=False) if stage == 3 else ZeroConfig(stage=stage)
    engine = ZeroEngine(model, [optimizer], config)
    return [
        ("begin_step", lambda s: engine.begin_step()),
        ("forward", lambda s: s.__setitem__("loss", model(idx, targets)[1])),
        ("backward", lambda s: s["loss"].backward()),
        ("finish_backward", lambda s: engine.finish_backward()),
        ("end_step", lambda s: engine.end_step()),
        ("optimizer", lambda s: optimizer.step()),
        ("write_back", lambda s: engine.after_optimizer_step(optimizer)),
        ("zero_grad", lambda s: optimizer.zero_grad()),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ[COLLECTIVES_AT_ONE_RANK] = "path"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        idx, targets = torch.randint(0, 256, (1, 32)), torch.randint(0, 256, (1, 32))
        variants = {stage: phases(stage, idx, targets) for stage in (0, 1, 2, 3)}
        times: dict[int, dict[str, list[float]]] = {stage: {} for stage in variants}
        for round_ in range(args.rounds):
            for stage, steps in variants.items():
                shared: dict = {}
                for name, call in steps:
                    start = time.perf_counter()
                    call(shared)
                    if round_ >= args.warmup:
                        times[stage].setdefault(name, []).append(time.perf_counter() - start)
        dist.destroy_process_group()
    for stage, by_phase in times.items():
        medians = {name: statistics.median(values) * 1e3 for name, values in by_phase.items()}
        label = "ddp" if stage == 0 else f"zero{stage}"
        print(f"{label:6} {sum(medians.values()):6.2f} ms  " + "  ".join(f"{name} {ms:.2f}" for name, ms in medians.items()))


if __name__ == "__main__":
    main()
