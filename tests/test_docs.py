"""The documentation: the site in docs/ builds with `mkdocs build --strict` (a broken link, anchor or
API reference fails it; runs when the `docs` extra is installed), and the README's links into it and
its CI command agree with the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocstrings reads the package from src/ (mkdocs.yml)
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # the API pages were generated from the docstrings, not left empty
    strategies = (site / "reference" / "strategies" / "index.html").read_text()
    assert "summon_full_params" in strategies and "offload_optimizer" in strategies
    assert "bucket_size_mb" in (site / "reference" / "engine" / "index.html").read_text()


def test_readme_links_into_the_docs_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\((docs/[^)#\s]+)(?:#[^)\s]*)?\)", readme)
    assert targets, "the README links into docs/"
    missing = [t for t in targets if not (ROOT / t).is_file()]
    assert not missing, f"README links to missing pages: {missing}"


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if line.startswith("python3 -m venv"))
    assert command in readme, "README's test command and .ci/run differ"


def test_troubleshooting_quotes_the_messages_lightning_and_torch_print(tmp_path: Path) -> None:
    """Two rows of docs/troubleshooting.md are for messages lightning-zero does not write, which a new
    user meets first: a strategy name Lightning does not know (misspelled, or ``lightning_zero`` never
    imported), and torch opening a sharded checkpoint directory as a file. They quote the messages as
    the installed Lightning and torch print them, so searching the page for the error finds its row."""
    import torch
    from lightning.pytorch import Trainer

    import lightning_zero  # noqa: F401 - the zero* names registered: a misspelled one still fails

    rows = (ROOT / "docs" / "troubleshooting.md").read_text()
    with pytest.raises(ValueError) as invalid:
        Trainer(strategy="zer03")
    lightning_says = str(invalid.value).replace("'zer03'", "'{name}'").split(" Find a complete list")[0]
    assert f"| {lightning_says} (Lightning's;" in rows, lightning_says
    with pytest.raises(IsADirectoryError) as opened:
        torch.load(tmp_path)
    torch_says = str(opened.value).replace(repr(str(tmp_path)), "'{path}'")
    assert f"| IsADirectoryError: {torch_says} |" in rows, torch_says
