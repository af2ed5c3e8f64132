"""Checking a checkpoint on disk without loading a model: what ``lightning-zero verify`` runs.

A sharded directory: the manifest, every file's size and checksum, DCP's metadata (readable, and
naming only files the manifest lists) and meta.pt's zip records; a directory saved before checksums
(format 1) has each of its DCP items, a ``torch.save`` zip, checked against the zip's own CRC-32s
instead. A file (the full format, or any ``torch.save`` file): every zip record against its CRC-32.

The pickles are unpickled as every load unpickles them (see [Note: untrusted checkpoints] in
``pickles.py``), so nothing they name that a load would refuse is run: DCP's metadata by
``DcpMetadataUnpickler``; meta.pt and a file by torch's weights-only unpickler, or with
``weights_only=False`` (a checkpoint the user trusts) not at all, the globals beyond the weights-only
allow list that they name listed instead.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

from lightning_zero.checkpoint import remote
from lightning_zero.checkpoint.checkpointing import check_file
from lightning_zero.checkpoint.errors import CorruptCheckpointError, UntrustedCheckpointError, describe
from lightning_zero.checkpoint.folders import Folder, LocalFolder, RemoteFolder
from lightning_zero.checkpoint.frozen import digest
from lightning_zero.checkpoint.integrity import check_directory, check_zip
from lightning_zero.checkpoint.locations import RemoteLocation, checkpoint_location
from lightning_zero.checkpoint.manifest import META_NAME, PathLike
from lightning_zero.checkpoint.pickles import checkpoint_globals, load_torch_file
from lightning_zero.checkpoint.storage import read_meta, storage_items
from lightning_zero.sizing import format_bytes


def verify_checkpoint(path: PathLike, weights_only: bool = True) -> str:
    """A one-line summary of what was checked; raises naming the first damaged file
    (``CorruptCheckpointError``) or the first global that a pickle names and a load under
    ``weights_only`` would refuse (``UntrustedCheckpointError``). At a URL the files are read in
    place; version folders that interrupted saves left beside the checkpoint are named."""
    location = checkpoint_location(path)
    if isinstance(location, RemoteLocation):
        folder: Folder = RemoteFolder(location)
        if not folder.has_manifest():
            return _verify_remote_file(location, weights_only)
        summary = _verify_directory(folder, weights_only)
        left = remote.leftovers(location)
        return summary + (f"; left beside it by interrupted saves, not part of it: {', '.join(left)}" if left else "")
    if location.is_file():
        path = location
        check_zip(path)
        pickled = _check_pickle(path, weights_only, lambda: load_torch_file(path, True, path, "it", mmap=True))
        return f"{path}: OK (a single-file checkpoint, {format_bytes(path.stat().st_size)}, every zip record matches its CRC-32; its pickle {pickled})"
    return _verify_directory(LocalFolder(location), weights_only)


def _verify_remote_file(location: RemoteLocation, weights_only: bool) -> str:
    fs = location.fs
    check_file(location)  # there (or named as missing, with what an interrupted save left), every zip record
    with fs.open(location.path, "rb") as f:
        size = f.size

        def load() -> Any:
            f.seek(0)
            return load_torch_file(f, True, location.url, "it")

        pickled = _check_pickle(f, weights_only, load, location.url)
    return f"{location.url}: OK (a single-file checkpoint, {format_bytes(size)}, every zip record matches its CRC-32; its pickle {pickled})"


def _verify_directory(path: Folder, weights_only: bool) -> str:
    """A sharded checkpoint: its manifest, every file against its size and checksum, DCP's
    metadata, meta.pt's zip and pickle."""
    manifest = check_directory(path)
    items = storage_items(path)
    unlisted = sorted({file for file, _, _ in items} - set(manifest.files))
    if unlisted:
        raise CorruptCheckpointError(f"Checkpoint {str(path)!r} is damaged: its DCP metadata names {unlisted[0]}, which the manifest does not list.")
    pickled = f"no {META_NAME}"
    if META_NAME in manifest.files:
        with path.open(META_NAME) as f:
            meta = io.BytesIO(f.read())
        check_zip(meta, f"{path}/{META_NAME}")
        pickled = f"{META_NAME} " + _check_pickle(meta, weights_only, lambda: read_meta(path, True), f"{path}/{META_NAME}")
    if manifest.checksums:
        checked = "sizes and checksums"
    else:
        _check_items(path.path, items)  # format 1: local directories only (written before URLs were)
        checked = "sizes, and each DCP item's zip checksums (format 1: no file checksums recorded)"
    total = format_bytes(sum(manifest.files.values()))
    frozen = f"; frozen weights left out ({len(manifest.frozen)} tensors, fingerprint {digest(manifest.frozen)})" if manifest.frozen else ""
    return f"{path}: OK ({len(manifest.files)} files, {total}; {checked}; DCP metadata read by its restricted unpickler; {pickled}{frozen})"


def _check_pickle(file: Any, weights_only: bool, load: Callable[[], Any], label: str = "") -> str:
    """Unpickle ``file`` with ``load`` (weights-only) or, when ``weights_only`` is False, list the
    globals it names beyond the weights-only allow list without unpickling it; what was done, in words."""
    if hasattr(file, "seek"):
        file.seek(0)
    if not zipfile.is_zipfile(file):
        return "in torch's legacy format, not unpickled"
    if weights_only:
        try:
            load()
        except (UntrustedCheckpointError, CorruptCheckpointError):
            raise
        except Exception as err:  # noqa: BLE001 - torch.load raises many kinds for a damaged pickle
            raise CorruptCheckpointError(f"{label or str(file)!r} is corrupted: its pickle cannot be read ({describe(err)}).") from err
        return "unpickled with weights_only=True"
    scan = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)  # torch 2.5+
    if scan is None:
        return "not unpickled (weights_only=False)"
    if hasattr(file, "seek"):
        file.seek(0)
    with checkpoint_globals():
        beyond = ", ".join(sorted(scan(file))) or "none"
    return f"not unpickled (weights_only=False; the globals it names beyond the weights-only allow list: {beyond})"


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
