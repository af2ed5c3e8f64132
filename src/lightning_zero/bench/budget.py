"""A capacity try's memory budget: how it is enforced, and what each rank is charged.

[Note: enforcing a memory budget]
The budget is per rank: every rank of a try must stay under it, or the size does not fit.
- CUDA: each rank calls `torch.cuda.set_per_process_memory_fraction(budget / total)` before it
  allocates anything, so the caching allocator raises `OutOfMemoryError` rather than reserve more;
  the try ends there (`worker.py` reports it as over budget). What is charged is what the allocator
  holds, so the CUDA context (~0.5 GB) and host memory are outside the budget, as on a GPU.
- CPU: there is no allocator to cap. `RLIMIT_AS` counts address space, of which torch and gloo map
  gigabytes they never touch (thread stacks, arenas, reserved regions), and `RLIMIT_DATA` counts
  mmap'ed tensors the same way, so either fails a try long before its memory is used, by an amount
  that depends on the machine. So the budget is the process's resident set size, the kernel's own
  count of the memory it uses: the parent's `RssWatchdog` reads every running rank's `VmRSS` and
  `VmHWM` in /proc/<pid>/status every 10 ms and kills the try's ranks the moment one is over (so a
  try that would exhaust the machine ends early), and each rank reports its peak (`VmHWM`, the
  kernel's high-water mark, which no spike between two looks escapes) for the verdict.
  The whole process is charged, the ~290 MB of Python, torch and gloo before the model included,
  just as a GPU's budget includes what the framework keeps there; the estimate stands on that
  process baseline, measured (`capacity._process_baseline`, ~325 MB once training). The ranks
  run with glibc's mmap threshold fixed (`memory.py`, [Note: peak memory]), so freed tensors
  leave the resident set.
- Offload on a CPU machine: host memory and device memory are the same RSS, so an offload variant
  would gain nothing. To predict what it gains on a GPU, the state the engine keeps in host memory
  on purpose (`memory_report().host`) is not charged: a rank's charged peak is the larger of its
  setup's peak, charged whole (model built, wrapped, sharded), and its steps' peak less that host
  state. The host state is allocated by the end of the first step and then stays, and the second
  and third steps reach the first's peak with it in place, which is why a try runs 3 steps. Its
  watchdog allows for the host state on top of the budget; the verdict is the charged peak.
- A host budget (`budget_scope="host"`, CPU only): the question is then what host memory holds, so
  nothing is left out: every variant is charged its whole resident set, offloaded state included,
  and its watchdog allows nothing on top. NVMe offload's files are not memory, and the page cache
  its reads and writes pass through is the kernel's, not the process's (it is in no VmRSS): it
  is charged the host buffers it streams the state through, not the state.
Every rank also checks its setup's peak before the first step and stops the try itself
(`OverBudget`) when that alone is over: no step could bring it back under.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from lightning_zero.bench.memory import PeakMemory

WATCH_INTERVAL_S = 0.01
"""How often the parent reads the ranks' memory: at a few GB/s of page faults a rank gets at most
some tens of MB past the budget before it is stopped."""


class OverBudget(Exception):
    """Raised by a rank whose setup alone went over the budget: its steps could only add to it, and
    an offload variant's watchdog, which allows for host state, might let them run long."""


class Watchdog(abc.ABC):
    """Looks at the ranks while `worker.run_variant` waits for their reports."""

    interval_s: float = WATCH_INTERVAL_S
    """How often to look."""

    @abc.abstractmethod
    def problem(self, running: Mapping[int, Any]) -> Optional[str]:
        """Why the ranks must be stopped now, or None; `running` maps each rank that has not
        reported yet to its `multiprocessing.Process`."""


@dataclass(frozen=True)
class RssWatchdog(Watchdog):
    """Stops a CPU try as soon as a rank's resident memory is over `limit_bytes`."""

    limit_bytes: int
    """The budget, plus the host state an offload variant is not charged for."""

    def problem(self, running: Mapping[int, Any]) -> Optional[str]:
        for rank, process in running.items():
            resident = resident_bytes(process.pid)
            if resident is not None and resident > self.limit_bytes:
                return (
                    f"rank {rank} reached {resident / 1e6:,.1f} MB resident, over its limit of "
                    f"{self.limit_bytes / 1e6:,.1f} MB: stopped"
                )
        return None


def resident_bytes(pid: int) -> Optional[int]:
    """The larger of process `pid`'s resident set and its peak (`VmRSS`, `VmHWM`); None when it has
    exited or /proc cannot be read."""
    kib = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM"):
                    kib[name] = int(value.split()[0])  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return 1024 * max(kib.values()) if kib else None


def limit_device(budget_bytes: int, device: torch.device) -> None:
    """On CUDA, cap this process's caching allocator at `budget_bytes`; on the CPU nothing is capped
    here (the parent's `RssWatchdog` watches instead)."""
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if budget_bytes > total:
        raise ValueError(f"the memory budget, {budget_bytes:,} bytes, is more than the GPU has ({total:,} bytes)")
    torch.cuda.set_per_process_memory_fraction(budget_bytes / total, device)


@dataclass
class ChargedPeak:
    """What a rank is charged over a try: its setup's peak whole, its steps' peak less the host state
    it keeps on purpose (see [Note: enforcing a memory budget])."""

    device: torch.device
    """The rank's device: CUDA allocator figures, or the process's resident set on the CPU."""
    _memory: PeakMemory = field(init=False)
    _setup_peak: int = field(init=False, default=0)
    _steps_apart: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._memory = PeakMemory(self.device)

    def in_use(self) -> int:
        """Bytes in use now (the baseline, before the model is built)."""
        return self._memory.current()

    def setup_done(self, budget_bytes: int) -> None:
        """Close the setup window and open the steps'; raise `OverBudget` if setup went over."""
        self._setup_peak = self._memory.peak()
        if self._setup_peak > budget_bytes:
            peak, budget = self._setup_peak / 1e6, budget_bytes / 1e6
            raise OverBudget(f"setup peaked at {peak:,.1f} MB, over the {budget:,.1f} MB budget")
        # PeakMemory says "since setup" only when the peak could be reset; otherwise the steps'
        # peak includes setup's, and nothing may be subtracted from it
        self._steps_apart = self._memory.reset().endswith("since setup")

    def charged(self, host_state_bytes: int) -> int:
        """The peak charged to the budget; `host_state_bytes` is left out of the steps' peak."""
        steps_peak = self._memory.peak()
        if not self._steps_apart:
            return max(self._setup_peak, steps_peak)
        return max(self._setup_peak, steps_peak - host_state_bytes)
