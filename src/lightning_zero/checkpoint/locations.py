"""Where checkpoints go: local and mounted filesystems, checked before anything is written.

A URL such as ``s3://bucket/run/last.ckpt`` handed to code that treats it as a local path becomes a
local folder named ``s3:`` in the working directory: the save "succeeds", nothing reaches the
bucket, and a later load of the URL silently reads that folder — on a cloud machine the user learns
of it when the disk is gone. Until checkpoints are written through fsspec, every checkpoint path
this package takes goes through ``local_checkpoint_path``, which refuses a URL with the way out, and
the strategies check the Trainer's checkpoint directories at setup, on every rank, before a step.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Optional

from lightning_zero.checkpoint.manifest import PathLike

_URL = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.\-]*)://")

MOUNTS = {"s3": "s3fs-fuse or mountpoint-s3", "gs": "gcsfuse", "gcs": "gcsfuse", "az": "blobfuse2", "abfs": "blobfuse2", "abfss": "blobfuse2"}
"""How a bucket of each object store can be mounted as a local directory."""


class RemoteCheckpointError(ValueError):
    """A checkpoint path that is a URL of object storage (or another remote filesystem)."""


def url_protocol(path: PathLike) -> Optional[str]:
    """The protocol of ``path`` if it is a URL other than ``file://`` (lower case), else None."""
    match = _URL.match(os.fspath(path))
    protocol = match["protocol"].lower() if match else None
    return None if protocol in (None, "file") else protocol


def local_checkpoint_path(path: PathLike, what: str = "Checkpoint") -> Path:
    """``path`` as a local path (``file://`` stripped); a remote URL raises ``RemoteCheckpointError``."""
    text = os.fspath(path)
    protocol = url_protocol(text)
    if protocol is None:
        return Path(text[len("file://") :] if text.lower().startswith("file://") else text)
    mount = MOUNTS.get(protocol, "a FUSE mount of that store")
    raise RemoteCheckpointError(
        f"{what} {text!r} is a {protocol}:// URL: lightning-zero saves and loads checkpoints on local or mounted"
        f" filesystems only, and would otherwise write a local folder named '{protocol}:' instead. HINT: give a local"
        f" directory (and copy the checkpoints to the bucket after each save, e.g. from a callback), or mount the"
        f" bucket ({mount}) and give the mount point."
    )


def check_local_locations(locations: Iterable[tuple[str, Optional[PathLike]]]) -> None:
    """Raise for the first of ``locations`` (``(what, path)``; None: not set) that is a remote URL."""
    for what, path in locations:
        if path is not None:
            local_checkpoint_path(path, what)
