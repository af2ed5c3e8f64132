"""The files of one sharded checkpoint, wherever they are: ``LocalFolder`` (a directory) or
``RemoteFolder`` (a versioned content folder on an fsspec filesystem, see ``remote.py``), and the
file access DCP is given for each (``NamingFiles`` / ``FsspecFiles``).

Both give DCP's writer and reader errors that name the file (DCP reports a failed rank without the
file or the cause: ``CheckpointException ranks:dict_keys([0])``): any error raised while a file is
open is re-raised as ``ShardFileError`` naming it.

On a remote folder the checksums are taken while the bytes stream out (``FsspecFiles.written``):
reading a file back from a bucket to checksum it would download the whole checkpoint again. A
write that fails is discarded, never completed: an object store makes an upload visible only when
it is closed, and closing a half-written file would publish it.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Generator, Optional, Union

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase

from lightning_zero.checkpoint.errors import CheckpointReadError, ShardFileError, describe
from lightning_zero.checkpoint.locations import PathLike, RemoteLocation, checkpoint_location

MANIFEST_NAME = "lightning_zero.json"
"""The manifest's file (``manifest.py``), which commits a sharded checkpoint: a folder knows where it is."""


class NamingFiles(FileSystem):
    """DCP's local file access, with any error raised while a file is open (opening, reading,
    unpickling, writing, syncing) re-raised as ``ShardFileError`` naming that file."""

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[io.IOBase, None, None]:
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except Exception as err:  # noqa: BLE001 - tagged and re-raised
            raise ShardFileError(Path(path).name, describe(err, with_filename=False)) from err


class LocalFolder:
    """A sharded checkpoint directory on a local (or mounted) filesystem; the manifest beside the files."""

    is_local = True

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def dcp_path(self) -> str:
        return str(self.path)

    def dcp_files(self) -> FileSystemBase:
        return NamingFiles()

    def open(self, name: str, mode: str = "rb") -> IO[bytes]:
        return open(self.path / name, mode)

    def size(self, name: str) -> int:
        return (self.path / name).stat().st_size

    def sizes(self) -> dict[str, int]:
        """Every file but the manifest, by name."""
        return {p.name: p.stat().st_size for p in sorted(self.path.iterdir()) if p.name != MANIFEST_NAME}

    def exists(self) -> bool:
        return self.path.exists()

    def has_manifest(self) -> bool:
        return (self.path / MANIFEST_NAME).is_file()

    def write_file(self, name: str, data: bytes) -> None:
        with open(self.path / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def use_content(self, content: str) -> None:
        """(Remote folders only: which version folder the manifest names.)"""


class RemoteFolder:
    """A sharded checkpoint at a URL: its manifest at ``<url>/lightning_zero.json``, every other file
    in ``<url>/<content>/`` (a version folder the manifest names, see ``remote.py``). ``content``:
    given when writing; when reading, taken from the manifest (``use_content``, by ``Manifest.read``)."""

    is_local = False

    def __init__(self, location: RemoteLocation, content: Optional[str] = None) -> None:
        self.location = location
        self.content = content
        self._sizes: Optional[dict[str, int]] = None

    def __str__(self) -> str:
        return self.location.url

    @property
    def name(self) -> str:
        return self.location.name

    def use_content(self, content: str) -> None:
        if content != self.content:
            self.content, self._sizes = content, None

    def _content(self) -> str:
        if self.content is None:  # the files, before the manifest was read: what it names
            with self.open(MANIFEST_NAME) as f:
                self.use_content(json.load(f).get("content", ""))
        assert self.content is not None
        return self.content

    def file(self, name: str) -> str:
        """The filesystem's path of file ``name``."""
        return self.location.join(name) if name == MANIFEST_NAME else self.location.join(self._content(), name)

    @property
    def dcp_path(self) -> str:
        return self.location.join(self._content())

    def dcp_files(self) -> "FsspecFiles":
        return FsspecFiles(self.location.fs, self.location.object_store)

    def open(self, name: str, mode: str = "rb") -> IO[bytes]:
        return self.location.fs.open(self.file(name), mode)

    def sizes(self) -> dict[str, int]:
        """Every file of the version folder, by name (one listing, kept for this folder's reads)."""
        if self._sizes is None:
            fs = self.location.fs
            fs.invalidate_cache(self.dcp_path)
            try:
                listed = fs.ls(self.dcp_path, detail=True)
            except FileNotFoundError:
                listed = []
            self._sizes = {posixpath.basename(e["name"].rstrip("/")): int(e["size"]) for e in listed if e.get("type") != "directory"}
        return dict(self._sizes)

    def size(self, name: str) -> int:
        sizes = self.sizes()
        if name not in sizes:
            raise FileNotFoundError(f"{self.location.url}/{self._content()}/{name}")
        return sizes[name]

    def exists(self) -> bool:
        fs = self.location.fs
        fs.invalidate_cache(self.location.path)
        with reaching(self.location, "while looking for it"):
            return fs.exists(self.location.path)

    def has_manifest(self) -> bool:
        """Whether the manifest is there: the first request of every read of a URL (a load, convert,
        verify, ``checkpoint_file``), so the one whose failure ``reaching`` names."""
        fs = self.location.fs
        fs.invalidate_cache(self.location.path)
        with reaching(self.location, f"while looking for its {MANIFEST_NAME}"):
            try:  # not fsspec's `isfile`, which answers False for any error: refused credentials too
                return fs.info(self.location.join(MANIFEST_NAME))["type"] == "file"
            except FileNotFoundError:
                return False
            except PermissionError:
                # S3 answers a missing key with 403 to credentials that may read objects but not list
                # the bucket: a full file readable at the URL itself has no manifest beside it
                if _is_readable_file(fs, self.location.path):
                    return False
                raise

    def write_file(self, name: str, data: bytes) -> None:
        with writing_remote(self.location.fs, self.file(name)) as f:
            f.write(data)


Folder = Union[LocalFolder, RemoteFolder]


def _is_readable_file(fs: Any, path: str) -> bool:
    try:
        return fs.info(path)["type"] == "file"
    except Exception:  # noqa: BLE001 - not a file this process can read, whatever the reason
        return False


@contextmanager
def reaching(location: RemoteLocation, doing: str) -> Generator[None, None, None]:
    """A request to ``location``'s storage whose failure (credentials missing or refused, the endpoint
    unreachable) is raised as one line, ``CheckpointReadError``, naming the URL and the cause as a
    save's error does (``describe``); an absent file is an answer, not a failure. The filesystem's
    own trace is dropped: its first line is in the message."""
    try:
        yield
    except FileNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever the filesystem raises (botocore's, aiohttp's, OSError)
        raise CheckpointReadError(f"Checkpoint {location.url!r} could not be read: {describe(err)} {doing}.") from None


def as_folder(directory: Union[PathLike, Folder, RemoteLocation]) -> Folder:
    """``directory`` as the folder of a sharded checkpoint (a URL: one to read, its content from its manifest)."""
    if isinstance(directory, (LocalFolder, RemoteFolder)):
        return directory
    location = checkpoint_location(directory)
    return RemoteFolder(location) if isinstance(location, RemoteLocation) else LocalFolder(location)


# ---- writing to an fsspec filesystem ------------------------------------------------------------
@contextmanager
def writing_remote(fs: Any, path: str) -> Generator[IO[bytes], None, None]:
    """``fs.open(path, "wb")``, closed (published) only if the block inside returns; on an error the
    upload is discarded (an object store then shows no object, or the one there before)."""
    f = fs.open(path, "wb")
    try:
        yield f
    except BaseException:
        _discard(f, fs, path)
        raise
    f.close()


def _discard(f: Any, fs: Any, path: str) -> None:
    try:
        if isinstance(f, io.BytesIO):  # fsspec's memory:// shows a file from its opening on: removed
            io.BytesIO.close(f)
            fs.rm(path)
            return
        discard = getattr(f, "discard", None)
        if discard is not None:
            discard()  # s3fs aborts the multipart upload; fsspec's buffered files drop the buffer
        f.closed = True  # never published by a later close() (e.g. at garbage collection)
    except Exception:  # noqa: BLE001 - the error being raised matters, not this one
        pass


class _ChecksummingStream(io.RawIOBase):
    """A write stream that keeps the CRC-32 and the size of what passes through it."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.crc = 0
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.written += len(view)
        self.raw.write(view)
        return len(view)

    def tell(self) -> int:
        return self.written

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:  # the file is closed (published) by `writing_remote`, once all is written
        pass


class FsspecFiles(FileSystemBase):
    """DCP's file access on an fsspec filesystem (in place of DCP's private ``_fsspec_filesystem``,
    whose writes would publish a half-written file on an error): errors name the file, failed
    writes are discarded, and every file written is recorded with its CRC-32 and size in ``written``
    (by name, as the manifest lists it). On an object store no folder is ever made."""

    def __init__(self, fs: Any, object_store: bool) -> None:
        self.fs = fs
        self.object_store = object_store
        self.written: dict[str, tuple[int, int]] = {}
        """name -> (CRC-32, bytes) of each file this process wrote through DCP."""

    @contextmanager
    def create_stream(self, path: Union[str, os.PathLike], mode: str) -> Generator[io.IOBase, None, None]:
        path = os.fspath(path)
        name = posixpath.basename(path)
        try:
            if "w" in mode:
                with writing_remote(self.fs, path) as f:
                    stream = _ChecksummingStream(f)
                    yield stream  # type: ignore[misc]
                self.written[name] = (stream.crc, stream.written)
            else:
                with self.fs.open(path, mode) as f:
                    yield f
        except Exception as err:  # noqa: BLE001 - tagged and re-raised
            raise ShardFileError(name, describe(err, with_filename=False)) from err

    def concat_path(self, path: Union[str, os.PathLike], suffix: str) -> str:
        return posixpath.join(os.fspath(path), suffix)

    def init_path(self, path: Union[str, os.PathLike], **kwargs: Any) -> str:
        return os.fspath(path)

    def rename(self, path: Union[str, os.PathLike], new_path: Union[str, os.PathLike]) -> None:
        self.fs.mv(os.fspath(path), os.fspath(new_path))  # DCP's .metadata.tmp -> .metadata
        old, new = posixpath.basename(os.fspath(path)), posixpath.basename(os.fspath(new_path))
        if old in self.written:
            self.written[new] = self.written.pop(old)

    def mkdir(self, path: Union[str, os.PathLike]) -> None:
        if not self.object_store:
            self.fs.makedirs(os.fspath(path), exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return False  # given to DCP explicitly, never picked by it

    def exists(self, path: Union[str, os.PathLike]) -> bool:
        return self.fs.exists(os.fspath(path))

    def rm_file(self, path: Union[str, os.PathLike]) -> None:
        self.fs.rm(os.fspath(path))

    def ls(self, path: Union[str, os.PathLike]) -> list[str]:
        return self.fs.ls(os.fspath(path), detail=False)
