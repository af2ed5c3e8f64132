"""The I/O floor of an NVMe variant's optimizer step: how fast the step could be, given what it
reads and writes and how fast this disk serves the engine's own requests (issue 61).

[Note: the I/O floor]
The NVMe stream (`engine/offload/state_on_disk.py`, [Note: optimizer state on disk]) reads a
bucket, updates it on the host and writes it back, with reads ahead and writes behind on the
directory's I/O threads. At best the three overlap completely, and the step takes the longer of
the host's update and the disk's work:

    floor = max(host step, bytes read / read rate + bytes written / write rate)

- **bytes read / written**: the engine's `IOStats` over one optimizer step of one rank (`StepIO`:
  where the step runs during backward, from the end of forward, since each bucket's read starts as
  its gradients land; with `offload_params="nvme"`, which steps after backward, from the end of
  backward, where the first reads are started: the gathers' reads in forward and backward are not
  the step's) to the end of the step;
- **rates**: `engine_path_throughput`, the engine's own path (`ScratchDirectory`: its threads, a
  bucket's state per request, as many requests, every rank at once, through the page cache as the
  engine goes), a rank's share of the aggregate; reads and writes are summed because they share
  the disk;
- **host step**: `IOStats.update_seconds`, the optimizer's update itself, summed over the buckets.

The figures are medians over the timed steps of the worst rank (the one that waited longest, as
the NVMe table's). **step / floor** is the optimizer step's wall time (the "gradients" to "step"
probes) over the floor: issue 61's target is ≤ `IO_FLOOR_TARGET`. It falls below 1 where the step
ran during backward (what is left after it is what backward did not hide), or where the reads
prefetched at the end of backward ran before the step's wall time began. **Occupancy**: the
seconds the I/O threads spent in reads (writes), summed over the threads, and the update's, each
over the step's span (`StepIO.span_seconds`: from where its reads may start to the end of the
step, so with the step during backward, backward and the step); a sum, not a union, so a figure
above 100% means requests overlapped. The floor at the **raw** (dd-style) rates is given beside
it: what the step would be held to if its files outgrew the page cache.

The max() assumes the disk and the host's cores are separate resources. Where the files live in
the page cache, reading and writing them is memory copying on the same cores the update runs on
(on a CPU VM with a core per rank, all of it), so there the sum of the three, not their maximum,
is what a step can reach; the occupancy shows which case a run is in.
"""

from __future__ import annotations

import inspect
import math
import statistics
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from lightning_zero.engine.offload.scratch_files import ScratchDirectory, gbps

IO_FLOOR_TARGET = 1.2
"""Issue 61: an NVMe variant's optimizer step at most this multiple of its I/O floor."""
ENGINE_IO_THREADS: int = inspect.signature(ScratchDirectory).parameters["workers"].default
"""I/O threads per rank: the engine's `DiskTier` makes its `ScratchDirectory` with the default."""
ENGINE_PATH_MIN_BYTES = 256 * 2**20
"""`engine_path_throughput` repeats its rounds until it has moved at least this many bytes each way."""


@dataclass(frozen=True)
class EnginePathThroughput:
    """Rates of the engine's own I/O path on one directory (`engine_path_throughput`)."""

    path: str
    """The directory measured."""
    request_bytes: int
    """Bytes per `preadv`/`pwritev` request: one file read or written whole, as the engine does."""
    requests: int
    """Requests per rank and round, each way (a step's, for the variant measured)."""
    ranks: int
    """Directories written and read at once, one per rank, each with its own I/O threads."""
    threads: int
    """I/O threads per directory (`ENGINE_IO_THREADS`)."""
    rounds: int
    """Timed rounds (each: every write, then every read), after one untimed round."""
    read_bytes: int
    """Bytes the directories' `IOStats` counted read over the timed rounds."""
    write_bytes: int
    read_seconds: float
    """Wall time of the timed rounds' reads, from the first submitted to the last done."""
    write_seconds: float
    read_gbps: float
    """All ranks together: `read_bytes` over `read_seconds`."""
    write_gbps: float
    request_read_gbps: float
    """Per request, as the engine's `IOStats` reports its own: bytes over thread seconds."""
    request_write_gbps: float


def engine_path_throughput(
    directory: Path, request_bytes: int, requests: int, ranks: int = 1, min_bytes: int = ENGINE_PATH_MIN_BYTES
) -> EnginePathThroughput:
    """Sequential write and read rates of `directory` through the engine's own I/O path, for the
    I/O floor (`io_floor.py`; see [Note: disk figures]).

    Why this and not the raw (dd-style) figure: the floor asks how fast the disk can serve what
    the engine asks of it, so it is measured the way the engine asks. Each of `ranks` directories
    is the engine's `ScratchDirectory` (its `ENGINE_IO_THREADS` threads, one `preadv`/`pwritev` per
    request into or out of a host byte tensor) holding `requests` files of `request_bytes` (a
    bucket's state, written and read whole), and all ranks' requests are in flight at once, as
    the ranks' streams share one disk in a step. Like the engine it neither fsyncs nor bypasses the
    page cache: writes land in the page cache and reach the device in the background, and reads of
    files written a round before come from it while free memory holds them, as the engine's reads
    of the last step's files do. One untimed round first creates the files (the engine overwrites
    files that exist); then rounds of every write, then every read (their wall times apart), until
    `min_bytes` moved each way (at least 3 rounds). Rates are aggregate (bytes over wall time); a
    rank's share is 1/`ranks` of them. Finally one file is read back and compared with what was
    written, so the path measured really moved the bytes.
    """
    if request_bytes <= 0 or requests <= 0 or ranks <= 0:
        raise ValueError(f"engine_path_throughput needs positive sizes, got {request_bytes=}, {requests=}, {ranks=}")
    rounds = max(3, math.ceil(min_bytes / (request_bytes * requests * ranks)))
    directories = [ScratchDirectory(str(directory), label=f"io-floor{rank}") for rank in range(ranks)]
    try:
        files = [[d.new_file(f"request{i}.bin") for i in range(requests)] for d in directories]
        # a few buffers per rank, reused: a phase only reads them (writes) or only fills them (reads)
        generator = torch.Generator().manual_seed(0)
        sources = [
            torch.randint(0, 256, (request_bytes,), dtype=torch.uint8, generator=generator)
            for _ in range(min(requests, 2 * ENGINE_IO_THREADS))
        ]  # incompressible, for drives that compress
        targets = [torch.empty(request_bytes, dtype=torch.uint8) for _ in sources]

        def every(start: Any, buffers: list[torch.Tensor]) -> float:
            begin = time.perf_counter()
            pending = [start(file, buffers[i % len(buffers)]) for per_rank in files for i, file in enumerate(per_rank)]
            for io in pending:
                io.wait()
            return time.perf_counter() - begin

        def write(file: Any, buffer: torch.Tensor) -> Any:
            return file.start_write(buffer, request_bytes)

        def read(file: Any, buffer: torch.Tensor) -> Any:
            return file.start_read(buffer, request_bytes)

        every(write, sources)
        every(read, targets)
        for d in directories:
            d.stats.reset()
        write_s = read_s = 0.0
        for _ in range(rounds):
            write_s += every(write, sources)
            read_s += every(read, targets)
        counted = [d.stats.counts() for d in directories]
        check = torch.empty(request_bytes, dtype=torch.uint8)
        files[0][0].start_read(check, request_bytes).wait()
        if not torch.equal(check, sources[0]):
            raise RuntimeError(f"engine_path_throughput: {files[0][0].path} did not read back what was written")
    finally:
        for d in directories:
            d.close()
    total = {name: sum(c[name] for c in counted) for name in ("read_bytes", "write_bytes", "read_seconds", "write_seconds")}
    return EnginePathThroughput(
        path=str(directory),
        request_bytes=request_bytes,
        requests=requests,
        ranks=ranks,
        threads=ENGINE_IO_THREADS,
        rounds=rounds,
        read_bytes=int(total["read_bytes"]),
        write_bytes=int(total["write_bytes"]),
        read_seconds=read_s,
        write_seconds=write_s,
        read_gbps=gbps(total["read_bytes"], read_s),
        write_gbps=gbps(total["write_bytes"], write_s),
        request_read_gbps=gbps(total["read_bytes"], total["read_seconds"]),
        request_write_gbps=gbps(total["write_bytes"], total["write_seconds"]),
    )


@dataclass(frozen=True)
class StepIO:
    """What the engine's I/O did in one optimizer step of one rank (see [Note: disk figures]): its
    `IOStats` from the end of backward to the end of the step, and the step's wall time."""

    reads: float
    writes: float
    read_bytes: float
    write_bytes: float
    read_seconds: float
    """Summed over the I/O threads: a read's time counts once per thread busy with it."""
    write_seconds: float
    update_seconds: float
    """The optimizer's own update on the host (`IOStats.update_seconds`): the host step."""
    wall_seconds: float
    """The optimizer step's wall time (`optimizer.step()` and the parameters' refresh after it)."""
    span_seconds: float = 0.0
    """The wall time the step's I/O could run in: from where its reads may start (the recorder's
    ``counts_from``; backward and the step where it steps during backward) to the end of the step;
    what the occupancy is over (0: not recorded, the step's wall time instead)."""

    @classmethod
    def median(cls, steps: Sequence["StepIO"]) -> "StepIO":
        """Each figure's median over `steps`."""
        return cls(**{f.name: statistics.median(getattr(s, f.name) for s in steps) for f in fields(cls)})


_STEP_COUNTS = ("reads", "writes", "read_bytes", "write_bytes", "read_seconds", "write_seconds", "update_seconds")


class StepIORecorder:
    """A step probe (`wrappers.Probe`) that records a `StepIO` per step from the engine's `stats`:
    counts at ``counts_from`` and at "step", the wall time from "gradients" to "step" (the step as
    exposed after backward). ``counts_from``: "forward" where the step runs during backward (its
    reads start as each bucket's gradients land), "backward" where it runs after it (before the
    gradients are finished, where the first reads start; the parameter chunks on disk: backward's
    own reads are the gathers'). The host's clock, also on a GPU: the stream reads, updates and
    writes on the host and waits for its last write before `step` returns."""

    def __init__(self, stats: Any, counts_from: str = "backward") -> None:
        self.stats = stats
        self.counts_from = counts_from
        self.steps: list[StepIO] = []
        self._before: dict[str, float] = {}
        self._start = 0.0
        self._span_start = 0.0

    def probe(self, phase: str) -> None:
        if phase == self.counts_from:
            self._before = self.stats.counts()
            self._span_start = time.perf_counter()
        if phase == "gradients":
            self._start = time.perf_counter()
        elif phase == "step":
            end = time.perf_counter()
            after = self.stats.counts()
            deltas = {name: after.get(name, 0) - self._before.get(name, 0) for name in _STEP_COUNTS}
            self.steps.append(StepIO(**deltas, wall_seconds=end - self._start, span_seconds=end - self._span_start))


@dataclass(frozen=True)
class IOFloor:
    """An NVMe variant's optimizer step against its I/O floor (see [Note: the I/O floor])."""

    rank: int
    """The rank these are from (the one that waited longest)."""
    rates: EnginePathThroughput
    """The engine path's rates on the variant's directory, measured after it ran."""
    read_bytes: float
    """Bytes the rank read in one optimizer step (median over the timed steps)."""
    write_bytes: float
    host_step_s: float
    """The optimizer's update on the host in one step (`IOStats.update_seconds`)."""
    read_s: float
    """`read_bytes` at the rank's share of the engine path's read rate."""
    write_s: float
    floor_s: float
    """max(`host_step_s`, `read_s` + `write_s`)."""
    step_s: float
    """The optimizer step's wall time (median over the timed steps)."""
    step_vs_floor: float
    """`step_s` / `floor_s`; issue 61's target is ≤ `IO_FLOOR_TARGET`."""
    read_busy: float
    """Read seconds, summed over the I/O threads, over the step's span (`StepIO.span_seconds`: with
    the step during backward, backward and the step; can exceed 1)."""
    update_busy: float
    """`host_step_s` over the step's span."""
    write_busy: float
    """Write seconds, summed over the I/O threads, over the step's span (can exceed 1)."""
    raw_floor_s: Optional[float] = None
    """The floor at the directory's raw (dd-style) rates, a rank's share; None without them."""

    @property
    def met(self) -> bool:
        return self.step_vs_floor <= IO_FLOOR_TARGET


def floor_seconds(host_step_s: float, read_bytes: float, write_bytes: float, read_gbps: float, write_gbps: float) -> float:
    """max(host step, bytes read / read rate + bytes written / write rate), rates in GB/s (1e9 bytes)."""
    return max(host_step_s, _seconds(read_bytes, read_gbps) + _seconds(write_bytes, write_gbps))


def _seconds(nbytes: float, rate_gbps: float) -> float:
    """Seconds to move `nbytes` at `rate_gbps`: 0 for no bytes, infinite at no rate."""
    if not nbytes:
        return 0.0
    return nbytes / (rate_gbps * 1e9) if rate_gbps > 0 else math.inf


def io_floor(step: StepIO, rates: EnginePathThroughput, rank: int = 0, raw: Optional[dict[str, Any]] = None) -> IOFloor:
    """The floor of a rank's optimizer step `step` (medians over the timed steps) at the engine
    path's `rates`, every rank taking its share of them; `raw`: the run's `disk.RawThroughput`, as
    the environment keeps it, for the floor at the raw rates too."""
    read_gbps, write_gbps = rates.read_gbps / rates.ranks, rates.write_gbps / rates.ranks
    read_s, write_s = _seconds(step.read_bytes, read_gbps), _seconds(step.write_bytes, write_gbps)
    floor_s = max(step.update_seconds, read_s + write_s)
    raw_floor_s = None
    if raw is not None:
        raw_floor_s = floor_seconds(
            step.update_seconds, step.read_bytes, step.write_bytes, raw["read_gbps"] / rates.ranks, raw["write_gbps"] / rates.ranks
        )
    wall = step.wall_seconds
    span = step.span_seconds or wall

    def busy(seconds: float) -> float:
        return seconds / span if span > 0 else 0.0

    return IOFloor(
        rank=rank,
        rates=rates,
        read_bytes=step.read_bytes,
        write_bytes=step.write_bytes,
        host_step_s=step.update_seconds,
        read_s=read_s,
        write_s=write_s,
        floor_s=floor_s,
        step_s=wall,
        step_vs_floor=wall / floor_s if floor_s > 0 else math.inf,
        read_busy=busy(step.read_seconds),
        update_busy=busy(step.update_seconds),
        write_busy=busy(step.write_seconds),
        raw_floor_s=raw_floor_s,
    )
