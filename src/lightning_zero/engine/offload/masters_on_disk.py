"""Stage-3 parameter chunks on NVMe: each offloaded bucket's master chunks live in a scratch file
and are in host memory only around their uses.

[Note: parameters on disk]
With ``offload_params="nvme"`` a bucket's ``HostChunks.master`` (every parameter's fp32 chunk, see
[Note: offloaded bucket] in ``host_chunks.py``) is what the all-gather sends and what the optimizer
steps; its ``ShardedParam.shard`` views are the optimizer's parameters, keyed in its state. Between
uses the master's *storage* is shrunk to 0 bytes (the tensor, its views and the optimizer's keys all
stay), and its bytes live in one scratch file per bucket and rank. A use brackets itself with
:meth:`MasterOnDisk.acquire` / :meth:`MasterOnDisk.release`:

- **acquire** grows the storage again and reads the file into it (or waits for a read started
  earlier by :meth:`MasterOnDisk.fetch`, the read-ahead: the gather schedule fetches the unit after
  the ones it prefetches, the optimizer's stream the buckets it reads state for);
- **release** of the last hold frees the storage at once if nothing was written; after a write
  (the optimizer step, a checkpoint load, an edit kept by ``summon_full_params``) the file is
  rewritten in the background and the storage freed once that write is done (:meth:`settle`).

So the host holds the masters of the units read ahead and of the buckets the optimizer streams,
not the whole shard. Reading a master at rest would read freed memory: its shards' class is then
:class:`ChunkOnDisk`, which refuses any read of their values with a message, as a stage-3
parameter at rest does (see [Note: parameters at rest] in ``at_rest.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_zero.engine.comm.copy_memory import PinnedBlocks
from lightning_zero.engine.offload.scratch_files import PendingIO, ScratchFile
from lightning_zero.engine.shards.at_rest import ParameterAtRest
from lightning_zero.engine.shards.partition import ChunkLayout
from lightning_zero.engine.shards.sharded_param import master_dtype_of


class ChunkOnDisk(ParameterAtRest):
    """The class of an optimizer's parameter (a master chunk) while its bucket is on disk."""

    @staticmethod
    def refusal(param: Any, operation: str) -> str:
        return (
            f"`{operation}` on a chunk of the weights that lightning-zero keeps on NVMe"
            " (`offload_params='nvme'`): between its uses the chunk is in its scratch file, not in"
            " memory, so it would read freed memory. HINT: read the weights inside"
            " `strategy.summon_full_params()`, or save a checkpoint; the engine reads the chunks in"
            " for the optimizer step, the gathers and checkpoints."
        )

    def __repr__(self) -> str:
        return f"ChunkOnDisk(shape={tuple(self.shape)}: in lightning-zero's NVMe scratch file)"


def master_bytes_needed(module: nn.Module, world_size: int) -> int:
    """Bytes of this rank's master chunks of ``module``'s parameters (padding included): what
    ``offload_params="nvme"`` writes to disk, known before the model is materialized."""
    total = 0
    for p in module.parameters():
        itemsize = master_dtype_of(p).itemsize  # a frozen one's in its own dtype (see [Note: frozen chunks])
        total += ChunkLayout(p.numel(), world_size).padded_chunk_numel * itemsize
    return total


class MasterOnDisk:
    """One bucket's master chunks (``master``, and the ``shards`` viewing it) kept in ``file``
    between uses (see [Note: parameters on disk]). Written to the file at once and freed.
    ``pinned``: where ``master`` is pinned, the count of pinned blocks its storage takes and gives
    back at each use (see [Note: pinned blocks] in ``copy_memory.py``)."""

    def __init__(
        self, master: Tensor, shards: Sequence[nn.Parameter], file: ScratchFile, pinned: Optional[PinnedBlocks] = None
    ) -> None:
        self.master = master
        self._pinned = pinned
        self.shards = list(shards)
        self.file = file
        self.nbytes = master.numel() * master.element_size()
        self._holds = 0
        self._wanted = False  # fetched for a use that has not acquired it yet: kept in memory
        self._dirty = False  # memory is newer than the file, and no write of it has started
        self._read: Optional[PendingIO] = None
        self._write: Optional[PendingIO] = None
        self.in_memory = True
        self.after_step: Optional[Callable[[], None]] = None
        """Run by ``stepped`` (the bucket's device copies of the chunks are refreshed there, while
        the chunks are still in memory)."""
        self.file.start_write(self._bytes(), self.nbytes).wait()
        self._free()

    def _bytes(self) -> Tensor:
        return self.master.view(torch.uint8)

    @property
    def held(self) -> bool:
        return self._holds > 0

    # ---- uses ----------------------------------------------------------------------------------
    def fetch(self) -> None:
        """Start reading the chunks into memory for a use soon (a no-op if they are there)."""
        self._wanted = True
        if self.in_memory:
            return
        for shard in self.shards:
            shard.__class__ = nn.Parameter
        self.master.untyped_storage().resize_(self.nbytes)
        if self._pinned is not None:
            self._pinned.taken(self.nbytes)
        self.in_memory = True
        self._read = self.file.start_read(self._bytes(), self.nbytes)

    def acquire(self, writing: bool = False) -> None:
        """The chunks are in memory until the matching ``release`` (waiting for their read, and
        with ``writing`` for a write of them still in flight, which must not see the new values)."""
        self.fetch()
        self._wanted = False
        if self._read is not None:
            read, self._read = self._read, None
            read.wait()
        if writing and self._write is not None:
            write, self._write = self._write, None
            write.wait()
        self._holds += 1

    def stepped(self) -> None:
        """The optimizer just stepped the chunks (while it holds them)."""
        if self.after_step is not None:
            self.after_step()

    def release(self, written: bool = False) -> None:
        """End a use; ``written``: it changed the chunks. The last release writes them back (in the
        background) if any use changed them, and frees the memory once nothing reads it."""
        if self._holds <= 0:
            raise RuntimeError("MasterOnDisk.release without a matching acquire")
        self._holds -= 1
        self._dirty |= written
        if self._holds == 0 and self._dirty:
            if self._write is not None:  # an older write of this memory: the new one replaces it
                self._write.wait()
            self._write = self.file.start_write(self._bytes(), self.nbytes)
            self._dirty = False
        self.settle()

    @property
    def writing(self) -> bool:
        """A write of the chunks is in flight (the memory is freed once it is done)."""
        return self._write is not None

    def settle(self, wait: bool = False) -> None:
        """Free the memory if no use holds or wants it and no write of it is in flight (``wait``:
        wait for that write first; else only a finished one counts)."""
        if self._write is not None and (wait or self._write.done()):
            write, self._write = self._write, None
            write.wait()  # raises what the write raised
        if self.in_memory and not self._holds and not self._wanted and self._write is None:
            if self._read is not None:  # fetched, never used: the reader thread writes into it
                read, self._read = self._read, None
                read.wait()
            self._free()

    def drop_unused(self) -> None:
        """A fetch whose use did not come (the step went another way): free it if nothing else holds it."""
        self._wanted = False
        self.settle()

    def _free(self) -> None:
        self.master.untyped_storage().resize_(0)  # pinned: the block stays in torch's pinned cache
        if self._pinned is not None:
            self._pinned.given_back(self.nbytes)
        for shard in self.shards:
            if type(shard) is nn.Parameter:
                shard.__class__ = ChunkOnDisk
        self.in_memory = False

