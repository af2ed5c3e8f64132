"""Where checkpoints go: a local (or mounted) path, or a URL of any filesystem fsspec implements
(``s3://``, ``gs://``, ``az://``, ``memory://``, ...), told apart before anything is written.

A URL handed to code that treats it as a local path becomes a local folder named ``s3:`` in the
working directory: the save "succeeds", nothing reaches the bucket, and a later load of the URL
silently reads that folder. So every checkpoint path this package takes goes through
``checkpoint_location``, which gives a ``Path`` for a local path (``file://`` stripped) and a
``RemoteLocation`` for a URL, whose filesystem is fsspec's; what the two kinds of location hold and
how a checkpoint is committed on each is ``folders.py`` and ``remote.py``.

A protocol with no fsspec implementation installed is refused where it is first seen — at the
strategies' setup for the Trainer's checkpoint directories, on every rank, before a step — naming
the package that implements it (``check_locations``).
"""

from __future__ import annotations

import os
import posixpath
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Optional, Union

PathLike = Union[str, os.PathLike]

_URL = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.\-]*)://")

PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs", "adl": "adlfs"}
"""The package that gives fsspec each object store's protocol."""

OBJECT_STORES = frozenset(PACKAGES) | {"oss", "r2", "b2", "wasb", "wasbs"}
"""Protocols with no directories: a "folder" is a key prefix, and making one would create a bucket
(s3fs's ``makedirs`` does, for a bucket that does not exist): never made, a missing bucket is an error."""


class MissingFilesystemError(ValueError):
    """A checkpoint URL whose protocol fsspec has no implementation of, here."""


def url_protocol(path: Any) -> Optional[str]:
    """The protocol of ``path`` if it is a URL other than ``file://`` (lower case), else None."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    match = _URL.match(os.fspath(path))
    protocol = match["protocol"].lower() if match else None
    return None if protocol in (None, "file") else protocol


class RemoteLocation:
    """A checkpoint's URL and the fsspec filesystem it lives on (``storage_options``: the
    filesystem's arguments, e.g. Lightning's ``storage_options`` of a save; fsspec's own
    configuration and the environment give the rest, e.g. ``AWS_ENDPOINT_URL``). Pickles as its URL
    and options: the filesystem is made again where it is used."""

    def __init__(self, url: str, storage_options: Optional[dict[str, Any]] = None) -> None:
        self.url = url.rstrip("/")
        self.protocol = url_protocol(url) or "file"
        self.storage_options = dict(storage_options or {})

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemoteLocation({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "protocol": self.protocol, "storage_options": self.storage_options}

    @cached_property
    def fs(self) -> Any:
        """The fsspec filesystem (``MissingFilesystemError`` naming the package if none is installed)."""
        filesystem_class(self.protocol, self.url)
        from fsspec.core import url_to_fs

        return url_to_fs(self.url, **self.storage_options)[0]

    @cached_property
    def path(self) -> str:
        """The location as the filesystem names it (``bucket/run/last.ckpt`` for ``s3://bucket/run/last.ckpt``)."""
        return self.fs._strip_protocol(self.url).rstrip("/")

    @property
    def object_store(self) -> bool:
        return self.protocol in OBJECT_STORES

    @property
    def name(self) -> str:
        return posixpath.basename(self.url)

    def join(self, *names: str) -> str:
        """The filesystem's path of ``names`` under this location."""
        return posixpath.join(self.path, *names)

    def sibling(self, name: str) -> "RemoteLocation":
        """The location ``name`` beside this one (same filesystem and options)."""
        return RemoteLocation(posixpath.join(posixpath.dirname(self.url), name), self.storage_options)


Location = Union[Path, RemoteLocation]


def checkpoint_location(path: Union[PathLike, RemoteLocation], storage_options: Optional[dict[str, Any]] = None) -> Location:
    """``path`` as a local ``Path`` (``file://`` stripped) or, for a URL, a ``RemoteLocation``."""
    if isinstance(path, RemoteLocation):
        return path
    text = os.fspath(path)
    if url_protocol(text) is None:
        return Path(text[len("file://") :] if text.lower().startswith("file://") else text)
    return RemoteLocation(text, storage_options)


def is_remote(path: Any) -> bool:
    return isinstance(path, RemoteLocation) or url_protocol(path) is not None


def filesystem_class(protocol: str, url: str, what: str = "Checkpoint") -> type:
    """fsspec's implementation of ``protocol``; ``MissingFilesystemError`` naming the package to
    install (``s3fs``, ``gcsfs``, ``adlfs``), or saying that no implementation is known."""
    import fsspec
    from fsspec.registry import known_implementations

    try:
        return fsspec.get_filesystem_class(protocol)
    except ImportError as err:
        package = PACKAGES.get(protocol)
        hint = f"HINT: `pip install {package}`" if package else known_implementations.get(protocol, {}).get("err", "")
        raise MissingFilesystemError(
            f"{what} {url!r} is a {protocol}:// URL, but the package that lets fsspec reach {protocol}:// is not"
            f" installed ({err}). {hint}".rstrip()
        ) from None
    except ValueError:
        raise MissingFilesystemError(
            f"{what} {url!r} is a {protocol}:// URL, and fsspec knows no filesystem for {protocol}://. HINT: give a"
            " local path, or a URL of a filesystem fsspec implements (s3://, gs://, az://, ...), with its package installed."
        ) from None


def check_locations(locations: Iterable[tuple[str, Optional[Any]]]) -> None:
    """At setup: every URL among ``locations`` (``(what, path)``; None: not set) has an fsspec
    implementation installed, else ``MissingFilesystemError`` for the first that has none."""
    for what, path in locations:
        protocol = url_protocol(path) if path is not None else None
        if protocol is not None:
            filesystem_class(protocol, os.fspath(path), what)


def check_storage_options(path: Any, storage_options: Optional[Any]) -> None:
    """Lightning's ``storage_options`` of a save: the fsspec filesystem's arguments for a URL; a
    local path takes none (as Lightning's own ``TorchCheckpointIO`` refuses them)."""
    if storage_options is None:
        return
    if url_protocol(path) is None:
        raise TypeError(
            f"`storage_options` were given for the local path {os.fspath(path)!r}: lightning-zero passes them to the"
            " fsspec filesystem of a checkpoint URL (s3://, gs://, ...) and takes none for a local path."
        )
    if not isinstance(storage_options, dict):
        raise TypeError(f"`storage_options` must be a dict of the fsspec filesystem's arguments, got {type(storage_options).__name__}.")
