"""Bytes of model state, by kind and by place: what the engine holds now (``measure``) and what the
estimator predicts (``lightning_zero.estimate``) in one vocabulary, ``StateBytes``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine.gradients.grad_sync import GradientSync
from lightning_zero.engine.gradients.sharded_grad import ShardedGradient
from lightning_zero.engine.offload.disk_tier import DiskTier
from lightning_zero.engine.parameters.residency import ParameterResidency
from lightning_zero.engine.shards.sharded_param import ShardedParam, place_of


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state in one place, by kind."""

    parameters: int = 0
    """Weights: full tensors where they exist now, and chunks that are the only copy of a weight;
    frozen weights too (see ``MemoryReport.frozen_parameters``)."""
    gradients: int = 0
    """Full-size ``param.grad`` tensors and gradient chunks."""
    optimizer_state: int = 0
    """Optimizer state tensors and fp32 master chunks (the ZeRO paper counts both as optimizer state)."""
    buffers: int = 0
    """The module's buffers (the estimator has no such term)."""
    averages: int = 0
    """A weight-averaging callback's average (``averaged_shards.py``): this rank's chunks of the
    parameters' average and the buffers' averages (the estimator has no such term)."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.buffers + self.averages

    def scaled(self, factor: int, divisor: int = 1) -> StateBytes:
        """Every kind times ``factor`` and floor-divided by ``divisor`` (e.g. one rank's share of a node)."""
        return StateBytes(**{f.name: getattr(self, f.name) * factor // divisor for f in fields(self)})


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of model state this rank holds right now, on its compute device and in host memory.

    Offloaded state counts as host memory by where the engine keeps it, also on a CPU-only
    machine where device and host are the same memory, so offload's effect stays visible.
    """

    device: StateBytes
    host: StateBytes
    comm_buffers: int = 0
    """Bytes of the communication buffers kept for reuse (``buffers.py``): not model state, the
    engine's working memory on the device, next to it."""
    waiting_gradients: int = 0
    """The most bytes of full-size gradients held at once in the last backward by buckets that were
    ready to be reduce-scattered but not yet launched (stages 2-3, [Note: no waiting in backward] in
    ``grad_sync.py``): a peak, not what is held now, so not in ``total``; over the floor's gradients
    at that moment. A bucket or two at most while reduce-scatters finish as backward goes on; every
    bucket's full gradients when their completion cannot be seen (issue 44: 4 B per parameter)."""
    unpacked_gradients: int = 0
    """The most bytes of full-size gradients of buckets already launched that the reduce stream's lag
    kept allocated, seen at a launch in the last backward (on CUDA; invisible to
    ``waiting_gradients``): those held until the compute stream waited for their copy-in, and those
    kept alive for a copy-in not yet seen done. A peak, not in ``total``. At most ``max_in_flight + 1``
    buckets where every rank launches every bucket during its backward (see "its lag" in [Note:
    reduce stream] in ``engine/comm/reduce_stream.py``); in the first backward, and with reentrant
    activation checkpointing, up to every bucket while the device lags the host."""
    disk: int = 0
    """Bytes of optimizer state (and, with ``offload_params="nvme"``, parameter chunks) in NVMe
    scratch files: not memory, and not in ``total``; the staging buffers count as host optimizer
    state, and chunks read in for a use count where they are while they are there."""
    pinned_host: int = 0
    """Bytes of page-locked (pinned) host memory held because of the engine's offload buffers (on
    CUDA; 0 where nothing is pinned): the blocks they hold now, each rounded up to a power of two as
    torch's pinned allocator serves it, and the blocks that allocator keeps cached once they are
    freed, which it never gives back to the OS — with ``offload_params="nvme"``, as many blocks of
    master chunks as were ever in memory at once, although ``host`` counts none between uses (see
    [Note: pinned blocks] in ``engine/comm/copy_memory.py``). It overlaps ``host`` (a live buffer is
    counted there by kind) and is not in ``total``."""
    checkpoint_staging: int = 0
    """Bytes of host memory holding this rank's copy of its shards for asynchronous sharded saves
    (``async_save=True``, see ``checkpoint/async_save.py``): about the rank's parameter chunks plus
    its optimizer state, kept from the first such save on (pinned on CUDA). Filled in by the
    strategies' ``memory_report``; not model state, not in ``total``; 0 without ``async_save``."""
    copy_buffers: int = 0
    """Bytes of device memory the engine's host-to-device copies (``CopyStream.to_device``) have
    needed at once at most. Each lands an offloaded bucket's master chunks (S elements in the master
    dtype: fp32 for half-precision weights) in a fresh device row, held until the compute stream
    has read it: one per bucket gathered from the host (stage 3 with ``offload_params``, up to
    ``prefetch_units`` + 1 units in flight; stages 1-2 after each step) and one per bucket whose
    device copies of half-precision chunks are refreshed after a step. Torch's caching allocator
    keeps that much reserved for the copy stream once they are freed. Not model state, beside
    ``comm_buffers``; 0 without offload, and where host and device are one memory."""

    frozen_device: int = 0
    """Of ``device.parameters``: the weights that require no gradient (see ``frozen_parameters``)."""
    frozen_host: int = 0
    """Of ``host.parameters``: the weights that require no gradient, where they live in host memory
    (stage 3 with ``offload_params`` and fp32 weights, whose host chunk is their only copy)."""
    kept_frozen_units: int = 0
    """Of ``device.parameters``: the full weights of all-frozen units kept gathered until the
    optimizer step (stage 3's ``keep_frozen_units_mb``, see [Note: kept frozen units] in
    ``engine/parameters/kept_units.py``); at most the budget, 0 between optimizer steps. Counted in
    ``parameters`` and ``frozen_device`` already, not in addition."""
    secondary_shards: int = 0
    """Of ``device.parameters`` (so in ``total``): hpZ's secondary shards held now, this rank's 1/K of
    the gathered weights of every unit between its training forward and its backward, in the
    parameters' dtype (see [Note: secondary shards] in ``engine/parameters/secondary_shards.py``);
    0 between steps and without ``secondary_shard_size``."""

    host_step_rollback: int = 0
    """Bytes of host memory holding rollback copies for the host step taken during backward (CPU
    offload with ``overlap_host_step``; see [Note: the host step during backward] in
    ``engine/offload/step_ahead.py``): each offloaded bucket's master chunks and optimizer state as
    they were before its step, kept for the next step (about 12 B per parameter / N with AdamW in
    fp32). 0 where no copy is kept (the Trainer with no clipping and no hook between backward and the
    step). Not model state, not in ``total``."""

    @property
    def parameters(self) -> int:
        return self.device.parameters + self.host.parameters

    @property
    def frozen_parameters(self) -> int:
        """Bytes of the weights that require no gradient (frozen), part of ``parameters``: at stages
        1-2 every rank holds them whole on its device (they are in no optimizer, so in no shard);
        at stage 3 this rank's chunks (about 1/N), on the host with ``offload_params`` and fp32
        weights, plus the full weights of frozen units gathered now (``kept_frozen_units``). Frozen
        weights have no gradients and no optimizer state. At stage 3 a half-precision frozen
        weight's chunk is kept in fp32, the engine's master dtype (4 B per element / N; with
        offload a half copy of it on the device too): counted here, not as optimizer state."""
        return self.frozen_device + self.frozen_host

    @property
    def gradients(self) -> int:
        return self.device.gradients + self.host.gradients

    @property
    def optimizer_state(self) -> int:
        return self.device.optimizer_state + self.host.optimizer_state

    @property
    def averages(self) -> int:
        return self.device.averages + self.host.averages

    @property
    def total(self) -> int:
        return self.device.total + self.host.total


def measure(
    module: nn.Module,
    params: Sequence[ShardedParam],
    optimizers: Sequence[tuple[Optimizer, Sequence[ShardedParam]]],
    comm_buffers: int = 0,
    host_gradient_buffers: Sequence[torch.Tensor] = (),
    averages: Iterable[tuple[torch.Tensor, str]] = (),
    staging_bytes: int = 0,
    disk_bytes: int = 0,
    pinned_host: int = 0,
    copy_buffers: int = 0,
    waiting_gradients: int = 0,
    unpacked_gradients: int = 0,
    host_step_rollback: int = 0,
    kept_frozen_units: int = 0,
    secondary_shards: int = 0,
) -> MemoryReport:
    """What ``params`` (and the state ``optimizers`` keep for them) and ``module``'s buffers hold now,
    and ``module``'s parameters the engine does not shard (frozen ones in no optimizer, at stages
    1-2): full tensors on every rank, counted as device parameters.
    ``host_gradient_buffers``: offloaded buckets' gradient rows, held for good (see
    ``host_chunks.py``); counted whole, also between steps, and the gradients viewing them not again.
    ``averages``: the tensors of weight averages, each with where it counts (``place_of``).

    Each tensor counts where it is (``place_of``). ``staging_bytes``: the NVMe tier's host buffers
    (optimizer state); ``disk_bytes``: the state (and parameter chunks) in its files.
    ``pinned_host``, ``copy_buffers``: what the offload copies hold (see ``MemoryReport``);
    ``waiting_gradients``: the last backward's peak of gradients waiting for a reduce-scatter.
    ``secondary_shards``: hpZ's, held now (device parameters).
    """

    def nbytes(t: Optional[torch.Tensor]) -> int:
        # a tensor whose storage is freed (a stage-3 chunk on disk between uses) holds nothing
        return 0 if t is None or t.untyped_storage().nbytes() == 0 else t.numel() * t.element_size()

    def place(t: torch.Tensor, sp: ShardedParam) -> str:
        return place_of(t, sp.offloaded, sp.device)

    counts = {"device": Counter(), "host": Counter()}
    frozen = Counter()  # parameter bytes of weights that require no gradient, by place
    counts["host"]["gradients"] += sum(nbytes(b) for b in host_gradient_buffers)
    counts["host"]["optimizer_state"] += staging_bytes
    held = {b.untyped_storage().data_ptr() for b in host_gradient_buffers}
    managed = {id(sp.param) for sp in params}
    for p in module.parameters():
        if id(p) not in managed:  # whole on every rank, on its device
            counts["device"]["parameters"] += nbytes(p)
            frozen["device"] += 0 if p.requires_grad else nbytes(p)
    for sp in params:
        weights = nbytes(sp.param) + nbytes(sp.device_chunk)
        counts["device"]["parameters"] += weights
        if not sp.param.requires_grad:
            frozen["device"] += weights
        if not isinstance(sp.param.grad, ShardedGradient):  # a view of the chunk counted below
            counts["device"]["gradients"] += nbytes(sp.param.grad)
        if sp.shard.grad is not None and sp.shard.grad.untyped_storage().data_ptr() not in held:
            counts[place(sp.shard.grad, sp)]["gradients"] += nbytes(sp.shard.grad)
        if not sp.aliases_param:
            only_copy = not sp.keeps_full and not sp.holds_master_copy and sp.device_chunk is None
            # stage 3: a frozen weight's chunk is a weight whatever its dtype (no optimizer steps it)
            frozen_chunk = not sp.keeps_full and not sp.param.requires_grad
            counts[place(sp.shard, sp)]["parameters" if only_copy or frozen_chunk else "optimizer_state"] += nbytes(sp.shard)
            if frozen_chunk:
                frozen[place(sp.shard, sp)] += nbytes(sp.shard)
    for optimizer, optimizer_params in optimizers:
        for sp in optimizer_params:
            for t in (optimizer.state.get(sp.shard) or {}).values():
                if isinstance(t, torch.Tensor):
                    counts[place(t, sp)]["optimizer_state"] += nbytes(t)
    counts["device"]["parameters"] += secondary_shards
    counts["device"]["buffers"] += sum(nbytes(b) for b in module.buffers())
    for t, where in averages:
        counts[where]["averages"] += nbytes(t)
    return MemoryReport(
        device=StateBytes(**counts["device"]),
        host=StateBytes(**counts["host"]),
        comm_buffers=comm_buffers,
        disk=disk_bytes,
        pinned_host=pinned_host,
        copy_buffers=copy_buffers,
        waiting_gradients=waiting_gradients,
        unpacked_gradients=unpacked_gradients,
        host_step_rollback=host_step_rollback,
        frozen_device=frozen["device"],
        frozen_host=frozen["host"],
        kept_frozen_units=kept_frozen_units,
        secondary_shards=secondary_shards,
    )


def working_memory(residency: ParameterResidency, disk: Optional[DiskTier], grad_sync: GradientSync) -> dict[str, Any]:
    """``measure``'s arguments for what an engine holds beside model state: its buffer pool,
    offloaded gradient rows, NVMe staging and files, pinned blocks and copy rows, and the last
    backward's gradients waiting for a reduce-scatter."""
    copies = residency.copies
    return dict(
        comm_buffers=residency.pool.kept_bytes + (residency.copies_back.pool_bytes if residency.copies_back is not None else 0),
        host_gradient_buffers=[row for b in residency.buckets_with_host for row in b.host.gradient_rows],
        staging_bytes=disk.staging.held_bytes if disk is not None else 0,
        disk_bytes=disk.disk_bytes if disk is not None else 0,
        pinned_host=copies.pinned_blocks.held_bytes if copies is not None else 0,
        copy_buffers=copies.temporaries.most_bytes if copies is not None else 0,
        waiting_gradients=grad_sync.waiting_peak_bytes,
        unpacked_gradients=grad_sync.unpacked_peak_bytes,
        kept_frozen_units=residency.kept_frozen_bytes,
        secondary_shards=residency.secondary_shard_bytes,
    )
