"""Stage 3: every rank keeps only its chunks; units are gathered just before use and freed after
(``gather_schedule.py``), so nothing needs gathering after a step (see ``residency.py``)."""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.engine.buckets.bucket import Bucket
from lightning_zero.engine.buckets.copies_back import ChunksBack
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.buffers import BufferPool
from lightning_zero.engine.comm.copy_stream import CopyStream
from lightning_zero.engine.comm.streams import streams_of
from lightning_zero.engine.comm.evaluation_join import EvaluationJoin
from lightning_zero.engine.comm.host_reads import HostReads
from lightning_zero.engine.comm.node_links import NodeLinks
from lightning_zero.engine.comm.quantized_reduction import QuantizedGradients
from lightning_zero.engine.config import ZeroConfig
from lightning_zero.engine.offload.masters_on_disk import MasterOnDisk
from lightning_zero.engine.offload.scratch_files import ScratchDirectory
from lightning_zero.engine.parameters.gather_schedule import GatherSchedule
from lightning_zero.engine.parameters.materialize import build_units
from lightning_zero.engine.parameters.reads_at_rest import ReadsAtRest
from lightning_zero.engine.parameters.secondary_shards import SecondaryShards
from lightning_zero.engine.parameters.residency import HOST, IN_FLIGHT, FullCopies, ParameterResidency
from lightning_zero.engine.parameters.unit import UnitCommunication, UnitState
from lightning_zero.engine.shards.at_rest import ParameterAtRest
from lightning_zero.engine.shards.sharded_param import ShardedParam
from lightning_zero.engine.zero_plus_plus import check_quantizable


class ShardedParameters(ParameterResidency):
    """Stage 3: only chunks at rest; units gathered around their use."""

    def __init__(
        self,
        module: nn.Module,
        config: ZeroConfig,
        group: collectives.ProcessGroup,
        device: torch.device,
        verdicts: HostReads,
        timeout: Optional[timedelta] = None,
        replicate_group: collectives.ProcessGroup = None,
        param_files: Optional[ScratchDirectory] = None,
        links: Optional[NodeLinks] = None,
    ) -> None:
        """``links``: ZeRO++'s groups (see ``ZeroEngine``). ``param_files``: with ``offload_params="nvme"``, where the offloaded chunks live between
        uses (see [Note: parameters on disk] in ``masters_on_disk.py``)."""
        # a dtype the quantized collectives cannot carry fails here, naming it, before any is built
        check_quantizable({p.dtype for p in module.parameters()}, config.weight_quantization, config.gradient_quantization)
        # buffers lent at once: the gathers of the unit in use and those prefetched, and the
        # reduce-scatters in flight during backward (offloaded: with their received rows and casts)
        offload = config.offload_optimizer
        self.pool = BufferPool(capacity_bytes=0, slots=IN_FLIGHT * (3 if offload else 1) + 1 + config.prefetch_units)
        self._releases_idle_buffers = not offload
        """Whether the pool's idle buffers give their memory back after each backward: where the
        optimizer steps on the device, its step is a rank's peak and they would only add to it;
        offloaded, the step runs on the host and the device's peak is in backward, where they are
        lent anyway, so releasing them would only cost their re-allocation every step (on the CPU,
        where the host step during backward needs the time, ~3.5 ms of exposed step at the
        benchmark's overlap stand-in, issue 60)."""
        self.copies = CopyStream(device) if offload else None
        self.compute_device = device
        self._verdicts = verdicts
        gather_group = collectives.new_group_like(group, timeout)  # see GatherSchedule's docstring
        self._own_group = gather_group if gather_group is not group else None  # destroyed by release_to
        self.secondary_shards: Optional[SecondaryShards] = None
        """hpZ: kept from each unit's training forward for its backward (see [Note: secondary shards]);
        ``chunks_changed`` at every point below where chunks are written."""
        if links is not None and links.secondary is not None:
            self.secondary_shards = SecondaryShards(links.secondary)
        comm = UnitCommunication(
            reduce_group=group,
            gather_group=gather_group,
            pool=self.pool,
            verdicts=verdicts,
            # reading tags where work is synchronous waits for nothing (see ZeroConfig.check_units_every_gather)
            check_every_gather=(
                streams_of(device) is None if config.check_units_every_gather is None else config.check_units_every_gather
            ),
            copies=self.copies,
            replicate_group=replicate_group,
            param_files=param_files,
            weight_format=config.weight_quantization,
            quantized_gradients=QuantizedGradients.of(links, config.gradient_quantization),
            secondary_shards=self.secondary_shards,
        )
        self.units = build_units(
            module,
            device,
            comm,
            config.unit_classes,
            config.min_unit_params,
            host=HOST if offload else None,
            keep_device_chunks=offload and not config.offload_params,
        )
        self.params = [p for unit in self.units for p in unit.params]
        self.grad_buckets = [b for unit in reversed(self.units) for b in unit.grad_buckets]  # backward runs units in reverse
        self._buckets_on_disk = [b for b in self.buckets_with_host if b.host is not None and b.host.on_disk is not None]
        self.masters_on_disk: list[MasterOnDisk] = [b.host.on_disk for b in self._buckets_on_disk]
        read_in = {id(p) for b in self._buckets_on_disk for p in b.params}
        self._params_in_memory = [p for p in self.params if id(p) not in read_in]  # whose chunks never leave memory
        # the root unit is gathered once per step and often holds the embeddings: it is not what
        # the pool is sized for (see buffers.py)
        regular = [b.buffer_bytes for unit in self.units[1:] for b in unit.buckets] or [
            b.buffer_bytes for b in self.units[0].buckets
        ]
        self.pool.capacity_bytes = max(regular, default=0)
        self.schedule = GatherSchedule(self.units, config.prefetch_units, config.kept_frozen_bytes)
        if offload and config.overlap_host_step and not config.params_on_disk:
            self.copies_back = ChunksBack(self.buckets_with_host, device)
        ParameterAtRest.names.update({id(p.param): p.name for p in self.params})
        ParameterAtRest.adopters.update({id(p.param): _adopter_at_rest(self, p) for p in self.params})
        self.reads = ReadsAtRest(comm.gather_group, device, timeout, self._chunk_in_memory, self._before_host_read)
        """Full values of single parameters for reads at rest (see [Note: reads at rest] in ``at_rest.py``)."""
        # where a read at rest takes an offloaded parameter's chunk from the host master, which the
        # host step during backward may be stepping ahead of its verdict (see `_chunk_in_memory`)
        self._read_from_host = {
            id(p): b.host for b in self.buckets_with_host for p in b.params if p.device_chunk is None or b.host.on_disk is not None
        }
        self.wait_for_host_step: Callable[[], None] = lambda: None
        """The engine's: wait until the host step during backward has stepped every bucket that
        reached it (``ZeroEngine.wait_for_host_step``), so no read of a master races its step."""
        ParameterAtRest.readers.update({id(p.param): _reader_at_rest(self, p) for p in self.params})
        ParameterAtRest.writers.update({id(p.param): _WriterAtRest(self, p) for p in self.params})
        self.join = EvaluationJoin(comm.gather_group, device)

    @property
    def buckets_with_host(self) -> list[Bucket]:
        return [b for unit in self.units for b in unit.buckets if b.host is not None]

    @property
    def gradient_listener(self) -> GatherSchedule:
        return self.schedule

    def _chunks_changed(self) -> None:
        """Chunks are (about to be) written, or a step begins: no secondary shard kept so far is used."""
        if self.secondary_shards is not None:
            self.secondary_shards.chunks_changed()

    def begin_step(self, evaluation: bool = False) -> None:
        self._chunks_changed()  # whatever was written between the steps
        self.reads.trained_here()
        self.schedule.begin_step(evaluation)

    def announce_evaluation_step(self) -> None:
        self.join.announce_step()

    def finish_evaluation(self) -> None:
        self.join.shadow_until_all_done(self.schedule.replay_evaluation_step)
        self._verdicts.read()
        self._drop_unused_reads()

    def _drop_unused_reads(self) -> None:
        """Chunks read ahead from disk for a gather that did not come leave memory."""
        for master in self.masters_on_disk:
            master.drop_unused()

    def buckets_in_memory(self, writing: bool = False) -> Iterator[Sequence[ShardedParam]]:
        if writing:
            self._chunks_changed()
        if not self.masters_on_disk:
            yield self.params
            return
        # one bucket's chunks at a time: with pinned masters each read takes a block that torch's
        # pinned allocator keeps for good once freed (see [Note: pinned blocks] in copy_memory.py),
        # so reading all of them at once would pin every chunk for the rest of the process
        if self._params_in_memory:
            yield self._params_in_memory
        for bucket in self._buckets_on_disk:
            with bucket.host.in_memory(writing):  # written back (and freed) before the next is read
                yield bucket.params

    def _chunk_in_memory(self, p: ShardedParam) -> AbstractContextManager:
        """A context in which ``p``'s chunk as the all-gather sends it (``chunk_to_send``) holds the
        weights as of the last optimizer step: where that is the host master (offloaded fp32
        weights), a step the host took during backward ahead of its verdict is finished and undone
        first (``HostChunks.in_memory``; the optimizer step then takes it again), as DDP's weights
        before ``optimizer.step()`` are the previous step's; its bucket is read in where it lives on
        disk. Device chunks are refreshed only after the step: nothing to wait for."""
        host = self._read_from_host.get(id(p))
        if host is None:
            return nullcontext()
        self.wait_for_host_step()  # `in_memory` sees a step only once its worker has finished it
        return host.in_memory()

    def write_full_value(self, p: ShardedParam, full: Tensor) -> None:
        """``p``, at rest, takes its chunk of ``full`` (a value of its shape): in the chunk the
        optimizer steps (the fp32 master where one is kept, on the host when offloaded, read in and
        written back where it lives on disk) and in the one the all-gather sends. Offloaded, a step
        the host took during backward ahead of its verdict is finished and undone first, as for a read
        (``_chunk_in_memory``): the optimizer step then steps the written value, as DDP's steps a
        parameter written between backward and ``optimizer.step()``."""
        if self.copies is not None:
            self.copies.synchronize()  # no copy to the device still reads the host chunks
        if p.offloaded:
            self.wait_for_host_step()
        self._chunks_changed()
        p.load_full_value(full)

    def _before_host_read(self) -> None:
        if self.copies is not None:
            self.copies.synchronize()  # no copy to the host still writes the chunks

    def weight_chunks(self) -> dict[int, Tensor]:
        if not self.masters_on_disk:
            return super().weight_chunks()
        chunks = {}
        for bucket in self.buckets_with_host:
            with bucket.host.in_memory():
                chunks.update({id(p): p.shard.detach().clone() for p in bucket.params})
        return chunks

    def finish_backward_gathers(self) -> None:
        self.schedule.finish_backward_gathers()

    def _placed_params(self) -> Sequence[ShardedParam]:
        return [p for unit in self.units if unit.state is UnitState.UNSHARDED for p in unit.params]

    def end_backward(self) -> None:
        self.schedule.end_backward()
        if self._releases_idle_buffers:
            self.pool.release_idle()  # every gather and reduction of the backward is finished

    def end_step(self, before_optimizer_step: bool = True) -> None:
        self.schedule.end_step(before_optimizer_step)

    @property
    def kept_frozen_bytes(self) -> int:
        return self.schedule.kept.held_bytes

    @property
    def secondary_shard_bytes(self) -> int:
        return self.secondary_shards.held_bytes if self.secondary_shards is not None else 0

    def after_optimizer_step(self, optimizer: Optimizer, optimizer_params: Sequence[ShardedParam]) -> None:
        self._chunks_changed()
        mine = {id(p) for p in optimizer_params}
        if self.copies_back is not None:  # those refreshed as they stepped are left as they are
            self.copies_back.after_step(mine)
        else:
            for bucket in self.buckets_with_host:
                # one copy and one cast per bucket; chunks on disk were copied by the step itself
                if bucket.host.on_disk is None and any(id(p) in mine for p in bucket.params):
                    bucket.host.refresh_device_chunks()
        self.schedule.refresh_gathered()
        self._drop_unused_reads()

    def full_values(self, device: torch.device) -> Iterator[tuple[ShardedParam, Tensor]]:
        """Every parameter's full value as a copy on ``device``, gathering one unit at a time (a
        collective: every rank must iterate it to the end). Units gathered before stay gathered."""
        for unit in self.units:
            was_gathered = unit.state is UnitState.UNSHARDED
            unit.unshard()
            for p in unit.params:
                yield p, p.param.detach().to(device, copy=True)
            if not was_gathered:
                unit.reshard()
        self._verdicts.read()

    @contextmanager
    def gathered(self, writeback: bool, full_copies: Optional[FullCopies] = None) -> Iterator[None]:
        """Every unit gathered; with ``writeback``, edits to the full parameters are kept. With
        ``full_copies``, the units are gathered one at a time and their parameters become copies
        (see :class:`FullCopies`)."""
        if full_copies is not None:
            with self._full_copies(writeback, full_copies):
                yield
            return
        was_sharded = [unit for unit in self.units if unit.state is not UnitState.UNSHARDED]
        for unit in self.units:
            unit.unshard()
        self._verdicts.read()
        try:
            yield
        finally:
            if writeback:
                self._chunks_changed()
                self.write_back()
            for unit in was_sharded:
                unit.reshard()

    @contextmanager
    def _full_copies(self, writeback: bool, copies: FullCopies) -> Iterator[None]:
        """Each unit at rest is gathered in turn and its parameters copied to ``copies.device``
        (kept only where ``copies.keep``), so the compute device never holds more than one unit
        beyond what it holds now. Units already gathered (inside a step) stay as they are. With
        ``writeback``, each rank takes its chunk of the edited copies when the context ends."""
        lent = []
        for unit in self.units:
            if unit.state is UnitState.UNSHARDED:
                continue
            unit.unshard()
            values = [p.param.detach().to(copies.device, copy=True) if copies.keep else None for p in unit.params]
            unit.reshard()
            lent.extend(zip(unit.params, values))
        self._verdicts.read()
        if copies.keep:
            for p, value in lent:
                p.lend_full_copy(value)
        try:
            yield
        finally:
            if copies.keep:
                if writeback and self.copies is not None:
                    self.copies.synchronize()  # no copy to the device still reads the host chunks
                if not writeback:
                    for p, _ in lent:
                        p.end_full_copy(writeback=False)
                else:
                    ended = {id(p) for p, _ in lent}
                    for bucket in self.buckets_in_memory(writing=True):
                        for p in bucket:
                            if id(p) in ended:
                                p.end_full_copy(writeback=True)

    def end_training(self) -> None:
        """A run ended normally: the module stays sharded at rest for evaluation, checkpoints or
        another ``fit``; its hooks and communication buffers go (see [Note: after fit] in
        ``module_link.py``)."""
        self.schedule.end_step()
        self.schedule.close()
        self.pool.clear()
        for master in self.masters_on_disk:
            master.drop_unused()
            master.settle(wait=True)

    def resume(self) -> None:
        self.schedule.open()

    def release_to(self, device: torch.device) -> None:
        """Give the module plain full parameters on ``device`` again (one unit on the compute
        device at a time) and drop the sharding (a stage-3 model handed to a differently configured
        engine: every rank then holds the whole model)."""
        full = {id(p): value for p, value in self.full_values(device)}
        self.close()
        for p in self.params:
            p.param.data = full[id(p)]
        # every gather on the engine's own group has finished; a failed run (``close`` alone) keeps
        # the group, since a gather may still be waiting there for a peer
        if self._own_group is not None:
            collectives.destroy_group(self._own_group)
            self._own_group = None

    def close(self) -> None:
        self.schedule.close()
        self.pool.clear()
        for p in self.params:  # plain parameters again (with empty placeholders, unless released)
            p.let_go()
            ParameterAtRest.names.pop(id(p.param), None)
            ParameterAtRest.adopters.pop(id(p.param), None)
            ParameterAtRest.readers.pop(id(p.param), None)
            ParameterAtRest.writers.pop(id(p.param), None)


def _adopter_at_rest(residency: ShardedParameters, param: ShardedParam) -> Callable[[Tensor], bool]:
    """What adopts ``param.param.data = value`` at rest (see [Note: parameters at rest]); False
    once the engine is gone. It holds both weakly: the registry outlives a module dropped after fit."""
    residency_ref, param_ref = weakref.ref(residency), weakref.ref(param)

    def adopt(value: Tensor) -> bool:
        residency, param = residency_ref(), param_ref()
        if residency is None or param is None:
            return False
        param.check_adoptable(value)
        residency.write_full_value(param, value)
        return True

    return adopt


def _reader_at_rest(residency: ShardedParameters, param: ShardedParam) -> Callable[[], Tensor]:
    """What gathers ``param``'s full value for a read at rest (see ``reads_at_rest.py``); weak
    references, as ``_adopter_at_rest``'s."""
    residency_ref, param_ref = weakref.ref(residency), weakref.ref(param)

    def read() -> Tensor:
        residency, param = residency_ref(), param_ref()
        if residency is None or param is None:
            raise RuntimeError("The lightning-zero engine that held this parameter is gone; its values went with it.")
        return residency.reads.full_value(param)

    return read


class _WriterAtRest:
    """How a write at rest reaches ``param``'s chunk (``at_rest.Writer``; see [Note: writes at rest]
    in ``shards/at_rest.py``). Weak references, as ``_adopter_at_rest``'s."""

    def __init__(self, residency: ShardedParameters, param: ShardedParam) -> None:
        self._residency, self._param = weakref.ref(residency), weakref.ref(param)

    def _held(self) -> tuple[ShardedParameters, ShardedParam]:
        residency, param = self._residency(), self._param()
        if residency is None or param is None:
            raise RuntimeError("The lightning-zero engine that held this parameter is gone; a write would reach nothing.")
        return residency, param

    def start(self, keep_values: bool) -> Tensor:
        residency, param = self._held()
        return residency.reads.value_to_write(param, keep_values)

    def finish(self, full: Tensor) -> None:
        residency, param = self._held()
        residency.write_full_value(param, full)
