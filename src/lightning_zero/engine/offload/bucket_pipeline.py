"""The NVMe tier's pipeline of bucket states through a few staging buffers: reads issued ahead, in
the order the buckets will step, and writes behind (see [Note: optimizer state on disk] in
``state_on_disk.py``).

Two threads use it: the one that asks for buckets ahead (``want``: the thread that runs backward, as
each bucket's gradients land, or the optimizer step for the buckets it is about to stream) and the
one that steps them (``take``, ``write_behind``: the host step's worker during backward, the
training thread after it; never both at once). One lock guards the buffers and the queues; nothing
waits for the disk while holding it, so ``want`` never blocks the thread that runs backward.

**A failed write** fails the step it belongs to as a whole: the other writes in flight are waited
for and every bucket's written slot is forgotten (``on_failure``), so the files hold the state of
the last step that committed, and the error is raised once (later drains do not raise it again,
nor the failure of a write whose slot was forgotten since: its step was undone).

**No deadlock with ``staging.count`` buffers**: reads are issued strictly in the order buckets were
wanted, and a bucket taken drops every read wanted before it (those buckets will not step in this
pass: no gradient reached them). So when the stepping thread takes a bucket whose read is not
issued yet, every buffer is held by a write in flight (or a dropped read still landing), and each
of those ends by itself: waiting for the oldest frees a buffer. No buffer is held until a verdict: a
stepped bucket's buffer goes back once its write has finished.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Union

from torch import Tensor

from lightning_zero.engine.offload.scratch_files import PendingIO
from lightning_zero.engine.offload.staging import StagingBuffers
from lightning_zero.engine.offload.state_layout import BucketState, Slot

StartRead = Callable[[BucketState, Tensor], Optional[PendingIO]]
"""Start reading a bucket's current slot into a buffer (None: nothing to read yet)."""


@dataclass(eq=False)
class _Read:
    bucket: BucketState
    buffer: Optional[Tensor] = None
    io: Optional[PendingIO] = None
    issued: bool = False


@dataclass(eq=False)
class _Write:
    bucket: BucketState
    buffer: Tensor
    io: PendingIO
    slot: Slot


class BucketPipeline:
    """Reads ahead and writes behind for one optimizer's bucket states (see the module docstring)."""

    def __init__(
        self,
        staging: StagingBuffers,
        start_read: StartRead,
        on_written: Callable[[BucketState], None],
        on_dropped: Callable[[BucketState], None],
        on_failure: Callable[[], None],
    ) -> None:
        self.staging = staging
        self._start_read = start_read
        self._on_written = on_written
        """Run on the stepping thread once the write of a bucket whose chunks live on disk too has
        finished (the chunks' own write is waited for, and they leave memory)."""
        self._on_dropped = on_dropped
        """Run on the stepping thread once a dropped read of such a bucket has landed (its chunks,
        fetched with it, leave memory)."""
        self._on_failure = on_failure
        """Run once a write failed (and the others in flight ended): the step fails as a whole."""
        self._lock = threading.Lock()
        self._wanted: list[_Read] = []
        """Buckets to step, in order; the issued reads are a prefix of those not taken."""
        self._dropped: list[_Read] = []
        """Issued reads nobody will take, whose buffers come back once they have landed."""
        self._writes: deque[_Write] = deque()
        self._out = 0
        """Buffers held: issued reads, the bucket stepping, writes in flight (at most ``staging.count``)."""

    # ---- asking ahead (any thread) ---------------------------------------------------------------
    def want(self, buckets: Iterable[BucketState]) -> None:
        """Read ``buckets`` ahead, after those wanted already, as buffers free up."""
        with self._lock:
            known = {id(r.bucket) for r in self._wanted}
            self._wanted.extend(_Read(b) for b in buckets if id(b) not in known)
            self._pump()

    def order(self, buckets: Iterable[BucketState]) -> list[BucketState]:
        """``buckets`` in the order they were wanted (those not wanted last, as given)."""
        with self._lock:
            rank = {id(r.bucket): i for i, r in enumerate(self._wanted)}
        buckets = list(buckets)
        return sorted(buckets, key=lambda b: rank.get(id(b), len(rank) + buckets.index(b)))

    def _pump(self) -> None:
        """(Lock held.) Take back the buffers of finished writes and landed dropped reads (not a
        bucket whose chunks live on disk too: the stepping thread waits for their own read or write
        first, ``_finish``); issue the next reads in order while buffers are free."""
        while self._writes and self._writes[0].bucket.master is None and self._writes[0].io.done() and not self._writes[0].io.failed():
            self._give_back(self._writes.popleft().buffer)
        for read in [r for r in self._dropped if r.bucket.master is None and (r.io is None or r.io.done())]:
            self._dropped.remove(read)
            self._give_back(read.buffer)
        for read in self._wanted:
            if read.issued:
                continue
            if self._out >= self.staging.count:
                break
            read.buffer = self.staging.take(read.bucket.nbytes)
            self._out += 1
            read.io = self._start_read(read.bucket, read.buffer)
            read.issued = True

    def _give_back(self, buffer: Optional[Tensor]) -> None:
        if buffer is not None:
            self.staging.give_back(buffer)
            self._out -= 1

    # ---- stepping (one thread at a time) ----------------------------------------------------------
    def take(self, bucket: BucketState) -> tuple[Tensor, Optional[PendingIO]]:
        """A buffer with ``bucket``'s current slot being read into it (wait for the read); the
        reads wanted before it are dropped. Waits for a write in flight where no buffer is free."""
        while True:
            with self._lock:
                at = next((i for i, r in enumerate(self._wanted) if r.bucket is bucket), None)
                if at is None:
                    self._wanted.append(_Read(bucket))
                    at = len(self._wanted) - 1
                self._dropped.extend(r for r in self._wanted[:at] if r.issued)
                del self._wanted[:at]
                self._pump()
                read = self._wanted[0]
                if read.issued:
                    del self._wanted[0]
                    break
                write = self._writes[0] if self._writes else None
                dropped = self._dropped[0] if self._dropped else None
            if write is not None:
                try:
                    self._finish(write)
                except BaseException:  # the step fails: its other writes end first, and none is kept
                    with contextlib.suppress(BaseException):
                        self.drain()
                    self._on_failure()
                    raise
            elif dropped is not None:
                self._finish_dropped(dropped)
            else:
                raise RuntimeError(f"NVMe offload: all {self.staging.count} staging buffers are held and none is being written")
        assert read.buffer is not None
        return read.buffer, read.io

    def _finish(self, write: _Write) -> None:
        """Wait for ``write`` (and its bucket's chunks' write), then take its buffer back; a failed
        one leaves its bucket's current slot the state, and raises, unless the slot it wrote was
        forgotten already (its step undone: nothing would read what it wrote)."""
        try:
            write.io.wait()
        except BaseException:
            if write.bucket.pending is write.slot:
                write.bucket.discard()
                raise
        finally:
            self._release(self._writes, write)
        self._on_written(write.bucket)

    def _finish_dropped(self, read: _Read) -> None:
        try:
            if read.io is not None:
                read.io.wait()
        except OSError:
            pass  # a dropped read: its file is read again, and fails again, where it is needed
        finally:
            self._release(self._dropped, read)
        self._on_dropped(read.bucket)

    def _release(self, pending: Union[list[_Read], deque[_Write]], item: Union[_Read, _Write]) -> None:
        """Take a finished read or write out of ``pending`` and give its buffer back (once: another
        thread may have released it first)."""
        with self._lock:
            if item in pending:
                pending.remove(item)  # type: ignore[arg-type]
                self._give_back(item.buffer)

    def grow(self, buffer: Tensor, nbytes: int) -> Tensor:
        """A buffer of at least ``nbytes`` holding ``buffer``'s bytes, in its place (state appeared)."""
        with self._lock:
            grown = self.staging.take(nbytes)
            grown[: buffer.numel()].copy_(buffer)
            self.staging.give_back(buffer)
        return grown

    def write_behind(self, bucket: BucketState, buffer: Tensor, slot: Slot) -> None:
        """Start writing ``buffer`` (``bucket``'s stepped state, laid out as ``slot``) to ``slot``, which
        becomes ``bucket``'s pending slot; the buffer comes back once the write is done. An earlier
        write of the bucket (to the same slot: one undone) is waited for first."""
        self.finish_writes(bucket)
        bucket.pending = slot
        io = bucket.file.start_write(buffer, slot.nbytes, slot.offset)
        with self._lock:
            self._writes.append(_Write(bucket, buffer, io, slot))
            self._pump()

    def finish_writes(self, bucket: Optional[BucketState] = None) -> None:
        """Wait for the writes in flight (only ``bucket``'s, if given); a failed one raises, after
        every other has been waited for, and its bucket keeps its current slot."""
        error: Optional[BaseException] = None
        while True:
            with self._lock:
                self._pump()
                write = next((w for w in self._writes if bucket is None or w.bucket is bucket), None)
            if write is None:
                break
            try:
                self._finish(write)
            except BaseException as err:  # noqa: BLE001 - re-raised below, once the others are done
                error = error or err
        if error is not None:  # the step fails, as a whole: every bucket keeps its current slot
            self._on_failure()
            raise error

    def drop_reads(self) -> None:
        """Drop every read not taken (their buffers come back as they land); writes go on."""
        with self._lock:
            self._dropped.extend(r for r in self._wanted if r.issued)
            self._wanted.clear()
            self._pump()

    def drain(self) -> None:
        """Drop every read not taken, and wait for every read and write in flight (see ``finish_writes``)."""
        self.drop_reads()
        while True:
            with self._lock:
                read = self._dropped[0] if self._dropped else None
            if read is None:
                break
            self._finish_dropped(read)
        self.finish_writes()

    @property
    def held(self) -> int:
        """Buffers held now (reads issued, writes in flight)."""
        return self._out
