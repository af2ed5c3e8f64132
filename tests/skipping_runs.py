"""Training runs in which ranks skip different blocks of a model in their backward, at the engine
level against torch DDP (``find_unused_parameters``): the schedules of skips and the run itself,
shared by ``test_reliability.py`` (gloo) and ``test_nccl_semantics.py`` (the same runs under NCCL's
contracts)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from case_groups import RankContext

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
"""Far above any step here, far below gloo's default 30 minutes: a hang becomes an error."""
STEPS = 3


class SkippingStack(torch.nn.Module):
    """Blocks on a residual stream between a tied embedding and head: the GPT's (``gpt=True``) or
    ``TiedMLPStack``'s, cheaper per step. Its forward runs the same modules on every rank but drops
    the output of the blocks in ``skip`` (the stream goes on from their input), so those get no
    gradient on that rank."""

    def __init__(self, blocks: int, gpt: bool) -> None:
        from lightning_helpers import TiedMLPStack

        from lightning_zero.models.gpt import GPT, GPTConfig

        super().__init__()
        self.gpt = gpt
        config = GPTConfig(vocab_size=32, block_size=8, n_layer=blocks, n_head=2, n_embd=16)
        self.model = GPT(config) if gpt else TiedMLPStack(vocab=32, width=16, depth=blocks)

    def forward(self, tokens: torch.Tensor, skip: frozenset) -> torch.Tensor:
        m, idx, targets = self.model, tokens[:, :-1], tokens[:, 1:]
        x = m.wte(idx) + m.wpe(torch.arange(idx.shape[1])) if self.gpt else m.wte(idx)
        for i, block in enumerate(m.blocks):
            out = block(x) if self.gpt else x + block(x)
            x = x if i in skip else out
        logits = m.lm_head(m.ln_f(x)) if self.gpt else m.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


Schedule = list[tuple[torch.Tensor, frozenset]]
"""Each step's batch on this rank and the blocks this rank skips."""


def block_6_from_step_2(rank: int) -> Schedule:
    """The issue's reproduction (8 blocks): from the second step rank 1 feeds block 7 with block 5's
    output, so block 6 gets no gradient there while blocks 0-5 still do."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randint(0, 32, (2, 9), generator=g), frozenset({6} if rank == 1 and step >= 1 else ())) for step in range(STEPS)]


RANDOM_STEPS, RANDOM_BLOCKS = 52, 6


def random_skips(rank: int) -> Schedule:
    """Blocks skipped at random, drawn per rank and per step (seeded; each block with a probability
    itself drawn per rank and step): top, middle, bottom, several, none or all, mostly different on
    each rank."""
    import random

    rng, g = random.Random(25), torch.Generator().manual_seed(1000 + rank)

    def draw() -> frozenset:
        p = rng.choice((0.0, 0.25, 0.5, 0.9))
        return frozenset(b for b in range(RANDOM_BLOCKS) if rng.random() < p)

    skips = [[draw() for _ in range(2)] for _ in range(RANDOM_STEPS)]
    return [(torch.randint(0, 32, (2, 9), generator=g), per_rank[rank]) for per_rank in skips]


def engine_or_ddp_run(
    ctx: RankContext,
    strategy: str,
    schedule: Any,
    blocks: int,
    gpt: bool,
    pretrained_before: int = -1,
    timeout: timedelta = COLLECTIVE_TIMEOUT,
    **options: Any,
) -> dict:
    """Every step's loss and the final weights of torch DDP (``find_unused_parameters``) or the
    engine at a stage (buckets of ~one block at stage 2, so more are ready than may be in flight),
    trained over ``schedule(rank)``. Before step ``pretrained_before``, every parameter's ``.data``
    is assigned another model's weights (at stage 3, parameters at rest)."""
    import torch.distributed as dist

    from lightning_zero.engine import ZeroConfig, ZeroEngine

    if not dist.is_initialized():  # else made by a Trainer in an earlier case
        dist.init_process_group("gloo", timeout=timeout)
    torch.manual_seed(1)
    pretrained = SkippingStack(blocks, gpt).state_dict()
    torch.manual_seed(0)
    model = SkippingStack(blocks, gpt)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if strategy == "ddp":
        engine, forward = None, torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    else:
        config = ZeroConfig(stage=int(strategy[-1]), bucket_size_mb=2e-3 if gpt else 1.3e-3, **options)
        engine, forward = ZeroEngine(model, [optimizer], config, timeout=timeout), model
    losses = []
    for step, (tokens, skip) in enumerate(schedule(ctx.rank)):
        if step == pretrained_before:
            for name, p in model.named_parameters():
                p.data = pretrained[name].clone()
        if engine is not None:
            engine.begin_step()
        loss = forward(tokens, skip)
        loss.backward()
        if engine is not None:
            engine.finish_backward()
            engine.end_step()
        optimizer.step()
        if engine is not None:
            engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()
        losses.append(loss.detach())
    if engine is None:
        return {"losses": torch.stack(losses), "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    weights = engine.full_state_dict(model)
    engine.release_parameters(torch.device("cpu"))
    return {"losses": torch.stack(losses), "weights": weights, "buckets": len(engine.buckets)}
