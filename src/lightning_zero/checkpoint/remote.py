"""Checkpoints at a URL (object storage, or any fsspec filesystem): committed by their manifest,
never by a rename.

[Note: commits on object storage]
Object stores have no rename (fsspec's ``mv`` copies every byte, then deletes) and no directory to
swap, so ``atomic.py``'s commit does not carry over. What they do have: an object appears whole or
not at all, when its upload completes (a multipart upload that is aborted, or never completed,
leaves nothing). So a sharded save of ``<url>`` writes

    <url>/v-<token>/          a version folder of its own: DCP's files and meta.pt (every rank)
    <url>/lightning_zero.json the manifest (rank 0, last), naming ``v-<token>`` as its ``content``

and the checkpoint at ``<url>`` is whatever complete version the manifest names: the save is
committed exactly when the manifest is written, in one object write that replaces the previous
manifest. Until then ``<url>`` still names the previous version, untouched, and a save cut short
(a rank killed, the endpoint gone) leaves only a version folder that no manifest names, which the
next successful save of ``<url>`` deletes (``finish_commit``) and ``verify`` reports. A reader
checks every file of the version against the manifest's sizes and checksums before using it. (On
an fsspec filesystem whose writes are not published whole — sftp, ``memory://`` — a manifest cut
mid-write fails to parse: it reads as a corrupted checkpoint, never as a complete one.)

A full file (``state_dict_type="full"``) is one object written straight to ``<url>``: published by
its upload's completion, discarded on an error (``folders.writing_remote``).

Removal (ModelCheckpoint's top-k) deletes the manifest first, so a half-removed checkpoint never
counts as complete, then the rest.
"""

from __future__ import annotations

import posixpath
import re
import warnings
from typing import Any, Callable

from lightning_zero.checkpoint.folders import RemoteFolder, writing_remote
from lightning_zero.checkpoint.locations import RemoteLocation
from lightning_zero.checkpoint.manifest import MANIFEST_NAME

VERSION = re.compile(r"v-[0-9a-f]+")
"""The name of a version folder (``v-<token>``)."""


def version_folder(location: RemoteLocation, token: str) -> RemoteFolder:
    """The folder a new save of ``location`` writes into (committed by ``write_directory``'s manifest)."""
    return RemoteFolder(location, content=f"v-{token}")


def finish_commit(folder: RemoteFolder) -> None:
    """After the manifest naming ``folder``'s version was written (rank 0): delete what the
    checkpoint at that URL no longer uses — the previous versions, versions that interrupted saves
    left, and a full file saved there before. A failure only warns: the checkpoint is in place."""
    location = folder.location
    try:
        stale = [posixpath.join(location.path, name) for name in _versions(location) if name != folder.content]
        fs = location.fs
        if stale:
            fs.rm(stale, recursive=True)
        _remove_file(location)
    except Exception as err:  # noqa: BLE001 - housekeeping after the commit: never fails the save
        warnings.warn(f"Could not delete the superseded files under {location.url!r} ({err}); the next save there tries again.", stacklevel=2)


def leftovers(location: RemoteLocation) -> list[str]:
    """Version folders under ``location`` that its manifest does not name (interrupted saves)."""
    folder = RemoteFolder(location)
    committed = folder.dcp_path.rpartition("/")[2] if folder.has_manifest() else None
    return [name for name in _versions(location) if name != committed]


def _versions(location: RemoteLocation) -> list[str]:
    fs = location.fs
    fs.invalidate_cache(location.path)
    try:
        entries = fs.ls(location.path, detail=False)
    except FileNotFoundError:
        return []
    return sorted(name for name in (posixpath.basename(e.rstrip("/")) for e in entries) if VERSION.fullmatch(name))


def write_file(location: RemoteLocation, write: Callable[[Any], None]) -> None:
    """A full checkpoint file: ``write(stream)`` into one object at ``location``, published once
    complete; then a sharded checkpoint saved at that URL before is removed."""
    with writing_remote(location.fs, location.path) as f:
        write(f)
    if RemoteFolder(location).has_manifest():
        remove(location, keep_file=True)


def remove(location: RemoteLocation, keep_file: bool = False) -> None:
    """Delete the checkpoint at ``location``: a sharded one manifest first (never left looking
    complete), then its versions; a full file (unless ``keep_file``)."""
    fs = location.fs
    manifest = location.join(MANIFEST_NAME)
    fs.invalidate_cache(location.path)
    if fs.exists(manifest):
        fs.rm(manifest)
    versions = [posixpath.join(location.path, name) for name in _versions(location)]
    if versions:
        fs.rm(versions, recursive=True)
    if not keep_file:
        _remove_file(location)


def _remove_file(location: RemoteLocation) -> None:
    """Delete the object at exactly ``location`` (a full file), if any: by its key, as an object
    store may also hold keys under it (a sharded checkpoint), which its ``isfile`` would then deny."""
    try:
        location.fs.rm_file(location.path)
    except (FileNotFoundError, IsADirectoryError):
        pass
