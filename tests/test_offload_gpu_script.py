"""scripts/offload_gpu.py (issue 12's GPU check): its largest-model search brackets the size where
training starts failing. (Its run end to end on the CPU, every figure written, is the GPU check's
dry-run step in test_gpu_check_script.py.)"""

import argparse
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "offload_gpu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("offload_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
