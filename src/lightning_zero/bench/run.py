"""`run_bench`: every selected variant, one process group after another (with `--paired`, the
variants that can share a process in one group, round-robin: `paired.py`), then the report."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_zero.bench import disk, io_floor, paired, provenance, report, targets, theory, variants, worker
from lightning_zero.bench.options import BenchOptions, model_config, num_parameters
from lightning_zero.bench.results import OK, UNAVAILABLE, BenchResult, VariantResult, not_run, summarize
from lightning_zero.models.gpt import GPT, Block, GPTConfig


def _say_nothing(line: str) -> None:
    """The default progress callback: silence."""


def check_devices(options: BenchOptions) -> None:
    """Raise a `ValueError` when `--device cuda` asks for more GPUs than are visible."""
    if options.device == "cuda" and torch.cuda.device_count() < options.devices:
        raise ValueError(
            f"--device cuda needs {options.devices} GPUs (one per rank), {torch.cuda.device_count()} visible."
        )


def run_bench(options: BenchOptions, progress: Callable[[str], None] = _say_nothing) -> BenchResult:
    """Run the benchmark `options` describes, write its report into `options.out` and return it.

    `progress` receives one line as each variant starts and ends (the command line passes `print`).
    """
    check_devices(options)
    environment = provenance.describe_environment(options)  # now, before our own processes load the machine
    config = model_config(options)
    psi = num_parameters(config)
    with torch.device("meta"):
        model = GPT(config)
        unit_bytes = theory.largest_unit_bytes(model, Block)
        numels = tuple(p.numel() for p in model.parameters())  # the optimizer's order: the owner plan's input
        rows = tuple(theory.unit_rows(model, Block, options.devices))
    specs = variants.select(options.variants)
    results: list[VariantResult] = []
    on_disk = any(spec.state_on_disk for spec in specs)
    with disk.nvme_directory(options.nvme_path, on_disk) as nvme_path:
        if on_disk:
            environment["nvme"] = measure_disk(nvme_path, progress)
        run_options = dataclasses.replace(options, nvme_path=nvme_path)
        log_dir = options.out / report.LOG_DIR_NAME
        runs = _Runs(run_options, config, numels, unit_bytes, log_dir, progress, environment.get("nvme"), rows)
        if options.paired:
            results = _paired_then_alone(runs, specs)
        else:
            results = [runs.alone(spec, f"[{i}/{len(specs)}]") for i, spec in enumerate(specs, start=1)]
    judged, notes = targets.judge(results, options, environment["load_average_1min"])
    bench = BenchResult(
        environment=environment,
        options=provenance.options_record(options),
        model={"config": dataclasses.asdict(config), "num_params": psi, "largest_unit_bytes": unit_bytes},
        variants=judged,
        notes=notes,
        files={},
    )
    return report.write_all(bench, options.out)


def measure_disk(directory: Path, progress: Callable[[str], None] = _say_nothing) -> dict[str, Any]:
    """`disk.raw_throughput` of `directory`, as the report's environment keeps it."""
    raw = disk.raw_throughput(directory)
    progress(
        f"disk under {directory} ({raw.filesystem or 'file system unknown'}): write {raw.write_gbps:.2f} GB/s"
        f" (fsync'ed), read {raw.read_gbps:.2f} GB/s{'' if raw.cache_dropped else ' (cache not dropped)'},"
        f" from the page cache {raw.cached_read_gbps:.2f} GB/s"
    )
    return {**dataclasses.asdict(raw), "in_memory": raw.in_memory}


def with_io_floor(result: VariantResult, directory: Path, ranks: int, raw: Optional[dict[str, Any]] = None) -> VariantResult:
    """An NVMe variant's `result` with its I/O floor (`io_floor.py`): the engine path's rates on
    `directory`, measured now (the variant's processes are gone) with as many requests as its
    optimizer step made, of their mean size, from `ranks` ranks at once; `raw`: the run's raw figures.
    Unchanged where no optimizer step was recorded (paired mode) or it moved nothing."""
    step = result.disk.optimizer_step if result.disk is not None else None
    if step is None or not step.reads + step.writes:
        return result
    request_bytes = max(1, round((step.read_bytes + step.write_bytes) / (step.reads + step.writes)))
    requests = max(1, round(max(step.reads, step.writes)))
    rates = io_floor.engine_path_throughput(directory, request_bytes, requests, ranks=ranks)
    return dataclasses.replace(result, io_floor=io_floor.io_floor(step, rates, result.disk.rank, raw))


@dataclass(frozen=True)
class _Runs:
    """What every variant's run needs: the options, the model, where the logs go, whom to tell."""

    options: BenchOptions
    config: GPTConfig
    numels: tuple[int, ...]
    """Each parameter's size, in the optimizer's order."""
    unit_bytes: int
    """The largest unit's bytes (the model-state tolerance)."""
    log_dir: Path
    progress: Callable[[str], None]
    raw_disk: Optional[dict[str, Any]] = None
    """The NVMe directory's raw figures (`measure_disk`), for the I/O floor at raw rates."""
    rows: tuple[int, ...] = ()
    """Each stage-3 unit's row (`theory.unit_rows`), the root first: prices the bytes per link."""

    def expected(self, spec: variants.VariantSpec) -> theory.VariantTheory:
        o, numels = self.options, self.numels
        ranks_per_node = o.ranks_per_node if o.nodes is not None else None
        return theory.variant_theory(
            spec, sum(numels), o.devices, self.unit_bytes, o.shard_group_size, numels, self.rows, ranks_per_node
        )

    def alone(self, spec: variants.VariantSpec, label: str) -> VariantResult:
        """One variant in fresh processes of its own, summarized (or why it did not run)."""
        self.progress(f"{label} {spec.name}: {spec.description} ...")
        run = worker.run_variant(spec, self.options, self.config, self.log_dir)
        if run.status == OK:
            result = summarize(spec, self.expected(spec), run.ranks, self.options.tokens_per_step)
            if spec.state_on_disk and self.options.nvme_path is not None:
                result = with_io_floor(result, self.options.nvme_path, self.options.devices, self.raw_disk)
            return self._ran(result)
        self.progress(f"      {run.status}: {run.reason}")
        return not_run(spec, self.expected(spec), run.status, run.reason or "")

    def paired(self, specs: Sequence[variants.VariantSpec]) -> tuple[dict[str, VariantResult], Optional[str]]:
        """`specs` stepped round-robin in one group of processes (`paired.py`): each one's result by
        name, or nothing and why the group failed."""
        names = tuple(spec.name for spec in specs)
        self.progress(f"[paired] {', '.join(names)}: round-robin in the same processes ...")
        body = functools.partial(paired.measure_paired, names=names)
        timeout_s = self.options.timeout_s * len(specs)  # the group runs them all
        run = worker.run_variant(
            specs[0], self.options, self.config, self.log_dir, body, name="paired", timeout_s=timeout_s
        )
        if run.status != OK:
            self.progress(f"      {run.status}: {run.reason}")
            return {}, f"{run.status}: {run.reason}"
        results = {}
        for spec in specs:
            unavailable = run.ranks[0].unavailable.get(spec.name)
            if unavailable is not None:
                self.progress(f"      {spec.name}: {UNAVAILABLE}: {unavailable}")
                results[spec.name] = not_run(spec, self.expected(spec), UNAVAILABLE, unavailable)
                continue
            measured = [rank.measurements[spec.name] for rank in run.ranks]
            summary = summarize(spec, self.expected(spec), measured, self.options.tokens_per_step, paired=True)
            results[spec.name] = self._ran(summary, f"{spec.name}: ")
        return results, None

    def _ran(self, result: VariantResult, name: str = "") -> VariantResult:
        """Tell what `result` measured (after `name`); return it."""
        self.progress(
            f"      {name}model state {result.model_state_bytes / 1e6:,.2f} MB/rank, "
            f"step {result.step_time_s * 1e3:,.1f} ms, comm {result.comm_bytes_per_step / 1e6:,.2f} MB/step, "
            f"{result.python_calls_per_step:,} Python calls/step"
        )
        if result.disk is not None:
            d = result.disk
            self.progress(
                f"      disk: read {d.read_gbps:.2f} GB/s, write {d.write_gbps:.2f} GB/s,"
                f" {d.waits_per_step:.1f} waits ({d.wait_s_per_step * 1e3:,.0f} ms) per step"
            )
        if result.io_floor is not None:
            f = result.io_floor
            self.progress(
                f"      I/O floor {f.floor_s * 1e3:,.1f} ms (engine path: read {f.rates.read_gbps:.2f} GB/s,"
                f" write {f.rates.write_gbps:.2f} GB/s, {f.rates.ranks} rank(s) at once; host step"
                f" {f.host_step_s * 1e3:,.1f} ms); optimizer step {f.step_s * 1e3:,.1f} ms = {f.step_vs_floor:.2f}x the floor"
            )
        return result


def _paired_then_alone(runs: _Runs, specs: Sequence[variants.VariantSpec]) -> list[VariantResult]:
    """`--paired`: every variant that can share a process in one paired group, the others alone
    (as without `--paired`), each with the reason; in the table's order."""
    pairable = [spec for spec in specs if paired.unpairable(spec) is None]
    together, failure = runs.paired(pairable) if len(pairable) >= 2 else ({}, None)
    results = []
    for index, spec in enumerate(specs, start=1):
        if spec.name in together:
            results.append(together[spec.name])
            continue
        why = paired.unpairable(spec)
        if why is None:
            why = f"the paired run failed ({failure}), so it was timed alone" if failure else "nothing to pair it with"
        result = runs.alone(spec, f"[alone {index}/{len(specs)}]")
        results.append(dataclasses.replace(result, not_paired_because=why))
    return results
