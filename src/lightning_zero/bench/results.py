"""The benchmark's figures: what each rank measured, and one summary per variant.

Every field of `VariantResult` exists for every variant, whether it ran or not (`None` where a
figure could not be measured), so the JSON has one schema; `asdict` gives it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Generic, Optional, Sequence, TypeVar

from lightning_zero.bench.comm import CommCount
from lightning_zero.bench.disk import DiskIO, DiskSummary, summarize_disk
from lightning_zero.bench.host_counts import HostCounts
from lightning_zero.bench.io_floor import IOFloor
from lightning_zero.bench.memory import HeldBytes
from lightning_zero.bench.overhead import Overhead
from lightning_zero.bench.theory import VariantTheory
from lightning_zero.bench.variants import VariantSpec

OK, UNAVAILABLE, FAILED = "ok", "unavailable", "failed"
"""A variant's status: it ran; it cannot run in this installation; it broke (the reason says how)."""
OVER_BUDGET = "over budget"
"""A capacity try's status: a rank needed more memory than `--memory-budget` (see `budget.py`)."""


@dataclass(frozen=True)
class RankMeasurement:
    """What one rank measured for one variant."""

    rank: int
    """The rank that measured."""
    step_times_s: tuple[float, ...]
    """Wall time of each timed step on this rank."""
    step_cpu_times_s: tuple[float, ...]
    """Host CPU time of each timed step on this rank (`rank.StepTimer`)."""
    losses: tuple[float, ...]
    """The loss of every step: warm-up, timed, then the instrumented one."""
    resting_memory_bytes: Optional[int]
    """Memory in use right after setup (RSS on CPU, allocated on CUDA): the start of the peak (None
    in paired mode, where the process holds every paired variant)."""
    peak_memory_bytes: Optional[int]
    """Peak over the warm-up and timed steps (see `memory.py`, [Note: peak memory]); None in paired mode."""
    peak_memory_meaning: str
    """How `peak_memory_bytes` was read."""
    model_state: HeldBytes
    """Model-state bytes at the phase of the instrumented step where they were largest."""
    model_state_phase: str
    """That phase (see `wrappers.PHASES`)."""
    phases: dict[str, HeldBytes]
    """Model-state bytes at every phase of the instrumented step."""
    engine_reports: dict[str, dict[str, Any]]
    """Ours only: the engine's own `memory_report()` at every phase, to cross-check `phases`."""
    collectives: CommCount
    """Collectives of the instrumented step (see `comm.py`, [Note: what is counted])."""
    overhead: Overhead
    """aten ops and host syncs of the instrumented step (see `overhead.py`)."""
    traffic_by_group: dict[str, int] = field(default_factory=dict)
    """Ours: full-buffer bytes of the instrumented step's collectives "within" this rank's shard
    group and "across" groups (hybrid sharding), or over "all" ranks; from the engine's own count."""
    bytes_by_link: dict[str, dict[str, int]] = field(default_factory=dict)
    """Ours: full-buffer bytes of the instrumented step's collectives by category ("all_gather
    forward", "reduce_scatter", ...) and link ("intra", "inter"-node), `links.bytes_by_link`."""
    disk_io: Optional[DiskIO] = None
    """Ours with NVMe offload: the engine's reads and writes over the timed steps (`disk.py`)."""
    optimizer_step_times_s: tuple[float, ...] = ()
    """CPU only: the part of each timed step from the reduced gradients to the refreshed parameters
    (the optimizer step; for DDP and FSDP2, whose probes have no gradient phase, the same)."""
    host: Optional[HostCounts] = None
    """Python calls, storage resizes and hook registrations of one untimed step (`host_counts.py`)."""
    units: Optional[int] = None
    """Units gathered and released as one (ours at stage 3, FSDP2's `fully_shard` groups); None otherwise."""


@dataclass(frozen=True)
class VariantResult:
    """One variant's summary over its ranks, next to its theory; see the report for definitions."""

    name: str
    """`variants.VariantSpec.name`."""
    family: str
    """Who implements it (`variants.Family` value)."""
    stage: int
    """The ZeRO stage it is compared with (0 = DDP)."""
    description: str
    """How it is configured, in one line."""
    status: str
    """`OK`, `UNAVAILABLE` or `FAILED`."""
    reason: Optional[str]
    """Why it is unavailable or failed; None when it ran."""
    theory: VariantTheory
    """The floors and tolerances it is compared with (given whether or not it ran)."""
    model_state_bytes: Optional[int]
    """Largest over ranks of the per-rank model-state bytes."""
    model_state_by_kind: Optional[dict[str, int]]
    """That rank's bytes of parameters, gradients and optimizer state."""
    model_state_by_location: Optional[dict[str, int]]
    """That rank's bytes by device type."""
    model_state_phase: Optional[str]
    """The phase of the step at which that rank held the most (`wrappers.PHASES`)."""
    model_state_vs_theory: Optional[float]
    """measured / floor - 1."""
    peak_memory_bytes: Optional[int]
    """Largest over ranks of the peak memory."""
    resting_memory_bytes: Optional[int]
    """Largest over ranks of the memory in use after setup."""
    step_time_s: Optional[float]
    """Median over timed steps of the slowest rank's step time."""
    step_time_ratio_to_ddp: Optional[float]
    """`step_time_s` / DDP's, measured in the same run (None without DDP)."""
    tokens_per_s: Optional[float]
    """Tokens of all ranks per `step_time_s`."""
    collective_calls_per_step: Optional[int]
    """Largest over ranks of the collectives issued in one step."""
    collective_calls_by_kind: Optional[dict[str, int]]
    """That busiest rank's calls by kind."""
    comm_bytes_per_step: Optional[float]
    """Largest over ranks of the ring bytes received in one step."""
    comm_buffer_bytes_per_step: Optional[int]
    """Largest over ranks of the full-buffer bytes of one step's collectives."""
    comm_vs_theory: Optional[float]
    """comm_bytes_per_step / floor - 1 (None where the floor is 0: one rank)."""
    aten_ops_per_step: Optional[int]
    """Largest over ranks of the aten operators dispatched in one step (see `overhead.py`)."""
    aten_ops_ratio_to_ddp: Optional[float]
    """`aten_ops_per_step` / DDP's (None without DDP)."""
    host_syncs_per_step: Optional[int]
    """Largest over ranks of the host-device syncs in one step, from anywhere."""
    host_syncs_ours_per_step: Optional[int]
    """Largest over ranks of those made by lightning-zero's code (0 for the baselines)."""
    host_syncs_ours_forward_backward: Optional[int]
    """Largest over ranks of ours made during forward and backward."""
    final_loss: Optional[float]
    """Rank 0's loss at the last step (same data, seed and optimizer everywhere, so it should agree
    with DDP's up to reduction order)."""
    losses: Optional[tuple[float, ...]]
    """Rank 0's loss at every step."""
    targets: dict[str, Optional[bool]]
    """Issue 8's targets, met or not (None: not applicable); filled in by `targets.judge`."""
    notes: tuple[str, ...]
    """Targets missed and anything else a reader must know about these figures."""
    ranks: tuple[RankMeasurement, ...]
    """Every rank's own figures."""
    disk: Optional[DiskSummary] = None
    """Ours with NVMe offload: reads, writes and waits per step, the worst rank's (`disk.py`)."""
    optimizer_step_s: Optional[float] = None
    """CPU only: median over timed steps of the slowest rank's optimizer step (`RankMeasurement`)."""
    comm_bytes_by_kind: Optional[dict[str, float]] = None
    """The busiest rank's ring bytes of one step by kind ("all_gather", "reduce_scatter",
    "all_to_all", ...), summing to `comm_bytes_per_step`."""
    paired: bool = False
    """Timed round-robin with the other paired variants in the same processes (`paired.py`), so
    `step_time_ratio_to_ddp` is the median of per-round ratios; False: in processes of its own."""
    not_paired_because: Optional[str] = None
    """With `--paired`, why this variant was timed in processes of its own instead."""
    step_time_ratio_quartiles: Optional[tuple[float, float]] = None
    """Paired: the first and third quartiles of the per-round ratios to DDP (how much rounds vary)."""
    step_time_ratio_ci95: Optional[tuple[float, float]] = None
    """Paired: a 95% confidence interval of `step_time_ratio_to_ddp`, the median (`ratios.median_interval`)."""
    host_cpu_s: Optional[float] = None
    """Median over timed steps of the busiest rank's host CPU time per step (`rank.StepTimer`)."""
    host_cpu_ratio_to_ddp: Optional[float] = None
    """`host_cpu_s` / DDP's (paired: the median of per-round ratios, as the step time's)."""
    host_cpu_ratio_ci95: Optional[tuple[float, float]] = None
    """Paired: a 95% confidence interval of `host_cpu_ratio_to_ddp`."""
    python_calls_per_step: Optional[int] = None
    """Largest over ranks of the Python function calls of one step (`host_counts.py`)."""
    python_calls_ratio_to_ddp: Optional[float] = None
    """`python_calls_per_step` / DDP's (None without DDP)."""
    storage_resizes_per_step: Optional[int] = None
    """Largest over ranks of the storages our engine resized in one step (0 for the baselines)."""
    hook_registrations_per_step: Optional[int] = None
    """Largest over ranks of the hooks our engine registered in one step (0 for the baselines)."""
    units: Optional[int] = None
    """Units gathered and released as one: ours at stage 3, FSDP2's `fully_shard` groups; None otherwise."""
    ms_beyond_ddp: Optional[float] = None
    """Host CPU ms per step beyond DDP's (paired: the median over rounds of the per-round difference)."""
    ms_beyond_ddp_per_unit: Optional[float] = None
    """`ms_beyond_ddp` / `units`, where the variant has units (see `ratios.py`)."""
    bytes_by_link: Optional[dict[str, dict[str, int]]] = None
    """Ours: the step's full-buffer bytes by category and link (`links.py`), of the rank that moved
    the most inter-node."""
    io_floor: Optional[IOFloor] = None
    """Ours with NVMe offload, timed alone: the optimizer step against its I/O floor, with the rates
    of the engine's I/O path on its directory and the pipeline's occupancy (`io_floor.py`)."""


def summarize(
    spec: VariantSpec,
    theory: VariantTheory,
    ranks: Sequence[RankMeasurement],
    tokens_per_step: int,
    paired: bool = False,
) -> VariantResult:
    """A ran variant's summary: memory as the worst rank, time as the median of per-step maxima;
    `paired`: it was timed round-robin with others (`paired.py`)."""
    worst_state = max(ranks, key=lambda r: r.model_state.total)
    held = worst_state.model_state
    step_time = statistics.median(round_times(ranks))
    busiest = max(ranks, key=lambda r: r.collectives.total_wire_bytes)
    comm = busiest.collectives.total_wire_bytes
    return VariantResult(
        name=spec.name,
        family=spec.family.value,
        stage=spec.stage,
        description=spec.description,
        status=OK,
        reason=None,
        theory=theory,
        model_state_bytes=held.total,
        model_state_by_kind={
            "parameters": held.parameters,
            "gradients": held.gradients,
            "optimizer_state": held.optimizer_state,
        },
        model_state_by_location=dict(held.by_location),
        model_state_phase=worst_state.model_state_phase,
        model_state_vs_theory=held.total / theory.model_state.total - 1,
        peak_memory_bytes=_largest([r.peak_memory_bytes for r in ranks]),
        resting_memory_bytes=_largest([r.resting_memory_bytes for r in ranks]),
        step_time_s=step_time,
        step_time_ratio_to_ddp=None,
        tokens_per_s=tokens_per_step / step_time if step_time > 0 else None,
        collective_calls_per_step=max(r.collectives.total_calls for r in ranks),
        collective_calls_by_kind=dict(busiest.collectives.calls),
        comm_bytes_per_step=comm,
        comm_bytes_by_kind=dict(busiest.collectives.wire_bytes),
        comm_buffer_bytes_per_step=max(r.collectives.total_buffer_bytes for r in ranks),
        comm_vs_theory=comm / theory.comm_bytes_per_step - 1 if theory.comm_bytes_per_step else None,
        aten_ops_per_step=max(r.overhead.aten_ops for r in ranks),
        aten_ops_ratio_to_ddp=None,
        host_syncs_per_step=max(r.overhead.host_syncs for r in ranks),
        host_syncs_ours_per_step=max(r.overhead.host_syncs_ours for r in ranks),
        host_syncs_ours_forward_backward=max(r.overhead.host_syncs_ours_forward_backward for r in ranks),
        final_loss=ranks[0].losses[-1] if ranks[0].losses else None,
        losses=ranks[0].losses,
        targets={},
        notes=(),
        ranks=tuple(ranks),
        disk=summarize_disk([r.disk_io for r in ranks]),
        optimizer_step_s=_median_of_maxima([r.optimizer_step_times_s for r in ranks]),
        paired=paired,
        python_calls_per_step=_largest([r.host.python_calls if r.host else None for r in ranks]),
        storage_resizes_per_step=_largest([r.host.storage_resizes if r.host else None for r in ranks]),
        hook_registrations_per_step=_largest([r.host.hook_registrations if r.host else None for r in ranks]),
        units=ranks[0].units,
        host_cpu_s=statistics.median(round_times(ranks, cpu=True)),
        bytes_by_link=_busiest_inter_node(ranks),
    )


def _busiest_inter_node(ranks: Sequence[RankMeasurement]) -> Optional[dict[str, dict[str, int]]]:
    """The bytes by link of the rank that moved the most inter-node (None where none were counted)."""
    counted = [r.bytes_by_link for r in ranks if r.bytes_by_link]
    if not counted:
        return None
    return max(counted, key=lambda by_link: sum(row["inter"] for row in by_link.values()))


def round_times(ranks: Sequence[RankMeasurement], cpu: bool = False) -> list[float]:
    """Each timed step's wall time, the slowest rank's: a step ends when its last rank does; `cpu`:
    its host CPU time, the busiest rank's."""
    return [max(times) for times in zip(*(r.step_cpu_times_s if cpu else r.step_times_s for r in ranks))]


def _largest(values: Sequence[Optional[int]]) -> Optional[int]:
    """The largest of the ranks' figures, None where a rank did not measure it."""
    return None if not values or any(v is None for v in values) else max(values)  # type: ignore[type-var]


def _median_of_maxima(per_rank: Sequence[Sequence[float]]) -> Optional[float]:
    """The median over steps of the slowest rank's figure (None when not measured)."""
    if not per_rank or not all(per_rank):
        return None
    return statistics.median(max(step) for step in zip(*per_rank))


def not_run(spec: VariantSpec, theory: VariantTheory, status: str, reason: str) -> VariantResult:
    """A variant that did not produce figures: every measured field None, the theory still given."""
    return VariantResult(
        name=spec.name,
        family=spec.family.value,
        stage=spec.stage,
        description=spec.description,
        status=status,
        reason=reason,
        theory=theory,
        model_state_bytes=None,
        model_state_by_kind=None,
        model_state_by_location=None,
        model_state_phase=None,
        model_state_vs_theory=None,
        peak_memory_bytes=None,
        resting_memory_bytes=None,
        step_time_s=None,
        step_time_ratio_to_ddp=None,
        tokens_per_s=None,
        collective_calls_per_step=None,
        collective_calls_by_kind=None,
        comm_bytes_per_step=None,
        comm_buffer_bytes_per_step=None,
        comm_vs_theory=None,
        aten_ops_per_step=None,
        aten_ops_ratio_to_ddp=None,
        host_syncs_per_step=None,
        host_syncs_ours_per_step=None,
        host_syncs_ours_forward_backward=None,
        final_loss=None,
        losses=None,
        targets={},
        notes=(),
        ranks=(),
    )


Row = TypeVar("Row")


@dataclass(frozen=True)
class RunReport(Generic[Row]):
    """One run of `lightning-zero bench`: where and how it ran, and a row per variant."""

    environment: dict[str, Any]
    """Versions, processor or GPU, world size, threads per rank."""
    options: dict[str, Any]
    """The `BenchOptions`, as given, with the command that reproduces them."""
    model: dict[str, Any]
    """The GPT shape and Ψ, and what the run derived from them: the largest unit's bytes (for the
    tolerance), or with `--capacity` the activation bytes and the process baseline of the estimate."""
    variants: tuple[Row, ...]
    """One per variant asked for, in the table's order."""
    notes: tuple[str, ...]
    """Notes about the whole run (targets missed are also in each variant's notes)."""
    files: dict[str, str]
    """What was written: markdown, json, png (or why not), logs."""


@dataclass(frozen=True)
class BenchResult(RunReport[VariantResult]):
    """A benchmark run: every variant's measurements (`run.py`)."""
