"""Checkpoints that are damaged, interrupted, untrusted or cannot be written: same-size damage caught
by the checksums (load on every rank alike, `convert`, `verify`), a broken zip record named, old
manifests without checksums, a full disk named in the first line, a crash between any two filesystem
operations of the commit never losing the last complete checkpoint (nor `ckpt_path="last"`), a pickle
that would run code refused by every reader without running it; and every process group the
strategies create (checkpoint groups included) failing a stalled peer's partner within `timeout`."""

from __future__ import annotations

import contextlib
import errno
import inspect
import io
import json
import os
import pickle
import re
import shlex
import shutil
import struct
import subprocess
import sys
import zipfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Optional
from unittest import mock

import lightning as L
import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from lightning.pytorch.callbacks import Callback
from lightning_helpers import RegressionModule

import lightning_zero  # noqa: F401
from lightning_zero.checkpoint import atomic
from lightning_zero.lightning.strategy import ZeroStrategy

STEP2, STEP4 = "epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"
"""What `save_two` leaves under `saved/`."""
NAN = struct.pack("<4f", *[float("nan")] * 4)


class _StepAtStart(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.global_step = trainer.global_step
        with trainer.strategy.summon_full_params():
            self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


# ---- damaging a DCP shard file in place ------------------------------------------------------------
def _data_offset(archive: bytes, record: zipfile.ZipInfo) -> int:
    """Where `record`'s bytes start in `archive`: after its local header, name and (padding) extra field."""
    name_len, extra_len = struct.unpack("<HH", archive[record.header_offset + 26 : record.header_offset + 30])
    return record.header_offset + 30 + name_len + extra_len


def _largest_record(directory: Path, file: str) -> tuple[int, zipfile.ZipInfo, int]:
    """(offset of the item in `file`, the zip record of its tensor data, offset of that data in the
    item) for the largest weight DCP stored in `file` (each item is a `torch.save` zip)."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(directory)).read_metadata().storage_data
    item = max(
        (info for index, info in storage.items() if info.relative_path == file and index.fqn.startswith("model/")),
        key=lambda info: info.length,
    )
    with open(directory / file, "rb") as f:
        f.seek(item.offset)
        blob = f.read(item.length)
    record = next(i for i in zipfile.ZipFile(io.BytesIO(blob)).infolist() if "/data/" in i.filename)
    return item.offset, record, _data_offset(blob, record)


def write_nan_into_tensor_data(directory: Path, file: str) -> None:
    item, _, data = _largest_record(directory, file)
    with open(directory / file, "r+b") as f:
        f.seek(item + data)
        f.write(NAN)


def flip_zip_header(directory: Path, file: str) -> None:
    """Same size: one byte of a record's local header signature (b"PK\\x03\\x04")."""
    item, record, _ = _largest_record(directory, file)
    with open(directory / file, "r+b") as f:
        f.seek(item + record.header_offset + 1)
        f.write(b"X")


def as_format_1(directory: Path) -> None:
    """What a checkpoint saved before checksums looks like."""
    manifest = directory / "lightning_zero.json"
    data = json.loads(manifest.read_text())
    del data["checksums"]
    data["format"] = "lightning-zero/sharded/1"
    manifest.write_text(json.dumps(data))


# ---- the 2-rank cases --------------------------------------------------------------------------------
GROUP = CaseGroup(world_size=2, timeout=480)


@GROUP.case
def save_two(ctx: RankContext) -> None:
    """A zero2 fit saving sharded checkpoints at steps 2 and 4, into `saved/`."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import fit_and_record

    ckpt = ModelCheckpoint(dirpath=os.path.join(ctx.tmpdir, "saved"), every_n_train_steps=2, save_top_k=-1)
    fit_and_record("zero2", 4, callbacks=[ckpt], enable_checkpointing=True)


@GROUP.case
def damage(ctx: RankContext) -> None:
    """Rank 0 makes damaged and interrupted copies for the next cases (the others wait for it)."""
    if ctx.rank != 0:
        return
    root = Path(ctx.tmpdir)
    shutil.copytree(root / "saved" / STEP4, root / "nan_data")
    write_nan_into_tensor_data(root / "nan_data", "__1_0.distcp")
    shutil.copytree(root / "saved" / STEP4, root / "format_1")
    as_format_1(root / "format_1")
    # a commit of last.ckpt interrupted between its two renames (no renameat2): last.ckpt is missing,
    # the previous checkpoint (step 2) is under .old-, the complete new one (step 4) under .tmp-
    (root / "crashed").mkdir()
    shutil.copytree(root / "saved" / STEP2, root / "crashed" / "last.ckpt.old-0badc0de")
    shutil.copytree(root / "saved" / STEP4, root / "crashed" / "last.ckpt.tmp-0badc0de")


def _first_line_of_error(fn: Callable[[], Any]) -> Optional[str]:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return str(err).splitlines()[0]
    return None


@GROUP.case
def load_nan_data(ctx: RankContext) -> Optional[str]:
    """Resuming from a shard with NaN written into its tensor data: this rank's error, first line."""
    from lightning_helpers import fit_and_record

    return _first_line_of_error(lambda: fit_and_record("zero2", 5, ckpt_path=os.path.join(ctx.tmpdir, "nan_data")))


@GROUP.case
def load_format_1(ctx: RankContext) -> tuple[int, dict]:
    from lightning_helpers import fit_and_record

    probe = _StepAtStart()
    fit_and_record("zero2", 5, callbacks=[probe], ckpt_path=os.path.join(ctx.tmpdir, "format_1"))
    return probe.global_step, probe.weights


@GROUP.case
def resume_last_after_interrupted_commit(ctx: RankContext) -> tuple[int, dict, list[str]]:
    """`ckpt_path="last"` in the folder `damage` left: the step restored, its weights, the folder after."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import fit_and_record

    folder = os.path.join(ctx.tmpdir, "crashed")
    probe = _StepAtStart()
    # (no version counter: the step-5 save replaces last.ckpt instead of writing last-v1.ckpt)
    ckpt = ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0, every_n_train_steps=1, enable_version_counter=False)
    fit_and_record(ZeroStrategy(stage=2), 5, callbacks=[ckpt, probe], enable_checkpointing=True, ckpt_path="last")
    return probe.global_step, probe.weights, sorted(os.listdir(folder))


@GROUP.case
def full_disk(ctx: RankContext) -> tuple[Optional[str], list[str], int]:
    """A save during which rank 1's writes fail with ENOSPC: this rank's error (first line), the
    folder after the next, successful save, and the step that save holds."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem
    from lightning_helpers import fit_and_record

    _, _, trainer = fit_and_record("zero2", 1)
    folder = Path(ctx.tmpdir) / "full_disk"
    path = folder / "model.ckpt"
    real_write_item = dcp_filesystem._write_item

    def no_space(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with mock.patch.object(dcp_filesystem, "_write_item", no_space if ctx.rank == 1 else real_write_item):
        message = _first_line_of_error(lambda: trainer.save_checkpoint(path))
    trainer.save_checkpoint(path)  # the disk has room again
    listing = sorted(p.name for p in folder.iterdir())  # before rank 0's convert writes beside it
    from lightning_zero import convert_checkpoint

    step = -1
    if ctx.rank == 0:
        step = torch.load(convert_checkpoint(path, folder / "converted.pt"), weights_only=False)["global_step"]
    return message, listing, step


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("integrity")


@pytest.fixture(scope="module")
def results(root) -> GroupResults:
    return GROUP.run(root)


@pytest.fixture(scope="module")
def saved(root, results) -> Path:
    """`saved/` with the sharded checkpoints of steps 2 and 4 (a failed save fails here)."""
    results["save_two"]
    results["damage"]
    return root / "saved"


@pytest.fixture(scope="module")
def full_weights(saved, tmp_path_factory) -> dict[int, dict]:
    """Step -> the checkpoint's full weights, converted once."""
    from lightning_zero import convert_checkpoint

    out = tmp_path_factory.mktemp("full")
    return {
        step: torch.load(convert_checkpoint(saved / name, out / f"{step}.pt"), weights_only=False)["state_dict"]
        for step, name in ((2, STEP2), (4, STEP4))
    }


def _assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key].float(), expected[key].float()), key


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`lightning-zero ARGS` as the console script runs it (``main``, its exit status, its output), in
    this process: a subprocess costs seconds of imports per call (tests/test_checkpoint.py and
    tests/test_bench.py run the installed console script itself)."""
    import contextlib
    import io
    import traceback

    from lightning_zero.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(list(args))
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
        except Exception:  # noqa: BLE001 - what the console script would print before exiting 1
            traceback.print_exc()
            status = 1
    return subprocess.CompletedProcess(["lightning-zero", *args], status, out.getvalue(), err.getvalue())


# ---- same-size damage --------------------------------------------------------------------------------
def test_nan_in_tensor_data_fails_the_load_on_every_rank_alike(results, root):
    messages = results["load_nan_data"]
    assert messages[0] is not None and messages[0] == messages[1]  # every rank, one message
    assert str(root / "nan_data") in messages[0] and "__1_0.distcp fails its checksum" in messages[0]


def test_nan_in_tensor_data_is_named_by_convert_and_verify(saved, root, tmp_path):
    from lightning_zero.checkpoint import CorruptCheckpointError, convert_checkpoint

    damaged = root / "nan_data"
    with pytest.raises(CorruptCheckpointError, match=r"nan_data' is damaged: __1_0.distcp fails its checksum"):
        convert_checkpoint(damaged, tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()

    converted = _cli("convert", str(damaged), str(tmp_path / "out.ckpt"))
    assert converted.returncode == 2 and "Traceback" not in converted.stderr
    assert converted.stderr.startswith("lightning-zero convert: error: Checkpoint")
    assert "__1_0.distcp fails its checksum" in converted.stderr.splitlines()[0]

    verified = _cli("verify", str(damaged))
    assert verified.returncode == 1 and "Traceback" not in verified.stderr
    assert "__1_0.distcp fails its checksum" in verified.stderr.splitlines()[0]
    # saved before checksums, the NaN is still caught by verify: the CRC-32 of the item's zip record
    shutil.copytree(damaged, tmp_path / "nan_format_1")
    as_format_1(tmp_path / "nan_format_1")
    verified = _cli("verify", str(tmp_path / "nan_format_1"))
    assert verified.returncode == 1 and "in __1_0.distcp, the item at byte" in verified.stderr.splitlines()[0]

    good = _cli("verify", str(saved / STEP4))
    assert good.returncode == 0 and good.stdout.strip().endswith("meta.pt unpickled with weights_only=True)"), good.stderr
    assert "sizes and checksums" in good.stdout
    missing = _cli("verify", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_a_broken_zip_record_is_named_with_its_file(saved, tmp_path):
    from lightning_zero.checkpoint import CorruptCheckpointError, convert_checkpoint, verify_checkpoint

    damaged = tmp_path / "zip_flip"
    shutil.copytree(saved / STEP4, damaged)
    flip_zip_header(damaged, "__0_0.distcp")
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp fails its checksum"):
        verify_checkpoint(damaged)
    # without checksums (a format-1 checkpoint), verify checks each item's own zip CRC-32s, and DCP's
    # failure to read it is unwrapped: the file and the cause
    as_format_1(damaged)
    with pytest.raises(CorruptCheckpointError, match="damaged: in __0_0.distcp, the item at byte"):
        verify_checkpoint(damaged)
    with pytest.raises(CorruptCheckpointError) as caught:
        convert_checkpoint(damaged, tmp_path / "out.ckpt")
    first = str(caught.value).splitlines()[0]
    assert f"{str(damaged)!r} is damaged: __0_0.distcp cannot be read (" in first and "CheckpointException" not in first
    converted = _cli("convert", str(damaged), str(tmp_path / "out.ckpt"))
    assert converted.returncode == 2 and "Traceback" not in converted.stderr and "__0_0.distcp cannot be read" in converted.stderr

    # meta.pt and a single-file checkpoint: their zip records carry CRC-32s, which verify checks
    meta_flip = tmp_path / "meta_flip"
    shutil.copytree(saved / STEP4, meta_flip)
    as_format_1(meta_flip)
    with zipfile.ZipFile(meta_flip / "meta.pt") as archive:
        record = archive.infolist()[0]
    data = bytearray((meta_flip / "meta.pt").read_bytes())
    data[_data_offset(bytes(data), record) + 5] ^= 0xFF  # a byte of the first record's data
    (meta_flip / "meta.pt").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="meta.pt' is corrupted: record .* fails its checksum"):
        verify_checkpoint(meta_flip)


def test_old_manifest_without_checksums_still_loads(results, full_weights):
    for step, weights in results["load_format_1"]:
        assert step == 4
        _assert_same(weights, full_weights[4])


# ---- a full disk ---------------------------------------------------------------------------------------
def test_full_disk_is_named_with_its_cause_and_file(results, root):
    for message, listing, _ in results["full_disk"]:
        assert message is not None
        path = str(root / "full_disk" / "model.ckpt")
        assert message.startswith(f"Checkpoint {path!r} was not saved: No space left on device while writing model.ckpt.tmp-")
        assert "/__1_0.distcp (rank 1)" in message and "untouched" in message
        assert listing == ["model.ckpt"]  # the next save cleared what the failed one left
    assert results["full_disk"][0][2] == 1


class _OneRank:
    """`RankCoordination` of a single process."""

    is_global_zero, world_size = True, 1

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self, name: Optional[str] = None) -> None:
        pass


def _full_file_save(checkpointing: Any, path: Path, checkpoint: dict, write: Optional[Callable] = None) -> None:
    checkpointing.save(_OneRank(), checkpoint, path, module=None, engine=None, write_file=write or (lambda c, p: torch.save(c, p)))


def _full_file_load(path: Path) -> dict:
    from lightning_zero.checkpoint.checkpointing import ZeroCheckpointing

    return ZeroCheckpointing("full").load(path, None, None, [], True, read_file=lambda p: torch.load(p, weights_only=False))


def test_full_disk_in_the_full_format_and_in_convert(saved, tmp_path):
    from lightning_zero.checkpoint import CheckpointWriteError, convert_checkpoint
    from lightning_zero.checkpoint.checkpointing import ZeroCheckpointing

    path = tmp_path / "full.ckpt"
    _full_file_save(ZeroCheckpointing("full"), path, {"global_step": 1})

    def no_space(checkpoint: dict, target: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    with pytest.raises(CheckpointWriteError) as caught:
        _full_file_save(ZeroCheckpointing("full"), path, {"global_step": 2}, write=no_space)
    first = str(caught.value).splitlines()[0]
    assert first.startswith(f"Checkpoint {str(path)!r} was not saved: No space left on device") and "full.ckpt.tmp-" in first
    assert _full_file_load(path)["global_step"] == 1

    with mock.patch.object(torch, "save", side_effect=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))):
        with pytest.raises(CheckpointWriteError, match="out.ckpt' could not be written: No space left on device"):
            convert_checkpoint(saved / STEP2, tmp_path / "out.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.ckpt"]  # no half-written file left


# ---- a crash inside the commit ---------------------------------------------------------------------------
class _Crash(BaseException):
    """The process dies here (not an Exception: nothing may catch it and carry on)."""


@contextlib.contextmanager
def _dies_at(k: float, exchange: bool) -> Iterator[list[str]]:
    """Every filesystem change of the commit is counted; the `k`-th and all later ones raise `_Crash`
    (the process is gone). Yields the names of the operations that ran. With `exchange=False`,
    renameat2 reports a filesystem without RENAME_EXCHANGE (the fallback path)."""
    done: list[str] = []

    def counted(name: str, fn: Callable) -> Callable:
        def operation(*args: Any, **kwargs: Any) -> Any:
            if len(done) + 1 >= k:
                raise _Crash(f"killed at {name} (operation {len(done) + 1})")
            done.append(name)
            return fn(*args, **kwargs)

        return operation

    def unsupported(*args: Any) -> None:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    with contextlib.ExitStack() as stack:
        for module, name in ((os, "replace"), (os, "rename"), (os, "unlink"), (shutil, "rmtree")):
            stack.enter_context(mock.patch.object(module, name, counted(f"{module.__name__}.{name}", getattr(module, name))))
        renameat2 = counted("renameat2", atomic._renameat2) if exchange else unsupported
        stack.enter_context(mock.patch.object(atomic, "_renameat2", renameat2))
        yield done


def _exchange_supported(tmp_path: Path) -> bool:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    try:
        return atomic._exchange(tmp_path / "a", tmp_path / "b")
    finally:
        shutil.rmtree(tmp_path / "a")
        shutil.rmtree(tmp_path / "b")


class _Checkpoints:
    """Complete checkpoints of one format, each written later than the one before (by mtime)."""

    def __init__(self, kind: str, saved: Path, full_weights: dict[int, dict]) -> None:
        self.kind, self.saved, self.full_weights = kind, saved, full_weights
        self.clock = 1_700_000_000

    def write(self, target: Path, step: int) -> None:
        self.clock += 10
        if self.kind == "directory":
            shutil.copytree(self.saved / (STEP2 if step == 2 else STEP4), target)
            stamped = target / "lightning_zero.json"
        else:
            torch.save({"global_step": step, "state_dict": self.full_weights[step]}, target)
            stamped = target
        os.utime(stamped, (self.clock, self.clock))

    def write_incomplete(self, target: Path) -> None:
        """What a save killed while writing leaves."""
        if self.kind == "directory":
            shutil.copytree(self.saved / STEP4, target)
            (target / "lightning_zero.json").unlink()
        else:
            buffer = io.BytesIO()
            torch.save({"global_step": 0}, buffer)
            target.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])

    def load(self, path: Path, out: Path) -> int:
        """The step resuming from `path` restores, its weights checked. Files go through
        `ZeroCheckpointing.load` (recovery, zip checksums, reading); directories through the same
        recovery and `convert_checkpoint`, which checks every checksum and reads every tensor (the
        strategy's own directory load needs a process group: the 2-rank cases cover it)."""
        if self.kind == "file":
            loaded = _full_file_load(path)
            weights = loaded["state_dict"]
        else:
            from lightning_zero.checkpoint import convert_checkpoint

            atomic.recover(path)  # what ZeroCheckpointing.load does first, on every rank
            loaded = torch.load(convert_checkpoint(path, out), weights_only=False)  # checks every checksum
            out.unlink()
            weights = loaded["state_dict"]
        _assert_same(weights, self.full_weights[loaded["global_step"]])
        return loaded["global_step"]


@pytest.mark.parametrize("kind", ["directory", "file"])
@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "fallback"])
def test_a_crash_between_any_two_commit_operations_keeps_the_last_complete_checkpoint(kind, exchange, saved, full_weights, tmp_path):
    if exchange and not _exchange_supported(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    checkpoints = _Checkpoints(kind, saved, full_weights)
    out = tmp_path / "converted.pt"

    def prepare(folder: Path) -> tuple[Path, Path]:
        folder.mkdir()
        path = folder / "last.ckpt"
        checkpoints.write(path, 2)  # the last complete checkpoint
        checkpoints.write_incomplete(atomic.temporary_sibling(path, "dead0001"))  # a save killed earlier
        temporary = atomic.temporary_sibling(path, "feed0002")
        checkpoints.write(temporary, 4)  # the save now committing
        return path, temporary

    path, temporary = prepare(tmp_path / "uninterrupted")
    with _dies_at(float("inf"), exchange) as operations:
        atomic.commit(temporary, path)
    assert ("renameat2" in operations) == (exchange and kind == "directory")
    assert checkpoints.load(path, out) == 4 and os.listdir(path.parent) == ["last.ckpt"]

    for k in range(1, len(operations) + 1):
        path, temporary = prepare(tmp_path / f"killed_at_{k}")
        with pytest.raises(_Crash), _dies_at(k, exchange):
            atomic.commit(temporary, path)
        # restarted: the previous checkpoint until the first operation, the new one from then on
        assert checkpoints.load(path, out) == (2 if k == 1 else 4), (k, operations[k - 1], sorted(os.listdir(path.parent)))
        # and the next save commits and loads, leaving nothing else behind
        following = atomic.temporary_sibling(path, "beef0003")
        checkpoints.write(following, 2)
        atomic.commit(following, path)
        assert checkpoints.load(path, out) == 2 and os.listdir(path.parent) == ["last.ckpt"], k


def test_the_save_after_an_interrupted_commit_never_deletes_the_only_complete_checkpoint(saved, full_weights, tmp_path):
    """Fallback path, killed between its renames (no `last.ckpt`); the next save is then killed at
    each of its operations in turn: a complete checkpoint always loads, the newest one."""
    checkpoints = _Checkpoints("directory", saved, full_weights)
    out = tmp_path / "converted.pt"
    k = 1
    while True:
        folder = tmp_path / f"second_killed_at_{k}"
        folder.mkdir()
        path = folder / "last.ckpt"
        checkpoints.write(path, 4)
        first = atomic.temporary_sibling(path, "feed0002")
        checkpoints.write(first, 4)
        with pytest.raises(_Crash), _dies_at(2, exchange=False):
            atomic.commit(first, path)  # killed after `last.ckpt` -> `.old-`: no `last.ckpt`
        assert not path.exists()
        second = atomic.temporary_sibling(path, "beef0003")
        checkpoints.write(second, 2)
        with _dies_at(k, exchange=False) as operations:
            try:
                atomic.commit(second, path)
                finished = True
            except _Crash:
                finished = False
        assert checkpoints.load(path, out) == 2, (k, operations, sorted(os.listdir(folder)))  # the newest complete one
        if finished:
            break
        k += 1
    assert k > 2


def test_ckpt_path_last_resumes_from_a_commit_interrupted_between_its_renames(results, full_weights):
    for step, weights, listing in results["resume_last_after_interrupted_commit"]:
        assert step == 4  # not 0: the complete step-4 checkpoint was put back before "last" was looked up
        _assert_same(weights, full_weights[4])
        assert listing == ["last.ckpt"]  # the step-5 save replaced it and cleared the siblings


def test_a_missing_checkpoint_with_a_complete_sibling_is_hinted_at(saved, full_weights, tmp_path):
    from lightning_zero.checkpoint import verify_checkpoint

    path = tmp_path / "last.ckpt"
    _Checkpoints("directory", saved, full_weights).write(atomic.temporary_sibling(path, "feed0002"), 4)
    with pytest.raises(FileNotFoundError, match="left the complete checkpoint 'last.ckpt.tmp-feed0002'"):
        verify_checkpoint(path)


# ---- untrusted checkpoints: a pickle that runs a command as it loads ------------------------------------
class _RunsCommand:
    """What an attacker pickles: unpickling it runs a shell command, here one that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


class _Opaque:
    """A harmless object of the user's own class: not on torch's weights-only allow list."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque)


POISONED = {"meta.pt": "poisoned_meta", ".metadata": "poisoned_metadata"}
"""Each pickle of a sharded directory -> the copy of `trusted/` whose pickle runs a command."""


def replace_and_fix_manifest(directory: Path, name: str, data: bytes) -> None:
    """Replace `name`, then write its size and CRC-32 into the manifest, as an attacker would."""
    from lightning_zero.checkpoint.integrity import file_checksum

    (directory / name).write_bytes(data)
    manifest = json.loads((directory / "lightning_zero.json").read_text())
    manifest["files"][name], manifest["checksums"][name] = len(data), file_checksum(directory / name)
    (directory / "lightning_zero.json").write_text(json.dumps(manifest))


def marker_of(directory: Path) -> Path:
    return directory.parent / f"{directory.name}.ran"


def poison(trusted: Path, file: str) -> Path:
    """A copy of `trusted` whose `file` runs a command that creates `marker_of(copy)` when unpickled."""
    copy = trusted.parent / POISONED[file]
    shutil.copytree(trusted, copy)
    command = _RunsCommand(marker_of(copy))
    if file == "meta.pt":
        buffer = io.BytesIO()
        torch.save({"epoch": 0, "global_step": 2, "loops": command}, buffer)
        data = buffer.getvalue()
    else:
        data = pickle.dumps(command)  # DCP's .metadata is a plain pickle
    replace_and_fix_manifest(copy, file, data)
    return copy


class WithHyperparameters(RegressionModule):
    """Hyperparameters as Lightning holds them (`AttributeDict`), an argparse `Namespace`, a `Path`;
    a StepLR scheduler; a validation step."""

    def __init__(self, settings: Optional[dict] = None) -> None:
        super().__init__(optimizer="two_groups_steplr")
        self.save_hyperparameters()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)


def _settings() -> dict:
    from argparse import Namespace

    from lightning.pytorch.utilities import AttributeDict

    return {"run": AttributeDict(depth=2), "cli": Namespace(width=3), "data": Path("data")}


class CountsBatches(Callback):
    """A callback with state of its own: the batches it saw; `loaded`: the state it was given back."""

    def __init__(self) -> None:
        self.batches, self.loaded = 0, None

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = dict(state_dict)


def _trusted_trainer(max_steps: int, *callbacks: Callback) -> Any:
    """Validation at step 2; ModelCheckpoint (its state, no files) and EarlyStopping hold state."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning_helpers import make_trainer

    callbacks = (ModelCheckpoint(monitor="val_loss", save_top_k=0), EarlyStopping("val_loss", patience=100), *callbacks)
    return make_trainer("zero2", max_steps, callbacks=list(callbacks), enable_checkpointing=True, limit_val_batches=1, val_check_interval=2)


def _weights_only(method: Callable[..., Any]) -> dict[str, bool]:
    """``weights_only=True`` for ``method`` where it takes the flag: ``Trainer.fit`` / ``validate`` and
    ``Fabric.load`` from Lightning 2.6. Lightning 2.5's take none; the strategies then read a sharded
    directory's pickles with torch's default, which is ``weights_only=True`` from torch 2.6."""
    return {"weights_only": True} if "weights_only" in inspect.signature(method).parameters else {}


@GROUP.case
def save_trusted(ctx: RankContext) -> None:
    """A zero2 fit of 2 steps saved to `trusted/` (hyperparameters, LR scheduler, callbacks' and
    loops' state); rank 0 then makes the poisoned copies of `POISONED`."""
    from lightning_helpers import regression_data

    L.seed_everything(0, verbose=False)
    trainer = _trusted_trainer(2, CountsBatches())
    trainer.fit(WithHyperparameters(_settings()), regression_data(), regression_data(8))
    trainer.save_checkpoint(os.path.join(ctx.tmpdir, "trusted"))
    if ctx.rank == 0:
        for file in POISONED:
            poison(Path(ctx.tmpdir) / "trusted", file)


@GROUP.case
def load_poisoned(ctx: RankContext) -> dict[str, dict[str, Optional[str]]]:
    """Each poisoned copy loaded by `Trainer.fit` and `Trainer.validate` (`weights_only=True`; fit also
    with torch's default) and by `fabric.load`: the first line of each error, by poisoned file."""
    from lightning.fabric import Fabric
    from lightning_helpers import regression_data

    from lightning_zero import ZeroFabricStrategy

    def fabric_load(path: str) -> None:
        fabric = Fabric(accelerator="cpu", devices=ctx.world_size, strategy=ZeroFabricStrategy(stage=2))
        fabric.launch()
        module = WithHyperparameters()
        model, optimizer = fabric.setup(module, module.configure_optimizers()["optimizer"])
        fabric.load(path, {"model": model, "optimizer": optimizer}, **_weights_only(Fabric.load))

    fit, validate = _weights_only(L.Trainer.fit), _weights_only(L.Trainer.validate)
    out = {}
    for file, name in POISONED.items():
        path = os.path.join(ctx.tmpdir, name)
        out[file] = {
            "fit": _first_line_of_error(lambda: _trusted_trainer(3).fit(WithHyperparameters(), regression_data(), ckpt_path=path, **fit)),
            "fit, torch's default": _first_line_of_error(lambda: _trusted_trainer(3).fit(WithHyperparameters(), regression_data(), ckpt_path=path)),
            "validate": _first_line_of_error(
                lambda: _trusted_trainer(3).validate(WithHyperparameters(), regression_data(8), ckpt_path=path, **validate)
            ),
            "fabric.load": _first_line_of_error(lambda: fabric_load(path)),
        }
    return out


@GROUP.case
def resume_trusted_with_weights_only(ctx: RankContext) -> dict[str, Any]:
    """`trusted/` resumed by `Trainer.fit` and loaded by `fabric.load`, both weights-only (see `_weights_only`):
    the step, learning rates and callback state restored, and what Fabric handed back."""
    from lightning.fabric import Fabric
    from lightning_helpers import regression_data

    from lightning_zero import ZeroFabricStrategy

    path = os.path.join(ctx.tmpdir, "trusted")
    counts = CountsBatches()
    trainer = _trusted_trainer(3, counts)
    trainer.fit(WithHyperparameters(), regression_data(), regression_data(8), ckpt_path=path, **_weights_only(L.Trainer.fit))

    fabric = Fabric(accelerator="cpu", devices=ctx.world_size, strategy=ZeroFabricStrategy(stage=2))
    fabric.launch()
    module = WithHyperparameters()
    model, optimizer = fabric.setup(module, module.configure_optimizers()["optimizer"])
    rest = fabric.load(path, {"model": model, "optimizer": optimizer}, **_weights_only(Fabric.load))
    return {
        "global_step": trainer.global_step,
        "callback_state": counts.loaded,
        "early_stopping_best": trainer.early_stopping_callback.best_score.item(),
        "lrs": [group["lr"] for group in trainer.optimizers[0].param_groups],
        "fabric_hyperparameters": rest["hyper_parameters"],
        "fabric_schedulers": rest["lr_schedulers"],
    }


def test_a_poisoned_pickle_is_refused_by_the_trainer_and_fabric_and_runs_nothing(results, root):
    for file, name in POISONED.items():
        for rank_messages in results["load_poisoned"]:
            for path, message in rank_messages[file].items():
                assert message is not None and f"{str(root / name)!r} is not safe to load" in message, (path, message)
                assert f"{file}" in message and "refers to posix.system" in message, (path, message)
        assert not marker_of(root / name).exists()


def _cli_in_process(capsys: Any, *args: str) -> tuple[int, str]:
    """`lightning-zero ARGS` in this process (a subprocess costs seconds of imports): (status, stderr)."""
    from lightning_zero.cli import main

    try:
        status = main(list(args))
    except SystemExit as exit_:
        status = exit_.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize("file", POISONED)
def test_a_poisoned_pickle_is_refused_by_every_reader_of_a_directory_and_runs_nothing(results, root, file, tmp_path, capsys):
    from lightning_zero.checkpoint import (
        UntrustedCheckpointError,
        checkpoint_file,
        convert_checkpoint,
        full_checkpoint,
        verify_checkpoint,
    )

    results["save_trusted"]
    poisoned = root / POISONED[file]
    refusal = rf"{re.escape(repr(str(poisoned)))} is not safe to load: .*{re.escape(file)}.* refers to posix.system"
    hint = "weights_only=False" if file == "meta.pt" else "restore the checkpoint from a copy you trust"
    readers = {
        "convert_checkpoint": lambda: convert_checkpoint(poisoned, tmp_path / "out.ckpt"),
        "full_checkpoint": lambda: full_checkpoint(poisoned, weights_only=True),
        "checkpoint_file": lambda: checkpoint_file(poisoned, weights_only=True),
        "load_from_checkpoint": lambda: WithHyperparameters.load_from_checkpoint(poisoned, weights_only=True),
        "verify_checkpoint": lambda: verify_checkpoint(poisoned),
    }
    for reader, read in readers.items():
        with pytest.raises(UntrustedCheckpointError, match=refusal) as caught:
            read()
        assert f"HINT: {hint}" in str(caught.value) or hint in str(caught.value).split("HINT:")[1], reader
    for command, status in (("convert", 2), ("verify", 1)):
        args = (str(poisoned), str(tmp_path / "out.ckpt")) if command == "convert" else (str(poisoned),)
        code, err = _cli_in_process(capsys, command, *args)
        assert code == status and re.search(refusal, err.splitlines()[0]), (command, err)
    # with weights_only=False, verify lists meta.pt's globals beyond the allow list: it never unpickles it
    if file == "meta.pt":
        assert "names beyond the weights-only allow list: posix.system" in verify_checkpoint(poisoned, weights_only=False)
    assert not (tmp_path / "out.ckpt").exists()
    assert not marker_of(poisoned).exists()


def test_metadata_naming_a_file_outside_the_directory_is_refused_before_any_read(results, root, tmp_path):
    """An altered, well-formed `.metadata` whose first file is `../<name>`: DCP would read the file
    beside the checkpoint (here a copy of the real one, as an attacker would place it)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from lightning_zero.checkpoint import CorruptCheckpointError, checkpoint_file, convert_checkpoint, full_checkpoint

    results["save_trusted"]
    altered = tmp_path / "altered"
    shutil.copytree(root / "trusted", altered)
    metadata = FileSystemReader(str(root / "trusted")).read_metadata()  # the test's own, trusted copy
    first = sorted({info.relative_path for info in metadata.storage_data.values()})[0]
    shutil.copy(altered / first, tmp_path / first)
    for info in metadata.storage_data.values():
        if info.relative_path == first:
            info.relative_path = f"../{first}"
    replace_and_fix_manifest(altered, ".metadata", pickle.dumps(metadata))
    readers = {
        "convert_checkpoint": lambda: convert_checkpoint(altered, tmp_path / "out.ckpt"),
        "full_checkpoint": lambda: full_checkpoint(altered, weights_only=True),
        "checkpoint_file": lambda: checkpoint_file(altered, weights_only=True),
    }
    for reader, read in readers.items():
        with pytest.raises(CorruptCheckpointError, match=re.escape(f"names '../{first}', which is not a file in the checkpoint's directory")):
            read()
    assert not (tmp_path / "out.ckpt").exists()


def test_a_checkpoint_with_hyperparameters_callbacks_and_schedulers_loads_under_weights_only(results, root, tmp_path):
    from lightning_zero.checkpoint import convert_checkpoint, verify_checkpoint

    for r in results["resume_trusted_with_weights_only"]:
        assert r["global_step"] == 3
        assert r["callback_state"] == {"batches": 2}
        assert r["early_stopping_best"] < float("inf")  # its state came back (validation ran at step 2 only)
        assert r["lrs"] == pytest.approx([1e-2 * 0.5**3, 3e-2 * 0.5**3])  # StepLR: halved at steps 1, 2 and 3
        assert r["fabric_hyperparameters"] == {"settings": _settings()}  # as saved, AttributeDict and all
        assert r["fabric_schedulers"][0]["last_epoch"] == 2  # the checkpoint's own, saved at step 2
    trusted = root / "trusted"
    assert "meta.pt unpickled with weights_only=True" in verify_checkpoint(trusted)
    loaded = WithHyperparameters.load_from_checkpoint(trusted, weights_only=True)
    assert loaded.hparams.settings == _settings() and loaded.hparams.settings["run"].depth == 2  # an AttributeDict still
    converted = torch.load(convert_checkpoint(trusted, tmp_path / "out.ckpt", weights_only=True), weights_only=False)
    assert converted["hyper_parameters"]["settings"] == _settings() and converted["lr_schedulers"][0]["last_epoch"] == 2


def test_weights_only_false_reads_a_trusted_checkpoint_holding_any_object(results, root, tmp_path):
    from lightning_zero.checkpoint import UntrustedCheckpointError, convert_checkpoint, verify_checkpoint
    from lightning_zero.checkpoint.checkpointing import ZeroCheckpointing
    from lightning_zero.checkpoint.pickles import save_torch_file

    results["save_trusted"]
    own = tmp_path / "own_objects"
    shutil.copytree(root / "trusted", own)
    meta = torch.load(own / "meta.pt", weights_only=False)
    buffer = io.BytesIO()
    save_torch_file({**meta, "mine": _Opaque()}, buffer)
    replace_and_fix_manifest(own, "meta.pt", buffer.getvalue())
    with pytest.raises(UntrustedCheckpointError, match=r"meta.pt refers to test_checkpoint_integrity._Opaque.*HINT: only for a checkpoint you trust"):
        convert_checkpoint(own, tmp_path / "out.ckpt", weights_only=True)
    assert torch.load(convert_checkpoint(own, tmp_path / "out.ckpt", weights_only=False), weights_only=False)["mine"] == _Opaque()
    assert "allow list: test_checkpoint_integrity._Opaque" in verify_checkpoint(own, weights_only=False)
    # a single file too, read by the strategies through `ZeroCheckpointing.load`
    file = tmp_path / "out.ckpt"
    with pytest.raises(UntrustedCheckpointError, match=rf"{re.escape(repr(str(file)))} is not safe to load: it refers to test_checkpoint_integrity._Opaque"):
        ZeroCheckpointing("full").load(file, None, None, [], True, read_file=lambda p: torch.load(p, weights_only=True))
    assert _full_file_load(file)["mine"] == _Opaque()


# ---- every process group the strategies create, under their `timeout` -----------------------------------
TIMEOUT = timedelta(seconds=3)
GIVE_UP_S = 30.0
"""How long rank 0 waits for its all-reduces before calling a group unbounded (far above TIMEOUT)."""


def _make_every_group(ctx: RankContext) -> None:
    """Run what makes each kind of group, every strategy with ``timeout=TIMEOUT``: stage 3's
    all-gather group, hybrid sharding's shard and replicate groups, a hybrid checkpoint's mesh groups,
    the checkpoint group of training on NCCL (pretended: gloo here) — under the Trainer and Fabric."""
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from lightning_helpers import make_trainer, regression_data

    from lightning_zero import ZeroFabricStrategy

    def on_nccl() -> Any:
        return mock.patch.object(dist, "get_backend", return_value="nccl")

    stage3 = ZeroStrategy(stage=3, timeout=TIMEOUT)
    make_trainer(stage3, 1).fit(RegressionModule(), regression_data(8))
    with on_nccl():
        stage3._checkpointing.group.group
    trainer = make_trainer(ZeroStrategy(stage=3, shard_group_size=1, timeout=TIMEOUT), 1)
    trainer.fit(RegressionModule(), regression_data(8))
    trainer.save_checkpoint(os.path.join(ctx.tmpdir, "hybrid"))

    fabric = Fabric(accelerator="cpu", devices=ctx.world_size, strategy=ZeroFabricStrategy(stage=3, timeout=TIMEOUT))
    fabric.launch()
    module = RegressionModule()
    fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    with on_nccl():
        fabric.strategy._checkpointing.group.group


@GROUP.case
def stalled_peer_on_every_group(ctx: RankContext) -> dict[str, Any]:
    """The groups torch registered while `_make_every_group` ran (so a group a later change adds is
    tested too): rank 0 starts an all-reduce on each at once, rank 1 never joins (it waits for a file
    rank 0 writes when done). Last in the group: it leaves those groups broken. Rank 0: for each
    group, its ranks, the seconds until its all-reduce ended and the error."""
    import time

    import torch.distributed as dist

    registered = lambda: {g for g in dist.distributed_c10d._world.pg_map if dist.get_world_size(g) > 1}  # noqa: E731
    before = registered()
    _make_every_group(ctx)
    groups = list(registered() - before)
    done = Path(ctx.tmpdir) / "rank0_done"
    if ctx.rank == 1:
        deadline = time.monotonic() + GIVE_UP_S + 10
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"groups": len(groups)}
    start = time.monotonic()
    works = [dist.all_reduce(torch.zeros(1), group=g, async_op=True) for g in groups]
    ended: dict[int, float] = {}
    while len(ended) < len(works) and time.monotonic() - start < GIVE_UP_S:
        ended.update({i: time.monotonic() - start for i, w in enumerate(works) if i not in ended and w.is_completed()})
        time.sleep(0.05)
    outcomes = []
    for i, (group, work) in enumerate(zip(groups, works)):
        error = "still waiting" if i not in ended else _first_line_of_error(work.wait) or "finished"
        outcomes.append({"ranks": dist.get_process_group_ranks(group), "seconds": ended.get(i), "error": error})
    done.touch()
    return {"groups": len(groups), "outcomes": outcomes}


def test_a_stalled_peer_fails_its_partner_within_the_timeout_on_every_group_the_strategies_create(results):
    rank0, rank1 = results["stalled_peer_on_every_group"]
    # stage 3's gathers (Trainer, Fabric); the replicate group; the hybrid mesh's replicate
    # dimension; the checkpoint groups of training on NCCL (Trainer, Fabric)
    assert rank0["groups"] == rank1["groups"] >= 6
    for outcome in rank0["outcomes"]:
        assert "imed out" in outcome["error"], outcome  # gloo: "Timed out waiting 3000ms for recv ..."
        assert outcome["seconds"] < 3 * TIMEOUT.total_seconds(), outcome
