"""Checkpoints on object storage, against a real S3-protocol server (moto's, on loopback, through s3fs;
``s3_server.py``), on 2 CPU ranks: the Trainer at zero2 (synchronous saves) and zero3 (``async_save``)
with ``ModelCheckpoint(every_n_train_steps=2, save_top_k=2)`` and ``last.ckpt`` in the bucket, resumed
from the bucket bitwise as from the same run's local checkpoint; Fabric's save/load; a full file;
``verify`` and ``convert`` on s3:// URLs, and a 2 -> 1 reshard from the bucket; the errors: a missing
bucket, an unreachable endpoint, the endpoint gone in the middle of a save (the previous checkpoint
intact and loadable, the leftover named by verify and removed by the next save), a protocol whose
fsspec package is missing. One-process cases on fsspec's ``memory://``."""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Iterator, Optional

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from lightning.pytorch.callbacks import Callback

pytest.importorskip("moto.server", reason="moto[server] (the `test` extra) runs the S3 server these tests write to")
pytest.importorskip("s3fs", reason="s3fs (the `test` extra) is fsspec's S3 filesystem")

from s3_server import S3Server, cut_endpoint, restore_endpoint  # noqa: E402

GROUP = CaseGroup(world_size=2, timeout=150)
BUCKET = "s3://bucket"


class _StateAtStart(Callback):
    """After a checkpoint is restored (before any step): full weights and full optimizer state."""

    def on_train_start(self, trainer, pl_module) -> None:
        with trainer.strategy.summon_full_params():
            self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.optimizer = copy.deepcopy(trainer.strategy.engine.full_optimizer_state_dict(trainer.optimizers[0]))


def _zero(stage: int, async_save: bool = False) -> Any:
    from lightning_zero import ZeroStrategy

    return ZeroStrategy(stage=stage, async_save=async_save)


def _local_files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder) for f in files)


def _trainer_case(ctx: RankContext, stage: int, async_save: bool) -> dict[str, Any]:
    """6 steps saving every 2 to the bucket (top 2 by step, and last.ckpt) and, the same steps, to a
    local folder; then two resumes from step 4, from the bucket and from the local checkpoint."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import fit_and_record

    from lightning_zero.checkpoint import verify_checkpoint

    name = f"trainer_zero{stage}_{'async' if async_save else 'sync'}"
    remote = f"{BUCKET}/{name}/checkpoints"
    local = os.path.join(ctx.tmpdir, name)
    root = os.path.join(ctx.tmpdir, f"{name}_root")  # the Trainer's own directory: must stay empty
    callbacks = [
        ModelCheckpoint(dirpath=remote, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last=True),
        ModelCheckpoint(dirpath=local, every_n_train_steps=2, save_top_k=-1),
    ]
    _, fitted, _ = fit_and_record(_zero(stage, async_save), 6, callbacks=callbacks, enable_checkpointing=True, default_root_dir=root)
    out: dict[str, Any] = {"root_files": _local_files(root) if os.path.isdir(root) else [], "fitted": [fitted[3], fitted[5]]}
    out["verified"] = verify_checkpoint(f"{remote}/epoch=0-step=6.ckpt") if ctx.rank == 0 else None
    for source, path in (("remote", f"{remote}/epoch=0-step=4.ckpt"), ("local", os.path.join(local, "epoch=0-step=4.ckpt"))):
        probe = _StateAtStart()
        _, history, _ = fit_and_record(_zero(stage), 8, callbacks=[probe], ckpt_path=path, default_root_dir=root)
        out[source] = {"weights": probe.weights, "optimizer": probe.optimizer, "history": history}
    probe = _StateAtStart()
    fit_and_record(_zero(stage), 8, callbacks=[probe], ckpt_path=f"{remote}/last.ckpt", default_root_dir=root)
    out["last_step_weights"] = probe.weights
    return out


GROUP.case(_trainer_case, name="trainer_zero2_sync", stage=2, async_save=False)
GROUP.case(_trainer_case, name="trainer_zero3_async", stage=3, async_save=True)


def _fabric_step(fabric: Any, model: Any, optimizer: Any, batch: torch.Tensor) -> None:
    _, loss = model(batch[:, :-1], batch[:, 1:])
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


@GROUP.case
def fabric_round_trips(ctx: RankContext) -> dict[str, Any]:
    """Fabric at zero2 (sync), zero3 (async) and zero3 writing one full file: train a step, save to
    the bucket, train another, load the bucket's checkpoint back: the full weights saved and loaded."""
    from fabric_loop import batches_for, fabric_for, full_weights, small_gpt

    out: dict[str, Any] = {}
    cases = (("zero2", "zero2", {}), ("zero3", "zero3", {"async_save": True}), ("zero3_full", "zero3", {"state_dict_type": "full"}))
    for label, strategy, options in cases:
        fabric = fabric_for(strategy, **options)
        with fabric.init_module(empty_init=False):
            torch.manual_seed(0)
            module = small_gpt()
        model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
        batches = batches_for(fabric.global_rank, 4)
        _fabric_step(fabric, model, optimizer, batches[0])
        url = f"{BUCKET}/fabric_{label}/state.ckpt"
        fabric.save(url, {"model": model, "optimizer": optimizer, "step": 1})
        saved = full_weights(fabric, model)
        _fabric_step(fabric, model, optimizer, batches[1])
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(url, state)
        loaded = full_weights(fabric, model)
        out[label] = {"diff": max((saved[k] - loaded[k]).abs().max().item() for k in saved), "step": state["step"]}
    return out


@GROUP.case
def full_file_in_the_bucket(ctx: RankContext) -> dict[str, Any]:
    """zero3 with state_dict_type="full": trainer.save_checkpoint to a URL (with Lightning's
    ``storage_options`` passed through), verified, read back by torch.load from the bucket, and a
    zero2 fit resumed from it."""
    from lightning_helpers import fit_and_record

    from lightning_zero import ZeroStrategy
    from lightning_zero.checkpoint import verify_checkpoint

    _, _, trainer = fit_and_record(ZeroStrategy(stage=3, state_dict_type="full"), 2)
    url = f"{BUCKET}/full/model.ckpt"
    trainer.save_checkpoint(url, storage_options={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]})
    with trainer.strategy.summon_full_params():
        weights = {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}
    import fsspec

    with fsspec.open(url, "rb") as f:
        loaded = torch.load(f, weights_only=False)["state_dict"]
    probe = _StateAtStart()
    fit_and_record(_zero(2), 3, callbacks=[probe], ckpt_path=url)
    return {
        "verified": verify_checkpoint(url) if ctx.rank == 0 else None,
        "diff": max((weights[k] - loaded[k]).abs().max().item() for k in weights),
        "resumed_diff": max((weights[k] - probe.weights[k]).abs().max().item() for k in weights),
    }


@contextlib.contextmanager
def _trying_once() -> Iterator[None]:
    """s3fs tries a request that fails to connect 5 times, sleeping 0.1 s to 0.8 s between tries
    (~2 s a request, ~3.5 s of this case's 8); a save made to fail tries it once. Only the time until
    the error changes: each try meets the same refused connection, and s3fs raises the last one's."""
    from s3fs import S3FileSystem

    tries = S3FileSystem.retries
    S3FileSystem.retries = 1
    try:
        yield
    finally:
        S3FileSystem.retries = tries


def _error(work: Any) -> Optional[str]:
    try:
        work()
    except Exception as err:  # noqa: BLE001 - the message is what is tested
        return f"{type(err).__name__}: {err}"
    return None


@GROUP.case
def errors(ctx: RankContext) -> dict[str, Any]:
    """A fitted zero2 Trainer saving where it cannot: a missing bucket, an unreachable endpoint, the
    endpoint going away after the shards were written (before meta.pt and the manifest); after each,
    what the previous checkpoint at that URL holds, and whether the ranks still save."""
    from lightning_helpers import fit_and_record

    import lightning_zero.checkpoint.storage as storage
    from lightning_zero.checkpoint import Manifest, verify_checkpoint
    from lightning_zero.checkpoint.convert import full_checkpoint

    _, _, trainer = fit_and_record(_zero(2), 2)
    out: dict[str, Any] = {}
    out["missing_bucket"] = _error(lambda: trainer.save_checkpoint("s3://no-such-bucket/run/last.ckpt"))
    dead = f"http://127.0.0.1:{_free_port()}"
    with _trying_once():
        out["unreachable"] = _error(lambda: trainer.save_checkpoint(f"{BUCKET}/errors/x.ckpt", storage_options={"endpoint_url": dead}))

    url = f"{BUCKET}/errors/last.ckpt"
    trainer.save_checkpoint(url)
    before = Manifest.read(url).content
    original = storage._write_meta_and_manifest

    def cut_then_write(*args: Any) -> None:  # rank 0, once every rank's shards are uploaded
        cut_endpoint()
        original(*args)

    storage._write_meta_and_manifest = cut_then_write
    try:
        with _trying_once():
            out["cut"] = _error(lambda: trainer.save_checkpoint(url))
    finally:
        storage._write_meta_and_manifest = original
        torch.distributed.barrier()
        restore_endpoint()
    out["intact"] = Manifest.read(url).content == before  # still the version saved before the cut
    out["loads"] = sorted(full_checkpoint(url)["state_dict"]) == sorted(trainer.lightning_module.state_dict())
    out["verify_after_cut"] = verify_checkpoint(url) if ctx.rank == 0 else None
    torch.distributed.barrier()
    trainer.save_checkpoint(url)  # the next successful save of that name removes the leftover
    out["verify_after_next_save"] = verify_checkpoint(url) if ctx.rank == 0 else None
    return out


def _free_port() -> int:
    from s3_server import free_port

    return free_port()


@GROUP.case
def missing_package(ctx: RankContext) -> dict[str, Optional[str]]:
    """A save to gs:// (gcsfs not installed) and a resume from az:// (adlfs not installed): what they
    raise. (A ModelCheckpoint at such a URL is refused by Lightning's own constructor already.)"""
    from lightning_helpers import fit_and_record

    _, _, trainer = fit_and_record(_zero(2), 1)
    return {
        "save": _error(lambda: trainer.save_checkpoint("gs://bucket/run/x.ckpt")),
        "resume": _error(lambda: fit_and_record(_zero(2), 2, ckpt_path="az://container/run/x.ckpt")),
    }


@GROUP.case
def preempted_into_the_bucket(ctx: RankContext) -> dict[str, Any]:
    """SLURM auto-requeue with ``default_root_dir`` in the bucket, zero2 with ``async_save``: SIGUSR1
    on rank 1 only, then again on both ranks after ``fit`` returned (it must not kill them); the job
    started again finds ``hpc_ckpt_1.ckpt`` in the bucket by itself and ends with the weights of an
    uninterrupted run."""
    import signal

    import lightning as L
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning_helpers import WeightRecorder
    from test_preemption import SendSignals, Setup, StepAtStart, _slurm_job

    setup = Setup(2, async_save=True)
    final = setup.reference()
    local = os.path.join(ctx.tmpdir, "preempted")
    os.makedirs(local, exist_ok=True)
    where = dict(default_root_dir=f"{BUCKET}/preempted", plugins=[SLURMEnvironment(auto_requeue=True)])
    with _slurm_job(ctx, local):
        L.seed_everything(0, verbose=False)
        preempted = setup.trainer([SendSignals(signal.SIGUSR1, {1: (2, "after")})], **where)
        exit_code: Any = "did not exit"
        try:
            setup.fit(preempted)
        except SystemExit as exit:
            exit_code = exit.code
        os.kill(os.getpid(), signal.SIGUSR1)  # a late signal, after fit returned
        L.seed_everything(1, verbose=False)
        recorder, start = WeightRecorder(), StepAtStart()
        resumed = setup.trainer([recorder, start], **where)
        setup.fit(resumed)  # no ckpt_path: Lightning finds the hpc checkpoint under SLURM
    return {
        "exit_code": exit_code,
        "stopped_at": preempted.global_step,
        "resumed_at": start.step,
        "differ": sorted(k for k in final if not torch.equal(final[k], recorder.history[-1][k])),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s3 = S3Server(str(tmp_path_factory.mktemp("s3"))).start()
    yield s3
    s3.stop()


@pytest.fixture(scope="module")
def results(server, tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("remote"))


def _versions(keys: list[str], checkpoint: str) -> set[str]:
    return {key[len(checkpoint) + 1 :].split("/")[0] for key in keys if key.startswith(checkpoint + "/v-")}


@pytest.mark.parametrize("case", ["trainer_zero2_sync", "trainer_zero3_async"])
def test_trainer_keeps_top_k_and_last_in_the_bucket_and_resumes_bitwise(results, server, case):
    out = results[case]
    keys = server.keys(f"{case}/checkpoints/")
    names = {key.split("/")[2] for key in keys}
    assert names == {"epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"}, names  # step 2 removed in the bucket
    for name in names:
        checkpoint = f"{case}/checkpoints/{name}"
        assert f"{checkpoint}/lightning_zero.json" in keys
        assert len(_versions(keys, checkpoint)) == 1, keys  # last.ckpt overwritten 3 times: one version left
    assert "OK" in out[0]["verified"] and "s3://bucket" in out[0]["verified"]
    for r in out:
        assert r["root_files"] == [], r["root_files"]  # nothing written locally
        remote, local = r["remote"], r["local"]
        for k in local["weights"]:
            assert torch.equal(remote["weights"][k], local["weights"][k]), k
        assert _state_equal(remote["optimizer"], local["optimizer"])
        assert len(remote["history"]) == 4
        for a, b in zip(remote["history"], local["history"]):
            assert all(torch.equal(a[k], b[k]) for k in a)
        step4, step6 = r["fitted"]
        assert all(torch.equal(remote["weights"][k], step4[k]) for k in step4)
        assert all(torch.equal(r["last_step_weights"][k], step6[k]) for k in step6)  # last.ckpt: its newest version
    assert not os.path.exists("s3:"), "a URL became a local folder"


def _state_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_fabric_saves_and_loads_in_the_bucket(results, server):
    for r in results["fabric_round_trips"]:
        for label in ("zero2", "zero3", "zero3_full"):
            assert r[label] == {"diff": 0.0, "step": 1}, (label, r[label])
    assert any(key.startswith("fabric_zero3/state.ckpt/v-") for key in server.keys("fabric_zero3/"))
    assert server.keys("fabric_zero3_full/") == ["fabric_zero3_full/state.ckpt"]


def test_full_file_in_the_bucket(results, server):
    for r in results["full_file_in_the_bucket"]:
        assert r["diff"] == 0.0 and r["resumed_diff"] == 0.0
    assert "a single-file checkpoint" in results["full_file_in_the_bucket"][0]["verified"]
    assert server.keys("full/") == ["full/model.ckpt"]


def test_save_errors_name_the_url_and_cause_on_every_rank(results, server):
    out = results["errors"]
    for r in out:
        assert r["missing_bucket"].startswith("CheckpointWriteError: Checkpoint 's3://no-such-bucket/run/last.ckpt' was not saved")
        assert "bucket" in r["missing_bucket"].lower() and "ranks 0, 1" in r["missing_bucket"], r["missing_bucket"]
        assert r["unreachable"].startswith("CheckpointWriteError: Checkpoint 's3://bucket/errors/x.ckpt' was not saved")
        assert "127.0.0.1" in r["unreachable"], r["unreachable"]
        assert r["cut"].startswith("CheckpointWriteError: Checkpoint 's3://bucket/errors/last.ckpt' was not saved")
        assert "meta.pt" in r["cut"] and "untouched" in r["cut"], r["cut"]
        assert r["intact"] and r["loads"]
    assert "left beside it by interrupted saves" in out[0]["verify_after_cut"], out[0]["verify_after_cut"]
    assert "interrupted" not in out[0]["verify_after_next_save"]
    keys = server.keys("errors/")
    assert len(_versions(keys, "errors/last.ckpt")) == 1, keys
    assert not [key for key in keys if key.startswith("errors/x.ckpt")]


def test_missing_bucket_is_not_created(results, server):
    import boto3

    results["errors"]  # noqa: B018 - after the save that named it
    buckets = [b["Name"] for b in boto3.client("s3", endpoint_url=server.endpoint).list_buckets()["Buckets"]]
    assert buckets == ["bucket"]


def test_missing_fsspec_package_is_named_at_setup(results):
    for package in ("gcsfs", "adlfs"):
        try:
            __import__(package)
            pytest.skip(f"{package} is installed here")
        except ImportError:
            pass
    for r in results["missing_package"]:
        assert r["save"].startswith("MissingFilesystemError: Checkpoint 'gs://bucket/run/x.ckpt' is a gs:// URL"), r["save"]
        assert "pip install gcsfs" in r["save"], r["save"]
        assert "az://container/run/x.ckpt" in r["resume"] and "adlfs" in r["resume"], r["resume"]


def test_verify_convert_and_reshard_from_the_bucket(results, server, tmp_path):
    """In this process alone (a 2 -> 1 reshard): convert the bucket's zero3 checkpoint to a file in
    the bucket, with its optimizer state; the weights equal what the 2 ranks had at that step."""
    from lightning_zero.checkpoint import convert_checkpoint, verify_checkpoint

    resumed = results["trainer_zero3_async"][0]["remote"]
    src = f"{BUCKET}/trainer_zero3_async/checkpoints/epoch=0-step=4.ckpt"
    dst = f"{BUCKET}/converted/step4.ckpt"
    convert_checkpoint(src, dst, include_optimizer=True)
    assert "a single-file checkpoint" in verify_checkpoint(dst)
    import fsspec

    with fsspec.open(dst, "rb") as f:
        converted = torch.load(f, weights_only=False)
    for k, v in resumed["weights"].items():
        assert torch.equal(converted["state_dict"][k], v), k
    assert _state_equal(converted["optimizer_states"][0]["state"], resumed["optimizer"]["state"])
    with pytest.raises(ValueError, match="would overwrite its source"):
        convert_checkpoint(src, src)


def test_a_cut_upload_never_replaces_the_object_there(server):
    """In this process, on the S3 server: a file upload that fails after one 5 MiB part went out
    (a multipart upload) is aborted; the object saved before stays, whole."""
    from lightning_zero.checkpoint import remote
    from lightning_zero.checkpoint.folders import writing_remote
    from lightning_zero.checkpoint.locations import RemoteLocation

    location = RemoteLocation(f"{BUCKET}/cut/model.ckpt", {"default_block_size": 5 << 20, "skip_instance_cache": True})
    remote.write_file(location, lambda f: f.write(b"first"))
    with pytest.raises(RuntimeError, match="cut"):
        with writing_remote(location.fs, location.path) as f:
            f.write(b"\x01" * (6 << 20))  # one part uploaded
            raise RuntimeError("cut")
    assert location.fs.cat(location.path) == b"first"
    assert server.keys("cut/") == ["cut/model.ckpt"]


def test_full_file_and_sharded_checkpoint_replace_each_other(server):
    """A full file saved where a sharded checkpoint is (the same URL) removes the sharded one once
    the file is complete, and the other way round."""
    from lightning_zero.checkpoint import remote
    from lightning_zero.checkpoint.folders import RemoteFolder
    from lightning_zero.checkpoint.locations import RemoteLocation
    from lightning_zero.checkpoint.manifest import is_sharded_checkpoint

    location = RemoteLocation(f"{BUCKET}/kinds/x.ckpt")
    fs = location.fs
    fs.pipe(location.join("v-1", "meta.pt"), b"m")
    fs.pipe(location.join("lightning_zero.json"), b'{"content": "v-1"}')
    assert is_sharded_checkpoint(location.url)
    remote.write_file(location, lambda f: f.write(b"full"))
    assert server.keys("kinds/") == ["kinds/x.ckpt"] and not is_sharded_checkpoint(location.url)
    fs.pipe(location.join("v-2", "meta.pt"), b"m")
    fs.pipe(location.join("lightning_zero.json"), b'{"content": "v-2"}')
    remote.finish_commit(RemoteFolder(location, "v-2"))
    assert server.keys("kinds/") == ["kinds/x.ckpt/lightning_zero.json", "kinds/x.ckpt/v-2/meta.pt"]


def test_cli_verify_and_convert_on_s3_urls(results, server):
    """`lightning-zero verify` and `convert` with s3:// sources and targets (the server's endpoint
    and credentials from the environment, as a user's shell would give them)."""
    import subprocess
    import sys

    src = f"{BUCKET}/trainer_zero2_sync/checkpoints/epoch=0-step=6.ckpt"
    dst = f"{BUCKET}/cli/step6.ckpt"
    command = (
        "import sys; from lightning_zero.cli import main; "
        f"main(['convert', {src!r}, {dst!r}]); main(['verify', {dst!r}]); main(['verify', {src!r}]); "
        "main(['verify', 's3://bucket/cli/missing.ckpt'])"
    )
    done = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True, timeout=120)
    import fsspec

    from lightning_zero.sizing import format_bytes

    lines = done.stdout.splitlines()
    assert lines[0] == f"wrote {dst} ({format_bytes(fsspec.filesystem('s3').size(dst))})", done.stdout + done.stderr
    assert lines[1].startswith(f"{dst}: OK (a single-file checkpoint") and lines[2].startswith(f"{src}: OK ("), lines
    assert done.returncode == 2 and "Checkpoint 's3://bucket/cli/missing.ckpt' does not exist" in done.stderr, done.stderr
    assert server.keys("cli/") == ["cli/step6.ckpt"]


def _killed_mid_write(rank: int, world_size: int) -> str:
    """zero2, a save to the bucket, then a second save of that URL during which rank 1 is killed
    (SIGKILL) as soon as it has sent its first bytes; the survivor is stopped by the harness."""
    import signal

    from lightning_helpers import fit_and_record

    from lightning_zero.checkpoint import folders

    _, _, trainer = fit_and_record(_zero(2), 2)
    url = f"{BUCKET}/killed/last.ckpt"
    trainer.save_checkpoint(url)
    if rank == 1:
        original = folders._ChecksummingStream.write

        def write(self, data: Any) -> int:
            written = original(self, data)
            os.kill(os.getpid(), signal.SIGKILL)
            return written

        folders._ChecksummingStream.write = write
    trainer.save_checkpoint(url)
    return "saved"


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(server):
    from multiprocess import run_on_ranks

    from lightning_zero.checkpoint import Manifest, verify_checkpoint
    from lightning_zero.checkpoint.convert import full_checkpoint

    outcomes = run_on_ranks(_killed_mid_write, world_size=2, init_process_group=False, timeout=120, tolerate_deaths=True)
    assert outcomes[1] is None and outcomes[0] != "saved"  # rank 1 died; rank 0 never finished that save
    url = f"{BUCKET}/killed/last.ckpt"
    keys = server.keys("killed/")
    assert len(_versions(keys, "killed/last.ckpt")) == 2, keys  # the complete one, and the cut one's files
    committed = Manifest.read(url).content
    assert f"killed/last.ckpt/{committed}/meta.pt" in keys
    assert "left beside it by interrupted saves" in verify_checkpoint(url)
    assert full_checkpoint(url)["global_step"] == 2


def test_preemption_saves_into_the_bucket_and_the_job_resumes_from_it(results, server):
    for r in results["preempted_into_the_bucket"]:
        assert r["exit_code"] is None and r["stopped_at"] == 4 and r["resumed_at"] == 4, r
        assert r["differ"] == [], r["differ"]
    names = {key.split("/")[1] for key in server.keys("preempted/")}
    assert names == {"hpc_ckpt_1.ckpt"}, names


def test_load_from_checkpoint_reads_a_sharded_checkpoint_in_the_bucket(results):
    """``LightningModule.load_from_checkpoint(url)`` in this process alone (no process group)."""
    from lightning_helpers import RegressionModule

    step6 = results["trainer_zero2_sync"][0]["fitted"][1]
    model = RegressionModule.load_from_checkpoint(f"{BUCKET}/trainer_zero2_sync/checkpoints/last.ckpt")
    state = model.state_dict()
    assert state.keys() == step6.keys() and all(torch.equal(state[k], step6[k]) for k in step6)


def test_damaged_files_in_the_bucket_are_named(results, server):
    """A copy of a checkpoint in the bucket with one shard's bytes changed (same size), then cut
    short: verify and convert name the file; its manifest was never rewritten."""
    import fsspec

    from lightning_zero.checkpoint import CorruptCheckpointError, Manifest, convert_checkpoint, verify_checkpoint

    results["trainer_zero2_sync"]  # noqa: B018 - written by that case
    fs = fsspec.filesystem("s3")
    fs.copy("bucket/trainer_zero2_sync/checkpoints/epoch=0-step=6.ckpt", "bucket/damaged/x.ckpt", recursive=True)
    url = f"{BUCKET}/damaged/x.ckpt"
    manifest = Manifest.read(url)
    shard = max((name for name in manifest.files if name.endswith(".distcp")), key=manifest.files.get)
    key = f"bucket/damaged/x.ckpt/{manifest.content}/{shard}"
    data = bytearray(fs.cat(key))
    data[len(data) // 2] ^= 0xFF
    fs.pipe(key, bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"{shard} fails its checksum"):
        verify_checkpoint(url)
    fs.pipe(key, bytes(data[:-10]))
    with pytest.raises(CorruptCheckpointError, match=f"{shard} is truncated or corrupted"):
        convert_checkpoint(url, f"{BUCKET}/damaged/out.ckpt")
    assert not fs.exists("bucket/damaged/out.ckpt")


def _resume_on_one_rank(rank: int, world_size: int, url: str) -> dict[str, Any]:
    from lightning_helpers import fit_and_record

    probe = _StateAtStart()
    fit_and_record(_zero(3), 5, callbacks=[probe], ckpt_path=url)
    return {"weights": probe.weights, "optimizer": probe.optimizer}


def test_reshard_from_the_bucket_onto_one_rank(results, server):
    """The 2-rank zero3 checkpoint in the bucket resumed by a 1-rank zero3 Trainer: the weights and
    the full optimizer state at train start equal the 2-rank resume's."""
    from multiprocess import run_on_ranks

    url = f"{BUCKET}/trainer_zero3_async/checkpoints/epoch=0-step=4.ckpt"
    two = results["trainer_zero3_async"][0]["remote"]
    (one,) = run_on_ranks(_resume_on_one_rank, url, world_size=1, init_process_group=False, timeout=120)
    assert all(torch.equal(one["weights"][k], two["weights"][k]) for k in two["weights"])
    assert _state_equal(one["optimizer"], two["optimizer"])


def _read_errors(url: str, tmp_path: Any) -> dict[str, Exception]:
    """What each reader of a checkpoint URL raises, in this process alone: a resume (the strategies'
    load), ``load_from_checkpoint``, ``checkpoint_file``, ``verify`` and ``convert``. Each starts from
    a fresh filesystem (s3fs keeps one per set of options, with the credentials it found)."""
    import s3fs
    from lightning.pytorch import LightningModule

    import lightning_zero.lightning  # noqa: F401 - load_from_checkpoint reads sharded checkpoints
    from lightning_zero.checkpoint import CheckpointReadError, checkpoint_file, convert_checkpoint, verify_checkpoint
    from lightning_zero.checkpoint.checkpointing import ZeroCheckpointing

    readers = {
        "resume": lambda: ZeroCheckpointing("sharded").load(url, torch.nn.Linear(1, 1), None, [], True, read_file=torch.load),
        "load_from_checkpoint": lambda: LightningModule.load_from_checkpoint(url),
        "checkpoint_file": lambda: checkpoint_file(url),
        "verify": lambda: verify_checkpoint(url),
        "convert": lambda: convert_checkpoint(url, tmp_path / "out.ckpt"),
    }
    errors = {}
    for name, read in readers.items():
        s3fs.S3FileSystem.clear_instance_cache()
        with pytest.raises(CheckpointReadError) as caught:
            read()
        errors[name] = caught.value
    s3fs.S3FileSystem.clear_instance_cache()  # none made without the test's credentials outlives it
    return errors


def _reset_auth(server: S3Server, after: str) -> None:
    """The moto server checks credentials from its next request on (``after="0"``), or never ("inf")."""
    import urllib.request

    request = urllib.request.Request(
        f"{server.endpoint}/moto-api/reset-auth", data=after.encode(), headers={"Content-Type": "text/plain"}, method="POST"
    )  # not a form: the server reads the body as it is
    urllib.request.urlopen(request).close()


def test_a_load_without_credentials_says_so_in_one_line(server, tmp_path, monkeypatch):
    """Reading a checkpoint in the bucket with no credentials anywhere (botocore raises before any
    request), then with credentials the server refuses (its authentication turned on): every reader
    raises one line naming the URL and the cause, as a save does, not botocore's 70-line trace."""
    import fsspec

    url = f"{BUCKET}/credentials/x.ckpt"
    fs = fsspec.filesystem("s3")
    fs.pipe("bucket/credentials/x.ckpt/v-1/meta.pt", b"m")
    fs.pipe("bucket/credentials/x.ckpt/lightning_zero.json", b'{"content": "v-1"}')

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key)
    for key in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(key, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup either
    for name, err in _read_errors(url, tmp_path).items():
        assert str(err) == (
            f"Checkpoint '{url}' could not be read: NoCredentialsError: Unable to locate credentials while looking for {_first_look(name)}."
        ), (name, str(err))
        assert err.__cause__ is None and err.__suppress_context__, name  # botocore's trace left out

    monkeypatch.undo()  # the server's test credentials, which it now refuses
    _reset_auth(server, "0")
    try:
        refused = _read_errors(url, tmp_path)
    finally:
        _reset_auth(server, "inf")
    for name, err in refused.items():
        # the server's 403 to a HEAD request has no body: "Forbidden" is all S3 says
        assert str(err) == f"Checkpoint '{url}' could not be read: PermissionError: Forbidden while looking for {_first_look(name)}.", (
            name, str(err),
        )  # fmt: skip
        assert err.__cause__ is None and err.__suppress_context__, name


def _first_look(reader: str) -> str:
    return "it" if reader == "convert" else "its lightning_zero.json"  # convert asks whether it exists first
