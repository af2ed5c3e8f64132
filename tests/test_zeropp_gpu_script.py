"""scripts/zeropp_gpu.py (issue 63's GPU check, qwZ's kernels against the bytes they save): its
arguments, and its whole run on the CPU at tiny sizes, importing neither Lightning nor lightning-zero."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "zeropp_gpu.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("zeropp_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_on_the_cpu_writes_every_figure(script, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "zeropp.json"
    assert script.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert [u["unit_elements"] for u in summary["units"]] == list(script.TINY_SIZES)
    for unit in summary["units"]:
        n, row = summary["world"], unit["row_elements"]
        assert row * n == unit["unit_elements"]
        # int8 rows: 4 bytes of scale per 256 elements, a byte each; bf16 full buffers
        assert unit["quantized_buffer_bytes"] == n * (row + 4 * -(-row // 256))
        assert unit["full_buffer_bytes"] == 2 * unit["unit_elements"]
        assert unit["bytes_saved_on_link"] == pytest.approx((unit["full_buffer_bytes"] - unit["quantized_buffer_bytes"]) * (n - 1) / n)
        assert unit["link_ms_saved"] == pytest.approx(unit["bytes_saved_on_link"] / 12.5e9 * 1e3)
        assert unit["kernels_ms"] == pytest.approx(unit["quantize_ms"] + unit["dequantize_ms"]) and unit["kernels_ms"] > 0
        assert unit["kernels_below_saving"] == (unit["kernels_ms"] < unit["link_ms_saved"])
        assert unit["max_error_over_block_scale"] <= 0.5 + 1e-3  # round to nearest: half a code at most
    printed = capsys.readouterr().out
    assert "| unit elements | quantize ms |" in printed and "verdict" in printed


def test_arguments(script) -> None:
    args = script.parse_args([])
    assert args.device == "cuda" and args.sizes == (50_000_000, 200_000_000) and args.repeats == 20 and args.world == 8
    assert script.parse_sizes("1.5M, 64k") == (1_500_000, 64_000)
    with pytest.raises(SystemExit):
        script.parse_args(["--sizes", "1001"])  # not a multiple of the 8 ranks
    with pytest.raises(SystemExit):
        script.parse_args(["--format", "int3"])


def test_needs_neither_lightning_nor_the_package() -> None:
    """Its dry run in a fresh interpreter without `src` on the path: only torch is imported."""
    code = (
        "import runpy, sys; sys.argv = ['zeropp_gpu.py', '--dry-run']\n"
        "try:\n    runpy.run_path(%r, run_name='__main__')\n"
        "except SystemExit as exit:\n    assert exit.code == 0, exit.code\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'lightning_zero', 'jsonargparse')]\n"
        "assert not loaded, loaded\n"
    ) % str(SCRIPT)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1])["dry_run"] is True
