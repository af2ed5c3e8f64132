"""One stage-3 parameter's full value, gathered for a read at rest (see [Note: reads at rest] in
``shards/at_rest.py``).

A read is a collective over the shard group, so the ranks first agree that they are all reading the
same parameter: each posts the parameter's name for this read (the n-th read at rest of this
engine) in the process group's store and waits, up to the group's timeout, for every rank's post
(``collectives.post_and_collect``). The store is used rather than a collective so that a read made
on some ranks only fails on each rank that made it, naming the parameter, and leaves no collective
half-done in the groups that training goes on with. Once all agree, one all-gather of that
parameter's chunks, in place in one buffer of the full (padded) size, gives every reading rank the
full value; nothing else is gathered, and the buffer is the caller's (dropped after the read unless
the result is it). Ranks that read different parameters all fail, naming what each read.

What a read costs: a store round trip (one small write and a wait for the peers' writes) and one
all-gather of that parameter, and one full copy of it held for the read. A loop reading every
parameter one at a time holds one parameter at a time; one that keeps what it read (``[p.clone()
for p in model.parameters()]``) holds the whole model, as the user asked.
"""

from __future__ import annotations

import itertools
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.shards.sharded_param import ShardedParam

ChunkInMemory = Callable[[ShardedParam], AbstractContextManager]
"""A context in which ``param.shard`` can be read (its bucket read in from disk, where it lives there)."""

_ENGINES = itertools.count()
"""Engines made in this process (the same order on every rank): each reads under its own keys."""


class ReadsAtRest:
    """Full values of parameters at rest, for reads, over ``group`` (the engine's gather group).

    ``device``: where the full values are made (where the parameters compute); ``timeout``: how long
    a read waits for the other ranks to read too; ``in_memory``: see ``ChunkInMemory``;
    ``before_read``: what must finish before chunks are read (copies to the host in flight)."""

    def __init__(
        self,
        group: collectives.ProcessGroup,
        device: torch.device,
        timeout: Optional[timedelta],
        in_memory: ChunkInMemory,
        before_read: Callable[[], None],
    ) -> None:
        self._group = group
        self._device = device
        self._timeout = timeout or collectives.default_timeout()
        self._in_memory = in_memory
        self._before_read = before_read
        ranks = "-".join(map(str, collectives.group_ranks(group)))
        self._prefix = f"lightning_zero/reads_at_rest/{next(_ENGINES)}/{ranks}"
        self._count = 0
        """Reads at rest made so far on this rank: the n-th read of every rank pairs with the others' n-th."""

    def full_value(self, p: ShardedParam) -> Tensor:
        """``p``'s full value (its shape, its dtype, on the compute device), once every rank of the
        group reads it too; raises, naming ``p``, when they do not within the timeout or read another."""
        if collectives.world_size(self._group) > 1:
            self._agree_on(p)
        with torch.no_grad(), self._in_memory(p):
            self._before_read()
            return self._gathered(p)

    def _agree_on(self, p: ShardedParam) -> None:
        read = f"{self._prefix}/{self._count}"
        if self._count >= 2:  # every rank posted the read after it, so finished reading it
            collectives.forget_posts([f"{self._prefix}/{self._count - 2}/{collectives.rank()}"])
        self._count += 1
        names = collectives.post_and_collect(read, p.name, self._group, self._timeout)
        ranks = collectives.group_ranks(self._group)
        missing = [r for r, name in zip(ranks, names) if name is None]
        if missing:
            collectives.post_mark(f"{read}/gave_up")
            raise RuntimeError(
                f"Parameter {p.name!r} was read at rest (a stage-3 parameter outside its unit's forward and"
                f" backward) on this rank, but ranks {missing} did not read it within {self._timeout}. A read at"
                " rest gathers the parameter from every rank, so every rank must make the same reads, in the same"
                " order (not in `if trainer.is_global_zero:`). HINT: read it on every rank, or gather the model"
                " once on every rank with `with trainer.strategy.summon_full_params(rank0_only=True):` and read"
                " it on rank 0 inside."
            )
        if collectives.is_marked(f"{read}/gave_up"):
            raise RuntimeError(
                f"Parameter {p.name!r} was read at rest, pairing with a read on another rank that had stopped"
                " waiting for this one: the ranks' reads at rest disagree (a read made on some ranks only)."
                " HINT: make reads at rest on every rank, or use `summon_full_params()`."
            )
        if any(name != p.name for name in names):
            read_by = ", ".join(f"rank {r}: {name!r}" for r, name in zip(ranks, names))
            raise RuntimeError(
                f"The ranks read different parameters at rest at the same point ({read_by}): a read at rest"
                " gathers the parameter from every rank, so every rank must make the same reads in the same"
                " order. HINT: read them on every rank alike, or use `summon_full_params()`."
            )

    def _gathered(self, p: ShardedParam) -> Tensor:
        """All-gather ``p``'s chunks in place into one buffer of N padded chunks, whose first
        ``numel`` elements are the parameter (see [Note: chunk layout] in ``partition.py``)."""
        n, c, rank = p.layout.world_size, p.padded_chunk_numel, collectives.rank(self._group)
        out = torch.empty(n * c, dtype=p.param.dtype, device=self._device)  # (N * c,)
        start, end = p.layout.owned_range(rank)
        row = out[rank * c : (rank + 1) * c]
        row[: end - start].copy_(p.chunk_to_send().detach().view(-1))
        if n > 1:
            collectives.start_all_gather(out, row, self._group).wait()
        return out[: p.layout.numel].view(p.shape)
