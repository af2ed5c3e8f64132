"""A few of Lightning's own multi-process tests, with ``ZeroStrategy(stage=3)`` swapped in for DDP.

Lightning 2.6.5's ``tests_pytorch`` is unpacked from ``shared/lightning-tests/`` at run time into a
temporary folder, and ``scripts/lightning_suite/run_suite.py`` runs the ids of
``scripts/lightning_suite/ci_ids.txt`` there, in one pytest process (their ranks are spawned; the full
list and the counts per stage: ``scripts/lightning_suite/README.md``, docs/behaviour.md). Each must pass and must have
launched its ranks with ``ZeroStrategy``: a swap that missed would test DDP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[1] / "scripts" / "lightning_suite"
sys.path.insert(0, str(SUITE))
from run_suite import read_ids  # noqa: E402
from suite_dir import default_tarball  # noqa: E402

IDS = SUITE / "ci_ids.txt"


def test_lightnings_own_tests_pass_with_zero3_swapped_in(tmp_path: Path) -> None:
    tarball = default_tarball()
    if not tarball.is_file() and not os.environ.get("CI"):
        pytest.skip(f"Lightning's tests are not at {tarball} (shared/ beside the checkout, or LZ_LIGHTNING_TESTS)")
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(SUITE / "run_suite.py"), "--variants", "zero3", "--ids", str(IDS), "--together",
           "--timeout", "150", "--out", str(out), "--tarball", str(tarball), "--workdir", str(tmp_path / "suite")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    results = json.loads(out.read_text()) if out.exists() else []
    ids = read_ids(IDS)
    assert sorted(r["node"] for r in results) == sorted(ids), done.stdout[-3000:] + done.stderr[-3000:]
    for r in results:
        assert r["items"] and all(item["outcome"] == "passed" for item in r["items"]), (r["node"], r["items"], r["tail"])
        assert any(launch["strategy"] == "ZeroStrategy" and launch["ranks"] == 2 for launch in r["launches"]), r
    assert done.returncode == 0, done.stdout[-3000:]
