"""scripts/offload_gpu.py (issue 12's GPU check) on the CPU with a tiny GPT: it runs end to end and
writes every figure; its largest-model search brackets the size where training starts failing."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "offload_gpu.py"
TINY = ["--device", "cpu", "--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--block-size", "32"]
TINY += ["--batch-size", "2", "--warmup", "1", "--steps", "2"]


def load_script():
    spec = importlib.util.spec_from_file_location("offload_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_on_cpu_and_writes_every_figure(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, "--search-sizes", ""], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "offload_gpu.json").read_text())
    for key in ("environment", "model", "zero3", "zero3_offload", "cpu_adamw", "prediction", "largest", "ratio"):
        assert key in summary, key
    for variant in ("zero3", "zero3_offload"):
        assert len(summary[variant]["step_times_s"]) == 3 and summary[variant]["median_step_s"] > 0
    assert summary["cpu_adamw"]["elements"] == summary["model"]["params"] == summary["zero3"]["params"]
    assert summary["ratio"] > 0 and summary["ratio_target"] == 1.25
    # The target: with fp32 weights and parameters offloaded, no model state on the device.
    assert summary["offload_device_model_state_bytes"] == 0 and summary["device_model_state_met"] is True
    assert summary["zero3"]["model_state_host_bytes"] == 0 < summary["zero3_offload"]["model_state_host_bytes"]
    prediction = summary["prediction"]["zero3_offload"]
    assert prediction["layout"] == "zero3 + offload optimizer, params" and prediction["params"] > 0
    assert summary["largest"]["tries"] == [] and summary["largest"]["skipped"] == "no sizes"
    assert "| zero3_offload / (zero3 + CPU step) |" in done.stdout  # the markdown table


@pytest.fixture
def script():
    return load_script()


def fake_tries(script, monkeypatch, largest_that_trains: int) -> list[int]:
    """Replace the child processes: sizes up to `largest_that_trains` train, larger ones run out of memory."""
    tried = []

    def try_size(n_layer, args, timeout_s):
        tried.append(n_layer)
        status = "ok" if n_layer <= largest_that_trains else "host out of memory"
        return {"n_layer": n_layer, "params": n_layer, "status": status, "seconds": 1.0}

    monkeypatch.setattr(script, "try_size", try_size)
    return tried


def search_args(**overrides) -> argparse.Namespace:
    values = dict(device="cuda", n_layer=24, search_sizes="auto", search_guess=0.85)
    return argparse.Namespace(**{**values, **overrides})


def test_auto_search_bisects_below_the_prediction(script, monkeypatch):
    tried = fake_tries(script, monkeypatch, largest_that_trains=37)
    prediction = {"zero3_offload": {"n_layer": 50}}  # 51 layers' model states alone would not fit
    result = script.search_largest(search_args(), prediction, deadline=script.time.perf_counter() + 1000)
    # 0.85 x 50 = 42 fails; then bisect between 24 (trained) and 42.
    assert tried == [42, 33, 37, 39, 38]
    assert result["largest_ok"]["n_layer"] == 37 and result["smallest_failed"]["n_layer"] == 38


def test_explicit_sizes_go_down_until_one_trains(script, monkeypatch):
    tried = fake_tries(script, monkeypatch, largest_that_trains=30)
    args = search_args(search_sizes="28,40,32,36", device="cpu")
    result = script.search_largest(args, {"zero3_offload": {"n_layer": 10}}, deadline=script.time.perf_counter() + 1000)
    assert tried == [40, 36, 32, 28]
    assert result["largest_ok"]["n_layer"] == 28 and result["smallest_failed"]["n_layer"] == 32


def test_search_starts_no_try_past_the_deadline(script, monkeypatch):
    tried = fake_tries(script, monkeypatch, largest_that_trains=37)
    result = script.search_largest(search_args(), {"zero3_offload": {"n_layer": 50}}, deadline=script.time.perf_counter() + 10)
    assert tried == [] and result["largest_ok"] is None
    skipped = script.search_largest(search_args(device="cpu"), {"zero3_offload": {"n_layer": 50}}, deadline=1e18)
    assert skipped["skipped"] == "the automatic search needs a GPU" and tried == []
