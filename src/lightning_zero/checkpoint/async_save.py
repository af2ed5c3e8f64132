"""Asynchronous sharded saves (``async_save=True``): the training step waits only while this rank's
shards are copied; the files and the commit are written on a background thread.

[Note: async saves]
A save is split in two, as ``start_save`` / ``finish_save``:

- In the foreground, on every rank (``ZeroCheckpointing.save``): the save in flight, if any, is
  finished first (at most one at a time: its staging buffers are about to be overwritten, and a
  failure it had is raised here); then this rank's DCP tensors are copied into ``StagingBuffers``
  (kept for the next save; pinned host memory on CUDA), each once, straight from where training
  keeps it, with one stream synchronization for the save (see [Note: host copies of a save] in
  ``sharded.py``), and rank 0 serializes meta.pt. From then
  on nothing the save writes aliases what training changes. The ranks agree on the outcome of that
  copy like any foreground step, so a failure there is raised on every rank at once.
- In the background, one thread per rank, on the rank's CUDA device (a new thread's is GPU 0), with
  DCP's serial loader (its default copies ahead on a CUDA stream; the staged tensors are on the host
  already): exactly what a synchronous save does after that point —
  DCP's writes, the checksums, meta.pt, the manifest last, the commit — so both paths leave the same
  files and raise the same ``CheckpointWriteError``. Its collectives run on a gloo group of its own,
  made on every rank at the first asynchronous save: collectives on one group must be issued in the
  same order on every rank, and the training thread issues its own meanwhile (under gloo on the
  default group, which DCP would otherwise share with it).
- The write ends in steps whose outcome every rank learns (``on_every_rank``, the commit's
  broadcast), so the error a failed save stores is the same on every rank; it is raised by the next
  ``finish_save`` (the next save or load, the end of ``fit``, teardown, a preemption stop).
  Nothing on disk is lost: a failed save never committed, so the previous checkpoint stays.
- ``after_commit``: work that must wait until the save in flight has committed, and must not run
  if it fails — ModelCheckpoint's removal of the checkpoint the new one supersedes.

The thread is not a daemon: a process that ends with a save in flight (a script that saves and
returns) waits for it at exit rather than leaving it half-written, and a failure no one waited for
is logged.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_zero.checkpoint.storage import CheckpointGroup
from lightning_zero.engine.comm.copy_memory import pinned_block_bytes

log = logging.getLogger(__name__)


class StagingBuffers:
    """Host copies of one rank's DCP tensors, in one arena kept from one save to the next (a model's
    tensors keep their keys, shapes and dtypes, so after the first save staging allocates nothing; new
    memory would cost a page fault per page, pinned memory a slow registration). Pinned on CUDA: one
    block, where a pinned buffer per tensor would each be rounded up to a power of two by torch's
    pinned allocator and kept by it after being freed (see [Note: pinned blocks] in ``copy_memory.py``)."""

    ALIGNMENT = 64
    """Bytes each tensor's place in the arena is aligned to (any dtype's alignment, a cache line)."""

    def __init__(self) -> None:
        self._arena: Optional[Tensor] = None  # (bytes,) uint8
        self._places: dict[str, Tensor] = {}  # DCP key -> its view of the arena
        self._layout: list[tuple[str, torch.Size, torch.dtype]] = []

    @property
    def held_bytes(self) -> int:
        """Host memory the arena holds: the pinned block it was served from on CUDA."""
        if self._arena is None:
            return 0
        nbytes = self._arena.numel()
        return pinned_block_bytes(nbytes) if self._arena.is_pinned() else nbytes

    def stage(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Copies of ``tensors`` (by DCP key, where training keeps them) in the arena, each copied
        once: a device tensor with a non-blocking copy (into pinned memory), then one stream
        synchronization for them all; a host tensor with a host copy. Returns once the copies landed:
        after that nothing staged aliases what training changes."""
        self._arrange([(key, t.shape, t.dtype) for key, t in tensors.items()])
        devices = set()
        for key, source in tensors.items():
            on_device = source.device.type == "cuda"
            self._places[key].copy_(source.detach(), non_blocking=on_device)
            if on_device:
                devices.add(source.device)
        wait_for_copies(devices)
        return {key: self._places[key] for key in tensors}

    def _arrange(self, layout: list[tuple[str, torch.Size, torch.dtype]]) -> None:
        """Give every (key, shape, dtype) of ``layout`` its place in the arena, allocating a new
        arena only when the layout changed (a new model or optimizer state) and outgrew the old one."""
        if layout == self._layout:
            return
        offsets, total = [], 0
        for _, shape, dtype in layout:
            offsets.append(total)
            nbytes = shape.numel() * dtype.itemsize
            total += -(-nbytes // self.ALIGNMENT) * self.ALIGNMENT
        if self._arena is None or self._arena.numel() < total:
            self._arena = None  # the old arena is freed before the new one is allocated
            self._arena = torch.empty(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self._places = {
            key: self._arena[offset : offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            for (key, shape, dtype), offset in zip(layout, offsets)
        }
        self._layout = layout

    def release(self) -> None:
        self._arena, self._places, self._layout = None, {}, []


class GroupRanks:
    """What ``ZeroCheckpointing``'s commit step needs of the ranks (``RankCoordination``), over
    ``group`` instead of the strategy's own collectives: the background save's gloo group."""

    def __init__(self, group: CheckpointGroup) -> None:
        self._group = group

    @property
    def is_global_zero(self) -> bool:
        return self._group.rank == 0

    @property
    def world_size(self) -> int:
        return self._group.size

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._group.all_gather(obj)[src]

    def barrier(self, name: Optional[str] = None) -> None:
        self._group.all_gather(None)


@dataclass
class InFlightSave:
    """The one save being written in the background."""

    path: Path
    started_at: float
    thread: Optional[threading.Thread] = None
    done: bool = False
    error: Optional[BaseException] = None
    after_commit: list[Callable[[], None]] = field(default_factory=list)


class FinishedSave(NamedTuple):
    """What ``finish_save`` hands back: the committed checkpoint."""

    path: Path
    seconds: float
    """From ``start_save`` until the foreground waited it out (the write, or less if it was done earlier)."""


class AsyncSaves:
    """Owns the one save in flight, its staging buffers and the background gloo group (see
    [Note: async saves]). ``timeout``: the strategy's, for that group's collectives."""

    def __init__(self, timeout: Optional[timedelta] = None) -> None:
        self.staging = StagingBuffers()
        self.group = CheckpointGroup(timeout, dedicated=True)
        self._lock = threading.Lock()
        self._in_flight: Optional[InFlightSave] = None

    def __getstate__(self) -> dict[str, Any]:
        # a strategy pickled to spawned ranks (or after fit) carries no thread, lock or buffers
        return {"staging": StagingBuffers(), "group": self.group}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock(), _in_flight=None)

    @property
    def in_flight(self) -> Optional[Path]:
        """Where the save in flight goes (None when none is)."""
        return self._in_flight.path if self._in_flight is not None else None

    def start_save(self, path: Path, write: Callable[[GroupRanks, CheckpointGroup], None]) -> InFlightSave:
        """Run ``write`` (the save's writes and commit, collective over the group given it) on a
        background thread. Call ``finish_save`` first: one save at a time. The group is made here,
        in the foreground, where every rank calls this at the same point."""
        assert self._in_flight is None, "finish_save() the save in flight first"
        group = self.group
        if not group.alone:
            group.group  # noqa: B018 - made now, by every rank, in the same order as the strategy's groups
        save = InFlightSave(path, time.perf_counter())
        device = _current_cuda_device()
        save.thread = threading.Thread(
            target=self._run, args=(save, write, device), name=f"lightning-zero save {path.name}", daemon=False
        )
        self._in_flight = save
        save.thread.start()
        return save

    def finish_save(self) -> Optional[FinishedSave]:
        """Wait for the save in flight (None if there is none); raise its error if it failed (the
        same ``CheckpointWriteError`` on every rank)."""
        save = self._in_flight
        if save is None:
            return None
        assert save.thread is not None
        save.thread.join()
        self._in_flight = None
        if save.error is not None:
            raise save.error
        return FinishedSave(save.path, time.perf_counter() - save.started_at)

    def after_commit(self, work: Callable[[], None]) -> None:
        """Run ``work`` once the save in flight has committed: now if none is in flight or it already
        has, on the save's thread right after its commit otherwise; never if that save failed (what
        ``work`` would remove may then be the newest complete checkpoint)."""
        with self._lock:
            save = self._in_flight
            if save is not None and not save.done:
                save.after_commit.append(work)
                return
        if save is not None and save.error is not None:
            log.warning("Not removing a checkpoint: the save meant to supersede it failed (raised at the next save).")
            return
        work()

    def release(self) -> None:
        """Free the staging buffers (after waiting for the save that may be reading them, whose
        error is raised once they are freed)."""
        try:
            self.finish_save()
        finally:
            self.staging.release()

    def _run(self, save: InFlightSave, write: Callable[[GroupRanks, CheckpointGroup], None], device: Optional[int]) -> None:
        try:
            if device is not None:
                # a new thread's current CUDA device is 0 whatever the rank's: anything in the write
                # that touched CUDA would make a context on GPU 0 from every rank
                torch.cuda.set_device(device)
            write(GroupRanks(self.group), self.group)
        except BaseException as err:  # noqa: BLE001 - stored, raised by the next finish_save on this rank
            save.error = err
            log.error(f"Asynchronous save of {str(save.path)!r} failed (raised at the next save, load or teardown): {err}")
        with self._lock:
            save.done = True
            work, save.after_commit = ([] if save.error is not None else save.after_commit), []
        for task in work:
            try:
                task()
            except Exception as err:  # noqa: BLE001 - housekeeping after a committed save: never fails it
                log.warning(f"After saving {str(save.path)!r}: {type(err).__name__}: {err}")


def wait_for_copies(devices: set[torch.device]) -> None:
    """The host waits once per device (one per rank) for the non-blocking copies queued on its
    current stream: the copies' stream, not the whole device, so other streams' work goes on."""
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def _current_cuda_device() -> Optional[int]:
    """The index of the calling thread's current CUDA device, where this process uses CUDA (None
    otherwise: asking would initialize CUDA)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None
