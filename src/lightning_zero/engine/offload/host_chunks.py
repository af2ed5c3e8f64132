"""An offloaded bucket's chunks in host memory, and the copies that move them.

[Note: offloaded bucket]
With CPU offload each bucket keeps, in host memory allocated once (pinned when the device is CUDA,
see ``copy_stream.py``), laid out exactly as the bucket's rows (every parameter's chunk followed by
its padding; see [Note: chunk layout] in ``partition.py``):

- ``master`` (S,), in the master dtype (fp32 for half-precision weights): every parameter's chunk.
  Each ``ShardedParam.shard`` is a view of it, so the optimizer steps it in place, and one copy
  moves the whole bucket to the device for its all-gather (or stages 1-2's write-back).
- ``grads`` (S + F,), in the master dtype: the bucket's reduce-scatter result, chunks and its F
  flags (used flags and stop votes, see [Note: used flags] in ``bucket.py``). Each shard's
  ``.grad`` is a view of it: a reduced gradient reaches the optimizer with one copy, started as
  soon as the bucket's reduce-scatter finishes, during backward.
- ``landing`` (S + F,), allocated the first time a bucket's gradients arrive while its shards
  still hold gradients (accumulation over micro-batches, or ``zero_grad(set_to_none=False)``):
  the copy lands there and is added on the host.

With ``offload_params="nvme"`` the master lives in a scratch file between uses and is in host
memory only inside ``in_memory`` (see [Note: parameters on disk] in ``masters_on_disk.py``).

Casts between the weight dtype and the master dtype happen on the device, in pool buffers, never
in host temporaries. The optimizer's own state is allocated by the optimizer, once, on the host
next to the shards; it is not pinned, since it never crosses the bus.
"""

from __future__ import annotations

import operator
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Protocol, Sequence

import threading

import torch
from torch import Tensor

from lightning_zero.engine.comm.buffers import BufferPool
from lightning_zero.engine.comm.copy_stream import CopyStream, Event
from lightning_zero.engine.offload import handoffs
from lightning_zero.engine.offload.masters_on_disk import MasterOnDisk
from lightning_zero.engine.offload.scratch_files import ScratchDirectory
from lightning_zero.engine.shards.sharded_param import ShardedParam

_SHARD_GRAD = operator.attrgetter("shard.grad")


class Arrivals(Protocol):
    """What steps a bucket as its gradients arrive, during backward (``step_ahead.py``)."""

    def arrived(self, host: "HostChunks", row: Tensor, copy: Event) -> threading.Event:
        """``row`` is being copied to the host (``copy``); the event is set once ``accept_now`` ran."""
        ...


class HostChunks:
    """The host side of one offloaded bucket (see [Note: offloaded bucket])."""

    def __init__(
        self,
        params: Sequence[ShardedParam],
        row_sizes: Sequence[int],
        flag_count: int,
        copies: CopyStream,
        trainable: bool,
        files: Optional[ScratchDirectory] = None,
        name: str = "bucket",
    ) -> None:
        self.params = list(params)
        self.flag_count = flag_count
        self.copies = copies
        self.dtype = self.params[0].master_dtype
        self._row_sizes = list(row_sizes)  # [chunk 0, padding 0, chunk 1, padding 1, ...]
        self.shard_numel = sum(self._row_sizes)
        self.allocations = 0
        """Host buffers allocated: two or three, all before or at the first step."""
        self.master = self._allocate(self.shard_numel)
        self.master.zero_()  # the padding goes out with every all-gather and is never read
        for p, piece in zip(self.params, self._chunks(self.master)):
            p.move_shard_into(piece)
        self.on_disk: Optional[MasterOnDisk] = None
        """``offload_params="nvme"``: the master's file (see [Note: parameters on disk])."""
        if files is not None and self.master.numel():
            file = files.new_file(f"{name}.bin", holds="parameter chunks")
            pinned = self.copies.pinned_blocks if self.copies.pinned else None
            self.on_disk = MasterOnDisk(self.master, [p.shard for p in self.params], file, pinned)
            self.on_disk.after_step = self.refresh_device_chunks
            for p in self.params:
                p.master_in_memory = self.in_memory
        self.grads = self._allocate(self.row_numel) if trainable else None
        self._grad_chunks = self._chunks(self.grads) if self.grads is not None else []
        self._grad_places = [(chunk.data_ptr(), chunk.numel()) for chunk in self._grad_chunks]
        self.gradient_row: Optional[Tensor] = self.grads[: self.shard_numel] if self.grads is not None else None
        """(S,): the chunks of ``grads``, where the shards' gradients live once handed out (a
        gradient assigned by hand lives elsewhere: ``holds_gradient``)."""
        self._landing: Optional[Tensor] = None
        self._landing_chunks: list[Tensor] = []
        self.arrivals: Optional[Arrivals] = None
        """While this bucket steps during backward (see [Note: the host step during backward] in
        ``step_ahead.py``): told of each reduced row as its copy starts; it hands the gradients out."""
        self._accepted_ahead: Optional[threading.Event] = None
        self.before_device_read: Optional[Callable[[], None]] = None
        """Where the host step's thread refreshes the device chunks as soon as it stepped them
        (``buckets/copies_back.py``): called before a gather reads them while ``unsettled``."""
        self.unsettled: Optional[Callable[[], None]] = None
        """Set while the master chunks hold a step taken ahead of its verdict: called before anything
        reads them (a gather, a copy to the device), it undoes that step first."""

    @property
    def row_numel(self) -> int:
        """S + F: a reduced row, chunks and flags."""
        return self.shard_numel + self.flag_count

    @property
    def gradient_rows(self) -> list[Tensor]:
        """The host buffers gradients land in (``grads``, and ``landing`` once it exists)."""
        return [row for row in (self.grads, self._landing) if row is not None]

    @property
    def device_chunks(self) -> list[Tensor]:
        """The device copies of the chunks that the all-gather sends, where the device keeps them
        (half-precision weights, or only the optimizer offloaded at stage 3); else empty."""
        return [p.device_chunk for p in self.params if p.device_chunk is not None]

    @contextmanager
    def in_memory(self, writing: bool = False) -> Iterator[None]:
        """A context in which ``master`` (and the shards viewing it) can be read, and with
        ``writing`` written; a no-op unless it lives on disk between uses."""
        if self.unsettled is not None:
            self.unsettled()
        if self.on_disk is None:
            yield
            return
        self.on_disk.acquire(writing)
        try:
            yield
        finally:
            self.on_disk.release(writing)
            if writing:  # between steps: the chunks leave memory now, not at their next use
                self.on_disk.settle(wait=True)

    def fetch(self) -> None:
        """A use of ``master`` is coming: start reading it from disk (where it lives there)."""
        if self.on_disk is not None:
            self.on_disk.fetch()

    def _allocate(self, numel: int) -> Tensor:
        self.allocations += 1
        return self.copies.host_buffer(numel, self.dtype)

    def _chunks(self, row: Tensor) -> list[Tensor]:
        pieces = torch.split_with_sizes(row[: self.shard_numel], self._row_sizes)
        return list(pieces[0::2])

    # ---- gradients: device → host ------------------------------------------------------------
    def receive(self, reduced: Tensor, pool: BufferPool) -> tuple[Tensor, Event]:
        """Start copying a reduced row (S + F,) from the device; returns the host row it lands in and
        the copy's event (hand ``reduced`` back to its pool with it). Read the row after the copy
        stream is synchronized."""
        staged = reduced
        if reduced.dtype != self.dtype:  # half-precision gradients: cast on the device
            staged = pool.take(reduced.numel(), self.dtype, reduced.device)
            staged.copy_(reduced)
        grads = list(map(_SHARD_GRAD, self.params))  # one C-level pass (this runs in backward, per bucket)
        row = self.grads if grads.count(None) == len(grads) else self._landing_row()
        copy = self.copies.to_host(row, staged)
        if staged is not reduced:
            pool.give_back(staged, copy)
        if self.arrivals is not None:
            self._accepted_ahead = self.arrivals.arrived(self, row, copy)
        return row, copy

    def _landing_row(self) -> Tensor:
        if self._landing is None:
            self._landing = self._allocate(self.row_numel)
            self._landing_chunks = self._chunks(self._landing)
        return self._landing

    def holds_gradient(self, i: int, grad: Optional[Tensor]) -> bool:
        """Whether ``grad`` views the chunk of ``gradient_row`` that parameter ``i``'s gradients land
        in, as handed out (``set_`` or ``.data =`` keep a tensor object and move what it views)."""
        if grad is None or i >= len(self._grad_places) or grad.dtype != self.dtype or grad.stride() not in ((1,), (0,)):
            return False
        return (grad.data_ptr(), grad.numel()) == self._grad_places[i]

    def _handed_out_chunks(self) -> list[Tensor]:
        """The chunks of ``grads`` to hand out as the shards' gradients: made again where user code
        moved one it was handed (``shard.grad.set_(...)``, ``shard.grad.data = ...``), which would
        otherwise take every later gradient somewhere else."""
        if not all(self.holds_gradient(i, chunk) for i, chunk in enumerate(self._grad_chunks)):
            self._grad_chunks = self._chunks(self.grads)
        return self._grad_chunks

    def accept(self, row: Tensor, used_anywhere: Sequence[float]) -> None:
        """Give every parameter a rank used its chunk of ``row`` as ``shard.grad``, added to what it
        holds already (see [Note: used flags] in ``bucket.py``); where the row went to a step during
        backward, that step's thread has done so: wait for it."""
        if self._accepted_ahead is not None:
            accepted, self._accepted_ahead = self._accepted_ahead, None
            handoffs.wait_for(accepted, "gradients handed out on the host step's thread")
            return
        self.accept_now(row, used_anywhere)

    def accept_now(self, row: Tensor, used_anywhere: Sequence[float]) -> None:
        """``accept`` itself, on the thread that calls it."""
        handed = self._handed_out_chunks()
        chunks = handed if row is self.grads else self._landing_chunks
        for i, p in enumerate(self.params):
            if used_anywhere[i] <= 0:
                continue
            if row is self.grads:  # all shards' gradients were None
                p.shard.grad = chunks[i]
            elif p.shard.grad is None:
                handed[i].copy_(chunks[i])
                p.shard.grad = handed[i]
            else:
                p.shard.grad.add_(chunks[i])

    # ---- weights: host → device ---------------------------------------------------------------
    def copy_master_to(self, out: Tensor) -> None:
        """Copy every chunk (S,) into ``out`` on the device, cast to its dtype there; kernels later
        on the compute stream see the result."""
        with self.in_memory():  # a step taken ahead of its verdict is undone first (`unsettled`)
            out.copy_(self.copies.to_device(self.master))

    def refresh_device_chunks(self, settle: bool = True) -> None:
        """After the optimizer stepped the master chunks: bring them to the device copies. ``settle``:
        a step taken ahead of its verdict is undone first (False: the caller copies that step on
        purpose, ``buckets/copies_back.py``)."""
        targets = self.device_chunks
        if targets and not settle:
            self._refresh(targets)
        elif targets:
            with self.in_memory():
                self._refresh(targets)

    def _refresh(self, targets: list[Tensor]) -> None:
        row = self.copies.to_device(self.master)
        sources = [chunk for p, chunk in zip(self.params, self._chunks(row)) if p.device_chunk is not None]
        torch._foreach_copy_(targets, sources)
