"""Lightning's tests laid out to run with the strategy swapped: ``tests/tests_pytorch`` unpacked from the
tarball in shared/ into a folder outside the checkout, with our ``conftest.py`` beside it.

Lightning's own ``tests_pytorch/conftest.py`` is replaced by one line that re-exports the helpers some
test files import from it (``mock_cuda_count``, ``mock_mps_count``, ``mock_tpu_available``,
``mock_xla_available``): a second copy of ours would register its hooks twice, and Lightning's would undo
the fixtures ours replaces.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SRC = REPO / "src"
TARBALL_NAME = "lightning-2.6.5-tests.tar.gz"
CONFTEST_LINE = "from conftest import mock_cuda_count, mock_mps_count, mock_tpu_available, mock_xla_available  # the harness's\n"


def default_tarball() -> Path:
    """``$LZ_LIGHTNING_TESTS``, else ``shared/lightning-tests/`` beside the checkout (where CI copies shared/)."""
    given = os.environ.get("LZ_LIGHTNING_TESTS")
    return Path(given) if given else REPO.parent / "shared" / "lightning-tests" / TARBALL_NAME


def lay_out(tarball: Path, into: Path | None = None) -> Path:
    """Unpack ``tests/tests_pytorch`` of ``tarball`` into ``into`` (a new temporary folder when None) and
    put the harness beside it. Returns the folder pytest runs in (it holds ``conftest.py`` and
    ``tests_pytorch/``)."""
    if not tarball.is_file():
        raise FileNotFoundError(
            f"{tarball}: Lightning's tests are not there. HINT: pass --tarball, or set LZ_LIGHTNING_TESTS to"
            f" the path of {TARBALL_NAME} (shared/lightning-tests/ beside the checkout)."
        )
    into = Path(tempfile.mkdtemp(prefix="lightning-suite-")) if into is None else into
    root = into / "tests"
    if (root / "tests_pytorch").exists():
        shutil.rmtree(root / "tests_pytorch")
    with tarfile.open(tarball) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith("tests/tests_pytorch/")]
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(into, members=members, **kwargs)
    shutil.copyfile(HERE / "conftest.py", root / "conftest.py")
    (root / "tests_pytorch" / "conftest.py").write_text(CONFTEST_LINE)
    return root
