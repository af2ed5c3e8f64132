"""One stage-3 parameter's full value, gathered for a read at rest (see [Note: reads at rest] in
``shards/at_rest.py``).

[Note: agreeing on a read]
A read is a collective over the shard group, so the ranks first agree that they are all reading the
same parameter: each posts the parameter's name for this read (the n-th read at rest of this
engine) in the process group's store and waits for every rank's post, then one key decides for all
whether they go ahead (``store_agreement.post_and_agree``). The store is used rather than a collective
so that a read made on some ranks only fails on each rank that made it, naming the parameter, and
leaves no collective half-done in the groups that training goes on with. The decision is atomic
(the store's ``compare_set``): a rank that gave up waiting and a late rank that then saw every post
cannot both act, so a late rank never enters an all-gather that an early one abandoned. Once all
agree, one all-gather of that parameter's chunks, in place in one buffer of the full (padded) size,
gives every reading rank the full value; nothing else is gathered, and the buffer is the caller's
(dropped after the read unless the result is it). Ranks that read different parameters all fail,
naming what each read. A write at rest agrees the same way, in the same count, posting that it
writes (``value_to_write``; see [Note: writes at rest] in ``shards/at_rest.py``): a rank writing a
parameter while another reads it, or writing on some ranks only, fails as a read would.

How long a rank waits for the others is the agreement timeout, not the process group's (torch's
default is 30 minutes, which Lightning keeps): ranks running the same script reach the same read
within the skew of their steps — seconds — while a read made on one rank only (a logger that reads
parameters on rank 0, such as ``WandbLogger.watch(model, log="parameters")``) is never joined, and
should fail in a minute rather than half an hour. ``AGREEMENT_TIMEOUT_VARIABLE`` sets it in seconds
(default ``DEFAULT_AGREEMENT_TIMEOUT``, never longer than the group's timeout); raise it where a rank
may legitimately reach a read much later than its peers (work done on rank 0 alone in between, such
as writing a large file).

Reads are refused off the thread that trains the model (the one that built the engine, or last began
a step; autograd's own threads, which run a backward that thread started, included): a read from a
second thread (``model.state_dict()`` in a background thread) would interleave its store posts and
all-gathers with the training thread's in an order that differs between ranks.

What a read costs: a store round trip (one small write, a wait for the peers' writes, one
compare-and-set) and one all-gather of that parameter, and one full copy of it held for the read. A
loop reading every parameter one at a time holds one parameter at a time; one that keeps what it
read (``[p.clone() for p in model.parameters()]``) holds the whole model, as the user asked.
"""

from __future__ import annotations

import itertools
import os
import threading
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_zero.engine.comm import collectives, store_agreement
from lightning_zero.engine.shards.sharded_param import ShardedParam

READ, WRITE = "read", "written"
"""How a parameter at rest is used, as messages and the ranks' agreement name it."""

ChunkInMemory = Callable[[ShardedParam], AbstractContextManager]
"""A context in which ``param.shard`` can be read (its bucket read in from disk, where it lives there)."""

AGREEMENT_TIMEOUT_VARIABLE = "LIGHTNING_ZERO_READ_AT_REST_TIMEOUT"
"""Seconds a read at rest waits for the other ranks to make it too (see [Note: agreeing on a read])."""
DEFAULT_AGREEMENT_TIMEOUT = timedelta(seconds=60)
"""A minute: ranks in step reach a read seconds apart; a read on one rank only fails in a minute."""

_ENGINES = itertools.count()
"""Engines made in this process (the same order on every rank): each reads under its own keys."""


def agreement_timeout(group_timeout: Optional[timedelta]) -> timedelta:
    """How long a read waits for the other ranks: ``AGREEMENT_TIMEOUT_VARIABLE`` seconds (default
    ``DEFAULT_AGREEMENT_TIMEOUT``), at most ``group_timeout`` (the process group's)."""
    raw = os.environ.get(AGREEMENT_TIMEOUT_VARIABLE, "")
    try:
        chosen = timedelta(seconds=float(raw)) if raw else DEFAULT_AGREEMENT_TIMEOUT
    except ValueError:
        raise ValueError(f"{AGREEMENT_TIMEOUT_VARIABLE} must be a number of seconds, got {raw!r}.") from None
    if chosen.total_seconds() <= 0:
        raise ValueError(f"{AGREEMENT_TIMEOUT_VARIABLE} must be a positive number of seconds, got {raw!r}.")
    return min(chosen, group_timeout or collectives.default_timeout())


class ReadsAtRest:
    """Full values of parameters at rest, for reads, over ``group`` (the engine's gather group).

    ``device``: where the full values are made (where the parameters compute); ``timeout``: the
    process group's (the agreement waits at most that long, see ``agreement_timeout``);
    ``in_memory``: see ``ChunkInMemory``; ``before_read``: what must finish before chunks are read
    (copies to the host in flight)."""

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
        self.timeout = agreement_timeout(timeout)
        """How long a read waits for the other ranks to make it too."""
        self._in_memory = in_memory
        self._before_read = before_read
        ranks = collectives.group_ranks(group)
        self._forgets_decisions = ranks[:1] == (collectives.rank(),)  # one rank deletes the shared keys
        self._prefix = f"lightning_zero/reads_at_rest/{next(_ENGINES)}/{'-'.join(map(str, ranks))}"
        self._count = 0
        """Reads at rest made so far on this rank: the n-th read of every rank pairs with the others' n-th."""
        self._trainer = threading.current_thread()

    def trained_here(self) -> None:
        """The calling thread trains the model (at construction and each step): reads are made there."""
        self._trainer = threading.current_thread()

    def full_value(self, p: ShardedParam) -> Tensor:
        """``p``'s full value (its shape, its dtype, on the compute device), once every rank of the
        group reads it too; raises, naming ``p``, when they do not within the timeout or read another,
        and on a thread that does not train the model."""
        self._check_thread(p, READ)
        if collectives.world_size(self._group) > 1:
            self._agree_on(p, READ)
        with torch.no_grad(), self._in_memory(p):
            self._before_read()
            return self._gathered(p)

    def value_to_write(self, p: ShardedParam, keep_values: bool) -> Tensor:
        """For a write at rest (see [Note: writes at rest] in ``shards/at_rest.py``), once every rank
        of the group writes ``p`` too (agreed as a read is): a full tensor of ``p``'s shape and dtype
        on the compute device, holding its values (gathered, as for a read) with ``keep_values``,
        else uninitialized (a write over all of it: nothing is gathered)."""
        self._check_thread(p, WRITE)
        if collectives.world_size(self._group) > 1:
            self._agree_on(p, WRITE)
        if not keep_values:
            return torch.empty(p.shape, dtype=p.param.dtype, device=self._device)
        with torch.no_grad(), self._in_memory(p):
            self._before_read()
            return self._gathered(p)

    def _check_thread(self, p: ShardedParam, access: str) -> None:
        if threading.current_thread() is self._trainer or torch._C._current_graph_task_id() != -1:
            return  # the training thread, or autograd's thread running its backward (hooks on CUDA)
        raise RuntimeError(
            f"Parameter {p.name!r} was {access} at rest (a stage-3 parameter outside its unit's forward and backward)"
            f" on thread {threading.current_thread().name!r}, which does not train the model (thread"
            f" {self._trainer.name!r} does). A read or write at rest agrees with every rank and gathers the"
            " parameter, and a second thread's would interleave with the training thread's collectives in an"
            " order that differs between ranks. HINT: read on the training thread and hand the values over (e.g."
            " `state = {k: v.clone() for k, v in model.state_dict().items()}` there), or read inside"
            " `with trainer.strategy.summon_full_params():` entered on every rank's training thread."
        )

    def _agree_on(self, p: ShardedParam, access: str) -> None:
        read = f"{self._prefix}/{self._count}"
        if self._count >= 2:  # every rank posted the read after it, so decided the one before
            done = f"{self._prefix}/{self._count - 2}"
            decided = [f"{done}/decision"] if self._forgets_decisions else []
            store_agreement.forget_posts([f"{done}/{collectives.rank()}", *decided])
        self._count += 1
        agreed = store_agreement.post_and_agree(read, f"{access}:{p.name}", self._group, self.timeout)
        ranks = collectives.group_ranks(self._group)
        missing = [r for r, name in zip(ranks, agreed.values) if name is None]
        if missing:
            raise RuntimeError(
                f"Parameter {p.name!r} was {access} at rest (a stage-3 parameter outside its unit's forward and"
                f" backward) on this rank, but ranks {missing} did not {'read' if access == READ else 'write'} it"
                f" within {self.timeout}. A read or write at rest takes every rank, so every rank must make the"
                " same reads and writes, in the same"
                " order (not in `if trainer.is_global_zero:`, nor in a logger that reads parameters on rank 0"
                " only). HINT: read it on every rank, or gather the model once on every rank with `with"
                " trainer.strategy.summon_full_params(rank0_only=True):` and read it on rank 0 inside. (Where"
                " every rank does read it, one much later than the others, raise the wait with"
                f" {AGREEMENT_TIMEOUT_VARIABLE}=<seconds>.)"
            )
        if not agreed.go:
            raise RuntimeError(
                f"Parameter {p.name!r} was {access} at rest, pairing with a read or write on another rank that had"
                " stopped waiting for this one: the ranks' reads and writes at rest disagree (one made on some"
                " ranks only). HINT: make reads and writes at rest on every rank, or use `summon_full_params()`."
            )
        if any(value != f"{access}:{p.name}" for value in agreed.values):
            made = ", ".join(f"rank {r}: {_described(value)}" for r, value in zip(ranks, agreed.values))
            raise RuntimeError(
                f"The ranks read or wrote different parameters at rest at the same point ({made}): a read or"
                " write at rest takes every rank, so every rank must make the same reads and writes in the same"
                " order. HINT: make them on every rank alike, or use `summon_full_params()`."
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


def _described(posted: str) -> str:
    """What a rank posted for a read or write at rest (``"<access>:<name>"``), for a message."""
    access, _, name = posted.partition(":")
    return f"{name!r} ({access})"
