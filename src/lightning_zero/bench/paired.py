"""Paired mode (`--paired`): the variants stepped round-robin in the same processes.

[Note: paired timing]
Timed one after the other, each variant in processes of its own, two variants are measured minutes
apart; on shared cores the load changes in between, and a 3% difference drowns in it. In paired mode
every rank builds each paired variant once (its own seeded model, optimizer and data, exactly as
alone: `rank.build_rank`), then runs rounds: one step of each variant in turn, the order rotated by
one every round (so no variant always follows the same one and inherits its caches or allocator
leftovers), with a barrier before each timed step at N ≥ 2 so its ranks start together. Warm-up
rounds first, then the timed ones; after them each variant gets its counted and instrumented steps
(`rank.closing_measurement`), one variant at a time. `ratios.py` then divides each round's step by
DDP's step of the same round (see [Note: ratios to DDP]).

What cannot be paired runs alone, as without `--paired`, with the reason in the report
(`unpairable`): DeepSpeed keeps process-wide state, and NVMe offload's I/O threads would run under
the other variants' steps. Peak memory is not measured in paired mode: one process holds every
paired variant, so no peak is any one variant's (model-state bytes are still counted per variant).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch.distributed as dist
from torch import Tensor

from lightning_zero.bench.options import BenchOptions
from lightning_zero.bench.rank import UNTIMED_AFTER, BuiltRank, StepTimer, build_rank, closing_measurement
from lightning_zero.bench.results import RankMeasurement
from lightning_zero.bench.variants import BY_NAME, Family, VariantSpec
from lightning_zero.bench.wrappers import VariantUnavailable
from lightning_zero.models.gpt import GPTConfig

PEAK_NOT_MEASURED = "not measured: paired variants share their processes (see paired.py)"


def unpairable(spec: VariantSpec) -> Optional[str]:
    """Why `spec` cannot share its processes with other variants, or None when it can."""
    if spec.family is Family.DEEPSPEED:
        return (
            "DeepSpeed keeps process-wide state (its accelerator and communication globals; at stage 3 it"
            " patches module construction), so it runs in processes of its own"
        )
    if spec.state_on_disk:
        return "its NVMe reads and writes run on background threads, which would overlap the other variants' steps"
    return None


@dataclass(frozen=True)
class PairedRank:
    """What one rank of a paired group reports."""

    measurements: dict[str, RankMeasurement]
    """Each variant that ran, by name, measured as alone except for the peak memory."""
    unavailable: dict[str, str]
    """Each variant that could not be built here, by name, and why (`wrappers.VariantUnavailable`)."""


def measure_paired(
    rank: int, spec: VariantSpec, options: BenchOptions, config: GPTConfig, names: Sequence[str] = ()
) -> PairedRank:
    """A rank body (`worker.RankBody`, with `names` bound): build the variants `names`, step them
    round-robin and measure each (see [Note: paired timing]); `spec` only names the group's logs."""
    built: dict[str, BuiltRank] = {}
    unavailable: dict[str, str] = {}
    steps = options.warmup + options.steps + UNTIMED_AFTER
    for name in names:
        try:
            built[name] = build_rank(rank, BY_NAME[name], options, config, steps)
        except VariantUnavailable as error:  # raised while building, the same on every rank
            unavailable[name] = str(error)
    order = list(built)
    timers = {name: StepTimer(built[name].device) for name in order}
    losses: dict[str, list[Tensor]] = {name: [] for name in order}
    together = dist.get_world_size() > 1
    for index in range(options.warmup + options.steps):
        for name in _rotated(order, index):
            wrapped, (x, y) = built[name].wrapped, built[name].batches[index]
            if index < options.warmup:
                losses[name].append(wrapped.step(x, y))
                continue
            if together:
                dist.barrier()  # each timed step starts on every rank at once
            losses[name].append(timers[name].step(wrapped, x, y))
    memory = (None, None, PEAK_NOT_MEASURED)
    measurements = {
        name: closing_measurement(rank, built[name], options, timers[name], losses[name], memory, disk_io=None)
        for name in order  # no disk: NVMe offload is never paired (`unpairable`)
    }
    return PairedRank(measurements, unavailable)


def _rotated(order: list[str], index: int) -> list[str]:
    """`order` started at its `index`-th entry (mod its length): round `index`'s stepping order."""
    start = index % len(order) if order else 0
    return order[start:] + order[:start]

