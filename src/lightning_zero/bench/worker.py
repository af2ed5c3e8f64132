"""One variant, one fresh process group: start N ranks, let each run its part, collect the reports.

Each variant gets its own processes so nothing leaks between them (allocator state, peak RSS, CUDA
caches, hooks, DeepSpeed's globals). They are forked from multiprocessing's *forkserver*, a clean
process that imported torch and this package once: a rank then starts in a fraction of a second
instead of spending ~3 s importing torch and Lightning, which is most of a small run. They are
never forked from the caller, whose threads or CUDA state would not survive a fork. The forkserver
is started with `CHILD_ENVIRONMENT` in its environment, which the ranks inherit.

What a rank does once its process group is up is its `body`: `rank.measure_rank` for the benchmark
(see `rank.py`), a few steps under a memory budget for a capacity try (`capacity.py`), where a
`budget.Watchdog` in the parent may end the try early. Output of the processes (DeepSpeed's logs,
warnings) goes to one log file per rank.
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
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from lightning_zero.bench.budget import OverBudget, Watchdog
from lightning_zero.bench.memory import MMAP_THRESHOLD_BYTES
from lightning_zero.bench.options import BenchOptions
from lightning_zero.bench.rank import measure_rank
from lightning_zero.bench.results import FAILED, OK, OVER_BUDGET, UNAVAILABLE
from lightning_zero.bench.variants import VariantSpec
from lightning_zero.bench.wrappers import VariantUnavailable
from lightning_zero.engine.comm.collectives import COLLECTIVES_AT_ONE_RANK
from lightning_zero.models.gpt import GPTConfig

__all__ = ["CHILD_ENVIRONMENT", "RankBody", "VariantRun", "run_variant"]

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
    """`OK`, `UNAVAILABLE`, `OVER_BUDGET` or `FAILED`."""
    reason: Optional[str]
    """Why it is unavailable, over budget or failed (None when it ran)."""
    ranks: tuple[Any, ...]
    """Every rank's payload in rank order, a `RankMeasurement` from `measure_rank` (empty unless it ran)."""


RankBody = Callable[[int, VariantSpec, BenchOptions, GPTConfig], Any]
"""What a rank runs once its process group is up: `(rank, spec, options, config)` to the payload it
reports (`measure_rank`, or a capacity try's). A module-level function: it is pickled by name."""


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
    body: RankBody
    """What each rank runs."""
    name: str
    """What the log files are named after: the variant, or "paired" for a paired group."""

    def log_path(self, rank: int) -> Path:
        return self.log_dir / f"{self.name}-rank{rank}.log"


_PRELOAD = [
    __name__, "torch._dynamo", "lightning_zero.bench.capacity", "lightning_zero.bench.paired",
    "lightning_zero.bench.offload_overlap",
]  # fmt: skip
"""Imported once by the forkserver and inherited by every rank. `torch._dynamo` is imported by
the first `Optimizer.add_param_group` of each process (torch wraps it in `_disable_dynamo`):
0.5 CPU-s per rank if left to the ranks."""


def run_variant(
    spec: VariantSpec,
    options: BenchOptions,
    config: GPTConfig,
    log_dir: Path,
    body: Optional[RankBody] = None,
    watchdog: Optional[Watchdog] = None,
    name: Optional[str] = None,
    timeout_s: Optional[float] = None,
) -> VariantRun:
    """Run `spec` on `options.devices` fresh processes and collect what `body` (default:
    `measure_rank`) returns on each; `watchdog`, if given, may stop them early. `name` (default: the
    variant's) names the log files; `timeout_s` (default: `options.timeout_s`) bounds the wait."""
    log_dir.mkdir(parents=True, exist_ok=True)
    task = _Task(spec, options, config, _free_port(), log_dir, body or measure_rank, name or spec.name)
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
    else:  # Windows: every rank imports everything itself
        context = multiprocessing.get_context("spawn")
    reports = context.Queue()
    processes = [context.Process(target=_rank_main, args=(rank, task, reports)) for rank in range(options.devices)]
    with _environment(CHILD_ENVIRONMENT):
        for process in processes:
            process.start()
    collected: dict[int, tuple[str, object]] = {}
    timeout_s = timeout_s or options.timeout_s
    deadline = time.monotonic() + timeout_s
    poll_s = _POLL_S if watchdog is None else watchdog.interval_s
    try:
        while len(collected) < options.devices:
            stop = watchdog and watchdog.problem({r: p for r, p in enumerate(processes) if r not in collected})
            if stop:
                _kill(processes)  # now: an over-budget rank must not go on allocating
                return VariantRun(OVER_BUDGET, stop, ())
            try:
                rank, status, payload = reports.get(timeout=poll_s)
            except queue.Empty:
                problem = _silent_failure(processes, collected, deadline, timeout_s)
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
        # one grace period for all: ranks that reported are exiting, the others are stopped
        grace_end = time.monotonic() + (10 if len(collected) == options.devices else 2)
        for process in processes:
            process.join(timeout=max(0.0, grace_end - time.monotonic()))
        _kill(processes)
    for wanted in (UNAVAILABLE, OVER_BUDGET, FAILED):
        reasons = [str(payload) for status, payload in collected.values() if status == wanted]
        if reasons:
            return VariantRun(wanted, reasons[0], ())
    return VariantRun(OK, None, tuple(collected[r][1] for r in range(options.devices)))  # type: ignore[misc]


def _kill(processes: list) -> None:
    """Kill every process still alive and reap it."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()


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


def threads_per_rank(options: BenchOptions) -> int:
    """A CPU rank's intra-op threads: `options.threads`, or by default the cores shared among the ranks."""
    return options.threads or max(1, (os.cpu_count() or 1) // options.devices)


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
        # at world size 1 our engine takes the sharded path users run at N >= 2, not its one-rank
        # shortcuts: on a GPU through NCCL itself, on the CPU with each collective a local copy
        # (gloo's per-call latency is no GPU's host time; see COLLECTIVES_AT_ONE_RANK)
        **{COLLECTIVES_AT_ONE_RANK: "1" if options.device == "cuda" else "path"},
    )
    if options.device == "cpu":
        os.environ.update(CPU_CHILD_ENVIRONMENT)
    try:
        if options.device == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(threads_per_rank(options))
        backend = "nccl" if options.device == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=options.devices, timeout=PROCESS_GROUP_TIMEOUT)
        reports.put((rank, OK, task.body(rank, task.spec, options, task.config)))
    except VariantUnavailable as error:
        reports.put((rank, UNAVAILABLE, str(error)))
    except BaseException as error:  # noqa: BLE001 - reported to the parent, with the log for details
        traceback.print_exc()
        # under a budget, running out of it is the try's verdict, not a crash
        budgeted = options.memory_budget is not None and isinstance(error, (torch.cuda.OutOfMemoryError, OverBudget))
        status = OVER_BUDGET if budgeted else FAILED
        reports.put((rank, status, f"{type(error).__name__}: {error} (see {task.log_path(rank)})"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
