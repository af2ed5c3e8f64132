"""One engine's NVMe tier: its scratch directory, the staging buffers, and each optimizer's state
on disk (see [Note: optimizer state on disk] in ``state_on_disk.py``); with ``offload_params="nvme"``
the directory also holds the parameter chunks (see [Note: parameters on disk] in
``masters_on_disk.py``)."""

from __future__ import annotations

import multiprocessing.util
from typing import Optional, Protocol, Sequence

from torch.optim import Optimizer

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.config import ZeroConfig
from lightning_zero.engine.offload.host_chunks import HostChunks
from lightning_zero.engine.offload.scratch_files import IOStats, ScratchDirectory, check_scratch_root, disk_of
from lightning_zero.engine.offload.staging import StagingBuffers
from lightning_zero.engine.offload.state_layout import aligned
from lightning_zero.engine.offload.state_on_disk import OptimizerStateOnDisk
from lightning_zero.engine.shards.sharded_param import ShardedParam

STATE_TENSORS_PER_PARAM = {
    "SGD": 1, "Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2,
    "RMSprop": 3, "Adagrad": 1, "Adadelta": 2, "ASGD": 1, "Rprop": 2,
}  # fmt: skip
"""Per-element state tensors torch's optimizers keep, at most (Adam's ``amsgrad`` adds one); 2 for others."""


def state_tensors_per_param(optimizer: Optimizer) -> int:
    """At most how many per-element state tensors ``optimizer`` keeps for each parameter."""
    tensors = STATE_TENSORS_PER_PARAM.get(type(optimizer).__name__, 2)
    return tensors + any(group.get("amsgrad") for group in optimizer.param_groups)


STATE_SLOTS = 2
"""Copies of each bucket's state in its file: the current one and the one the next step writes (see
``state_layout.py``), so a step is kept only once its verdict commits it."""


def state_bytes_needed(optimizer: Optimizer, params: Sequence[ShardedParam]) -> int:
    """At most how many bytes of files ``optimizer``'s state for ``params`` (this rank's chunks) takes:
    ``STATE_SLOTS`` copies of it."""
    return STATE_SLOTS * state_tensors_per_param(optimizer) * sum(p.shard.numel() * p.shard.element_size() for p in params)


class GradientBucket(Protocol):
    """What ``DiskTier.attach`` reads of each of the engine's gradient buckets (``buckets.Bucket``):
    its parameters, and with offload its host chunks (whose masters may live on disk too)."""

    params: Sequence[ShardedParam]
    host: Optional[HostChunks]


class DiskTier:
    """Made by the engine with ``offload_optimizer="nvme"``; ``attach`` each optimizer once sharded."""

    def __init__(self, config: ZeroConfig) -> None:
        assert config.nvme_path is not None
        self.root = config.nvme_path
        # not pinned: the optimizer steps the state on the host, it never crosses to a device
        self.staging = StagingBuffers(config.nvme_buffer_count)
        self.directory: Optional[ScratchDirectory] = None
        self.states: list[OptimizerStateOnDisk] = []
        self._attached = 0
        self.param_bytes = 0
        """Bytes of parameter chunks in the directory (``offload_params="nvme"``)."""

    def reserve(self, nbytes: int, what: str) -> ScratchDirectory:
        """The scratch directory, once every rank has checked that its ``nvme_path`` can hold
        ``nbytes`` more of ``what`` (with the bytes of all ranks whose paths are on the same disk of
        the same host). A collective: all ranks fail alike if one cannot."""
        disk = disk_of(self.root)
        sharing = [n for d, n in collectives.gather_objects((disk, nbytes)) if disk is not None and d == disk] or [nbytes]
        collectives.raise_if_any_rank(check_scratch_root(self.root, sum(sharing), ranks=len(sharing), what=what))
        if self.directory is None:
            self.directory = ScratchDirectory(self.root, label=f"rank{collectives.rank()}")
            # when this tier is dropped, or at the latest when the process ends, also a rank that
            # multiprocessing started (it skips atexit after a fork); a killed process leaves it
            self._remove_directory = multiprocessing.util.Finalize(self, self.directory.close, exitpriority=10)
        return self.directory

    def reserve_for_params(self, nbytes: int) -> ScratchDirectory:
        """Where the parameter chunks go (``nbytes`` of them on this rank), checked as ``reserve``."""
        directory = self.reserve(nbytes, "the parameter chunks")
        self.param_bytes += nbytes
        return directory

    def attach(self, optimizer: Optimizer, params: Sequence[ShardedParam], buckets: Sequence[GradientBucket]) -> None:
        """Move ``optimizer``'s state for ``params`` (``state_dict`` order) to files, one per bucket
        of ``buckets`` (the engine's gradient buckets) that holds some of them. A collective (see
        ``reserve``). Where a bucket's chunks live on disk too, the stream steps them with its state."""
        self.reserve(state_bytes_needed(optimizer, params), "the optimizer state")
        assert self.directory is not None
        members = [{id(p) for p in bucket.params} for bucket in buckets]
        positions = [[i for i, p in enumerate(params) if id(p) in bucket] for bucket in members]
        masters = [bucket.host.on_disk if bucket.host is not None else None for bucket in buckets]
        bucketed = {i for bucket in positions for i in bucket}
        positions.append([i for i in range(len(params)) if i not in bucketed])  # frozen ones, if an optimizer holds them
        masters.append(None)
        # sized once for the largest bucket, so that the first step (which makes the state) allocates no more
        tensors = state_tensors_per_param(optimizer)
        self.staging.reserve(max(tensors * sum(aligned(params[i].shard.nbytes) for i in bucket) for bucket in positions))
        self.states.append(
            OptimizerStateOnDisk(
                optimizer, params, positions, self.directory, f"optimizer{self._attached}", self.staging, masters
            )
        )
        self._attached += 1

    def state_of(self, optimizer: Optimizer) -> Optional[OptimizerStateOnDisk]:
        """The files of ``optimizer``'s state (None: not attached)."""
        return next((state for state in self.states if state.optimizer is optimizer), None)

    def prefetch(self) -> None:
        """The gradients are final and an optimizer step is next: start reading the first buckets'
        state of the first optimizer that has gradients (one at a time keeps the staging bound)."""
        for state in self.states:
            if state.has_gradients():
                state.prefetch()
                return

    def detach_all(self) -> None:
        """The optimizers are done with (a new fit replaces them): each gets its own ``step`` back."""
        for state in self.states:
            state.close()
        self.states.clear()

    @property
    def disk_bytes(self) -> int:
        return sum(state.disk_bytes for state in self.states) + self.param_bytes

    @property
    def io(self) -> Optional[IOStats]:
        """What the disk did since the stats were last reset (None before any optimizer was attached)."""
        return self.directory.stats if self.directory is not None else None

    def close(self) -> None:
        """Detach every optimizer and remove the scratch directory with its files."""
        self.detach_all()
        if self.directory is not None:
            self._remove_directory()
