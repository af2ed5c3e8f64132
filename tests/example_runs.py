"""Running ``examples/train_gpt.py`` for the example's tests: as a user does, in a subprocess
(``run_example``), or in the ranks of a ``case_groups.CaseGroup`` (``run_example_in_rank``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TINY_MODEL = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.n_embd=32",
    "--data.block_size=32",
    "--data.batch_size=4",
    "--data.max_bytes=100000",
]
"""The example's GPT and data at their smallest that still runs every part: 2 blocks (two stage-3
units besides the root), 4 sequences of 32 bytes a step, a 100 kB corpus."""


def _cli_args(save_dir: Path, args: tuple[str, ...]) -> list[str]:
    return [
        "fit",
        *args,
        # CSV explicitly: Lightning's default logger is TensorBoard where it is installed
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={save_dir}",
    ]


def run_example(tmp_path: Path, *args: str) -> Path:
    """``train_gpt.py fit ARGS`` logging to CSV under ``tmp_path``; fails the test with the tail of
    its output if it exits non-zero. Returns the run's log directory."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(EXAMPLES / "train_gpt.py"), *_cli_args(tmp_path, args)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return tmp_path / "lightning_logs" / "version_0"


def run_example_in_rank(save_dir: Path, *args: str) -> Path:
    """``train_gpt.py fit ARGS`` as ``run_example`` runs it, but in this rank of a CaseGroup (its
    Trainer joins the group's ranks instead of launching its own): the script's ``main()`` with
    these arguments as its command line, in ``save_dir`` as its working directory. Returns the run's
    log directory. Every rank calls it with the same ``save_dir``."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_gpt

    save_dir.mkdir(parents=True, exist_ok=True)
    argv, cwd = sys.argv, os.getcwd()
    sys.argv = [str(EXAMPLES / "train_gpt.py"), *_cli_args(save_dir, args)]
    os.chdir(save_dir)
    try:
        train_gpt.main()
    finally:
        sys.argv = argv
        os.chdir(cwd)
    return save_dir / "lightning_logs" / "version_0"
