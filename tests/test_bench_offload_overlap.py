"""`lightning-zero bench --offload-overlap` (issue 53's CPU stand-in) and its memory probe, on a tiny GPT.

What is asserted is that the measurement is sound and complete (every field there, positive, the
ranks' shards adding up), never a speed: the targets are the bench's to judge, in its notes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_zero.bench import offload_overlap, variants, wrappers
from lightning_zero.bench.host_bandwidth import adamw_step_bytes, measure_host_bandwidth
from lightning_zero.bench.offload_overlap_results import SETTINGS, SLEEP_PLACES
from lightning_zero.bench.options import OFFLOAD_OVERLAP_DEFAULTS, BenchOptions, model_config, num_parameters, shaped
from lightning_zero.bench.results import OK
from lightning_zero.cli import main
from lightning_zero.engine import ZeroConfig
from lightning_zero.models.gpt import GPT, GPTConfig

TINY = [
    "--n-layer", "3", "--n-embd", "64", "--n-head", "2", "--block-size", "16",
    "--warmup", "1", "--steps", "2", "--bucket-size-mb", "0.1", "--threads", "1",
]  # fmt: skip
"""~160k parameters in buckets of ~2 per block, 2 timed rounds: the run is process start-up and the probe.
One thread per rank: two OpenMP threads per rank on a loaded machine can make a step seconds long."""


def test_probe_measures_a_positive_bandwidth_with_the_current_threads() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        probe = measure_host_bandwidth(nbytes=4 * 2**20, repeats=2)
    finally:
        torch.set_num_threads(before)
    assert probe.bytes_per_s > 0 and probe.best_s > 0
    assert probe.tensor_bytes == 4 * 2**20
    assert probe.threads == 1
    assert probe.bytes_per_s == pytest.approx(3 * probe.tensor_bytes / probe.best_s)


def test_adamw_moves_28_bytes_per_fp32_parameter() -> None:
    assert adamw_step_bytes(10) == 280
    assert adamw_step_bytes(10, element_bytes=2) == 140
    assert adamw_step_bytes(0) == 0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: measure_host_bandwidth(nbytes=2), "`nbytes` must be an integer of at least 4"),
        (lambda: measure_host_bandwidth(repeats=0), "`repeats` must be a positive integer"),
        (lambda: adamw_step_bytes(-1), "`numel` must be a non-negative number"),
        (lambda: adamw_step_bytes(1, element_bytes=0), "`element_bytes` must be a positive number"),
    ],
)
def test_probe_and_byte_count_refuse_bad_input(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_defaults_size_a_host_step_of_tens_of_milliseconds() -> None:
    options = shaped(None, offload_overlap=True)
    assert options.devices == 1 and options.variants == ("zero2_offload", "zero3_offload")
    assert options.n_layer == OFFLOAD_OVERLAP_DEFAULTS["n_layer"]
    assert 30e6 <= num_parameters(model_config(options)) <= 70e6
    explicit = shaped(None, offload_overlap=True, devices=2, n_layer=3, variants=("zero3_offload",))
    assert (explicit.devices, explicit.n_layer, explicit.variants) == (2, 3, ("zero3_offload",))


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(variants=("ddp", "zero3_offload")), "measures zero2_offload, zero3_offload, zero3_offload_nvme .* not ddp"),
        (dict(variants=("zero3_offload_nvme_params",)), "not zero3_offload_nvme_params"),
        (dict(capacity="model", memory_budget=10**9), "without `capacity`"),
        (dict(shape="launch-bound"), "without `shape`"),
        (dict(paired=True), "remove `paired`"),
        (dict(device="cuda"), "scripts/offload_gpu.py"),
        (dict(sleep_ms=-1.0), "`sleep_ms` must be a non-negative, finite number"),
        (dict(sleep_ms=float("inf")), "`sleep_ms` must be a non-negative, finite number"),
    ],
)
def test_options_refuse_what_the_overlap_cannot_measure(options: dict, message: str) -> None:
    base = dict(OFFLOAD_OVERLAP_DEFAULTS, offload_overlap=True)
    with pytest.raises(ValueError, match=message):
        BenchOptions(**{**base, **options})


def test_sleep_without_the_overlap_mode_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match="`sleep_ms` is only used with `offload_overlap`"):
        BenchOptions(sleep_ms=10.0)
    with pytest.raises(SystemExit):
        main(["bench", "--sleep-ms", "10"])
    assert "--sleep-ms is only used with --offload-overlap" in capsys.readouterr().err


def test_console_script_routes_to_the_overlap_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[BenchOptions] = []
    report = tmp_path / "bench.md"
    report.write_text("report")

    def fake_run(options: BenchOptions, progress: object) -> SimpleNamespace:
        seen.append(options)
        return SimpleNamespace(files={"markdown": str(report)})

    monkeypatch.setattr("lightning_zero.cli.bench.run_offload_overlap", fake_run)
    assert main(["bench", "--offload-overlap", "--sleep-ms", "40", "--n-layer", "6"]) == 0
    (options,) = seen
    assert options.offload_overlap and options.sleep_ms == 40.0
    assert (options.n_layer, options.n_embd, options.devices) == (6, OFFLOAD_OVERLAP_DEFAULTS["n_embd"], 1)


def test_sleep_in_backward_is_the_identity() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    y = offload_overlap._SleepInBackward.apply(x, 0.001)
    (y * torch.arange(12.0).reshape(3, 4)).sum().backward()
    assert torch.equal(y.detach(), x.detach())
    assert torch.equal(x.grad, torch.arange(12.0).reshape(3, 4))


def _run(out: Path, *extra: str) -> dict:
    assert main(["bench", "--offload-overlap", *TINY, *extra, "--out", str(out)]) == 0
    return json.loads((out / "bench.json").read_text())


def _assert_complete(written: dict, ranks: int) -> None:
    assert [row["name"] for row in written["variants"]] == ["zero2_offload", "zero3_offload"]
    assert "--offload-overlap" in written["options"]["command"]
    for row in written["variants"]:
        assert row["status"] == OK, row["reason"]
        assert row["sleep_ms"] > 0
        host = row["host_step"]
        for key in ("ms", "bytes", "bytes_per_s", "bandwidth_bytes_per_s"):
            assert host[key] > 0, (row["name"], key)
        assert 0 < host["hideable"] < 1
        assert [(line["overlap_host_step"], line["clipping"]) for line in row["lines"]] == [
            (overlap, clipping) for overlap in (False, True) for clipping in SETTINGS
        ]
        for line in row["lines"]:
            for key in ("exposed_backward_ms", "exposed_forward_ms", "optimizer_step_backward_ms", "optimizer_step_forward_ms"):
                assert line[key] > 0, (row["name"], key)
            # the verdict's time is reported where a verdict runs (overlap on); the content check runs in it
            assert (line["verdict_ms"] > 0) == line["overlap_host_step"], (row["name"], line)
        assert any("the content check" in note for note in row["notes"]), row["notes"]
        assert [rank["rank"] for rank in row["ranks"]] == list(range(ranks))
        for rank in row["ranks"]:
            assert {(t["overlap_host_step"], t["sleep_in"], t["clipping"]) for t in rank["times"]} == {
                (o, s, c) for o in (False, True) for s in SLEEP_PLACES for c in SETTINGS
            }
            assert all(len(t["exposed_s"]) == 2 and len(t["optimizer_step_s"]) == 2 for t in rank["times"])
            assert rank["final_loss"] == pytest.approx(rank["final_loss"])  # finite: not NaN
        assert host["bytes"] == adamw_step_bytes(sum(rank["stepped_numel"] for rank in row["ranks"]))


def test_one_rank_reports_every_figure(tmp_path: Path) -> None:
    written = _run(tmp_path)
    _assert_complete(written, ranks=1)
    psi = written["model"]["num_params"]
    for row in written["variants"]:
        assert row["ranks"][0]["stepped_numel"] >= psi  # the whole model, padding included
    text = (tmp_path / "bench.md").read_text()
    assert "## Exposed after backward" in text and "| `zero3_offload` | on | on, firing |" in text


def test_two_ranks_split_the_host_step(tmp_path: Path) -> None:
    written = _run(tmp_path, "--devices", "2", "--sleep-ms", "1")
    _assert_complete(written, ranks=2)
    psi = written["model"]["num_params"]
    for row in written["variants"]:
        assert row["sleep_ms"] == 1.0
        numels = [rank["stepped_numel"] for rank in row["ranks"]]
        assert all(n < psi for n in numels) and sum(numels) >= psi


@pytest.mark.parametrize("place", SLEEP_PLACES)
def test_the_sleep_falls_between_the_later_blocks_gradients_and_block_0s(
    place: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In backward: after every later block's gradients are complete and before any of block 0's (what
    a host step can hide behind); in forward: before backward starts."""
    events: list[str] = []
    monkeypatch.setattr(offload_overlap.time, "sleep", lambda seconds: events.append("sleep"))
    model = GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=8))
    for index, block in enumerate(model.blocks):
        for p in block.parameters():
            p.register_post_accumulate_grad_hook(lambda p, index=index: events.append(f"block {index}"))
    sleep = offload_overlap._SleepAt()
    sleep.place, sleep.seconds = place, 0.001
    model.blocks[0].register_forward_hook(sleep.hook)
    x = torch.randint(0, 256, (1, 8))
    loss = model(x, x)[1]
    if place == "forward":
        assert events == ["sleep"]
    loss.backward()
    blocks = [event for event in events if event != "sleep"]
    assert set(blocks) == {"block 0", "block 1", "block 2"}
    if place == "backward":
        at = events.index("sleep")
        assert set(events[:at]) == {"block 1", "block 2"} and set(events[at + 1 :]) == {"block 0"}


def test_our_offload_variants_keep_the_benchs_threads_and_take_engine_options() -> None:
    """On the CPU the bench sets each rank's threads (`--threads`); an offload variant passes them as
    `host_threads`, so that the engine does not set them again from the node's cores."""
    setup = wrappers.Setup(
        torch.optim.AdamW, {}, contextlib.nullcontext, torch.device("cpu"), 25.0, 1,
        engine_options={"overlap_host_step": False},
    )  # fmt: skip
    offloaded = wrappers._zero_config(ZeroConfig, variants.BY_NAME["zero3_offload"], setup)
    assert offloaded.host_threads == torch.get_num_threads()
    assert offloaded.overlap_host_step is False
    plain = wrappers._zero_config(ZeroConfig, variants.BY_NAME["zero3"], dataclasses.replace(setup, engine_options={}))
    assert plain.host_threads is None
