"""The benchmark's I/O floor (`bench/io_floor.py`, [Note: the I/O floor]), in one process: its
arithmetic on known numbers, the per-step recording, the engine path's rates on a small directory
(behaviour only: nothing here is timed against a number), the target and the report's section."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from lightning_zero.bench import io_floor, targets, theory, variants
from lightning_zero.bench.disk import DiskIO, summarize_disk
from lightning_zero.bench.io_floor import EnginePathThroughput, StepIO, StepIORecorder
from lightning_zero.bench.report_sections import io_floor_section
from lightning_zero.bench.results import OK, VariantResult
from lightning_zero.engine.offload.scratch_files import IOStats


def _rates(read_gbps: float, write_gbps: float, ranks: int = 1) -> EnginePathThroughput:
    return EnginePathThroughput(
        path="/nvme", request_bytes=8_000_000, requests=50, ranks=ranks, threads=4, rounds=3,
        read_bytes=10**9, write_bytes=10**9, read_seconds=1 / read_gbps, write_seconds=1 / write_gbps,
        read_gbps=read_gbps, write_gbps=write_gbps, request_read_gbps=read_gbps / 2, request_write_gbps=write_gbps / 2,
    )  # fmt: skip


def _step(wall: float, update: float = 0.1) -> StepIO:
    """400 MB read and 400 MB written in 50 requests each, the threads busy 0.4 s / 0.2 s."""
    return StepIO(
        reads=50, writes=50, read_bytes=4e8, write_bytes=4e8, read_seconds=0.4, write_seconds=0.2,
        update_seconds=update, wall_seconds=wall,
    )  # fmt: skip


def test_floor_is_the_larger_of_the_host_step_and_the_disk_time() -> None:
    # 2 GB at 2 GB/s + 1 GB at 1 GB/s = 2 s of disk, more than 0.5 s of host
    assert io_floor.floor_seconds(0.5, 2e9, 1e9, 2.0, 1.0) == pytest.approx(2.0)
    # host-bound: the update takes longer than the disk
    assert io_floor.floor_seconds(3.0, 2e9, 1e9, 2.0, 1.0) == pytest.approx(3.0)
    assert io_floor.floor_seconds(0.25, 0, 0, 0.0, 0.0) == 0.25  # nothing moved: no rate needed
    assert io_floor.floor_seconds(0.25, 1, 0, 0.0, 1.0) == math.inf  # bytes at no rate: no floor


def test_io_floor_takes_a_ranks_share_of_the_rates_and_gives_the_occupancy() -> None:
    # two ranks at once share 4 GB/s read, 2 GB/s write: 2 and 1 GB/s each
    floor = io_floor.io_floor(_step(wall=0.8), _rates(4.0, 2.0, ranks=2), rank=1, raw={"read_gbps": 1.0, "write_gbps": 0.5})
    assert floor.read_s == pytest.approx(0.2) and floor.write_s == pytest.approx(0.4)
    assert floor.floor_s == pytest.approx(0.6) and floor.host_step_s == 0.1
    assert floor.step_s == 0.8 and floor.step_vs_floor == pytest.approx(0.8 / 0.6) and not floor.met  # 1.33x > 1.2x
    assert (floor.read_busy, floor.update_busy, floor.write_busy) == pytest.approx((0.5, 0.125, 0.25))
    assert floor.raw_floor_s == pytest.approx(4e8 / 0.5e9 + 4e8 / 0.25e9)  # 0.8 + 1.6 s at half the raw rates
    assert floor.rank == 1 and floor.read_bytes == floor.write_bytes == 4e8
    # within 1.2x: met; host-bound: the update is the floor
    assert io_floor.io_floor(_step(wall=0.7), _rates(4.0, 2.0, ranks=2)).met
    host_bound = io_floor.io_floor(_step(wall=1.1, update=1.0), _rates(4.0, 2.0, ranks=2))
    assert host_bound.floor_s == 1.0 and host_bound.raw_floor_s is None and host_bound.met
    # stepped during backward: little left after it, the occupancy over backward and the step (4 s)
    ahead = io_floor.io_floor(dataclasses.replace(_step(wall=0.05), span_seconds=4.0), _rates(4.0, 2.0, ranks=2))
    assert ahead.step_vs_floor == pytest.approx(0.05 / 0.6) and ahead.met
    assert (ahead.read_busy, ahead.update_busy, ahead.write_busy) == pytest.approx((0.1, 0.025, 0.05))


def test_step_io_recorder_counts_from_the_end_of_backward_to_the_step() -> None:
    stats = IOStats()
    recorder = StepIORecorder(stats)
    stats.add(reads=7, read_bytes=700)  # forward's gathers: not the step's
    recorder.probe("forward")
    recorder.probe("backward")
    stats.add(reads=2, read_bytes=200, read_seconds=0.5)  # the prefetch, before the step's wall begins
    recorder.probe("gradients")
    stats.add(reads=1, read_bytes=100, writes=3, write_bytes=300, write_seconds=0.25, update_seconds=0.125)
    recorder.probe("step")
    (step,) = recorder.steps
    assert (step.reads, step.read_bytes, step.read_seconds) == (3, 300, 0.5)
    assert (step.writes, step.write_bytes, step.write_seconds, step.update_seconds) == (3, 300, 0.25, 0.125)
    assert step.span_seconds >= step.wall_seconds >= 0  # from the end of backward / of the gradients
    # a step taken during backward reads as its buckets' gradients land: counted from the end of forward
    during = StepIORecorder(stats, counts_from="forward")
    during.probe("forward")
    stats.add(reads=2, read_bytes=200)  # in backward
    for phase in ("backward", "gradients", "step"):
        during.probe(phase)
    assert during.steps[0].read_bytes == 200
    # the summary's optimizer step: each figure's median over the steps, of the rank that waited longest
    steps = (step, dataclasses.replace(step, read_bytes=500), dataclasses.replace(step, read_bytes=900))
    quiet = DiskIO(3, 9, 9, 900, 900, 1.0, 1.0, 0, 0.0, per_step=steps)
    waited = dataclasses.replace(quiet, waits=2, wait_seconds=0.5)
    summary = summarize_disk([quiet, waited])
    assert summary is not None and summary.rank == 1 and summary.optimizer_step.read_bytes == 500
    assert summarize_disk([dataclasses.replace(quiet, per_step=())]).optimizer_step is None  # paired mode


def test_engine_path_throughput_moves_what_it_says(tmp_path: Path) -> None:
    """Two ranks' directories of 3 files of 64 KiB, written and read back whole by the engine's own
    `ScratchDirectory`: every byte counted, positive rates, nothing left behind."""
    request = 64 * 1024
    rates = io_floor.engine_path_throughput(tmp_path, request_bytes=request, requests=3, ranks=2, min_bytes=2 * 2**20)
    per_round = request * 3 * 2
    assert rates.rounds == math.ceil(2 * 2**20 / per_round) and rates.rounds >= 3
    assert rates.read_bytes == rates.write_bytes == rates.rounds * per_round
    assert rates.threads == io_floor.ENGINE_IO_THREADS == 4 and rates.ranks == 2 and rates.requests == 3
    assert rates.read_gbps > 0 and rates.write_gbps > 0 and rates.request_read_gbps > 0 and rates.request_write_gbps > 0
    assert rates.read_gbps == pytest.approx(rates.read_bytes / rates.read_seconds / 1e9)
    assert list(tmp_path.iterdir()) == []  # each directory removed with its files
    few = io_floor.engine_path_throughput(tmp_path, request_bytes=4096, requests=1, min_bytes=1)
    assert few.rounds == 3 and few.write_bytes == 3 * 4096  # at least 3 rounds
    with pytest.raises(ValueError, match="positive"):
        io_floor.engine_path_throughput(tmp_path, request_bytes=0, requests=1)


def _nvme_result(floor: io_floor.IOFloor) -> VariantResult:
    spec = variants.BY_NAME["zero3_offload_nvme"]
    nones = {f.name: None for f in dataclasses.fields(VariantResult) if f.default is dataclasses.MISSING}
    return VariantResult(**{
        **nones, "name": spec.name, "family": spec.family.value, "stage": spec.stage, "description": "", "status": OK,
        "theory": theory.variant_theory(spec, num_params=1_000_000, world_size=2, unit_bytes=0), "targets": {},
        "notes": (), "ranks": (), "io_floor": floor,
    })  # fmt: skip


def test_the_target_and_the_report_section() -> None:
    raw = {"read_gbps": 1.0, "write_gbps": 0.5}
    missed = _nvme_result(io_floor.io_floor(_step(wall=0.8), _rates(4.0, 2.0, ranks=2), rank=1, raw=raw))
    verdict = targets._io_floor(missed)
    assert verdict.met is False
    assert verdict.note == "MISSED target: optimizer step 800.0 ms = 1.33x the I/O floor 600.0 ms (target ≤ 1.2x, issue 61)"
    met = _nvme_result(io_floor.io_floor(_step(wall=0.66), _rates(4.0, 2.0, ranks=2)))
    assert targets._io_floor(met).met is True and targets._io_floor(met).note.startswith("target met: optimizer step 660.0 ms")
    assert targets._io_floor(dataclasses.replace(met, io_floor=None)).met is None  # paired, or not NVMe
    assert "io_floor" in targets.TARGETS

    lines = io_floor_section([missed, dataclasses.replace(met, name="zero3_offload_nvme_params")])
    text = "\n".join(lines)
    assert "Target (issue 61): NVMe step ≤ 1.2× the I/O floor" in text and "2 rank(s) at once, 4 I/O threads" in text
    row = next(line for line in lines if line.startswith("| `zero3_offload_nvme` |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells == [
        "`zero3_offload_nvme`", "1", "50 × 8.00", "4.00 / 2.00", "400.0 / 400.0", "100.0", "200.0 + 400.0", "**600.0**",
        "2,400.0", "800.0", "**1.33×**", "50% / 12% / 25%", "MISSED",
    ]  # fmt: skip
    params_row = next(line for line in lines if line.startswith("| `zero3_offload_nvme_params` |"))
    assert params_row.rstrip().endswith("| met |") and "| — |" in params_row  # no raw figures given
    assert io_floor_section([dataclasses.replace(met, io_floor=None)]) == []
