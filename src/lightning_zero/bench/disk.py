"""The disk under `zero3_offload_nvme`: its directory, what it does raw, and what the engine got from it.

[Note: disk figures]
Two kinds of figures, measured in the same run so they compare:
- **raw** (`raw_throughput`, once per run, before the variants): one file of `RAW_BYTES` written
  with `os.pwrite` in `RAW_BLOCK_BYTES` pieces and `fsync`ed (write GB/s, the fsync included), then
  dropped from the page cache with `posix_fadvise(DONTNEED)` (which needs no privileges; where it
  is missing or the kernel ignores it, the read says "cache not dropped") and read back with
  `os.pread` (read GB/s), then read once more, now from the page cache (cached GB/s). That is the
  dd-style figure: one stream, one request at a time.
- **engine** (`DiskIO`, per rank over the timed steps): the engine's `IOStats`, whose GB/s are bytes
  over the seconds its I/O threads spent in `preadv`/`pwritev`, summed over the threads: a
  per-request rate, and several requests overlap, so the disk's aggregate can be higher. The engine
  neither fsyncs nor bypasses the page cache: with free memory its writes land in the page cache and
  its reads mostly come back from it, so its figures sit between the raw read and the cached one,
  and a step's files reach the device in the background. Compare `waits` (reads and writes the
  optimizer had to block on) for whether the disk keeps up.
- **engine path** (`io_floor.engine_path_throughput`, once per NVMe variant, after it ran): the rates the
  engine's own I/O path reaches on this directory, measured with the engine's `ScratchDirectory`
  (its I/O threads, whole-request `preadv`/`pwritev`, no fsync, the page cache as the engine has
  it), requests the size the variant's step made, as many per step, one directory per rank all at
  once. Aggregate GB/s: bytes over the wall time of all of them. These are the rates of the I/O
  floor (`io_floor.py`); the raw figures stay beside them, for a model whose files outgrow the page
  cache.
- **per step** (`io_floor.StepIO`, per rank and timed step): the engine's counts from the end of backward
  (before the optimizer step's first reads are started) to the end of the optimizer step, and that
  step's wall time, so a step's bytes exclude the reads of the gathers in forward and backward.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from lightning_zero.bench.io_floor import StepIO
from lightning_zero.engine.offload.scratch_files import gbps

RAW_BYTES = 256 * 2**20
"""Size of the raw throughput file: larger than any drive's write cache that matters here, small
enough to take a second or two."""
RAW_BLOCK_BYTES = 8 * 2**20
"""Bytes per `pwrite`/`pread` call of the raw measurement."""
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs")
"""File systems that live in memory: NVMe offload onto them moves nothing out of memory."""



def filesystem_of(path: Path) -> Optional[str]:
    """The type of the file system `path` is on ("ext4", "tmpfs", ...), from /proc/mounts; None
    where that cannot be read."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    resolved = str(Path(path).resolve())
    best, kind = "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point = fields[1].replace("\\040", " ")
        inside = resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, kind = mount_point, fields[2]
    return kind


@contextlib.contextmanager
def nvme_directory(given: Optional[Path], needed: bool) -> Iterator[Optional[Path]]:
    """The directory the NVMe variant's ranks keep their scratch files in: `given` (it must exist),
    or, when `needed` and none was given, a fresh one under the current directory (never /tmp,
    which is memory on many machines), removed afterwards with what is left in it."""
    if not needed:
        yield given
        return
    if given is not None:
        if not Path(given).is_dir():
            raise ValueError(f"--nvme-path {given} is not a directory: create it on the disk to measure")
        yield Path(given)
        return
    made = Path(tempfile.mkdtemp(prefix="lightning-zero-nvme-", dir=Path.cwd()))
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


@dataclass(frozen=True)
class RawThroughput:
    """dd-style figures for one directory (see [Note: disk figures])."""

    path: str
    """The directory measured."""
    filesystem: Optional[str]
    """Its file system's type, from /proc/mounts."""
    nbytes: int
    """Bytes written and read."""
    write_gbps: float
    """pwrite of every block, then fsync: GB (1e9 bytes) per second."""
    read_gbps: float
    """pread of every block after the file was dropped from the page cache (if `cache_dropped`)."""
    cached_read_gbps: float
    """The same reads again, from the page cache: what memory-to-memory copying does."""
    cache_dropped: bool
    """Whether `posix_fadvise(DONTNEED)` was available to drop the file before `read_gbps`."""

    @property
    def in_memory(self) -> bool:
        """The directory is on a memory file system: "disk" figures are memory copies."""
        return self.filesystem in MEMORY_FILESYSTEMS


def raw_throughput(directory: Path, nbytes: int = RAW_BYTES, block_bytes: int = RAW_BLOCK_BYTES) -> RawThroughput:
    """Write, fsync, drop and read back one file of `nbytes` in `directory` (see [Note: disk figures])."""
    block = os.urandom(min(block_bytes, nbytes))  # incompressible, for drives that compress
    fd, path = tempfile.mkstemp(prefix="raw-throughput-", dir=directory)
    try:
        start = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.pwrite(fd, block[: nbytes - done], done)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        dropped = hasattr(os, "posix_fadvise")
        if dropped:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        read_s = _read_all(fd, nbytes, len(block))
        cached_s = _read_all(fd, nbytes, len(block))
    finally:
        os.close(fd)
        os.unlink(path)
    return RawThroughput(
        path=str(directory),
        filesystem=filesystem_of(directory),
        nbytes=nbytes,
        write_gbps=nbytes / write_s / 1e9,
        read_gbps=nbytes / read_s / 1e9,
        cached_read_gbps=nbytes / cached_s / 1e9,
        cache_dropped=dropped,
    )


def _read_all(fd: int, nbytes: int, block_bytes: int) -> float:
    """Seconds to pread `nbytes` from `fd` in blocks."""
    buffer = bytearray(block_bytes)
    view = memoryview(buffer)
    start = time.perf_counter()
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[: min(block_bytes, nbytes - done)]], done)
        if n == 0:
            break
        done += n
    return time.perf_counter() - start


@dataclass(frozen=True)
class DiskIO:
    """One rank's NVMe I/O over the timed steps: the engine's `IOStats`, and the steps they cover."""

    steps: int
    reads: int
    writes: int
    read_bytes: int
    write_bytes: int
    read_seconds: float
    """Summed over the I/O threads (see [Note: disk figures])."""
    write_seconds: float
    waits: int
    """Times the optimizer step blocked on a read or write that had not finished."""
    wait_seconds: float
    per_step: tuple[StepIO, ...] = ()
    """Each timed step's optimizer step (`StepIORecorder`); empty where it was not recorded (paired mode)."""

    @classmethod
    def of(cls, stats: Any, steps: int, per_step: Sequence[StepIO] = ()) -> "DiskIO":
        """From an engine `IOStats` counted over `steps` steps, with each one's `StepIO`."""
        names = ("reads", "writes", "read_bytes", "write_bytes", "read_seconds", "write_seconds", "waits", "wait_seconds")
        return cls(steps=steps, **{name: getattr(stats, name) for name in names}, per_step=tuple(per_step))

    @property
    def read_gbps(self) -> float:
        return gbps(self.read_bytes, self.read_seconds)

    @property
    def write_gbps(self) -> float:
        return gbps(self.write_bytes, self.write_seconds)


@dataclass(frozen=True)
class DiskSummary:
    """A variant's NVMe I/O per step, the worst rank's (the one that waited longest)."""

    read_gbps: float
    """Engine reads, GB/s per request (see [Note: disk figures])."""
    write_gbps: float
    """Engine writes, GB/s per request."""
    read_bytes_per_step: float
    write_bytes_per_step: float
    waits_per_step: float
    """Reads and writes the optimizer blocked on, per step."""
    wait_s_per_step: float
    """Seconds it blocked, per step."""
    rank: int
    """The rank these are from."""
    optimizer_step: Optional[StepIO] = None
    """That rank's optimizer step, each figure's median over the timed steps (None where not recorded)."""


def summarize_disk(per_rank: Sequence[Optional[DiskIO]]) -> Optional[DiskSummary]:
    """The worst rank's figures per step, or None when no rank used the disk."""
    measured = [(rank, io) for rank, io in enumerate(per_rank) if io is not None and io.steps]
    if not measured:
        return None
    rank, io = max(measured, key=lambda pair: pair[1].wait_seconds)
    return DiskSummary(
        read_gbps=io.read_gbps,
        write_gbps=io.write_gbps,
        read_bytes_per_step=io.read_bytes / io.steps,
        write_bytes_per_step=io.write_bytes / io.steps,
        waits_per_step=io.waits / io.steps,
        wait_s_per_step=io.wait_seconds / io.steps,
        rank=rank,
        optimizer_step=StepIO.median(io.per_step) if io.per_step else None,
    )
