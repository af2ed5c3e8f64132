"""Replacing a checkpoint only once the new one is complete.

A save writes into a sibling ``<path>.tmp-<token>`` and, when every rank is done, renames it to
``<path>`` (moving an existing checkpoint aside first and deleting it last). A save interrupted at
any point — a rank killed, a full disk — leaves the previous checkpoint at ``<path>`` intact.
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

from lightning_zero.checkpoint.manifest import PathLike


def temporary_sibling(path: PathLike, token: str) -> Path:
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{token}")


def commit(temporary: PathLike, path: PathLike) -> None:
    """Move the complete ``temporary`` (file or directory) to ``path``, replacing what is there,
    then delete what earlier interrupted saves of ``path`` left behind."""
    temporary, path = Path(temporary), Path(path)
    if not path.exists() or (path.is_file() and temporary.is_file()):
        os.replace(temporary, path)  # atomic on one filesystem
    else:
        old = path.with_name(f"{path.name}.old-{temporary.name.rpartition('.tmp-')[2]}")
        os.replace(path, old)
        os.replace(temporary, path)
        _remove(old)
    for stale in (*path.parent.glob(f"{glob.escape(path.name)}.tmp-*"), *path.parent.glob(f"{glob.escape(path.name)}.old-*")):
        _remove(stale)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
