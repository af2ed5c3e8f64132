"""Replacing a checkpoint only once the new one is complete, never losing the last complete one.

A save writes into a sibling ``<path>.tmp-<token>``; when every rank is done, ``commit`` switches it
with ``<path>``:

- a file over a file: ``os.replace``, atomic;
- a directory (or a change of kind): Linux's ``renameat2(RENAME_EXCHANGE)`` swaps the two names in
  one atomic step, then the previous checkpoint, now under the temporary name, is deleted;
- where the exchange is unavailable (another OS, a filesystem without it, e.g. NFS): ``<path>`` is
  renamed to ``<path>.old-<token>``, the temporary to ``<path>``, and the old one deleted. Between the
  two renames no ``<path>`` exists, but both siblings are complete; ``recover`` (called by every
  load, and by Lightning's launcher before ``ckpt_path="last"`` is looked up) moves the newest
  complete sibling back to ``<path>``.

So at any instant — a rank killed, a full disk, a crash inside the commit — ``<path>`` is the last
complete checkpoint, or it is missing and ``recover`` puts that checkpoint back. A directory is
deleted manifest first, so a half-deleted one never counts as complete. The commit deletes the
siblings that interrupted saves left only once its own checkpoint is in place.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Optional

from lightning_zero.checkpoint.manifest import MANIFEST_NAME, Manifest, PathLike

_SIBLING = re.compile(r"(?P<name>.+)\.(?:tmp|old)-\w+")
"""``<path>.tmp-<token>`` (a save, complete or not) and ``<path>.old-<token>`` (a commit's previous checkpoint)."""


def temporary_sibling(path: PathLike, token: str) -> Path:
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{token}")


def commit(temporary: PathLike, path: PathLike) -> None:
    """Move the complete ``temporary`` (file or directory) to ``path``, replacing what is there,
    then delete what earlier interrupted saves of ``path`` left behind."""
    temporary, path = Path(temporary), Path(path)
    if not path.exists() or (path.is_file() and temporary.is_file()):
        os.replace(temporary, path)
    elif not _exchange(temporary, path):  # else the previous checkpoint is now under the temporary name
        old = path.with_name(f"{path.name}.old-{temporary.name.rpartition('.tmp-')[2]}")
        os.rename(path, old)
        try:
            os.rename(temporary, path)  # until this returns `path` is missing; `recover` brings back `temporary`
        except OSError:
            os.rename(old, path)  # as it was
            raise
    _sync_directory(path.parent)
    for stale in _siblings(path):  # the previous checkpoint and what interrupted saves left
        try:
            _remove(stale)
        except OSError as err:  # the new checkpoint is in place: a leftover is no reason to fail the save
            warnings.warn(f"Could not delete {str(stale)!r} ({err}); the next save of {str(path)!r} tries again.", stacklevel=2)


def recover(path: PathLike) -> Optional[Path]:
    """If ``path`` is missing, move the newest complete sibling (a commit interrupted between its
    renames, see the module's docstring) back to ``path``; returns where it came from, or None.

    Every rank may call it at once: they try the same candidates in the same order, a rename that
    another rank made first fails (its source is gone), and everyone stops once ``path`` exists.
    """
    path = Path(path)
    for candidate in _complete_siblings(path):
        if path.exists():
            return None
        try:
            os.rename(candidate, path)
        except OSError:
            continue  # another rank moved it first (`path` now exists) or it vanished
        warnings.warn(
            f"Checkpoint {str(path)!r} was missing: a save was interrupted while replacing it. The newest"
            f" complete checkpoint it left, {candidate.name!r}, is back under that name.",
            stacklevel=2,
        )
        return candidate
    return None


def recover_folder(folder: PathLike) -> None:
    """``recover`` every checkpoint of ``folder`` that an interrupted commit left under a sibling name."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    names = {m["name"] for m in map(_SIBLING.fullmatch, os.listdir(folder)) if m}
    for name in sorted(names):
        recover(folder / name)


def discard_leftovers(folder: PathLike, prefix: str) -> None:
    """Delete the siblings that interrupted saves of the checkpoints of ``folder`` named ``prefix...``
    left, once ``recover_folder(folder)`` has put back any complete one whose checkpoint was missing.

    For checkpoints whose names are never saved twice, so that no later commit cleans up after them:
    Lightning's SLURM checkpoints, ``hpc_ckpt_<N>.ckpt`` with a new N for each save. Lightning finds
    the one to resume from by reading every digit of each name holding ``hpc_ckpt_`` — a leftover's
    ``.tmp-<token>`` included — and would then look for a checkpoint that does not exist. Every rank
    may call it at once: what another rank deleted first is skipped."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for name in sorted(os.listdir(folder)):
        if name.startswith(prefix) and _SIBLING.fullmatch(name):
            try:
                _remove(folder / name)
            except OSError:
                continue  # another rank's, or vanished


def complete_siblings(path: PathLike) -> list[Path]:
    """Complete checkpoints saved for ``path`` under a sibling name, newest first."""
    return _complete_siblings(Path(path))


# ---- helpers -------------------------------------------------------------------------------------
def _siblings(path: Path) -> list[Path]:
    pattern = glob.escape(path.name)
    return sorted((*path.parent.glob(f"{pattern}.tmp-*"), *path.parent.glob(f"{pattern}.old-*")))


def _complete_siblings(path: Path) -> list[Path]:
    written_at = {}
    for candidate in _siblings(path):
        try:
            if candidate.is_dir():
                Manifest.read(candidate)  # sizes of every file: not a half-written or half-deleted one
                written_at[candidate] = (candidate / MANIFEST_NAME).stat().st_mtime_ns  # the manifest is written last
            elif zipfile.is_zipfile(candidate):  # torch.save writes the zip's directory last
                written_at[candidate] = candidate.stat().st_mtime_ns
        except (OSError, ValueError):
            continue  # incomplete, or moved away meanwhile
    return sorted(written_at, key=lambda c: (written_at[c], c.name), reverse=True)


def _remove(path: Path) -> None:
    if path.is_dir():
        manifest = path / MANIFEST_NAME
        if manifest.exists():
            os.unlink(manifest)  # first: a directory deleted halfway never looks complete
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _sync_directory(folder: Path) -> None:
    """Make the renames in ``folder`` durable (a power cut after a commit keeps it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems and OSes cannot sync a directory
    finally:
        os.close(fd)


# ---- renameat2(RENAME_EXCHANGE) ------------------------------------------------------------------
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}
"""No renameat2 in the C library or the kernel, or a filesystem without the exchange."""


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically; False where the OS or filesystem cannot."""
    try:
        _renameat2(a, b, _RENAME_EXCHANGE)
    except OSError as err:
        if err.errno in _UNSUPPORTED:
            return False
        raise
    return True


def _renameat2(src: Path, dst: Path, flags: int) -> None:
    function = _libc_renameat2()
    if function is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available here")
    if function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(src), None, str(dst))


_libc_function = None


def _libc_renameat2():  # type: ignore[no-untyped-def]
    """The C library's ``renameat2`` (glibc 2.28+), looked up once; None where it has none (macOS)."""
    global _libc_function
    if _libc_function is None:
        try:
            function = ctypes.CDLL(None, use_errno=True).renameat2
        except (AttributeError, OSError, TypeError):  # no such symbol, or no C library to open
            function = False
        else:
            function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            function.restype = ctypes.c_int
        _libc_function = function
    return _libc_function or None
