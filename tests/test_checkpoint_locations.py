"""Checkpoint paths that are URLs are refused with the way out, never taken for local folders
(one process; the Trainer's setup-time check is in test_strategy_loop.py's bad-input cases)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_zero import convert_checkpoint
from lightning_zero.checkpoint import verify_checkpoint
from lightning_zero.checkpoint.locations import RemoteCheckpointError, local_checkpoint_path, url_protocol


def test_local_paths_and_file_urls_pass():
    assert local_checkpoint_path("runs/last.ckpt") == Path("runs/last.ckpt")
    assert local_checkpoint_path(Path("/tmp/x")) == Path("/tmp/x")
    assert local_checkpoint_path("file:///tmp/x.ckpt") == Path("/tmp/x.ckpt")
    assert url_protocol("c:/windows/path") is None


@pytest.mark.parametrize("url,mount", [("s3://bucket/run/last.ckpt", "s3fs-fuse"), ("gs://b/x", "gcsfuse"), ("az://c/x", "blobfuse2"), ("hf://r/x", "FUSE")])
def test_urls_refused_naming_a_mount(url, mount):
    with pytest.raises(RemoteCheckpointError, match=f"is a {url.split(':')[0]}:// URL") as refused:
        local_checkpoint_path(url)
    assert mount in str(refused.value) and "local folder" in str(refused.value)


def test_convert_and_verify_refuse_urls_and_write_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RemoteCheckpointError, match="s3://"):
        convert_checkpoint("s3://bucket/run/epoch=0-step=2.ckpt", tmp_path / "out.ckpt")
    with pytest.raises(RemoteCheckpointError, match="Destination 's3://bucket/out.ckpt'"):
        convert_checkpoint(tmp_path / "missing", "s3://bucket/out.ckpt")
    with pytest.raises(RemoteCheckpointError, match="gs://"):
        verify_checkpoint("gs://bucket/run/last.ckpt")
    assert os.listdir(tmp_path) == []
