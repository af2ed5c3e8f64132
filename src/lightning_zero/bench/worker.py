"""One variant, one fresh process group: start N ranks, train, measure, report back.

Each variant gets its own processes so nothing leaks between them (allocator state, peak RSS, CUDA
caches, hooks, DeepSpeed's globals). They are forked from multiprocessing's *forkserver*, a clean
process that imported torch and this package once: a rank then starts in a fraction of a second
instead of spending ~3 s importing torch and Lightning, which is most of a small run. They are
never forked from the caller, whose threads or CUDA state would not survive a fork. The forkserver
is started with `CHILD_ENVIRONMENT` in its environment, which the ranks inherit.

Every rank of every variant:
1. builds the same model: `torch.manual_seed(seed)` then `GPT(config)`, so all variants start from
   identical weights;
2. draws the same data: random byte tokens (uniform over the 256-symbol vocabulary) from a
   generator seeded with `seed + 1 + rank`, so ranks see different samples and every variant sees
   the same ones. Random tokens need no files, cost nothing to make, and a language model cannot
   learn them, which keeps the loss near ln(256) ≈ 5.55 and comparable across variants;
3. makes the same optimizer: `ADAMW` below, `fused` as asked;
4. runs `warmup` untimed steps, `steps` timed ones, then one instrumented step in which collectives
   are counted and model state is measured at each phase (instrumentation costs time, so it is kept
   out of the timed steps; every step moves the same bytes, so one is representative).

Output of the processes (DeepSpeed's logs, warnings) goes to one log file per rank.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.bench.comm import CollectiveCounter, CommCount
from lightning_zero.bench.memory import MMAP_THRESHOLD_BYTES, HeldBytes, PeakMemory, held_bytes, small_mmap_threshold
from lightning_zero.bench.options import BenchOptions
from lightning_zero.bench.overhead import HostSyncCounter, OpCounter, Overhead, overhead_of
from lightning_zero.bench.results import FAILED, OK, UNAVAILABLE, RankMeasurement
from lightning_zero.bench.variants import VariantSpec
from lightning_zero.bench.wrappers import OursWrapped, Setup, VariantUnavailable, Wrapped, autocast_for, build
from lightning_zero.engine.collectives import COLLECTIVE_STATS
from lightning_zero.models.gpt import GPT, Block, GPTConfig

ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
"""nanoGPT's AdamW settings, for every variant: one parameter group, decay on every parameter."""

CHILD_ENVIRONMENT = {
    # glibc: allocations of 128 KiB and more are mmap'ed and unmapped on free, so peak RSS shows
    # what sharding frees (with the default, freed heap stays resident); see memory.py.
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
}
CPU_CHILD_ENVIRONMENT = {
    "DS_ACCELERATOR": "cpu",  # DeepSpeed would otherwise look for a GPU
}

PROCESS_GROUP_TIMEOUT = timedelta(minutes=5)
"""How long a collective may block before torch fails it (a hung variant fails, it does not hang)."""


@dataclass(frozen=True)
class VariantRun:
    """What the processes of one variant reported."""

    status: str
    """`OK`, `UNAVAILABLE` or `FAILED`."""
    reason: Optional[str]
    """Why it is unavailable or failed (None when it ran)."""
    ranks: tuple[RankMeasurement, ...]
    """Every rank's measurement, in rank order (empty unless it ran)."""


@dataclass(frozen=True)
class _Task:
    """Everything a rank process needs (pickled into it)."""

    spec: VariantSpec
    """The variant to run."""
    options: BenchOptions
    """The run's options."""
    config: GPTConfig
    """The model shape (already fitted to `--params`)."""
    port: int
    """The rendezvous port on 127.0.0.1."""
    log_dir: Path
    """Where each rank's output goes."""

    def log_path(self, rank: int) -> Path:
        return self.log_dir / f"{self.spec.name}-rank{rank}.log"


def run_variant(spec: VariantSpec, options: BenchOptions, config: GPTConfig, log_dir: Path) -> VariantRun:
    """Run `spec` on `options.devices` fresh processes and collect their measurements."""
    log_dir.mkdir(parents=True, exist_ok=True)
    task = _Task(spec, options, config, _free_port(), log_dir)
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])  # imported once by the server, inherited by every rank
    else:  # Windows: every rank imports everything itself
        context = multiprocessing.get_context("spawn")
    reports = context.Queue()
    processes = [context.Process(target=_rank_main, args=(rank, task, reports)) for rank in range(options.devices)]
    with _environment(CHILD_ENVIRONMENT):
        for process in processes:
            process.start()
    collected: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + options.timeout_s
    try:
        while len(collected) < options.devices:
            try:
                rank, status, payload = reports.get(timeout=_POLL_S)
            except queue.Empty:
                problem = _silent_failure(processes, collected, deadline, options.timeout_s)
                if problem is None:
                    continue
                try:  # a report written just before the exit may still be in the pipe
                    rank, status, payload = reports.get(timeout=2 * _POLL_S)
                except queue.Empty:
                    return VariantRun(FAILED, f"{problem}; see {log_dir}", ())
            collected[rank] = (status, payload)
            if status != OK:
                break  # the other ranks may be blocked in a collective: stop them below
    finally:
        for process in processes:
            process.join(timeout=10 if len(collected) == options.devices else 2)
            if process.is_alive():
                process.kill()
                process.join()
    for wanted in (UNAVAILABLE, FAILED):
        reasons = [str(payload) for status, payload in collected.values() if status == wanted]
        if reasons:
            return VariantRun(wanted, reasons[0], ())
    return VariantRun(OK, None, tuple(collected[r][1] for r in range(options.devices)))  # type: ignore[misc]


_POLL_S = 1.0
"""How often the parent looks for ranks that died without reporting (a crash, a kill)."""


def _silent_failure(
    processes: list, collected: dict[int, tuple[str, object]], deadline: float, timeout_s: float
) -> Optional[str]:
    """Why waiting longer is pointless — a rank exited without reporting, or time is up — or None."""
    for rank, process in enumerate(processes):
        # a rank that reported may still be flushing the queue; only a silent exit is a failure
        if rank not in collected and process.exitcode is not None:
            return f"rank {rank} exited with code {process.exitcode} before reporting"
    if time.monotonic() > deadline:
        missing = sorted(set(range(len(processes))) - set(collected))
        return f"ranks {missing} did not finish within {timeout_s:.0f} s"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set `values` in os.environ while rank processes start, then restore it. The forkserver, started
    by the first start, copies the environment then; the ranks forked from it inherit that copy."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _redirect_output(path: Path) -> None:
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def _rank_main(rank: int, task: _Task, reports: "multiprocessing.Queue") -> None:
    """A rank process: join the group, measure, put `(rank, status, payload)` on `reports`."""
    _redirect_output(task.log_path(rank))
    options = task.options
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(task.port),
        WORLD_SIZE=str(options.devices),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(options.devices),
        LOCAL_SIZE=str(options.devices),  # DeepSpeed's name for it
    )
    if options.device == "cpu":
        os.environ.update(CPU_CHILD_ENVIRONMENT)
    try:
        if options.device == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // options.devices))  # ranks share the cores
        backend = "nccl" if options.device == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=options.devices, timeout=PROCESS_GROUP_TIMEOUT)
        reports.put((rank, OK, measure_rank(rank, task.spec, options, task.config)))
    except VariantUnavailable as error:
        reports.put((rank, UNAVAILABLE, str(error)))
    except BaseException as error:  # noqa: BLE001 - reported to the parent, with the log for details
        traceback.print_exc()
        reports.put((rank, FAILED, f"{type(error).__name__}: {error} (see {task.log_path(rank)})"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()


def measure_rank(rank: int, spec: VariantSpec, options: BenchOptions, config: GPTConfig) -> RankMeasurement:
    """Build the variant on this rank, train it, and return what was measured (see the module doc)."""
    device = torch.device("cuda", rank) if options.device == "cuda" else torch.device("cpu")
    threshold_fixed = device.type != "cpu" or small_mmap_threshold()  # before the model is allocated
    torch.manual_seed(options.seed)
    model = GPT(config).to(device)
    if options.activation_checkpointing:
        checkpoint_every_block(model)
    batches = _batches(options, rank, device, count=options.warmup + options.steps + 1)
    setup = Setup(
        optimizer_class=torch.optim.AdamW,
        optimizer_kwargs=dict(ADAMW, fused=options.fused),
        autocast=autocast_for(options.precision, device),
        device=device,
        bucket_size_mb=options.bucket_size_mb,
        batch_size=options.batch_size,
        shard_group_size=options.shard_group_size,
    )
    wrapped = build(spec, model, setup)

    peak = PeakMemory(device)
    _synchronize(device)
    peak_meaning = peak.reset()
    if not threshold_fixed:
        peak_meaning += " (glibc's mmap threshold could not be fixed: freed memory may stay resident)"
    resting = peak.current()
    losses = [wrapped.step(x, y) for x, y in batches[: options.warmup]]
    dist.barrier()  # the timed steps start together
    step_times = []
    for x, y in batches[options.warmup : options.warmup + options.steps]:
        start = time.perf_counter()
        losses.append(wrapped.step(x, y))
        _synchronize(device)
        step_times.append(time.perf_counter() - start)
    peak_bytes = peak.peak()
    instrumented = _instrumented_step(wrapped, *batches[-1], world_size=options.devices, device=device)
    wrapped.close()
    return RankMeasurement(
        rank=rank,
        step_times_s=tuple(step_times),
        losses=tuple(float(loss) for loss in (*losses, instrumented.loss)),
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
    )


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

    @property
    def largest_phase(self) -> str:
        return max(self.phases, key=lambda phase: self.phases[phase].total)


def _instrumented_step(
    wrapped: Wrapped, x: Tensor, y: Tensor, world_size: int, device: torch.device
) -> _InstrumentedStep:
    """One step with every collective, aten op and host sync counted and model state measured at
    each probe point (the counters pause while memory is measured, so the measuring is not counted)."""
    phases: dict[str, HeldBytes] = {}
    engine_reports: dict[str, dict[str, Any]] = {}
    counter, ops, syncs = CollectiveCounter(world_size), OpCounter(), HostSyncCounter()
    COLLECTIVE_STATS.reset()  # the engine's own count, which knows each collective's process group

    def probe(phase: str) -> None:
        counter.recording = ops.recording = syncs.recording = False
        _synchronize(device)
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
        _synchronize(device)
    traffic = traffic_by_group(COLLECTIVE_STATS.bytes_by_group) if isinstance(wrapped, OursWrapped) else {}
    return _InstrumentedStep(loss, phases, engine_reports, counter.result(), overhead_of(ops, syncs), traffic)


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


def _synchronize(device: torch.device) -> None:
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
