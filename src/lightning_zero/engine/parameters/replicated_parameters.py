"""Stages 1-2: every rank keeps the full parameters; after an optimizer step each rank's updated
chunks are all-gathered back into them, bucket by bucket (see ``residency.py``)."""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.engine.buckets.assignment import assign_buckets
from lightning_zero.engine.buckets.copies_back import CopiesBack
from lightning_zero.engine.buckets.pipelining import finish_pipelined
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.buffers import BufferPool
from lightning_zero.engine.comm.copy_stream import CopyStream
from lightning_zero.engine.config import ZeroConfig
from lightning_zero.engine.parameters.residency import HOST, IN_FLIGHT, FullCopies, ParameterResidency
from lightning_zero.engine.shards.full_targets import FullTargets
from lightning_zero.engine.shards.sharded_param import ShardedParam


class ReplicatedParameters(ParameterResidency):
    """Stages 1-2: full parameters on every rank; the optimizer steps chunks of them."""

    def __init__(
        self,
        module: nn.Module,
        optimizer_of: dict[int, int],
        config: ZeroConfig,
        group: collectives.ProcessGroup,
        replicate_group: collectives.ProcessGroup = None,
        timeout: Optional[timedelta] = None,
    ) -> None:
        rank, world_size = collectives.rank(group), collectives.world_size(group)
        host = HOST if config.offload_optimizer else None
        self.compute_device = _device_of_params(module)
        self.copies = CopyStream(self.compute_device) if host is not None else None
        self.params = [
            ShardedParam(name, p, rank, world_size, keep_full=True, host=host)
            for name, p in module.named_parameters()
            if id(p) in optimizer_of
        ]
        # gradients arrive roughly in reverse registration order, so buckets are filled that way
        trainable = [sp for sp in reversed(self.params) if sp.param.requires_grad]
        # at most two buckets communicate at once (reduce-scatters in backward, gathers after a
        # step), each with up to three buffers when offloaded (send, received, fp32 cast)
        self.pool = BufferPool(capacity_bytes=0, slots=IN_FLIGHT * (3 if host is not None else 1))
        copies_back = host is not None and config.overlap_host_step  # CPU or NVMe state: the masters are in memory
        # the write-backs that start during backward go on a group of their own: their order against
        # backward's reduce-scatters differs between ranks (see [Note: copies back per bucket])
        self._write_back_group = collectives.new_group_like(group, timeout) if copies_back else None
        self.grad_buckets = assign_buckets(
            trainable,
            {id(sp): optimizer_of[id(sp.param)] for sp in trainable},
            config.bucket_bytes,
            group,
            self.pool,
            self.copies,
            replicate_group,
            gather_group=self._write_back_group,
        )
        regular = [b.buffer_bytes for b in self.grad_buckets if b.param_bytes <= config.bucket_bytes]
        self.pool.capacity_bytes = max(regular, default=0)
        self._all = FullTargets(self.params)  # frozen ones too: asked after each backward
        if copies_back:
            self.copies_back = CopiesBack(self.grad_buckets, self.compute_device)

    def holds_assigned_data(self) -> bool:
        return self._all.assigned()  # asked after each backward: one check, no call per parameter

    def adopt_assigned_data(self) -> None:
        """As ``ParameterResidency.adopt_assigned_data``, each parameter looked at only when one of
        them was assigned (rare)."""
        if self._all.assigned():
            super().adopt_assigned_data()

    def after_optimizer_step(self, optimizer: Optimizer, optimizer_params: Sequence[ShardedParam], max_in_flight: int = IN_FLIGHT) -> None:
        """All-gather the buckets of ``optimizer``'s parameters, at most ``max_in_flight`` at once (the
        rest of a write-back round, where one is open: see [Note: copies back per bucket])."""
        if self.copies_back is not None and self.copies_back.round_open:
            self.copies_back.close()
            return
        mine = set(map(id, optimizer_params))
        # a parameter two optimizers step sits in one bucket, beside parameters of only one of them
        buckets = [b for b in self.grad_buckets if not mine.isdisjoint(map(id, b.params))]  # no call per parameter
        for bucket in buckets:
            bucket.full_targets.check_not_assigned()
        finish_pipelined((bucket.start_param_gather() for bucket in buckets), max_in_flight)

    def release_to(self, device: torch.device) -> None:
        super().release_to(device)
        if self.copies_back is not None:
            self.copies_back.release()
        if self._write_back_group is not None:  # no gather is pending there once training ended
            collectives.destroy_group(self._write_back_group)
            self._write_back_group = None

    def full_values(self, device: torch.device) -> Iterator[tuple[ShardedParam, Tensor]]:
        for p in self.params:
            yield p, p.param.detach().to(device, copy=True)

    @contextmanager
    def gathered(self, writeback: bool, full_copies: Optional[FullCopies] = None) -> Iterator[None]:
        # the parameters are whole on every rank already: where full copies would go changes nothing
        try:
            yield
        finally:
            if writeback:
                self.write_back()


def _device_of_params(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))
