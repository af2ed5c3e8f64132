"""Checking a checkpoint on disk without loading a model: what ``lightning-zero verify`` runs.

A sharded directory: the manifest, every file's size and checksum, DCP's metadata (readable, and
naming only files the manifest lists) and meta.pt's zip records; a directory saved before checksums
(format 1) has each of its DCP items, a ``torch.save`` zip, checked against the zip's own CRC-32s
instead. A file (the full format, or any ``torch.save`` file): every zip record against its CRC-32. Of the pickles, only DCP's metadata is
read (as every DCP reader does); meta.pt and full files, which may hold any Python object, are not.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

from lightning_zero.checkpoint.errors import CorruptCheckpointError
from lightning_zero.checkpoint.integrity import check_directory, check_zip
from lightning_zero.checkpoint.manifest import META_NAME, PathLike
from lightning_zero.checkpoint.storage import storage_items


def verify_checkpoint(path: PathLike) -> str:
    """A one-line summary of what was checked; raises naming the first damaged file."""
    path = Path(path)
    if path.is_file():
        check_zip(path)
        return f"{path}: OK (a single-file checkpoint, {path.stat().st_size / 1e6:.1f} MB, every zip record matches its CRC-32)"
    manifest = check_directory(path)
    items = storage_items(path)
    unlisted = sorted({file for file, _, _ in items} - set(manifest.files))
    if unlisted:
        raise CorruptCheckpointError(f"Checkpoint {str(path)!r} is damaged: its DCP metadata names {unlisted[0]}, which the manifest does not list.")
    if META_NAME in manifest.files:
        check_zip(path / META_NAME)
    if manifest.checksums:
        checked = "sizes and checksums"
    else:
        _check_items(path, items)
        checked = "sizes, and each DCP item's zip checksums (format 1: no file checksums recorded)"
    total = sum(manifest.files.values()) / 1e6
    return f"{path}: OK ({len(manifest.files)} files, {total:.1f} MB; {checked}; DCP metadata and {META_NAME} readable)"


def _check_items(directory: Path, items: list[tuple[str, int, int]]) -> None:
    """Each DCP item stored as a ``torch.save`` zip, against the CRC-32 of each of its records."""
    for file, offset, length in items:
        with open(directory / file, "rb") as f:
            f.seek(offset)
            blob = f.read(length)
        if not blob.startswith(b"PK"):
            continue  # not a torch.save zip: a raw byte item (DCP's BYTE_IO), nothing to check it against
        try:
            with zipfile.ZipFile(io.BytesIO(blob)) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, EOFError, ValueError) as err:
            bad = f"its zip structure ({err})"
        if bad is not None:
            raise CorruptCheckpointError(
                f"Checkpoint {str(directory)!r} is damaged: in {file}, the item at byte {offset} fails its zip"
                f" checks (CRC-32 or header) at {bad}."
            )
