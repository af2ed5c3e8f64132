"""Where the full parameters live between uses — the one difference between stages 1-2 and 3 —
and the interface the engine drives both through, ``ParameterResidency``:

``ReplicatedParameters`` (stages 1-2, ``replicated_parameters.py``): every rank keeps the full
parameters; after an optimizer step each rank's updated chunks are all-gathered back into them,
bucket by bucket.

``ShardedParameters`` (stage 3, ``sharded_parameters.py``): every rank keeps only its chunks; units
are gathered just before use and freed after (``gather_schedule``), so nothing needs gathering after
a step.
"""

from __future__ import annotations

import abc
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.engine.buckets.bucket import Bucket
from lightning_zero.engine.buckets.copies_back import ChunksBack, CopiesBack
from lightning_zero.engine.comm.buffers import BufferPool
from lightning_zero.engine.comm.copy_stream import CopyStream
from lightning_zero.engine.shards.sharded_param import ShardedParam

HOST = torch.device("cpu")
"""Where offloaded state lives."""

IN_FLIGHT = 2
"""Bucket collectives of one kind in flight at once (reduce-scatters in backward, gathers after a
step at stages 1-2): enough to overlap one with the next one's copies, and what bounds the
communication buffers."""


@dataclass(frozen=True)
class FullCopies:
    """Stage 3, ``summon_full_params(rank0_only=..., offload_to_cpu=...)``: full parameters as
    copies on ``device``, gathered one unit at a time, held only where ``keep`` (FSDP's knobs)."""

    device: torch.device
    """Where the copies live: the host (``offload_to_cpu``) or the compute device."""
    keep: bool
    """Whether this rank holds them (``rank0_only``: rank 0 alone; the others keep their chunks)."""


class ParameterResidency(abc.ABC):
    """The sharded parameters, the buckets their gradients are reduced in, and the step hooks."""

    params: list[ShardedParam]
    grad_buckets: list[Bucket]
    """Buckets of trainable parameters, in the order their reduce-scatters are issued."""
    pool: BufferPool
    """The buckets' communication buffers (see ``buffers.py``)."""
    copies: Optional[CopyStream]
    """Host↔device copies of offloaded buckets (None without offload; see ``host_chunks.py``)."""
    compute_device: torch.device
    """Where the full parameters are computed with."""
    copies_back: Optional[Union[CopiesBack, ChunksBack]] = None
    """With CPU offload and the host step during backward: each bucket's weights back to the device as
    it steps (``buckets/copies_back.py``): stages 1-2 its write-back, stage 3 its device chunks."""

    @property
    def host_allocations(self) -> int:
        """Host buffers the offloaded buckets have allocated (flat after the first step)."""
        return sum(b.host.allocations for b in self.buckets_with_host)

    @property
    def buckets_with_host(self) -> list[Bucket]:
        """Every offloaded bucket (at stage 3 also those of frozen parameters)."""
        return [b for b in self.grad_buckets if b.host is not None]

    def begin_step(self, evaluation: bool = False) -> None:
        """Before a training or evaluation (``evaluation``) step."""

    def announce_evaluation_step(self) -> None:
        """Before an evaluation step: stage 3 tells ranks that ran out of batches that this one
        still runs a step (see ``evaluation_join.py``)."""

    def finish_evaluation(self) -> None:
        """After this rank's last evaluation step: stage 3 shadows the steps its peers still run."""

    def finish_backward_gathers(self) -> None:
        """After each backward, before its gradients are reduced: stage 3 issues the gathers its
        peers may still wait for (see [Note: backward gather order] in ``gather_schedule.py``)."""

    def end_backward(self) -> None:
        """After each backward, once the gradients are reduced."""

    def end_step(self, before_optimizer_step: bool = True) -> None:
        """After a step's backward (or after an evaluation step); ``before_optimizer_step``: the
        backward was the last before the optimizer step (False: a micro-batch that only accumulates)."""

    @property
    def kept_frozen_bytes(self) -> int:
        """Bytes of full weights of all-frozen units kept gathered until the optimizer step (stage 3's
        ``keep_frozen_units_mb``; 0 here)."""
        return 0

    @property
    def secondary_shard_bytes(self) -> int:
        """Bytes of hpZ's secondary shards held now (stage 3 with ``secondary_shard_size``; 0 here)."""
        return 0

    @property
    def gradient_listener(self) -> Optional[Any]:
        """What hears of each parameter's accumulated gradient, a ``grad_sync.GradientListener``
        (stage 3's gather schedule; None here)."""
        return None

    @abc.abstractmethod
    def after_optimizer_step(self, optimizer: Optimizer, optimizer_params: Sequence[ShardedParam]) -> None:
        """Make the module see the weights ``optimizer`` just updated in its shards."""

    @abc.abstractmethod
    def full_values(self, device: torch.device) -> Iterator[tuple[ShardedParam, Tensor]]:
        """Every sharded parameter's full value, copied to ``device`` (a collective at stage 3)."""

    @abc.abstractmethod
    def gathered(self, writeback: bool, full_copies: Optional[FullCopies] = None) -> AbstractContextManager[None]:
        """A context in which every parameter is its full tensor (on every rank, unless
        ``full_copies`` says otherwise)."""

    def buckets_in_memory(self, writing: bool = False) -> Iterator[Sequence[ShardedParam]]:
        """Every sharded parameter, in groups whose chunks (the ones the optimizer steps) can be
        read, and with ``writing`` written, directly while the group is the current one. With
        ``offload_params="nvme"`` a group is a bucket, read in from its file when it becomes current
        and written back (if ``writing``) and freed when the next one is asked for, so the host
        holds one bucket's chunks at a time; elsewhere the chunks are always in memory and there is
        one group, every parameter. The groups come in the same order every time. Iterate to the
        end (a ``break`` or an exception ends the current bucket's use as well)."""
        yield self.params

    def weight_chunks(self) -> dict[int, Tensor]:
        """This rank's chunk of every weight, by ``id`` of its ``ShardedParam``, readable after this
        returns: the chunks the optimizer steps, or copies of them where they live on disk."""
        return {id(p): p.shard for p in self.params}

    def holds_assigned_data(self) -> bool:
        """Whether some parameter's ``.data`` was assigned since its data was placed (``adopt_assigned_data`` has work)."""
        return any(p.data_was_assigned() for p in self._placed_params())

    def adopt_assigned_data(self) -> None:
        """After each backward, before any optimizer step: keep the values of parameters whose
        ``.data`` was assigned (see ``ShardedParam.adopt_assigned_data``)."""
        assigned = [p for p in self._placed_params() if p.data_was_assigned()]
        if assigned and self.copies is not None:
            self.copies.synchronize()  # no copy to the device still reads the host chunks
        for p in assigned:
            p.adopt_assigned_data()

    def _placed_params(self) -> Sequence[ShardedParam]:
        """The parameters whose full data the engine has placed in the module now."""
        return self.params

    def write_back(self) -> None:
        """Copy edits of the full parameters into the chunks the optimizer steps."""
        if self.copies is not None:
            self.copies.synchronize()  # no copy to the device still reads the host chunks
        for bucket in self.buckets_in_memory(writing=True):
            for p in bucket:
                if p.data_was_assigned():  # `param.data = ...` (e.g. ModelPruning's lottery-ticket reset)
                    p.adopt_assigned_data(between_steps=True)
                else:
                    p.sync_master_from_param()

    def release_to(self, device: torch.device) -> None:
        """Leave the module with plain full parameters (when training ends)."""
        self.close()

    def resume(self) -> None:
        """Stage 3: register the hooks ``end_training`` removed."""

    def close(self) -> None:
        """Remove hooks."""
