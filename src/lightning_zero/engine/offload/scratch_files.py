"""Scratch files on a fast local disk, read and written in the background: NVMe offload's I/O.

One :class:`ScratchDirectory` per engine and rank: a fresh directory made under the user's
``nvme_path`` (never a file that was there before) and removed, with everything in it, when the
engine closes. Its files are read and written by a small thread pool running ``os.preadv`` and
``os.pwritev`` straight into host tensors (pinned on CUDA); both release the GIL, so the disk works
while the optimizer steps on the main thread. Each read or write returns a :class:`PendingIO`;
:class:`IOStats` counts the bytes, the seconds the disk took, and how often and how long the
caller had to wait for one (a read that was not prefetched early enough).

A file that is shorter than expected or was removed while training fails the read, naming the
file: its contents are this run's only copy of that state, and a checkpoint (elsewhere) is the way
back.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import socket
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Callable, Optional

import torch
from torch import Tensor


IO_ALIGNMENT = 4096
"""Bytes the slots of a file start at a multiple of (a page: a read or write of a slot never shares a
page of the page cache with the other slot)."""


class ScratchFileError(OSError):
    """A scratch file no longer holds what was written to it (truncated or removed while training)."""


def gbps(nbytes: float, seconds: float) -> float:
    """GB (1e9 bytes) per second; 0 when nothing was timed."""
    return nbytes / seconds / 1e9 if seconds else 0.0


@dataclass
class IOStats:
    """What the disk did for one directory since the last ``reset``."""

    reads: int = 0
    writes: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    read_seconds: float = 0.0
    """Summed over the workers' reads (several overlap, so this can exceed the wall time)."""
    write_seconds: float = 0.0
    read_waits: int = 0
    """Times the caller needed a read that had not finished yet, and blocked: a read on the
    critical path (the read-ahead was not deep enough, or the disk too slow)."""
    write_waits: int = 0
    """Times the caller needed a buffer whose write had not finished yet (at the latest at the end
    of each step, which waits for the last writes), and blocked."""
    read_wait_seconds: float = 0.0
    write_wait_seconds: float = 0.0

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    update_seconds: float = 0.0
    """Seconds the optimizer's own update took on the host, summed over the buckets it stepped
    (the stream's compute, beside its reads and writes: the benchmark's host step)."""

    def reset(self) -> None:
        with self._lock:
            for f in fields(self):
                if f.name != "_lock":
                    setattr(self, f.name, f.default)

    def add(self, **counts: float) -> None:
        """Add to the counters (the I/O threads and the caller update them at once)."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def counts(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}

    def __copy__(self) -> "IOStats":
        return IOStats(**self.counts())

    def __getstate__(self) -> dict[str, float]:  # a lock does not pickle: the counts do
        return self.counts()

    def __setstate__(self, state: dict[str, float]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @property
    def waits(self) -> int:
        return self.read_waits + self.write_waits

    @property
    def wait_seconds(self) -> float:
        return self.read_wait_seconds + self.write_wait_seconds

    @property
    def read_gbps(self) -> float:
        return gbps(self.read_bytes, self.read_seconds)

    @property
    def write_gbps(self) -> float:
        return gbps(self.write_bytes, self.write_seconds)


class PendingIO:
    """A read or write in flight; ``wait`` returns once it is done (or raises what it raised)."""

    def __init__(self, future: Future, stats: IOStats, kind: str) -> None:
        self._future = future
        self._stats = stats
        self._kind = kind

    def done(self) -> bool:
        return self._future.done()

    def failed(self) -> bool:
        """Done, with an error (``wait`` raises it)."""
        return self._future.done() and self._future.exception() is not None

    def wait(self) -> None:
        if not self._future.done():
            start = time.perf_counter()
            try:
                self._future.result()
            finally:
                kind = self._kind
                self._stats.add(**{f"{kind}_waits": 1, f"{kind}_wait_seconds": time.perf_counter() - start})
        self._future.result()  # re-raise a failed I/O


def _byte_view(buffer: Tensor, nbytes: int) -> memoryview:
    """The first ``nbytes`` of a contiguous host byte tensor, as a writable buffer for ``preadv``.

    Made from the tensor's address (ctypes), not with ``.numpy()``: the buffer is host memory, so no
    call here waits for a device, and ``.numpy()`` is what the benchmark's host-sync counter takes for
    a sync on a CPU run (see ``bench/overhead.py``). The view does not keep the tensor alive:
    ``ScratchDirectory._submit`` holds it until the I/O is done."""
    if buffer.device.type != "cpu" or buffer.dtype != torch.uint8 or not buffer.is_contiguous() or buffer.numel() < nbytes:
        raise ValueError(f"scratch I/O needs a contiguous host uint8 tensor of at least {nbytes} bytes")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(buffer.data_ptr())).cast("B")


def _run_holding(fn: Callable[[memoryview], None], view: memoryview, buffer: Tensor) -> None:
    """``fn(view)``; the pool's work item holds ``buffer`` (the memory ``view`` points into) until now."""
    fn(view)


class ScratchFile:
    """One file of a :class:`ScratchDirectory`, read and written in whole ranges (``nbytes`` from
    ``offset``: one slot of a bucket's state, see ``state_layout.py``)."""

    def __init__(self, directory: "ScratchDirectory", name: str, holds: str = "optimizer state") -> None:
        self.directory = directory
        self.path = os.path.join(directory.path, name)
        self.holds = holds
        """What the file holds, for the messages: "optimizer state" or "parameter chunks"."""
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.nbytes = 0
        """Bytes up to the end of the last range written so far: what a read expects to find."""

    def start_write(self, buffer: Tensor, nbytes: int, offset: int = 0) -> PendingIO:
        """Write the first ``nbytes`` of ``buffer`` at ``offset`` (a host tensor nobody writes until this is done)."""
        self.nbytes = max(self.nbytes, offset + nbytes)
        return self.directory._submit(functools.partial(self._write, offset), buffer, nbytes, "write")

    def start_read(self, buffer: Tensor, nbytes: int, offset: int = 0) -> PendingIO:
        """Read the file's ``nbytes`` from ``offset`` into ``buffer`` (nobody reads it until this is done)."""
        return self.directory._submit(functools.partial(self._read, offset), buffer, nbytes, "read")

    def _write(self, offset: int, view: memoryview) -> None:
        start, done = time.perf_counter(), 0
        try:
            while done < len(view):
                done += os.pwritev(self._fd, [view[done:]], offset + done)
        except OSError as err:
            raise ScratchFileError(
                err.errno, f"NVMe offload: writing {len(view)} bytes to {self.path} failed ({err.strerror or err})."
                f" The {self.holds} that write held {self._are} not kept (the step that made it fails); free space"
                " on `nvme_path` or choose another disk, and resume from the last checkpoint."
            ) from err
        self.directory.stats.add(writes=1, write_bytes=len(view), write_seconds=time.perf_counter() - start)

    def _read(self, offset: int, view: memoryview) -> None:
        self.check()
        start, done = time.perf_counter(), 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise ScratchFileError(
                    f"NVMe offload: {self.path} ends after {offset + done} bytes, {offset + len(view)} were written there: it was"
                    f" truncated while training. The {self.holds} in it {self._are} lost; resume from the last checkpoint."
                )
            done += n
        self.directory.stats.add(reads=1, read_bytes=len(view), read_seconds=time.perf_counter() - start)

    def check(self) -> None:
        """Raise a ``ScratchFileError`` naming the file if it was removed or cut short."""
        status = os.fstat(self._fd)
        if status.st_nlink == 0 or not os.path.exists(self.path):
            raise ScratchFileError(
                f"NVMe offload: {self.path} was removed while training. The {self.holds} in it {self._are} lost;"
                " resume from the last checkpoint, and keep `nvme_path` free of cleanup jobs while a run uses it."
            )
        if status.st_size < self.nbytes:
            raise ScratchFileError(
                f"NVMe offload: {self.path} holds {status.st_size} bytes, {self.nbytes} were written there: it was"
                f" truncated while training. The {self.holds} in it {self._are} lost; resume from the last checkpoint."
            )

    @property
    def _are(self) -> str:
        return "are" if self.holds.endswith("s") else "is"

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def remove(self) -> None:
        """Close the file and delete it (its contents are no longer wanted)."""
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)


class ScratchDirectory:
    """This rank's directory of scratch files under ``root`` (see the module docstring)."""

    def __init__(self, root: str, label: str, workers: int = 4) -> None:
        self.path = tempfile.mkdtemp(prefix=f"lightning-zero-{label}-", dir=root)
        self.stats = IOStats()
        self._pool: Optional[ThreadPoolExecutor] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nvme-io")
        self._files: list[ScratchFile] = []

    def new_file(self, name: str, holds: str = "optimizer state") -> ScratchFile:
        file = ScratchFile(self, name, holds)
        self._files.append(file)
        return file

    def _submit(self, fn: Callable[[memoryview], None], buffer: Tensor, nbytes: int, kind: str) -> PendingIO:
        """Run ``fn`` on the pool with the first ``nbytes`` of ``buffer``, which stays alive until it ran."""
        if self._pool is None:
            raise RuntimeError(f"scratch directory {self.path} is closed")
        return PendingIO(self._pool.submit(_run_holding, fn, _byte_view(buffer, nbytes), buffer), self.stats, kind)

    def close(self) -> None:
        """Finish the I/O in flight, close the files and remove the directory."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for file in self._files:
            file.close()
        self._files.clear()
        shutil.rmtree(self.path, ignore_errors=True)


def disk_of(root: str) -> Optional[tuple[str, int]]:
    """Which disk ``root`` is on, as (host, device number): ranks whose roots share one fill it together."""
    try:
        return socket.gethostname(), os.stat(root).st_dev
    except OSError:
        return None


def check_scratch_root(root: str, bytes_needed: int, ranks: int = 1, what: str = "the optimizer state") -> Optional[str]:
    """Why ``root`` cannot hold ``bytes_needed`` bytes of scratch files (None if it can): it must
    be an existing, writable directory with that much free space (``ranks``: how many ranks'
    files the bytes are, when several share the disk; ``what``: what they hold, for the message)."""
    if not os.path.isdir(root):
        what = "is not a directory" if os.path.exists(root) else "does not exist"
        return f"`nvme_path={root!r}` {what}. Create it on a fast local disk (an NVMe SSD), or point `nvme_path` at one."
    try:
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as err:
        return f"`nvme_path={root!r}` is not writable here ({err.strerror}). Give this user write access, or choose another directory."
    free = shutil.disk_usage(root).free
    if free < bytes_needed:
        whose = f"this rank's {what[4:]} needs" if ranks == 1 else f"{what} of the {ranks} ranks on this disk needs"
        return (
            f"`nvme_path={root!r}` has {_gb(free)} free, and {whose} {_gb(bytes_needed)} there (at most; the"
            " `nvme per node` column of `lightning-zero estimate` gives the total). Free space, or choose a larger disk."
        )
    return None


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e7 else f"{nbytes:,} bytes"
