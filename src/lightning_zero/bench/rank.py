"""What every rank of every variant does in the benchmark: build, train, measure (`measure_rank`).

Every rank of every variant:
1. builds the same model: `torch.manual_seed(seed)` then `GPT(config)`, so all variants start from
   identical weights;
2. draws the same data: random byte tokens (uniform over the 256-symbol vocabulary) from a
   generator seeded with `seed + 1 + rank`, so ranks see different samples and every variant sees
   the same ones. Random tokens need no files, cost nothing to make, and a language model cannot
   learn them, which keeps the loss near ln(256) ≈ 5.55 and comparable across variants;
3. makes the same optimizer: `ADAMW` below, `fused` as asked;
4. runs `warmup` untimed steps, `steps` timed ones, then one step whose host work is counted
   (Python calls, storage resizes, hook registrations: `host_counts.py`) and one instrumented step
   in which collectives, aten ops and host syncs are counted and model state is measured at each
   phase (counting costs time, so it is kept out of the timed steps; every step does the same work,
   so one is representative).

Steps 1-3 are `build_rank`, which a capacity try (`capacity.py`) and paired mode (`paired.py`)
share; paired mode also shares the step timer and step 4's closing steps. The processes themselves
are started and collected by `worker.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.bench.comm import CollectiveCounter, CommCount
from lightning_zero.bench.disk import DiskIO
from lightning_zero.bench.host_counts import counted_step
from lightning_zero.bench.io_floor import StepIORecorder
from lightning_zero.bench.links import LinkBytes, bytes_by_link, phase_deltas
from lightning_zero.bench.memory import HeldBytes, PeakMemory, held_bytes, small_mmap_threshold
from lightning_zero.bench.options import BenchOptions
from lightning_zero.bench.overhead import HostSyncCounter, OpCounter, Overhead, overhead_of
from lightning_zero.bench.results import RankMeasurement
from lightning_zero.bench.variants import VariantSpec
from lightning_zero.bench.wrappers import OursWrapped, Setup, Wrapped, autocast_for, build, no_probe
from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS
from lightning_zero.models.gpt import GPT, Block, GPTConfig

ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
"""nanoGPT's AdamW settings, for every variant: one parameter group, decay on every parameter."""


def rank_device(rank: int, options: BenchOptions) -> torch.device:
    """The device rank `rank` computes on: its own GPU, or the CPU."""
    return torch.device("cuda", rank) if options.device == "cuda" else torch.device("cpu")


@dataclass(frozen=True)
class BuiltRank:
    """A rank's variant, built and ready to step, and its data."""

    wrapped: Wrapped
    """The variant's model and optimizer."""
    batches: list[tuple[Tensor, Tensor]]
    """(inputs, targets) pairs, one per step to run."""
    device: torch.device
    """Where it computes."""
    threshold_fixed: bool
    """Whether glibc's mmap threshold could be fixed (see `memory.py`, [Note: peak memory])."""


def build_rank(
    rank: int,
    spec: VariantSpec,
    options: BenchOptions,
    config: GPTConfig,
    steps: int,
    engine_options: Optional[dict[str, Any]] = None,
) -> BuiltRank:
    """Build `spec` on this rank from the seeded model, with data for `steps` steps (module doc, 1-3);
    `engine_options` are further `ZeroConfig` fields for our variants (`Setup.engine_options`)."""
    device = rank_device(rank, options)
    threshold_fixed = device.type != "cpu" or small_mmap_threshold()  # before the model is allocated
    torch.manual_seed(options.seed)
    model = GPT(config).to(device)
    if options.activation_checkpointing:
        checkpoint_every_block(model)
    batches = _batches(options, rank, device, count=steps)
    setup = Setup(
        optimizer_class=torch.optim.AdamW,
        optimizer_kwargs=dict(ADAMW, fused=options.fused),
        autocast=autocast_for(options.precision, device),
        device=device,
        bucket_size_mb=options.bucket_size_mb,
        batch_size=options.batch_size,
        shard_group_size=options.shard_group_size,
        ranks_per_node=options.ranks_per_node,
        nvme_path=None if options.nvme_path is None else str(options.nvme_path),
        engine_options=dict(engine_options or {}),
    )
    return BuiltRank(build(spec, model, setup), batches, device, threshold_fixed)


UNTIMED_AFTER = 2
"""Steps after the timed ones: one with its host work counted, one instrumented (module doc, 4)."""


def measure_rank(rank: int, spec: VariantSpec, options: BenchOptions, config: GPTConfig) -> RankMeasurement:
    """Build the variant on this rank, train it, and return what was measured (see the module doc)."""
    built = build_rank(rank, spec, options, config, steps=options.warmup + options.steps + UNTIMED_AFTER)
    wrapped, batches, device = built.wrapped, built.batches, built.device

    peak = PeakMemory(device)
    synchronize(device)
    peak_meaning = peak.reset()
    if not built.threshold_fixed:
        peak_meaning += " (glibc's mmap threshold could not be fixed: freed memory may stay resident)"
    resting = peak.current()
    losses = [wrapped.step(x, y) for x, y in batches[: options.warmup]]
    disk = wrapped.disk_stats()
    if disk is not None:
        disk.reset()  # the timed steps' I/O only
    dist.barrier()  # the timed steps start together
    # the moments' reads start as each bucket's gradients land during backward, where the step runs
    # there (the parameter chunks on disk step after backward: its backward's reads are the gathers')
    timer = StepTimer(device, disk, counts_from="backward" if spec.offload_params == "nvme" else "forward")
    for x, y in batches[options.warmup : options.warmup + options.steps]:
        losses.append(timer.step(wrapped, x, y))
    peak_bytes = peak.peak()
    disk_io = DiskIO.of(disk, options.steps, timer.disk_steps) if disk is not None else None
    return closing_measurement(rank, built, options, timer, losses, (resting, peak_bytes, peak_meaning), disk_io)


class StepTimer:
    """Times whole steps, wall and host CPU, and on the CPU the optimizer step within each: on the
    CPU the clock at each probe point is exact, so the optimizer step (with the parameter refresh
    after it) is timed on its own; on a GPU that would need a sync per phase.

    Host CPU time is the rank process's (`time.process_time`: all its threads, gloo's and autograd's
    included) until the step returns, before the device is waited for (a CUDA sync spins). Where the
    step is host work (the launch-bound shape, a fast GPU) it is that work, and time the process
    spends waiting for a core on a loaded machine is not in it.

    With `disk` (an NVMe variant's `IOStats`) it also records each step's optimizer step and its
    I/O (`io_floor.StepIORecorder`), on either device, for the I/O floor."""

    def __init__(self, device: torch.device, disk: Optional[Any] = None, counts_from: str = "backward") -> None:
        self.device = device
        self.step_times: list[float] = []
        self.cpu_times: list[float] = []
        self.optimizer_times: list[float] = []
        self._clock = _PhaseClock() if device.type == "cpu" else None
        self._disk = StepIORecorder(disk, counts_from) if disk is not None else None

    @property
    def disk_steps(self) -> tuple[Any, ...]:
        """Each timed step's `io_floor.StepIO` (empty without `disk`)."""
        return tuple(self._disk.steps) if self._disk is not None else ()

    def _probe(self, phase: str) -> None:
        if self._clock is not None:
            self._clock.probe(phase)
        if self._disk is not None:
            self._disk.probe(phase)

    def step(self, wrapped: Wrapped, x: Tensor, y: Tensor) -> Tensor:
        """One timed step of `wrapped`; returns its loss."""
        clock = self._clock
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = wrapped.step(x, y, self._probe if clock is not None or self._disk is not None else no_probe)
        self.cpu_times.append(time.process_time() - cpu_start)
        synchronize(self.device)
        self.step_times.append(time.perf_counter() - start)
        if clock is not None:
            self.optimizer_times.append(clock.at["step"] - clock.at["gradients"])
        return loss


def closing_measurement(
    rank: int,
    built: BuiltRank,
    options: BenchOptions,
    timer: StepTimer,
    losses: list[Tensor],
    memory: tuple[Optional[int], Optional[int], str],
    disk_io: Optional[DiskIO],
) -> RankMeasurement:
    """After the timed steps: the counted step and the instrumented step on the last two batches
    (module doc, 4), then `built` is closed; `memory` is (resting, peak, what the peak means)."""
    wrapped, batches = built.wrapped, built.batches
    counted_loss, host = counted_step(wrapped, *batches[-2])
    instrumented = _instrumented_step(
        wrapped, *batches[-1], world_size=options.devices, device=built.device, ranks_per_node=options.ranks_per_node
    )
    units = wrapped.units()
    wrapped.close()
    resting, peak_bytes, peak_meaning = memory
    return RankMeasurement(
        rank=rank,
        step_times_s=tuple(timer.step_times),
        step_cpu_times_s=tuple(timer.cpu_times),
        losses=tuple(float(loss) for loss in (*losses, counted_loss, instrumented.loss)),
        resting_memory_bytes=resting,
        peak_memory_bytes=peak_bytes,
        peak_memory_meaning=peak_meaning,
        model_state=instrumented.phases[instrumented.largest_phase],
        model_state_phase=instrumented.largest_phase,
        phases=instrumented.phases,
        engine_reports=instrumented.engine_reports,
        collectives=instrumented.collectives,
        overhead=instrumented.overhead,
        traffic_by_group=instrumented.traffic,
        bytes_by_link=instrumented.links,
        disk_io=disk_io,
        optimizer_step_times_s=tuple(timer.optimizer_times),
        host=host,
        units=units,
    )


class _PhaseClock:
    """A probe that only reads the clock at each phase of a step."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    def probe(self, phase: str) -> None:
        self.at[phase] = time.perf_counter()


@dataclass(frozen=True)
class _InstrumentedStep:
    """What the one instrumented step measured."""

    loss: Tensor
    """The step's loss."""
    phases: dict[str, HeldBytes]
    """Model-state bytes at each probe point."""
    engine_reports: dict[str, dict[str, Any]]
    """The implementation's own report at each probe point, where it has one."""
    collectives: CommCount
    """The step's collectives."""
    overhead: Overhead
    """The step's aten ops and host syncs."""
    traffic: dict[str, int]
    """Ours: the step's collective bytes by where they went (see `traffic_by_group`)."""
    links: LinkBytes
    """Ours: the step's collective bytes by category and link (`links.bytes_by_link`)."""

    @property
    def largest_phase(self) -> str:
        return max(self.phases, key=lambda phase: self.phases[phase].total)


def _instrumented_step(
    wrapped: Wrapped, x: Tensor, y: Tensor, world_size: int, device: torch.device, ranks_per_node: Optional[int] = None
) -> _InstrumentedStep:
    """One step with every collective, aten op and host sync counted and model state measured at
    each probe point (the counters pause while memory is measured, so the measuring is not counted);
    our collectives' bytes are split by link with nodes of `ranks_per_node` ranks (None: one node)."""
    phases: dict[str, HeldBytes] = {}
    engine_reports: dict[str, dict[str, Any]] = {}
    counter, ops, syncs = CollectiveCounter(world_size), OpCounter(), HostSyncCounter()
    COLLECTIVE_STATS.reset()  # the engine's own count, which knows each collective's process group
    snapshots: list[tuple[str, dict[tuple[str, tuple[int, ...]], int]]] = []  # cumulative, at each phase's end

    def probe(phase: str) -> None:
        snapshots.append((phase, dict(COLLECTIVE_STATS.bytes_by_group)))
        counter.recording = ops.recording = syncs.recording = False
        synchronize(device)
        phases[phase] = held_bytes(wrapped.state_tensors())
        report = wrapped.engine_report()
        if report is not None:
            engine_reports[phase] = report
        if phase == "backward":
            syncs.in_forward_backward = False
        counter.recording = ops.recording = syncs.recording = True

    with counter, ops, syncs.installed():
        loss = wrapped.step(x, y, probe)
        counter.recording = ops.recording = syncs.recording = False
        synchronize(device)
    ours = isinstance(wrapped, OursWrapped)
    traffic = traffic_by_group(COLLECTIVE_STATS.bytes_by_group) if ours else {}
    snapshots.append(("after the step", dict(COLLECTIVE_STATS.bytes_by_group)))
    by_link = bytes_by_link(phase_deltas(snapshots), ranks_per_node or world_size) if ours else {}
    return _InstrumentedStep(loss, phases, engine_reports, counter.result(), overhead_of(ops, syncs), traffic, by_link)


def traffic_by_group(bytes_by_group: dict[tuple[str, tuple[int, ...]], int]) -> dict[str, int]:
    """Full-buffer bytes by where they went: over "all" ranks, or under hybrid sharding "within" a
    shard group (consecutive ranks) or "across" shard groups (a strided group)."""
    world = dist.get_world_size()
    out = {"all": 0, "within": 0, "across": 0}
    for (_, ranks), nbytes in bytes_by_group.items():
        if len(ranks) >= world or len(ranks) <= 1:
            out["all"] += nbytes
        elif ranks == tuple(range(ranks[0], ranks[0] + len(ranks))):
            out["within"] += nbytes
        else:
            out["across"] += nbytes
    return out


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a clock reading or a memory figure covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(options: BenchOptions, rank: int, device: torch.device, count: int) -> list[tuple[Tensor, Tensor]]:
    """`count` (inputs, targets) pairs of random byte tokens, (B, T) each, targets shifted by one."""
    generator = torch.Generator().manual_seed(options.seed + 1 + rank)
    tokens = torch.randint(0, 256, (count, options.batch_size, options.block_size + 1), generator=generator)
    return [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in tokens]


def checkpoint_every_block(model: torch.nn.Module) -> None:
    """Wrap each `Block` in torch's non-reentrant `checkpoint_wrapper`, as Lightning users enable
    activation checkpointing for FSDP; the wrapped `Block` stays the stage-3 / FSDP2 unit."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block),
    )
