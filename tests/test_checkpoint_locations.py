"""Where checkpoints go, in one process: local paths stay paths (never a URL taken for a local
folder), URLs get their fsspec filesystem or an error naming the package to install, and what the
object-storage commit builds on (``checkpoint/folders.py``, ``remote.py``) on fsspec's ``memory://``.
The multi-rank saves and loads against an S3 server are in test_remote_checkpoints.py."""

from __future__ import annotations

import io
import uuid
import zlib
from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint import remote, verify_checkpoint
from lightning_zero.checkpoint.folders import FsspecFiles, RemoteFolder, writing_remote
from lightning_zero.checkpoint.locations import (
    MissingFilesystemError,
    RemoteLocation,
    check_locations,
    check_storage_options,
    checkpoint_location,
    url_protocol,
)
from lightning_zero.checkpoint.manifest import MANIFEST_NAME, is_sharded_checkpoint


def _url(name: str) -> str:
    return f"memory://lz-{uuid.uuid4().hex[:8]}/{name}"


def test_local_paths_and_file_urls_stay_paths():
    assert checkpoint_location("runs/last.ckpt") == Path("runs/last.ckpt")
    assert checkpoint_location(Path("/tmp/x")) == Path("/tmp/x")
    assert checkpoint_location("file:///tmp/x.ckpt") == Path("/tmp/x.ckpt")
    assert url_protocol("c:/windows/path") is None
    location = checkpoint_location("s3://bucket/run/last.ckpt/", {"anon": True})
    assert isinstance(location, RemoteLocation)
    assert (location.url, location.protocol, location.storage_options) == ("s3://bucket/run/last.ckpt", "s3", {"anon": True})


@pytest.mark.parametrize("url,package", [("gs://b/x", "gcsfs"), ("az://c/x", "adlfs"), ("abfs://c/x", "adlfs")])
def test_missing_fsspec_package_is_named(url, package):
    try:
        __import__(package)
        pytest.skip(f"{package} is installed here")
    except ImportError:
        pass
    with pytest.raises(MissingFilesystemError, match=f"pip install {package}") as refused:
        check_locations([("ModelCheckpoint(dirpath=...)", url)])
    assert url in str(refused.value)
    with pytest.raises(MissingFilesystemError, match=package):
        verify_checkpoint(url)


def test_unknown_protocol_is_refused():
    with pytest.raises(MissingFilesystemError, match="fsspec knows no filesystem for nosuch://"):
        _ = checkpoint_location("nosuch://x/y").fs
    check_locations([("a", "memory://x"), ("b", None), ("c", "local/dir")])  # all fine


def test_storage_options_only_for_urls():
    with pytest.raises(TypeError, match="local path"):
        check_storage_options("runs/x.ckpt", {"anon": True})
    with pytest.raises(TypeError, match="dict"):
        check_storage_options("s3://b/x", "anon")
    check_storage_options("s3://b/x", {"anon": True})


def test_files_written_through_dcp_carry_their_streamed_checksums():
    location = checkpoint_location(_url("ckpt"))
    files = FsspecFiles(location.fs, object_store=False)
    data = [b"abc" * 1000, bytearray(b"\x00\x01" * 77)]
    with files.create_stream(location.join("v-1", "__0_0.distcp"), "wb") as stream:
        for chunk in data:
            stream.write(chunk)
        assert stream.tell() == sum(map(len, data))
    files.rename(location.join("v-1", "__0_0.distcp"), location.join("v-1", "renamed"))
    expected = zlib.crc32(b"".join(data))
    assert files.written == {"renamed": (expected, sum(map(len, data)))}
    assert zlib.crc32(location.fs.cat(location.join("v-1", "renamed"))) == expected


def test_remote_checkpoint_layout_commit_and_removal():
    """A sharded checkpoint at a URL counts only with its manifest; ``finish_commit`` deletes every
    other version; ``remove`` deletes it all."""
    location = checkpoint_location(_url("last.ckpt"))
    fs = location.fs
    for version in ("v-aaa", "v-bbb", "v-ccc"):
        fs.pipe(location.join(version, "__0_0.distcp"), b"x")
    assert not is_sharded_checkpoint(location)
    fs.pipe(location.join(MANIFEST_NAME), b'{"content": "v-bbb"}')
    assert is_sharded_checkpoint(location.url)
    assert remote.leftovers(location) == ["v-aaa", "v-ccc"]
    remote.finish_commit(RemoteFolder(location, "v-bbb"))
    assert remote.leftovers(location) == []
    assert fs.exists(location.join("v-bbb", "__0_0.distcp"))
    remote.remove(location)
    assert not fs.exists(location.join(MANIFEST_NAME)) and not fs.find(location.path)


def test_full_file_at_a_url_is_written_whole_or_not_at_all():
    location = checkpoint_location(_url("model.ckpt"))
    with pytest.raises(RuntimeError, match="cut"):
        with writing_remote(location.fs, location.path) as f:
            f.write(b"half a file")
            raise RuntimeError("cut")
    assert not location.fs.exists(location.path)
    remote.write_file(location, lambda f: torch.save({"w": torch.ones(2)}, f))
    assert torch.equal(torch.load(io.BytesIO(location.fs.cat(location.path)))["w"], torch.ones(2))
    assert "a single-file checkpoint" in verify_checkpoint(location.url)
    remote.remove(location)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        verify_checkpoint(location.url)


def test_urls_never_become_local_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError):
        verify_checkpoint(_url("missing.ckpt"))
    assert list(tmp_path.iterdir()) == []


def test_the_directory_above_checkpoints_names_them(tmp_path):
    """The Trainer's ``checkpoints/`` given where one checkpoint in it is meant (``load_from_checkpoint``,
    ``ckpt_path``, ``verify``, ``checkpoint_file``): the refusal lists the checkpoints it holds."""
    from lightning_zero import checkpoint_file

    folder = tmp_path / "checkpoints"
    for name in ("last.ckpt", "epoch=0-step=4.ckpt"):
        (folder / name).mkdir(parents=True)
        (folder / name / MANIFEST_NAME).write_text("{}")
    (folder / "notes").mkdir()  # not a checkpoint: not listed
    hint = f"HINT: it holds the sharded checkpoints '{folder}/epoch=0-step=4.ckpt', '{folder}/last.ckpt'; give the path of one."
    for read in (checkpoint_file, verify_checkpoint):
        with pytest.raises(ValueError, match="is not a lightning-zero sharded checkpoint") as refused:
            read(folder)
        assert str(refused.value).endswith(hint), str(refused.value)
    with pytest.raises(ValueError) as refused:
        verify_checkpoint(folder / "notes")  # a directory that holds none: no hint
    assert "HINT" not in str(refused.value)
