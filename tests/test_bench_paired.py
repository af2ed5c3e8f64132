"""Issue 51's benchmark side: the launch-bound shape, paired mode, and the host work per step.

One paired run (world size 1, the launch-bound shape, a few rounds; ~10 s) serves the report
checks; `count_python_calls` and the paired ratio arithmetic are checked in this process. Nothing
here asserts a timing: the ratios are computed from the times measured, and what is asserted is
their structure and arithmetic, and that the counts are there and plausible.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_zero.bench import BenchResult, paired, provenance, ratios, run_bench, theory, variants
from lightning_zero.bench.options import SHAPES, BenchOptions, shaped
from lightning_zero.bench.python_calls import count_python_calls
from lightning_zero.bench.results import OK, UNAVAILABLE, not_run
from lightning_zero.cli import main

ROUNDS = 3


def _leaf() -> int:
    return 1


def _caller(n: int) -> int:
    return sum(_leaf() for _ in range(n))  # 1 call, n + 1 of the generator (entered at each resumption), n of _leaf


def test_count_python_calls_counts_every_python_call_and_no_c_call() -> None:
    with count_python_calls() as calls:
        _caller(10)
        sorted(range(100))  # C functions: not counted
    assert calls.total == 1 + 11 + 10
    by_function = calls.by_function()
    assert sum(by_function.values()) == calls.total and len(by_function) == 3
    assert [count for name, count in by_function.items() if "._leaf:" in name] == [10]
    assert [count for name, count in by_function.items() if "_caller.<locals>.<genexpr>" in name] == [11]
    assert list(calls.by_function(top=1).values()) == [11]
    with count_python_calls() as nothing:
        pass
    assert nothing.total == 0 and nothing.by_function() == {}


def test_count_python_calls_restores_the_profiler_it_found_even_after_an_error() -> None:
    def outer(frame: object, event: str, arg: object) -> None:
        pass

    sys.setprofile(outer)
    try:
        with pytest.raises(RuntimeError), count_python_calls() as calls:
            _caller(2)
            raise RuntimeError("inside")
        assert sys.getprofile() is outer
        assert calls.total == 1 + 3 + 2  # counted up to the error
    finally:
        sys.setprofile(None)
    assert threading.getprofile() is None


def test_count_python_calls_sees_threads_started_inside() -> None:
    with count_python_calls() as calls:
        worker = threading.Thread(target=_caller, args=(5,))
        worker.start()
        worker.join()
    assert [count for name, count in calls.by_function().items() if "._leaf:" in name] == [5]


# --- the launch-bound shape and the command line ------------------------------------------------


def test_launch_bound_shape_sets_its_options_and_explicit_ones_override_it() -> None:
    options = shaped("launch-bound", devices=1)
    for name, value in SHAPES["launch-bound"].items():
        assert getattr(options, name) == value
    assert (options.n_layer, options.n_embd, options.n_head, options.block_size, options.batch_size) == (12, 64, 4, 32, 1)
    assert options.threads == 1  # a GPU's host is one thread; two per rank spin-wait on a loaded machine
    overridden = shaped("launch-bound", n_layer=2, steps=4, paired=True)
    assert (overridden.n_layer, overridden.steps, overridden.n_embd) == (2, 4, 64)
    command = provenance.command_line(overridden)
    assert command.startswith("lightning-zero bench --shape launch-bound --n-layer 2")
    assert "--steps 4" in command and "--paired" in command and "--n-embd" not in command and "--threads" not in command
    assert "--threads 2" in provenance.command_line(shaped("launch-bound", threads=2))
    assert shaped(None) == BenchOptions()
    with pytest.raises(ValueError, match="`shape` must be one of launch-bound"):
        shaped("tiny")
    with pytest.raises(ValueError, match="`threads` must be a positive integer"):
        BenchOptions(threads=0)
    with pytest.raises(ValueError, match="`paired` times steps"):
        BenchOptions(paired=True, capacity="model", memory_budget=10**9)


def test_console_script_applies_the_shape_under_explicit_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    seen: list[BenchOptions] = []
    report = tmp_path / "bench.md"
    report.write_text("report")

    def fake_run(options: BenchOptions, progress: object) -> SimpleNamespace:
        seen.append(options)
        return SimpleNamespace(files={"markdown": str(report)})

    monkeypatch.setattr("lightning_zero.cli.bench.run_bench", fake_run)
    assert main(["bench", "--shape", "launch-bound", "--devices", "1", "--paired", "--batch-size", "2"]) == 0
    assert main(["bench", "--threads", "3"]) == 0
    options, plain = seen
    assert plain.threads == 3 and plain.shape is None and plain.n_layer == BenchOptions().n_layer
    assert (options.shape, options.paired, options.devices, options.threads) == ("launch-bound", True, 1, 1)
    assert (options.n_layer, options.n_embd, options.batch_size, options.steps) == (12, 64, 2, 100)
    with pytest.raises(SystemExit):
        main(["bench", "--paired", "--capacity", "model", "--memory-budget", "1GB"])
    assert "`paired` times steps" in capsys.readouterr().err


# --- the paired ratio arithmetic ---------------------------------------------------------------


def _timed(name: str, times_ms: list[float], cpu_ms: list[float], units: object = None) -> object:
    """A ran, paired result of `name` whose one rank took `times_ms` (wall) and `cpu_ms` (host CPU) per round."""
    spec = variants.BY_NAME[name]
    expected = theory.variant_theory(spec, 1000, 1, 100, None, (1000,))
    seconds = lambda ms: tuple(t / 1e3 for t in ms)  # noqa: E731
    rank = SimpleNamespace(step_times_s=seconds(times_ms), step_cpu_times_s=seconds(cpu_ms))
    median, cpu_median = (sorted(ms)[len(ms) // 2] / 1e3 for ms in (times_ms, cpu_ms))
    return dataclasses.replace(
        not_run(spec, expected, OK, ""), status=OK, paired=True, ranks=(rank,), step_time_s=median,
        host_cpu_s=cpu_median, units=units,
    )  # fmt: skip


def test_paired_ratio_is_the_median_of_per_round_ratios() -> None:
    # round 0 of zero3 was slowed by a load that DDP's round 0 did not see: the median of per-round
    # ratios ignores it, the ratio of medians (30 / 20 = 1.5) would not
    ddp = _timed("ddp", [10.0, 30.0, 20.0], cpu_ms=[5.0, 15.0, 10.0])
    zero3 = _timed("zero3", [30.0, 33.0, 21.0], cpu_ms=[7.0, 17.0, 11.0], units=3)
    by_name = {r.name: r for r in ratios.against_ddp([ddp, zero3])}
    assert by_name["zero3"].step_time_ratio_to_ddp == pytest.approx(1.1)
    low, high = by_name["zero3"].step_time_ratio_quartiles
    assert low == pytest.approx(1.075) and high == pytest.approx(2.05)  # of [1.05, 1.1, 3.0]
    assert by_name["zero3"].step_time_ratio_ci95 is None  # 3 rounds are too few for a 95% interval
    assert by_name["zero3"].host_cpu_ratio_to_ddp == pytest.approx(17.0 / 15.0)  # of [1.4, 1.133, 1.1]
    assert by_name["zero3"].ms_beyond_ddp == pytest.approx(2.0)  # host CPU: per-round differences 2, 2, 1
    assert by_name["zero3"].ms_beyond_ddp_per_unit == pytest.approx(2.0 / 3)
    assert by_name["ddp"].step_time_ratio_to_ddp == 1.0 and by_name["ddp"].step_time_ratio_quartiles is None
    assert by_name["ddp"].ms_beyond_ddp_per_unit is None  # no units
    alone = ratios.against_ddp([dataclasses.replace(ddp, paired=False), zero3])
    assert alone[1].step_time_ratio_to_ddp == pytest.approx(30.0 / 20.0)  # not both paired: medians
    assert alone[1].ms_beyond_ddp == pytest.approx(11.0 - 10.0)


def test_median_interval_is_the_binomial_order_statistics() -> None:
    assert ratios.median_interval([1.0] * 5) is None  # 2 / 2**5 > 5%: no pair of order statistics covers 95%
    assert ratios.median_interval([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == (1.0, 6.0)
    assert ratios.median_interval([float(v) for v in range(1, 21)]) == (6.0, 15.0)  # the textbook's n = 20
    low, high = ratios.median_interval([float(v) for v in range(1, 101)])
    assert (low, high) == (40.0, 61.0)  # n = 100: ranks 40 and 61


def test_what_cannot_share_a_process_says_why() -> None:
    assert paired.unpairable(variants.BY_NAME["zero3"]) is None
    assert paired.unpairable(variants.BY_NAME["fsdp2_z3"]) is None
    assert "DeepSpeed" in paired.unpairable(variants.BY_NAME["ds_zero3"])
    assert "NVMe" in paired.unpairable(variants.BY_NAME["zero3_offload_nvme"])


# --- one paired run ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> BenchResult:
    out = tmp_path_factory.mktemp("paired")
    # ds_zero1 cannot be paired: it runs alone (unavailable where DeepSpeed is not installed)
    options = shaped(
        "launch-bound", devices=1, paired=True, warmup=1, steps=ROUNDS, variants=("ddp", "zero3", "ds_zero1"),
        out=out, timeout_s=120,
    )  # fmt: skip
    return run_bench(options)


def test_paired_run_reports_ratios_to_ddp_per_round(bench: BenchResult) -> None:
    ddp, zero3, deepspeed = bench.variants
    assert (ddp.name, zero3.name, deepspeed.name) == ("ddp", "zero3", "ds_zero1")
    assert ddp.status == OK and zero3.status == OK, (ddp.reason, zero3.reason)
    assert ddp.paired and zero3.paired and ddp.not_paired_because is None
    for r in (ddp, zero3):
        assert len(r.ranks[0].step_times_s) == ROUNDS
    assert ddp.step_time_ratio_to_ddp == 1.0
    low, high = zero3.step_time_ratio_quartiles
    assert 0 < low <= zero3.step_time_ratio_to_ddp <= high
    assert zero3.step_time_ratio_ci95 is None and zero3.host_cpu_ratio_ci95 is None  # too few rounds
    assert 0 < zero3.host_cpu_s and 0 < ddp.host_cpu_s and zero3.host_cpu_ratio_to_ddp > 0
    assert len(zero3.ranks[0].step_cpu_times_s) == ROUNDS
    # peak memory is no one variant's when they share a process
    assert ddp.peak_memory_bytes is None and zero3.peak_memory_bytes is None
    assert ddp.ranks[0].peak_memory_meaning == paired.PEAK_NOT_MEASURED
    # sharing the process changes nothing in training: the same losses as DDP, bitwise
    assert zero3.losses == ddp.losses
    assert not deepspeed.paired and "DeepSpeed" in deepspeed.not_paired_because
    assert deepspeed.status in (OK, UNAVAILABLE)


def test_paired_run_reports_host_counts_per_step(bench: BenchResult) -> None:
    ddp, zero3, _ = bench.variants
    # a step of a 12-block GPT with AdamW is hundreds of Python calls (the forward alone calls every module)
    assert ddp.python_calls_per_step > 12 * 5 and zero3.python_calls_per_step > 12 * 5
    assert zero3.python_calls_ratio_to_ddp == pytest.approx(zero3.python_calls_per_step / ddp.python_calls_per_step)
    for r in (ddp, zero3):
        assert isinstance(r.storage_resizes_per_step, int) and r.storage_resizes_per_step >= 0
        assert isinstance(r.hook_registrations_per_step, int) and r.hook_registrations_per_step >= 0
        host = r.ranks[0].host
        assert host.python_calls == r.python_calls_per_step
        assert 0 < sum(host.top_functions.values()) <= host.python_calls
    assert (ddp.storage_resizes_per_step, ddp.hook_registrations_per_step) == (0, 0)  # not our engine
    assert ddp.collective_calls_per_step == 1  # DDP's all-reduce, even alone
    assert zero3.units == 12 + 1 and ddp.units is None  # a unit per Block and the root
    assert zero3.ms_beyond_ddp_per_unit == pytest.approx(zero3.ms_beyond_ddp / 13)
    assert ddp.ms_beyond_ddp == 0.0 and ddp.ms_beyond_ddp_per_unit is None


def test_paired_run_is_written_down(bench: BenchResult) -> None:
    text = Path(bench.files["markdown"]).read_text()
    assert "`lightning-zero bench --shape launch-bound" in text and "--paired" in text
    assert f"paired over {ROUNDS} rounds: `ddp`, `zero3`" in text
    assert "| `zero3` | paired |" in text and "Python calls/step" in text and "hook registrations/step" in text
    assert "Timed alone although `--paired` was given" in text and "- `ds_zero1`: DeepSpeed" in text
    written = json.loads(Path(bench.files["json"]).read_text())
    assert written["options"]["shape"] == "launch-bound" and written["options"]["paired"] is True
    assert written["environment"]["threads_per_rank"] == 1
    zero3 = written["variants"][1]
    assert zero3["paired"] is True and len(zero3["step_time_ratio_quartiles"]) == 2
    assert zero3["ranks"][0]["host"]["top_functions"]
