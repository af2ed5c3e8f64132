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
  (``optimizer.state[shard][key] = view``), the update runs on a view of the optimizer whose param
  groups hold only bucket k's shards (the user's optimizer is never narrowed), the entries go back
  to placeholders and the buffer is written back. Reads run ahead: while bucket k steps, the next
  buckets are read into free buffers, and bucket k-1's write finishes; a buffer is reused once its
  write is done (``bucket_pipeline.py``). The first buckets' reads start when the backward that
  precedes the step finishes (``prefetch``), so the step rarely waits for a read.
  ``buffer_count`` buffers, each the size of the largest bucket's state, are all the host memory
  the state takes. Step hooks run once per ``step``, as before.
- **Two slots per file** (``state_layout.py``): a write goes to the slot that is not the current
  one, and the end of ``optimizer.step()`` (a step post-hook, ``commit``) waits for every write and
  makes the written slots current. A write that fails fails the step with every bucket's state as
  the last committed step left it; the files take twice the state (``disk_tier.STATE_SLOTS``).
- **During backward** (``overlap_host_step``, the default): the host step's worker streams each
  bucket as its gradients land (its read issued at the landing), so the step is taken before
  ``optimizer.step()``; the verdict there keeps it (the commit) or undoes it by forgetting the
  written slot, with no copy of the state in host memory (see ``disk_step_ahead.py`` and [Note: the
  host step during backward] in ``step_ahead.py``).
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
  rank's state, for as long as the caller keeps it: a checkpoint's save) from each file's current
  slot; a step taken ahead and not committed is undone before (the engine's ``settle``). **``load_state_dict()``**
  writes the loaded state to the files and releases it. Checkpoints therefore hold the state as
  under every other option, and a resumed run refills the files.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_zero.engine.device_roles import mark_host
from lightning_zero.engine.offload.masters_on_disk import MasterOnDisk
from lightning_zero.engine.offload.bucket_pipeline import BucketPipeline
from lightning_zero.engine.offload.scratch_files import PendingIO, ScratchDirectory
from lightning_zero.engine.offload.staging import StagingBuffers, return_freed_memory
from lightning_zero.engine.offload.state_layout import BucketState, Slot, StateEntry, add_entry
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
        self._bucket_of = {id(self.shards[i]): bucket for bucket in self.buckets for i in bucket.positions}
        self._placeholders: dict[torch.dtype, Tensor] = {}
        self._unhooked = unhooked_step(optimizer)
        self.pipeline = BucketPipeline(staging, self._start_reading, self._written, self._dropped, self._discard_all)
        self._had_step = "step" in optimizer.__dict__
        self._previous_step = optimizer.__dict__.get("step")
        # torch's hooks around the streamed step, seen by LR schedulers made before or after
        optimizer.step = instance_step(optimizer, lambda opt, kwargs: self.step_body(opt, **kwargs))  # type: ignore[method-assign]
        self._handles: list[RemovableHandle] = [
            optimizer.register_step_post_hook(lambda *_: self.commit()),
            optimizer.register_state_dict_post_hook(self._read_into_state_dict),
            optimizer.register_load_state_dict_post_hook(lambda _: self.spill()),
        ]
        self.spill()  # state loaded before (a resumed run's) goes to the files

    # ---- the step ----------------------------------------------------------------------------
    def _due(self, members: Optional[set[int]] = None) -> list[BucketState]:
        """The buckets a step updates: those with a gradient (among ``members``, ``id``s of shards)."""
        return [
            b for b in self.buckets
            if any(self.shards[i].grad is not None and (members is None or id(self.shards[i]) in members) for i in b.positions)
        ]  # fmt: skip

    def has_gradients(self) -> bool:
        return any(shard.grad is not None for shard in self.shards)

    def bucket_of(self, shard: Tensor) -> Optional[BucketState]:
        """The bucket whose state holds ``shard``'s (None: not one of this optimizer's)."""
        return self._bucket_of.get(id(shard))

    def prefetch(self) -> None:
        """Start reading the state of the buckets the step will stream (those with gradients, but
        those a step taken during backward wrote already) into staging buffers now, so that the
        step's first reads are not on its critical path."""
        self.pipeline.drop_reads()
        self.pipeline.want([b for b in self._due() if b.pending is None])

    def want(self, shard: Tensor) -> None:
        """``shard``'s bucket steps soon (its gradients are landing): read its state ahead."""
        bucket = self._bucket_of.get(id(shard))
        if bucket is not None:
            self.pipeline.want([bucket])

    def _start_reading(self, bucket: BucketState, buffer: Tensor) -> Optional[PendingIO]:
        """Start reading ``bucket``'s current slot into ``buffer`` (and its chunks, where they live
        on disk); None where it has no state yet."""
        if bucket.master is not None:
            bucket.master.fetch()
        slot = bucket.current
        return bucket.file.start_read(buffer, slot.nbytes, slot.offset) if slot.entries else None

    def _written(self, bucket: BucketState) -> None:
        if bucket.master is not None:
            bucket.master.settle(wait=True)  # its chunks' write, started with the state's

    def _dropped(self, bucket: BucketState) -> None:
        if bucket.master is not None:
            bucket.master.drop_unused()  # fetched for a step that went another way

    def step_body(self, source: Optimizer, **step_kwargs: Any) -> None:
        """The optimizer's update of ``source``'s parameters (the optimizer itself, or a view of it
        narrowed to some buckets' shards: the host step during backward), streamed bucket by bucket
        in the order they were wanted: each read (ahead), stepped, and written behind to its other
        slot, which the end of ``optimizer.step()`` commits (``commit``). At most ``staging.count``
        buffers are in use at once: reading, stepping or writing."""
        members = {id(p) for group in source.param_groups for p in group["params"]}
        due = self.pipeline.order(self._due(members))
        self.pipeline.want(due)
        for bucket in due:
            buffer, read = self.pipeline.take(bucket)
            if read is not None:
                read.wait()
            if bucket.master is not None:
                bucket.master.acquire(writing=True)
            try:
                buffer, slot = self._step_bucket(source, bucket, buffer, step_kwargs)
                if bucket.master is not None:
                    bucket.master.stepped()
            finally:
                if bucket.master is not None:
                    bucket.master.release(written=True)  # its write starts now
            self.pipeline.write_behind(bucket, buffer, slot)

    def _step_bucket(self, source: Optimizer, bucket: BucketState, buffer: Tensor, step_kwargs: dict[str, Any]) -> tuple[Tensor, Slot]:
        """Run the optimizer's update on ``bucket``'s shards with their state bound to ``buffer``, on
        a view of ``source`` whose param groups hold only them (the user's optimizer is never
        narrowed: another thread may read it meanwhile); returns the buffer that holds the updated
        state (a larger one if the state grew) and the slot to write it to."""
        state = self.optimizer.state
        bound = {}
        for entry in bucket.entries:
            bound[(entry.position, entry.key)] = state[self.shards[entry.position]][entry.key] = entry.view(buffer)
        members = {id(self.shards[i]) for i in bucket.positions}
        narrowed = [
            {**group, "params": params}
            for group in source.param_groups
            if (params := [p for p in group["params"] if id(p) in members])
        ]  # fmt: skip
        view = object.__new__(type(self.optimizer))
        view.__dict__.update(source.__dict__)
        view.param_groups = narrowed
        try:
            start = time.perf_counter()
            self._unhooked(view, **step_kwargs)
            self.directory.stats.add(update_seconds=time.perf_counter() - start)
        finally:
            for group, stepped in zip([g for g in source.param_groups if any(id(p) in members for p in g["params"])], narrowed):
                for key, value in stepped.items():
                    if key != "params" and group.get(key) is not value:
                        group[key] = value  # an optimizer that counts in its groups
        return self._collect(bucket, buffer, bound)

    def _collect(self, bucket: BucketState, buffer: Tensor, bound: dict[tuple[int, str], Tensor]) -> tuple[Tensor, Slot]:
        """After a bucket's update: every per-element entry into ``buffer`` (the optimizer may have
        replaced a bound view, or made state for the first time), then placeholders in the
        optimizer; the slot the buffer goes to (laid out with the new entries)."""
        fresh: list[tuple[StateEntry, Tensor]] = []
        layout = list(bucket.entries)
        for position in bucket.positions:
            shard = self.shards[position]
            for key, value in self.optimizer.state.get(shard, {}).items():
                if not _per_element(key, value, shard):
                    continue
                view = bound.get((position, key))
                if view is None:
                    fresh.append((add_entry(layout, position, key, value), value))
                elif value.data_ptr() != view.data_ptr():
                    view.copy_(value)
        slot = bucket.next_slot(layout)
        if slot.nbytes > buffer.numel():  # state appeared: a larger buffer, with what is there already
            buffer = self.pipeline.grow(buffer, slot.nbytes)
        for entry, value in fresh:
            entry.view(buffer).copy_(value.reshape(-1))
        self._release(layout)
        if fresh:
            del fresh, value
            return_freed_memory()
        return buffer, slot

    def _release(self, entries: Sequence[StateEntry]) -> None:
        for entry in entries:
            self.optimizer.state[self.shards[entry.position]][entry.key] = self._placeholder(entry.dtype)

    def _placeholder(self, dtype: torch.dtype) -> Tensor:
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.empty(0, dtype=dtype)
        return self._placeholders[dtype]

    def commit(self) -> None:
        """The end of ``optimizer.step()``: wait for every write, then make each bucket's pending slot
        current (a failed write raises here, and every bucket keeps the state it had before)."""
        self.drain()
        for bucket in self.buckets:
            bucket.commit()

    def discard(self, shards: Sequence[Tensor]) -> None:
        """Undo the step written for ``shards``' bucket and not committed: its current slot stays the
        state (the write in flight finishes by itself, and the next write of the bucket waits for it)."""
        bucket = self._bucket_of.get(id(shards[0])) if shards else None
        if bucket is not None:
            bucket.discard()

    def _discard_all(self) -> None:
        for bucket in self.buckets:
            bucket.discard()

    def drain(self) -> None:
        """Wait for every read and write in flight; reads not taken are dropped."""
        self.pipeline.drain()

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
            bucket.file.start_read(buffer, bucket.nbytes, bucket.current.offset).wait()  # the current slot
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
            layout: list[StateEntry] = []
            for position, key, value in in_memory:
                add_entry(layout, position, key, value)
            slot = bucket.next_slot(layout)
            buffer = self.staging.take(slot.nbytes)
            for entry, (_, _, value) in zip(layout, in_memory):
                entry.view(buffer).copy_(value.reshape(-1))
            try:
                bucket.file.start_write(buffer, slot.nbytes, slot.offset).wait()
            finally:
                self.staging.give_back(buffer)
            bucket.pending = slot
            bucket.commit()
            self._release(layout)
            del in_memory
            return_freed_memory()

    @property
    def disk_bytes(self) -> int:
        """Bytes of this optimizer's files: both slots of each bucket's state."""
        return sum(bucket.file.nbytes for bucket in self.buckets)

    def close(self) -> None:
        """Give the optimizer back its own ``step`` and hooks, and delete the files. The state in
        them ends with the engine (a checkpoint saved before holds it): the optimizer is left with
        no state for these parameters, as if it had never stepped them, rather than placeholders.
        A write in flight that fails now is not raised: it can only be one of a step that failed
        already (a step's writes are all waited for when it commits), and the files go anyway."""
        with contextlib.suppress(OSError):
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
