"""Optimizer state on NVMe, stepped one bucket at a time through a few host buffers.

[Note: optimizer state on disk]
With ``offload_optimizer="nvme"`` the optimizer's per-element state (Adam's moments, SGD's momentum:
every state tensor shaped like its parameter's shard) lives in scratch files, one per bucket and
rank (``scratch_files.py``), instead of host memory. The optimizer object stays the user's, with
its class, param groups, hyperparameters and schedulers; what changes:

- **Between steps** each such state entry holds an empty placeholder. Non-element state (Adam's
  ``step`` counter) stays where the optimizer put it.
- **``step``** runs the closure, then the optimizer's own update one bucket at a time: bucket k's
  state is read into a host staging buffer, its entries bound as views of that buffer
  (``optimizer.state[shard][key] = view``), the update runs with each param group's ``params``
  narrowed to bucket k's shards, the entries go back to placeholders and the buffer is written
  back. Reads run ahead: while bucket k steps, the next buckets are read into free buffers, and
  bucket k-1's write finishes; a buffer is reused once its write is done. The first buckets'
  reads start when the backward that precedes the step finishes (``prefetch``), so the step
  rarely waits for a read. ``buffer_count`` buffers,
  each the size of the largest bucket's state, are all the host memory the state takes. Step hooks
  run once per ``step``, as before.
- **Arithmetic:** an element-wise optimizer (the only kind the engine takes) updates each element
  from that element's state alone, so stepping bucket by bucket gives the bits that stepping all at
  once gives, with torch's fused CPU kernel too: NVMe offload is bitwise equal to CPU offload.
- **First step of a bucket:** the optimizer creates its state itself, in ordinary memory, for that
  bucket only; it is packed into a staging buffer, written, and released. The bucket's layout (its
  entries' keys, dtypes and offsets) is fixed then, and grows if a parameter gains state later.
- **Parameters on disk too** (``offload_params="nvme"``): a bucket's master chunks (what the
  optimizer steps) are read with its state, ahead, and written back with it; they leave memory
  once their write is done (see [Note: parameters on disk] in ``masters_on_disk.py``).
- **``state_dict()``** returns the entries read back from the files into fresh host tensors (this
  rank's state, for as long as the caller keeps it: a checkpoint's save). **``load_state_dict()``**
  writes the loaded state to the files and releases it. Checkpoints therefore hold the state as
  under every other option, and a resumed run refills the files.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_zero.engine.device_roles import mark_host
from lightning_zero.engine.offload.masters_on_disk import MasterOnDisk
from lightning_zero.engine.offload.scratch_files import PendingIO, ScratchDirectory
from lightning_zero.engine.offload.staging import StagingBuffers, return_freed_memory
from lightning_zero.engine.offload.state_layout import BucketState, StateEntry
from lightning_zero.engine.optimizer.instance_step import instance_step, unhooked_step
from lightning_zero.engine.optimizer.sharded_optimizer import STEP_KEY
from lightning_zero.engine.shards.sharded_param import ShardedParam


class OptimizerStateOnDisk:
    """Keeps one optimizer's per-element state in files, one per bucket (see [Note: optimizer state
    on disk]). ``buckets``: the positions (``state_dict`` order) of each bucket's parameters."""

    def __init__(
        self,
        optimizer: Optimizer,
        params: Sequence[ShardedParam],
        buckets: Sequence[Sequence[int]],
        directory: ScratchDirectory,
        name: str,
        staging: StagingBuffers,
        masters: Optional[Sequence[Optional[MasterOnDisk]]] = None,
    ) -> None:
        self.optimizer = optimizer
        self.shards = [p.shard for p in params]
        self.staging = staging
        self.directory = directory
        masters = masters if masters is not None else [None] * len(buckets)
        self.buckets = [
            BucketState(list(positions), directory.new_file(f"{name}-bucket{k}.bin"), master=master)
            for k, (positions, master) in enumerate(zip(buckets, masters))
            if positions
        ]
        self._placeholders: dict[torch.dtype, Tensor] = {}
        self._unhooked = unhooked_step(optimizer)
        self._writes: deque[tuple[BucketState, Tensor, PendingIO]] = deque()
        self._prefetched: deque[tuple[BucketState, Tensor, Optional[PendingIO]]] = deque()
        self._had_step = "step" in optimizer.__dict__
        self._previous_step = optimizer.__dict__.get("step")
        # torch's hooks around the streamed step, seen by LR schedulers made before or after
        optimizer.step = instance_step(optimizer, lambda _, kwargs: self._stream(self._due(), kwargs))  # type: ignore[method-assign]
        self._handles: list[RemovableHandle] = [
            optimizer.register_state_dict_post_hook(self._read_into_state_dict),
            optimizer.register_load_state_dict_post_hook(lambda _: self.spill()),
        ]
        self.spill()  # state loaded before (a resumed run's) goes to the files

    # ---- the step ----------------------------------------------------------------------------
    def _due(self) -> list[BucketState]:
        """The buckets the next step updates: those with a gradient."""
        return [b for b in self.buckets if any(self.shards[i].grad is not None for i in b.positions)]

    def has_gradients(self) -> bool:
        return any(shard.grad is not None for shard in self.shards)

    def prefetch(self) -> None:
        """Start reading the first buckets' state into staging buffers now (the gradients are
        final: the optimizer step is next), so that the step's first reads are not on its
        critical path. The step uses them if it updates those buckets first, else drops them."""
        self.discard_prefetched()
        for bucket in self._due()[: self.staging.count - 1]:  # one left for the step's own read-ahead
            self._prefetched.append((bucket, *self._start_reading(bucket)))

    def _start_reading(self, bucket: BucketState) -> tuple[Tensor, Optional[PendingIO]]:
        """A staging buffer with ``bucket``'s state being read into it (and its chunks, where they
        live on disk, being read too)."""
        if bucket.master is not None:
            bucket.master.fetch()
        buffer = self.staging.take(bucket.nbytes)
        return buffer, bucket.file.start_read(buffer, bucket.nbytes) if bucket.entries else None

    def discard_prefetched(self) -> None:
        while self._prefetched:
            bucket, buffer, read = self._prefetched.popleft()
            if read is not None:
                read.wait()
            self.staging.give_back(buffer)
            if bucket.master is not None:
                bucket.master.drop_unused()

    def _stream(self, due: list[BucketState], step_kwargs: dict[str, Any]) -> None:
        """Step ``due`` in order, reading ahead into free buffers and writing behind: a buffer is
        reading, stepping or writing, and at most ``staging.count`` are in use at once."""
        reads: deque[tuple[Tensor, Optional[PendingIO]]] = deque()
        if [bucket for bucket, _, _ in self._prefetched] == due[: len(self._prefetched)]:
            reads.extend((buffer, read) for _, buffer, read in self._prefetched)
            self._prefetched.clear()
        self.discard_prefetched()
        next_read = len(reads)
        for k, bucket in enumerate(due):
            while self._writes and self._writes[0][2].done():
                self._finish_oldest_write()
            if next_read == k and len(self._writes) >= self.staging.count:
                self._finish_oldest_write()  # room for the bucket about to step: wait for a write
            while next_read < len(due) and len(reads) + len(self._writes) < self.staging.count:
                reads.append(self._start_reading(due[next_read]))
                next_read += 1
            buffer, read = reads.popleft()
            if read is not None:
                read.wait()
            if bucket.master is not None:
                bucket.master.acquire(writing=True)
            try:
                buffer = self._step_bucket(bucket, buffer, step_kwargs)
                if bucket.master is not None:
                    bucket.master.stepped()
            finally:
                if bucket.master is not None:
                    bucket.master.release(written=True)  # its write starts now
            self._writes.append((bucket, buffer, bucket.file.start_write(buffer, bucket.nbytes)))
        self.drain()

    def _finish_oldest_write(self) -> None:
        bucket, buffer, write = self._writes.popleft()
        write.wait()
        self.staging.give_back(buffer)
        if bucket.master is not None:
            bucket.master.settle(wait=True)  # its chunks' write, started with the state's

    def _step_bucket(self, bucket: BucketState, buffer: Tensor, step_kwargs: dict[str, Any]) -> Tensor:
        """Run the optimizer's update on ``bucket``'s shards with their state bound to ``buffer``;
        returns the buffer that holds the updated state (a larger one if the state grew)."""
        state = self.optimizer.state
        bound = {}
        for entry in bucket.entries:
            bound[(entry.position, entry.key)] = state[self.shards[entry.position]][entry.key] = entry.view(buffer)
        members = {id(self.shards[i]) for i in bucket.positions}
        groups = self.optimizer.param_groups
        all_params = [group["params"] for group in groups]
        try:
            for group in groups:
                group["params"] = [p for p in group["params"] if id(p) in members]
            start = time.perf_counter()
            self._unhooked(self.optimizer, **step_kwargs)
            self.directory.stats.add(update_seconds=time.perf_counter() - start)
        finally:
            for group, params in zip(groups, all_params):
                group["params"] = params
        return self._collect(bucket, buffer, bound)

    def _collect(self, bucket: BucketState, buffer: Tensor, bound: dict[tuple[int, str], Tensor]) -> Tensor:
        """After a bucket's update: every per-element entry into ``buffer`` (the optimizer may have
        replaced a bound view, or made state for the first time), then placeholders in the optimizer."""
        fresh: list[tuple[StateEntry, Tensor]] = []
        for position in bucket.positions:
            shard = self.shards[position]
            for key, value in self.optimizer.state.get(shard, {}).items():
                if not _per_element(key, value, shard):
                    continue
                view = bound.get((position, key))
                if view is None:
                    fresh.append((bucket.add_entry(position, key, value), value))
                elif value.data_ptr() != view.data_ptr():
                    view.copy_(value)
        if bucket.nbytes > buffer.numel():  # state appeared: a larger buffer, with what is there already
            grown = self.staging.take(bucket.nbytes)
            grown[: buffer.numel()].copy_(buffer)
            self.staging.give_back(buffer)
            buffer = grown
        for entry, value in fresh:
            entry.view(buffer).copy_(value.reshape(-1))
        self._release(bucket)
        if fresh:
            del fresh, value
            return_freed_memory()
        return buffer

    def _release(self, bucket: BucketState) -> None:
        for entry in bucket.entries:
            self.optimizer.state[self.shards[entry.position]][entry.key] = self._placeholder(entry.dtype)

    def _placeholder(self, dtype: torch.dtype) -> Tensor:
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.empty(0, dtype=dtype)
        return self._placeholders[dtype]

    def drain(self) -> None:
        """Wait for every read and write in flight; prefetched state is dropped."""
        self.discard_prefetched()
        while self._writes:
            self._finish_oldest_write()

    # ---- state_dict / load_state_dict ----------------------------------------------------------
    def _read_into_state_dict(self, _: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict()`` post-hook: every entry read back from its file into a fresh host tensor."""
        self.drain()
        packed = state_dict["state"]
        copied: set[int] = set()
        for bucket in self.buckets:
            if not bucket.entries:
                continue
            buffer = mark_host(torch.empty(bucket.nbytes, dtype=torch.uint8))
            bucket.file.start_read(buffer, bucket.nbytes).wait()
            for entry in bucket.entries:
                if entry.position not in copied:  # never write into the optimizer's own state dicts
                    packed[entry.position] = dict(packed.get(entry.position, {}))
                    copied.add(entry.position)
                packed[entry.position][entry.key] = entry.view(buffer)
        return state_dict

    def spill(self) -> None:
        """Write whatever per-element state the optimizer holds in memory to the files and release
        it (after ``load_state_dict``, and at construction)."""
        self.drain()
        for bucket in self.buckets:
            in_memory = [
                (position, key, value)
                for position in bucket.positions
                for key, value in self.optimizer.state.get(self.shards[position], {}).items()
                if _per_element(key, value, self.shards[position])
            ]
            if not in_memory:
                continue
            bucket.entries = []
            for position, key, value in in_memory:
                bucket.add_entry(position, key, value)
            buffer = self.staging.take(bucket.nbytes)
            for entry, (_, _, value) in zip(bucket.entries, in_memory):
                entry.view(buffer).copy_(value.reshape(-1))
            bucket.file.start_write(buffer, bucket.nbytes).wait()
            self.staging.give_back(buffer)
            self._release(bucket)
            del in_memory
            return_freed_memory()

    @property
    def disk_bytes(self) -> int:
        """Bytes of state in this optimizer's files."""
        return sum(bucket.nbytes for bucket in self.buckets)

    def close(self) -> None:
        """Give the optimizer back its own ``step`` and hooks, and delete the files. The state in
        them ends with the engine (a checkpoint saved before holds it): the optimizer is left with
        no state for these parameters, as if it had never stepped them, rather than placeholders."""
        self.drain()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._had_step:
            self.optimizer.step = self._previous_step  # type: ignore[method-assign]
        else:
            self.optimizer.__dict__.pop("step", None)
        for bucket in self.buckets:
            if bucket.entries:
                for position in bucket.positions:
                    self.optimizer.state.pop(self.shards[position], None)
            bucket.file.remove()


def _per_element(key: str, value: Any, shard: Tensor) -> bool:
    """State kept on disk: tensors shaped like the shard (not the step count, not scalars)."""
    return key != STEP_KEY and isinstance(value, Tensor) and value.shape == shard.shape
