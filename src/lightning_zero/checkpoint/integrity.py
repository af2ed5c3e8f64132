"""Checksums of a sharded checkpoint's files: taken at save, checked before anything is read.

Sizes (in the manifest since format 1) catch truncation; a CRC-32 per file (format 2) catches
damage that keeps the size — bytes overwritten on disk or in a copy — which DCP and ``torch.load``
would read without complaint (16 bytes of NaN in a shard train to NaN). CRC-32 is enough: this
guards against accidents, not tampering, and ``zlib.crc32`` runs at ~2 GB/s on one core.

Who checks what: at save, every rank checksums the files it wrote itself, right after writing them
(still in the page cache), and rank 0 records them; at load, each rank checks a share of the files
balanced by size (``share``), and the ranks agree on the verdict (``sharded.on_every_rank``).
"""

from __future__ import annotations

import zipfile
import zlib
from contextlib import nullcontext
from pathlib import Path
from typing import IO, Any, Iterable, Optional, Union

from lightning_zero.checkpoint.atomic import complete_siblings
from lightning_zero.checkpoint.errors import CorruptCheckpointError
from lightning_zero.checkpoint.folders import Folder, as_folder
from lightning_zero.checkpoint.manifest import Manifest, PathLike

CHUNK_BYTES = 16 << 20
"""Read size while checksumming: large enough for full speed, small enough to bound memory."""


def bytes_checksum(data: bytes) -> int:
    return zlib.crc32(data)


def file_checksum(path: Union[PathLike, IO[bytes]]) -> int:
    crc = 0
    with open(path, "rb") if not hasattr(path, "read") else nullcontext(path) as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def checksum_files(directory: Any, names: Iterable[str]) -> dict[str, int]:
    folder = as_folder(directory)
    return {name: _folder_checksum(folder, name) for name in names}


def _folder_checksum(folder: Folder, name: str) -> int:
    with folder.open(name) as f:
        return file_checksum(f)


def checksum_problem(directory: Any, manifest: Manifest, name: str) -> Optional[str]:
    """What is wrong with file ``name`` (size, then checksum when the manifest has one), or None."""
    problem = manifest.size_problem(directory, name)
    if problem is not None or name not in manifest.checksums:
        return problem
    found, written = _folder_checksum(as_folder(directory), name), manifest.checksums[name]
    if found != written:
        return f"{name} fails its checksum (CRC-32 {found:#010x}, written as {written:#010x}): its bytes changed after the save"
    return None


def check_files(directory: Any, manifest: Manifest, names: Iterable[str]) -> None:
    """Raise ``CorruptCheckpointError`` naming the first of ``names`` that is damaged."""
    for name in names:
        problem = checksum_problem(directory, manifest, name)
        if problem is not None:
            raise CorruptCheckpointError(f"Checkpoint {str(directory)!r} is damaged: {problem}.")


def share(files: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The files (name -> size) that ``rank`` checks: the largest first, each to the rank with the
    fewest bytes so far, so every rank reads about as much and the result is the same everywhere."""
    load, mine = [0] * world_size, []
    for name, size in sorted(files.items(), key=lambda item: (-item[1], item[0])):
        least = load.index(min(load))
        load[least] += size
        if least == rank:
            mine.append(name)
    return mine


def check_directory(directory: Any) -> Manifest:
    """Manifest readable, every file present at its size and matching its checksum (one process)."""
    directory = as_folder(directory)
    try:
        manifest = Manifest.read(directory)
    except FileNotFoundError as err:
        found = complete_siblings(directory.path) if directory.is_local else []
        if not found:
            raise
        raise FileNotFoundError(
            f"{err} A save interrupted while replacing it left the complete checkpoint {found[0].name!r}:"
            f" HINT: loading {str(directory)!r} with ZeroStrategy (or `ckpt_path=\"last\"`) moves it back."
        ) from None
    check_files(directory, manifest, manifest.files)
    return manifest


def check_zip(path: Union[PathLike, IO[bytes]], label: Optional[str] = None) -> None:
    """A ``torch.save`` file (a zip archive; or an open, seekable one, named ``label``): every record
    against the CRC-32 the zip stores for it, which ``torch.load`` does not check. Files in torch's
    legacy (non-zip) format are let through."""
    if hasattr(path, "read"):
        label = label or "the checkpoint file"
    else:
        path = Path(path)  # type: ignore[arg-type]
        label = str(path)
    if not zipfile.is_zipfile(path):
        with open(path, "rb") if not hasattr(path, "read") else nullcontext(path) as f:  # type: ignore[arg-type]
            f.seek(0)
            if f.read(2) == b"PK":  # a zip whose end was cut off
                raise CorruptCheckpointError(f"{label!r} is truncated: its zip directory is missing.")
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise CorruptCheckpointError(f"{label!r} is corrupted: its zip structure cannot be read ({err}).") from err
    if bad is not None:
        raise CorruptCheckpointError(f"{label!r} is corrupted: record {bad} fails its checksum.")
