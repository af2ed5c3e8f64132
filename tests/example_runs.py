"""Running ``examples/train_gpt.py`` as a user does, in a subprocess, for the example's tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def run_example(tmp_path: Path, *args: str) -> Path:
    """``train_gpt.py fit ARGS`` logging to CSV under ``tmp_path``; fails the test with the tail of
    its output if it exits non-zero. Returns the run's log directory."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable,
        str(EXAMPLES / "train_gpt.py"),
        "fit",
        *args,
        # CSV explicitly: Lightning's default logger is TensorBoard where it is installed
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={tmp_path}",
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return tmp_path / "lightning_logs" / "version_0"
