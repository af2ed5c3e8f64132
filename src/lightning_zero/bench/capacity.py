"""`lightning-zero bench --capacity model|batch --memory-budget SIZE`: the largest GPT (`n_layer` grown
at the options' width) or the largest batch (sequences per rank, the options' model) each variant
trains with every rank under a memory budget, next to what `footprint.py` predicts for it.

A try builds the variant in fresh ranks (`worker.run_variant`) and trains `CAPACITY_STEPS` steps;
it fits when no rank's charged peak is over the budget (`budget.py`, [Note: enforcing a memory
budget]). Running each try in its own processes is what lets a try that runs out of memory, or is
killed for it, end itself and not the benchmark. The size doubles from 1 until the first try that
does not fit, then is bisected between the last that did and it (`sizing.largest_passing`); the
prediction is searched the same way on `footprint.footprint`. A try that fails for another reason
(a crash, a timeout) ends the variant's search, and its row says so.

Targets (model mode; judged in `run_notes`, never asserted): zero3's largest model at least 1.8x DDP's,
at least FSDP2's (`fsdp2_z3`), and at least 90% of its own prediction.

With `budget_scope="host"` (CPU) the budget is host memory: every variant is charged its whole
resident set, offloaded state included, and `zero3_offload_nvme` (whose files are on disk and whose
reads pass through the page cache, neither of them the process's memory) shows how much larger a
model NVMe offload trains than `zero3_offload` under the same host budget.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


from lightning_zero import sizing
from lightning_zero.bench import capacity_report, disk, provenance, report, theory, variants, worker
from lightning_zero.bench.budget import ChargedPeak, RssWatchdog, limit_device
from lightning_zero.bench.footprint import ActivationBytes, Footprint, count_activations, footprint, model_states
from lightning_zero.bench.options import BenchOptions, model_config, num_parameters
from lightning_zero.bench.rank import build_rank, rank_device, synchronize
from lightning_zero.bench.capacity_results import Capacity, CapacityResult, CapacityRow, CapacityTry, TryMeasurement
from lightning_zero.bench.results import FAILED, OK, OVER_BUDGET, UNAVAILABLE
from lightning_zero.bench.run import check_devices, measure_disk
from lightning_zero.bench.variants import BASELINE, VariantSpec
from lightning_zero.models.gpt import GPT, Block, GPTConfig

CAPACITY_STEPS = 3
"""Steps per try: the first creates the optimizer state (and DDP rebuilds its buckets after it), the
later ones show the steady peak with all of it in place (see `budget.py`)."""

KNOBS = {"model": "n_layer", "batch": "batch_size"}
"""The `BenchOptions` field each mode grows."""

TARGETS = {"vs_ddp": 1.8, "vs_fsdp2": 1.0, "vs_estimate": 0.9}
"""zero3's largest model as a multiple of DDP's, of FSDP2's (`fsdp2_z3`) and of its prediction."""

HOST_ALLOWANCE = 1.5
"""An offload variant's watchdog allows this much more than the predicted host state over the budget
(the verdict is the charged peak; the watchdog only stops a try that is over it by far)."""


@dataclass(frozen=True)
class CapacityProgress:
    """Where a capacity run is, for a progress bar."""

    text: str
    """What is running or what the last try showed, in one line."""
    completed: int
    """Variants whose search is over."""
    total: int
    """Variants to search."""
    line: Optional[str] = None
    """A line to keep (the end of a variant's search), where a bar shows `text` only while it runs."""


def _say_nothing(progress: CapacityProgress) -> None:
    """The default progress callback: silence."""


def run_capacity(options: BenchOptions, progress: Callable[[CapacityProgress], None] = _say_nothing) -> CapacityResult:
    """Search every selected variant's capacity under `options.memory_budget`, write the report into
    `options.out` (markdown, `bench.json`, chart) and return it."""
    if options.capacity not in KNOBS or options.memory_budget is None:
        raise ValueError("run_capacity needs `capacity` and `memory_budget` in the options")
    check_devices(options)
    environment = provenance.describe_environment(options)  # now, before our own processes load the machine
    base_config = model_config(options)
    base = dataclasses.replace(options, params=None, n_embd=base_config.n_embd)  # the width stays fixed
    activations = count_activations(base_config, options.precision, options.activation_checkpointing)
    specs = variants.select(options.variants)
    predict = _Prediction(base, activations, _unit_bytes(base_config))
    searched: list[tuple[VariantSpec, list[CapacityTry]]] = []
    on_disk = any(spec.state_on_disk for spec in specs)
    with disk.nvme_directory(options.nvme_path, on_disk) as nvme_path:
        if on_disk:
            environment["nvme"] = measure_disk(nvme_path, lambda line: progress(CapacityProgress(line, 0, len(specs))))
        searching = dataclasses.replace(base, nvme_path=nvme_path)
        for index, spec in enumerate(specs):
            progress(CapacityProgress(f"{spec.name}: starting", index, len(specs)))
            tries = _search(spec, searching, lambda text: progress(CapacityProgress(text, index, len(specs))))
            searched.append((spec, tries))
            line = f"{spec.name}: largest {KNOBS[base.capacity]} {_largest_size(tries)} ({len(tries)} tries)"
            progress(CapacityProgress(line, index + 1, len(specs), line=line))
    baseline = _process_baseline(searched, predict)
    rows = tuple(_row(spec, base, tries, predict, baseline) for spec, tries in searched)
    model = {
        "config": dataclasses.asdict(base_config),
        "num_params": num_parameters(base_config),
        "activation_bytes": dataclasses.asdict(activations),
        "baseline_bytes": baseline,
        "before_model_bytes": _median([t.baseline_bytes for _, tries in searched for t in tries if t.baseline_bytes]),
    }
    notes = run_notes(rows, options)
    result = CapacityResult(environment, provenance.options_record(options), model, rows, notes, files={})
    return report.write_all(result, options.out, render=capacity_report.markdown, chart=capacity_report.write_chart)


# --- the tries ---------------------------------------------------------------------------------


def _search(spec: VariantSpec, base: BenchOptions, say: Callable[[str], None]) -> list[CapacityTry]:
    """Every try of `spec`'s search, in order (see the module doc)."""
    knob = KNOBS[base.capacity]
    tries: list[CapacityTry] = []

    def fits(size: int) -> bool:
        if tries and tries[-1].status in (FAILED, UNAVAILABLE):
            return False  # the search ended on something other than the budget: no more tries
        say(f"{spec.name}: {knob} {size} ...")
        tries.append(try_size(spec, base, size))
        outcome = tries[-1]
        peak = f", peak {outcome.peak_bytes / 1e6:,.0f} MB" if outcome.peak_bytes else ""
        say(f"{spec.name}: {knob} {size} {outcome.status}{peak}")
        return outcome.status == OK

    sizing.largest_passing(fits)
    return tries


def try_size(spec: VariantSpec, base: BenchOptions, size: int) -> CapacityTry:
    """Train `spec` for `CAPACITY_STEPS` steps with the mode's knob at `size`, in fresh ranks, and
    judge every rank's charged peak against the budget."""
    knob = KNOBS[base.capacity]
    options = dataclasses.replace(base, **{knob: size})
    config = model_config(options)
    psi = num_parameters(config)
    budget = options.memory_budget
    watchdog = None
    if options.device == "cpu":
        # the host state is charged under a host budget, so nothing is allowed for it then
        uncharged = 0 if options.budget_scope == "host" else model_states(spec, psi, options.devices).host_per_rank.total
        watchdog = RssWatchdog(budget + int(HOST_ALLOWANCE * uncharged))
    log_dir = options.out / report.LOG_DIR_NAME / f"{knob}-{size}"
    run = worker.run_variant(spec, options, config, log_dir, body=train_under_budget, watchdog=watchdog)
    if run.status != OK:
        return CapacityTry(size, psi, run.status, run.reason, None, None)
    worst = max(run.ranks, key=lambda r: r.peak_bytes)
    baseline = max(r.baseline_bytes for r in run.ranks)
    if worst.peak_bytes > budget:
        reason = f"rank {worst.rank} peaked at {worst.peak_bytes / 1e6:,.1f} MB, over the {budget / 1e6:,.1f} MB budget"
        return CapacityTry(size, psi, OVER_BUDGET, reason, worst.peak_bytes, baseline)
    return CapacityTry(size, psi, OK, None, worst.peak_bytes, baseline)


def train_under_budget(rank: int, spec: VariantSpec, options: BenchOptions, config: GPTConfig) -> TryMeasurement:
    """A try's rank (a `worker.RankBody`): cap the device, build the variant, train `CAPACITY_STEPS`
    steps and report the charged peak (see `budget.py`)."""
    device = rank_device(rank, options)
    limit_device(options.memory_budget, device)
    charged = ChargedPeak(device)
    baseline = charged.in_use()
    built = build_rank(rank, spec, options, config, steps=CAPACITY_STEPS)
    synchronize(device)
    charged.setup_done(options.memory_budget)
    losses = [built.wrapped.step(x, y) for x, y in built.batches]
    synchronize(device)
    engine = built.wrapped.engine_report()
    charges_host = options.budget_scope == "host"
    host_state = sum(engine["host"].values()) if engine is not None and device.type == "cpu" and not charges_host else 0
    peak = charged.charged(host_state)
    built.wrapped.close()
    return TryMeasurement(rank, baseline, peak, host_state, float(losses[-1]))


# --- rows and targets --------------------------------------------------------------------------


def _median(values: Sequence[int]) -> int:
    return int(statistics.median(values)) if values else 0


def _largest_size(tries: Sequence[CapacityTry]) -> int:
    return max((t.size for t in tries if t.status == OK), default=0)


def _unit_bytes(config: GPTConfig) -> int:
    """The largest stage-3 unit's bytes, which size NVMe offload's host buffers: a block, or the
    root's embeddings; neither depends on `n_layer`, so one block is built (on meta)."""
    with torch.device("meta"):
        return theory.largest_unit_bytes(GPT(dataclasses.replace(config, n_layer=1)), Block)


@dataclass(frozen=True)
class _Prediction:
    """`footprint.footprint` at a size of the mode's knob."""

    base: BenchOptions
    activations: ActivationBytes
    unit_bytes: int
    """`_unit_bytes` of the model: what sizes NVMe offload's host buffers at stage 3."""

    def at(self, spec: VariantSpec, size: int, baseline: int) -> Footprint:
        options = dataclasses.replace(self.base, **{KNOBS[self.base.capacity]: size})
        config = model_config(options)
        psi = num_parameters(config)
        return footprint(
            spec, config, psi, options.batch_size, options.devices, baseline, self.activations,
            charge_host=options.budget_scope == "host", nvme=theory.nvme_staging(spec.stage, self.unit_bytes),
        )  # fmt: skip


def _process_baseline(searched: Sequence[tuple[VariantSpec, Sequence[CapacityTry]]], predict: _Prediction) -> int:
    """The measured constant every prediction stands on: the least that any variant's first try (size
    1) needed beyond its predicted model states and activations. That is the process itself: on the
    CPU Python, torch and gloo before the model (~290 MB) plus what training adds once (threads,
    allocator arenas, ~40 MB); on CUDA the allocator's small change. The least, so what one variant
    keeps beyond the others (buffers, gathered units) stays visible as its distance from its
    prediction. When no first try fit: the median of what the ranks held before the model."""
    extras = [
        tries[0].peak_bytes - predict.at(spec, tries[0].size, baseline=0).total
        for spec, tries in searched
        if tries and tries[0].status == OK and tries[0].peak_bytes is not None
    ]
    if extras:
        return max(0, min(extras))
    return _median([t.baseline_bytes for _, tries in searched for t in tries if t.baseline_bytes])


def _row(
    spec: VariantSpec, base: BenchOptions, tries: Sequence[CapacityTry], predict: _Prediction, baseline: int
) -> CapacityRow:
    """`spec`'s row: its largest fit, the prediction on `baseline` (`_process_baseline`) and why the
    search ended."""
    knob, budget = KNOBS[base.capacity], base.memory_budget
    largest_size = _largest_size(tries)
    estimate_size = sizing.largest_passing(lambda size: predict.at(spec, size, baseline).total <= budget)
    stopped = next((t for t in tries if t.status != OK), None)
    broke = stopped is not None and stopped.status in (FAILED, UNAVAILABLE)
    status = stopped.status if broke else OK
    reason = None if stopped is None else f"{knob} {stopped.size}: {stopped.reason}"
    return CapacityRow(
        name=spec.name,
        stage=spec.stage,
        description=spec.description,
        status=status,
        reason=reason,
        capacity=Capacity(
            mode=base.capacity,
            budget_bytes=budget,
            largest=_amount(base, largest_size),
            estimate=_amount(base, estimate_size),
        ),
        knob=knob,
        largest_size=largest_size,
        estimate_size=estimate_size,
        estimate_bytes=predict.at(spec, max(estimate_size, 1), baseline).as_dict(),
        tries=tuple(tries),
        notes=(f"{status}: {reason}",) if broke else (),
    )


def _amount(base: BenchOptions, size: int) -> int:
    """What `size` of the knob is in the unit `capacity` reports: parameters, or samples per rank."""
    if size == 0 or base.capacity == "batch":
        return size
    return num_parameters(model_config(dataclasses.replace(base, n_layer=size)))


def run_notes(rows: Sequence[CapacityRow], options: BenchOptions) -> tuple[str, ...]:
    """The run's notes: every row's largest as a multiple of DDP's and of its prediction, and in model
    mode zero3's `TARGETS`, met or "MISSED"."""
    by_name = {r.name: r for r in rows}
    ddp = by_name.get(BASELINE)
    notes = []
    unit = "parameters" if options.capacity == "model" else "samples per rank"
    for r in rows:
        ratios = []
        if ddp is not None and ddp.capacity.largest and r is not ddp:
            ratios.append(f"{r.capacity.largest / ddp.capacity.largest:.2f}x DDP's")
        if r.capacity.estimate:
            ratios.append(f"{r.capacity.largest / r.capacity.estimate:.0%} of its estimate")
        compared = f" ({', '.join(ratios)})" if ratios else ""
        notes.append(f"`{r.name}`: largest {r.capacity.largest:,} {unit}{compared}")
    zero3 = by_name.get("zero3")
    if options.capacity == "model" and zero3 is not None:
        notes += _targets(zero3, ddp, by_name.get("fsdp2_z3"))
    offload = by_name.get("zero3_offload")
    for name in ("zero3_offload_nvme", "zero3_offload_nvme_params"):
        nvme = by_name.get(name)
        if options.capacity == "model" and nvme is not None and offload is not None and offload.capacity.largest:
            ratio = nvme.capacity.largest / offload.capacity.largest
            host = options.budget_scope == "host"
            scope = "host memory (the whole process)" if host else "device memory (host state uncharged)"
            notes.append(
                f"NVMe offload (issue 28): under a {options.memory_budget / 1e6:,.0f} MB budget of {scope},"
                f" {name} trains {nvme.capacity.largest:,} parameters, {ratio:.2f}x zero3_offload's"
                f" {offload.capacity.largest:,}"
                + ("" if host else "; use --budget-scope host to charge the host memory it saves")
            )
    return tuple(notes)


def _targets(zero3: CapacityRow, ddp: Optional[CapacityRow], fsdp2: Optional[CapacityRow]) -> list[str]:
    """zero3's `TARGETS`, one note each, against what ran."""
    largest = zero3.capacity.largest
    against = {
        "vs_ddp": ("DDP's", ddp.capacity.largest if ddp else None),
        "vs_fsdp2": ("FSDP2's (fsdp2_z3)", fsdp2.capacity.largest if fsdp2 else None),
        "vs_estimate": ("its estimate", zero3.capacity.estimate),
    }
    notes = []
    for key, (what, other) in against.items():
        if not other:
            continue
        wanted = TARGETS[key]
        verdict = "met" if largest >= wanted * other else "MISSED"
        notes.append(
            f"target {verdict}: zero3's largest model ≥ {wanted:g}x {what}: {largest:,} vs {other:,} ({largest / other:.2f}x)"
        )
    return notes
