"""`lightning-zero bench --capacity`: a CPU smoke run where DDP runs out of budget before zero3, the
argument errors, and the search, the activation count and the watchdog in one process.

The smoke run is sized from a measurement, not a guess: one DDP try of a 1-block GPT gives this
machine's peak (process baseline included), and the budget is that plus room for a few more blocks
of DDP's 16Ψ, where zero3's 8Ψ fits about twice as many. Each try's ranks are killed after
`timeout_s`, so a hang fails the test instead of stalling it (~20 s on 2 cores).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_zero.bench import BenchOptions
from lightning_zero.bench.budget import RssWatchdog
from lightning_zero.bench.capacity import try_size
from lightning_zero.bench import theory
from lightning_zero.bench.footprint import ActivationBytes, count_activations, footprint, saved_bytes
from lightning_zero.bench.options import model_config, num_parameters
from lightning_zero.bench.results import OK, OVER_BUDGET
from lightning_zero.bench.variants import BY_NAME
from lightning_zero.cli import main
from lightning_zero.sizing import largest_passing

SHAPE = dict(n_embd=256, n_head=4, block_size=32, batch_size=1, devices=2)
"""A block of 0.79M parameters: 12.6 MB of DDP's model states, 6.3 MB of zero3's on 2 ranks."""
ROOM = 60_000_000
"""Budget above DDP's 1-block peak: four more blocks of DDP (13 MB each), about eight of zero3 (7 MB)."""
TRY_TIMEOUT_S = 30


def test_zero3_trains_a_larger_model_than_ddp_under_the_same_budget(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    probe = BenchOptions(
        **SHAPE, n_layer=1, capacity="model", memory_budget=10**12, timeout_s=TRY_TIMEOUT_S, out=tmp_path / "probe"
    )
    one_block = try_size(BY_NAME["ddp"], probe, 1)
    assert one_block.status == OK, one_block.reason
    budget = one_block.peak_bytes + ROOM

    args = [f"--{key.replace('_', '-')}={value}" for key, value in SHAPE.items()]
    out = tmp_path / "capacity"
    status = main([
        "bench", *args, "--capacity", "model", "--memory-budget", f"{budget}B", "--variants", "ddp,zero3",
        "--timeout", str(TRY_TIMEOUT_S), "--out", str(out),
    ])  # fmt: skip
    assert status == 0
    printed = capsys.readouterr().out
    assert "| `zero3` |" in printed and "ddp: largest n_layer" in printed

    rows = {row["name"]: row for row in json.loads((out / "bench.json").read_text())["variants"]}
    assert list(rows) == ["ddp", "zero3"]
    for row in rows.values():
        assert set(row["capacity"]) == {"mode", "budget_bytes", "largest", "estimate"}
        assert row["capacity"]["mode"] == "model" and row["capacity"]["budget_bytes"] == budget
        assert row["status"] == OK, row["reason"]
        assert row["capacity"]["estimate"] > 0
        tries = row["tries"]
        assert [t["size"] for t in tries[:3]] == [1, 2, 4]  # doubling first
        assert any(t["status"] == OVER_BUDGET for t in tries), "the search must end at the budget"
        assert all(t["peak_bytes"] <= budget for t in tries if t["status"] == OK)
    ddp, zero3 = rows["ddp"]["capacity"], rows["zero3"]["capacity"]
    assert 0 < ddp["largest"] < zero3["largest"], (ddp, zero3)
    assert rows["ddp"]["largest_size"] < rows["zero3"]["largest_size"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").stat().st_size > 0
    assert "## Definitions" in (out / "bench.md").read_text()


# --- bad input: argparse errors that say what is accepted ---------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--capacity", "model", "--memory-budget", "lots"], "expected a positive size such as 80 (GB)"),
        (["--capacity", "model", "--memory-budget", "0"], "not a positive memory size"),
        (["--capacity", "model", "--memory-budget=-2GB"], "not a positive memory size"),
        (["--capacity", "model", "--memory-budget", "2XB"], "unknown unit 'xb'"),
        (["--capacity", "width", "--memory-budget", "2GB"], "invalid choice: 'width' (choose from 'model', 'batch')"),
        (["--capacity", "model"], "--capacity needs --memory-budget"),
        (["--memory-budget", "2GB"], "--memory-budget is only used with --capacity (model or batch)"),
        (["--budget-scope", "host"], "--budget-scope is only used with --capacity (model or batch)"),
        (["--capacity", "model", "--memory-budget", "2GB", "--budget-scope", "disk"], "invalid choice: 'disk'"),
    ],
)
def test_bad_capacity_arguments_are_usage_errors(
    args: list, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *args, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert expected in error
    assert not (tmp_path / "bench.json").exists()


def test_options_check_capacity() -> None:
    with pytest.raises(ValueError, match="`capacity` needs `memory_budget`"):
        BenchOptions(capacity="model")
    with pytest.raises(ValueError, match="`capacity` must be one of model, batch"):
        BenchOptions(capacity="depth", memory_budget=10**9)
    with pytest.raises(ValueError, match="only used with `capacity`"):
        BenchOptions(memory_budget=10**9)


def test_a_host_budget_charges_the_offloaded_state_and_not_the_nvme_files(tmp_path: Path) -> None:
    """One try of zero3_offload_nvme under a host budget: its peak is charged whole (nothing left out
    for host state), and the prediction counts the host's share, which for NVMe is the chunks and a
    few buckets' moments, not the moments on disk."""
    options = BenchOptions(
        **{**SHAPE, "devices": 1}, n_layer=4, capacity="model", memory_budget=10**12, budget_scope="host",
        timeout_s=TRY_TIMEOUT_S, out=tmp_path / "out", nvme_path=tmp_path,
    )  # fmt: skip
    tried = try_size(BY_NAME["zero3_offload_nvme"], options, 4)
    assert tried.status == OK, tried.reason
    assert tried.peak_bytes > tried.baseline_bytes
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the rank's scratch directory is gone

    psi = num_parameters(model_config(options))
    nothing = ActivationBytes(0, 0, 0, 0)
    unit = psi // 4  # about one block: the buffers' size at stage 3
    config = model_config(options)

    def states(name: str, charge_host: bool) -> int:
        staging = theory.nvme_staging(3, 4 * unit)
        return footprint(BY_NAME[name], config, psi, 1, 1, 0, nothing, charge_host, staging).model_states

    # a device budget charges neither (fp32 with offload_params leaves nothing on the device) ...
    assert states("zero3_offload", False) == states("zero3_offload_nvme", False) == 0
    # ... a host budget charges 16 B per parameter for CPU offload, 8 B + 4 blocks' moments for NVMe
    assert states("zero3_offload", True) == 16 * psi
    assert states("zero3_offload_nvme", True) == 8 * psi + 4 * 8 * unit


# --- single-process pieces ---------------------------------------------------------------------


def test_search_doubles_until_the_first_failure_then_bisects() -> None:
    asked: list[int] = []

    def fits(size: int) -> bool:
        asked.append(size)
        return size <= 11

    assert largest_passing(fits) == 11
    assert asked == [1, 2, 4, 8, 16, 12, 10, 11]
    assert largest_passing(lambda size: False) == 0


def test_activation_count_is_linear_in_blocks_and_samples() -> None:
    config = model_config(BenchOptions(n_layer=1, n_embd=64, n_head=2, block_size=16))
    for precision in ("fp32", "bf16-mixed"):
        counted = count_activations(config, precision, checkpointing=False)
        direct = saved_bytes(dataclasses.replace(config, n_layer=3), 3, precision, checkpointing=False)
        assert counted.at(3, 3) == pytest.approx(direct, abs=1024), precision  # up to a few scalars
        assert counted.per_block_sample > 0
    checkpointed = count_activations(config, "fp32", checkpointing=True)
    assert checkpointed.per_block_sample == 16 * 64 * 4  # only each block's input (T, C) is kept


def test_watchdog_stops_a_rank_over_its_limit() -> None:
    me = {0: SimpleNamespace(pid=os.getpid())}
    assert RssWatchdog(limit_bytes=10**13).problem(me) is None
    assert "rank 0 reached" in RssWatchdog(limit_bytes=1).problem(me)
    assert RssWatchdog(limit_bytes=1).problem({1: SimpleNamespace(pid=2**22 + 12345)}) is None  # gone: not judged
