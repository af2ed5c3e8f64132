"""`run_bench`: every selected variant, one process group after another, then the report."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import torch

from lightning_zero.bench import disk, provenance, report, targets, theory, variants, worker
from lightning_zero.bench.options import BenchOptions, model_config, num_parameters
from lightning_zero.bench.results import OK, BenchResult, VariantResult, not_run, summarize
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
    specs = variants.select(options.variants)
    log_dir = options.out / report.LOG_DIR_NAME
    results: list[VariantResult] = []
    on_disk = any(spec.state_on_disk for spec in specs)
    with disk.nvme_directory(options.nvme_path, on_disk) as nvme_path:
        if on_disk:
            environment["nvme"] = measure_disk(nvme_path, progress)
        run_options = dataclasses.replace(options, nvme_path=nvme_path)
        for index, spec in enumerate(specs, start=1):
            results.append(_run_one(spec, index, len(specs), run_options, config, numels, unit_bytes, log_dir, progress))
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


def _run_one(
    spec: variants.VariantSpec,
    index: int,
    count: int,
    options: BenchOptions,
    config: GPTConfig,
    numels: tuple[int, ...],
    unit_bytes: int,
    log_dir: Path,
    progress: Callable[[str], None],
) -> VariantResult:
    """One variant in fresh processes, summarized (or why it did not run); `numels`: each parameter's
    size, in the optimizer's order."""
    expected = theory.variant_theory(spec, sum(numels), options.devices, unit_bytes, options.shard_group_size, numels)
    progress(f"[{index}/{count}] {spec.name}: {spec.description} ...")
    run = worker.run_variant(spec, options, config, log_dir)
    if run.status == OK:
        result = summarize(spec, expected, run.ranks, options.tokens_per_step)
        progress(
            f"      model state {result.model_state_bytes / 1e6:,.2f} MB/rank, "
            f"step {result.step_time_s * 1e3:,.0f} ms, comm {result.comm_bytes_per_step / 1e6:,.2f} MB/step"
        )
        if result.disk is not None:
            d = result.disk
            progress(
                f"      disk: read {d.read_gbps:.2f} GB/s, write {d.write_gbps:.2f} GB/s,"
                f" {d.waits_per_step:.1f} waits ({d.wait_s_per_step * 1e3:,.0f} ms) per step"
            )
        return result
    progress(f"      {run.status}: {run.reason}")
    return not_run(spec, expected, run.status, run.reason or "")
