"""Model states against a memory budget: whether an estimate fits, the layout to recommend, the
largest model that fits, and the decimal units they are told in.

The arithmetic is `lightning_zero.estimate`'s; this module only compares its results with budgets
(`lightning-zero estimate --gpu-memory`, the capacity benchmark, `scripts/offload_gpu.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Callable, Optional, Sequence

from lightning_zero.estimate import LEFT_OUT, MemoryEstimate, NvmeStaging, Topology, estimate
from lightning_zero.estimate_schemes import LAYOUTS, Layout, PrecisionScheme

_DECIMAL_UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1))
"""Decimal units, largest first: GPU spec sheets ("80 GB") and the ZeRO paper's figures use 1e9."""


def fits(candidate: MemoryEstimate, gpu_memory: int, host_memory: Optional[int] = None) -> bool:
    """Whether the model states fit in `gpu_memory` bytes per device (and `host_memory` per node, if
    given), with a whole-tensor optimizer also while it steps (`MemoryEstimate.device_during_step`),
    with frozen units kept gathered also during backward (`MemoryEstimate.device_during_backward`),
    and on the host with the host step's rollback copies where the estimate counts them
    (`MemoryEstimate.host_during_step`). Only model states: see the module's note for what else
    needs room."""
    if max(candidate.device_during_step, candidate.device_during_backward) > gpu_memory:
        return False
    return host_memory is None or candidate.host_during_step <= host_memory


@dataclass(frozen=True)
class Recommendation:
    """The first layout, in order of preference, whose model states fit; `choice` is None if none does."""

    choice: Optional[MemoryEstimate]
    smallest: MemoryEstimate
    """The layout with the fewest bytes per device, to say how far off a budget is when none fits."""
    gpu_memory: int
    host_memory: Optional[int]

    @property
    def message(self) -> str:
        """One sentence for a person, followed by what the estimate leaves out."""
        budget = f"{format_bytes(self.gpu_memory)} per device"
        if self.host_memory is not None:
            budget += f" and {format_bytes(self.host_memory)} of host memory per node"
        if self.choice is None:
            return (
                f"No layout fits in {budget}: the smallest, {self.smallest.layout.label}, needs "
                f"{format_bytes(self.smallest.device.total)} per device and "
                f"{format_bytes(self.smallest.host.total)} per node. Add devices or nodes (stage 3 "
                f"divides every term by their number) or use a smaller model. {LEFT_OUT}"
            )
        choice = self.choice
        line = f"Recommended for {budget}: {choice.layout.label}, {format_bytes(choice.device.total)} per device"
        if choice.host.total:
            line += f" and {host_memory_phrase(choice)}"
        return f"{line}. {LEFT_OUT}"


def recommend(
    estimates: Sequence[MemoryEstimate], gpu_memory: int, host_memory: Optional[int] = None
) -> Recommendation:
    """The cheapest layout that fits: `estimates` are tried in order (`estimate_all` returns them in
    `LAYOUTS`' order of preference: the lowest stage that fits on the device, then offload)."""
    if not estimates:
        raise ValueError("recommend needs at least one estimate")
    if gpu_memory < 1:
        raise ValueError(f"gpu_memory must be a positive number of bytes, got {gpu_memory}")
    choice = next((e for e in estimates if fits(e, gpu_memory, host_memory)), None)
    smallest = min(estimates, key=lambda e: (e.device.total, e.host.total))
    return Recommendation(choice=choice, smallest=smallest, gpu_memory=gpu_memory, host_memory=host_memory)


def host_memory_phrase(candidate: MemoryEstimate) -> str:
    """E.g. `19.2 GB of host memory per node (9.6 GB of it pinned)`, with the host step's rollback
    copies `..., and up to 14.4 GB more for the host step's rollback copies`, and with NVMe `..., and
    9.6 GB of NVMe per node`."""
    phrase = f"{format_bytes(candidate.host.total)} of host memory per node ({format_bytes(candidate.pinned)} of it pinned)"
    if candidate.host_step_rollback:
        phrase += f", and up to {format_bytes(candidate.host_step_rollback)} more for the host step's rollback copies"
    if candidate.disk:
        phrase += f", and {format_bytes(candidate.disk)} of NVMe per node"
    return phrase


@dataclass(frozen=True)
class LargestModel:
    """The most parameters whose model states fit a budget, and the layout that holds them."""

    num_params: int
    """0 when not even one parameter fits."""
    estimate: Optional[MemoryEstimate]
    """That layout's bytes at `num_params` (None when nothing fits)."""
    gpu_memory: int
    host_memory: Optional[int]
    """None: only layouts that keep everything on the device were searched."""

    @property
    def message(self) -> str:
        """One sentence for a person: the count, the layout and its bytes, and what reduces it."""
        budget = f"{format_bytes(self.gpu_memory)} per device"
        if self.host_memory is None:
            budget += " without offload (give the host memory to count offload)"
        else:
            budget += f" and {format_bytes(self.host_memory)} of host memory per node"
        if self.estimate is None:
            return f"Largest model for {budget}: none, not even one parameter's model states fit."
        e = self.estimate
        line = (
            f"Largest model for {budget}: {self.num_params:,} parameters ({format_count(self.num_params)}), as "
            f"{e.layout.label}: {format_bytes(e.device.total)} per device"
        )
        if e.host.total:
            line += f" and {host_memory_phrase(e)}"
        return f"{line}. Model states only: activations and the terms left out reduce it."


def largest_model(
    scheme: PrecisionScheme,
    topology: Topology,
    gpu_memory: int,
    host_memory: Optional[int] = None,
    layouts: Sequence[Layout] = LAYOUTS,
    nvme: NvmeStaging = NvmeStaging(),
    rollback_copies: bool = True,
) -> LargestModel:
    """The largest parameter count whose model states `fits` in some layout of `layouts` (the first in
    their order when several hold the same count, so NVMe only when it holds more). Offload layouts
    are searched only when `host_memory` is given: without a host budget they would have no bound.
    NVMe's disk is not a budget here: the message says how much of it the model needs.
    `rollback_copies`: whether the host has room for the host step's rollback copies too (`estimate`'s)."""
    if gpu_memory < 1:
        raise ValueError(f"gpu_memory must be a positive number of bytes, got {gpu_memory}")
    best = LargestModel(num_params=0, estimate=None, gpu_memory=gpu_memory, host_memory=host_memory)
    for layout in layouts:
        if layout.offload_optimizer and host_memory is None:
            continue
        num_params = _largest_fitting(layout, scheme, topology, gpu_memory, host_memory, nvme, rollback_copies)
        if num_params > best.num_params:
            at_size = estimate(num_params, layout, scheme, topology, nvme, rollback_copies=rollback_copies)
            best = LargestModel(num_params, at_size, gpu_memory, host_memory)
    return best


def _largest_fitting(
    layout: Layout,
    scheme: PrecisionScheme,
    topology: Topology,
    gpu_memory: int,
    host_memory: Optional[int],
    nvme: NvmeStaging,
    rollback_copies: bool,
) -> int:
    """The largest Ψ whose model states fit in `layout`, or 0 (`largest_passing`). Every layout costs
    at least one byte per parameter somewhere (NVMe's host keeps the master and gradient chunks), and
    both places searched have a budget, so the doubling ends."""
    return largest_passing(
        lambda num_params: fits(
            estimate(num_params, layout, scheme, topology, nvme, rollback_copies=rollback_copies), gpu_memory, host_memory
        )
    )


def largest_passing(passes: Callable[[int], bool]) -> int:
    """The largest n ≥ 1 with `passes(n)`, or 0 when `passes(1)` fails, for a test that passes up to
    some n and fails from there on (bytes grow with the size): double n from 1 until the first
    failure, then bisect between the last pass and it. `passes` is called in that order, O(log n)
    times, which `lightning-zero bench --capacity` relies on (each call there is a training run)."""
    if not passes(1):
        return 0
    good, bad = 1, 2
    while passes(bad):
        good, bad = bad, 2 * bad
    while bad - good > 1:  # invariant: `good` passes, `bad` does not
        middle = (good + bad) // 2
        good, bad = (middle, bad) if passes(middle) else (good, middle)
    return good


def format_count(num_params: int) -> str:
    """A parameter count the way models are named: `1.21B`, `125M`, `350K`."""
    rounded = float(f"{num_params:.3g}")  # three significant digits first, so 999.6M reads 1B
    for suffix, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if rounded >= size:
            return f"{rounded / size:g}{suffix}"
    return str(num_params)


def decimal_unit(nbytes: float) -> tuple[str, int]:
    """The largest decimal unit (name, bytes) in which `nbytes` is at least 1, so figures stay readable
    from a 1M-parameter model (MB) to a 1T one (TB)."""
    return next(((name, size) for name, size in _DECIMAL_UNITS if abs(nbytes) >= size), ("B", 1))


def format_bytes(nbytes: float) -> str:
    """`nbytes` in its decimal unit, e.g. `41.25 GB`; three decimals show the paper's 28.125 exactly."""
    name, size = decimal_unit(nbytes)
    return f"{Decimal(nbytes) / size:.3f}".rstrip("0").rstrip(".") + f" {name}"
