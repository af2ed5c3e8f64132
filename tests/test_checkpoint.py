"""Sharded checkpoint directories: resharding to other world sizes (2→1, 1→2, 2→3) with weights and
optimizer state compared element by element, conversion to one file, ModelCheckpoint's
bookkeeping, a rank killed mid-save, and damaged or mismatched checkpoints."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Optional

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from case_groups import CaseGroup, GroupResults, RankContext
from multiprocess import run_on_ranks


class _StateAtStart(Callback):
    """After a checkpoint is restored (before any step): full weights and full optimizer state."""

    def __init__(self, save_to: str = "") -> None:
        self.save_to = save_to

    def on_train_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        with strategy.summon_full_params():
            self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.optimizer = copy.deepcopy(strategy.engine.full_optimizer_state_dict(trainer.optimizers[0]))
        self.global_step = trainer.global_step
        if self.save_to:
            trainer.save_checkpoint(self.save_to)


class _LiveWeights(Callback):
    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        with trainer.strategy.summon_full_params():
            self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


# ---- saved at world size 2: one group of ranks, each case its own function --------------------------------
GROUP = CaseGroup(world_size=2)
W2_CHECKPOINT = ("w2", "epoch=0-step=3.ckpt")
"""Where `save_sharded` leaves its step-3 checkpoint, under the group's directory."""


@GROUP.case
def save_sharded(ctx: RankContext) -> dict[str, torch.Tensor]:
    """A zero3 fit of 3 steps saving a sharded checkpoint at step 3: the live full weights then."""
    import lightning_zero  # noqa: F401
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import fit_and_record

    live = _LiveWeights()
    ckpt = ModelCheckpoint(dirpath=os.path.join(ctx.tmpdir, W2_CHECKPOINT[0]), every_n_train_steps=3, save_top_k=-1)
    fit_and_record("zero3", 3, callbacks=[ckpt, live], enable_checkpointing=True)
    return live.weights


@GROUP.case
def model_checkpoint_top_k(ctx: RankContext) -> None:
    """A zero2 fit saving every step with save_top_k=1 and save_last, into `topk` (the test lists it)."""
    import lightning_zero  # noqa: F401
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import fit_and_record

    # ModelCheckpoint removes superseded directories: only the newest and last.ckpt remain
    keep = ModelCheckpoint(dirpath=os.path.join(ctx.tmpdir, "topk"), every_n_train_steps=1, save_top_k=1, save_last=True)
    fit_and_record("zero2", 3, callbacks=[keep], enable_checkpointing=True)


@GROUP.case
def mismatched_model(ctx: RankContext) -> Optional[str]:
    """Resuming `save_sharded`'s checkpoint into a model of other shapes: the error (None if none)."""
    import lightning_zero  # noqa: F401
    from lightning_helpers import fit_and_record
    from models import OddShapes

    # a checkpoint that does not fit the model fails on every rank, naming what differs
    try:
        fit_and_record(
            "zero2", 4, module_kwargs={"make_model": lambda: OddShapes(width=11)},
            ckpt_path=os.path.join(ctx.tmpdir, *W2_CHECKPOINT),
        )
    except ValueError as err:
        return str(err)
    return None


def _resume(rank: int, world_size: int, source: str, strategy: str, save_to: str) -> dict:
    import lightning_zero  # noqa: F401
    from lightning_helpers import fit_and_record

    probe = _StateAtStart(save_to)
    fit_and_record(strategy, 4, callbacks=[probe], ckpt_path=source)  # on_train_start runs before step 4
    return {"weights": probe.weights, "optimizer": probe.optimizer, "step": probe.global_step}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reshard")


@pytest.fixture(scope="module")
def results(root) -> GroupResults:
    return GROUP.run(root)


@pytest.fixture(scope="module")
def w2(root, results) -> str:
    """The sharded checkpoint saved at world size 2 (a failed save fails here, with its traceback)."""
    results["save_sharded"]
    return str(root.joinpath(*W2_CHECKPOINT))


@pytest.fixture(scope="module")
def resharded(root, w2) -> dict[str, list[dict]]:
    # each world size is its own group of ranks
    w1 = str(root / "w1.ckpt")
    out = {}
    out["2->1"] = run_on_ranks(_resume, w2, "zero2", w1, world_size=1, init_process_group=False)
    out["1->2"] = run_on_ranks(_resume, w1, "zero3", "", world_size=2, init_process_group=False)
    out["2->3"] = run_on_ranks(_resume, w2, "zero1", "", world_size=3, init_process_group=False)
    return out


def _assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key].float(), expected[key].float()), key


def test_conversion_equals_the_live_weights(results, w2, tmp_path):
    from lightning_zero import convert_checkpoint

    live = results["save_sharded"][0]
    out = convert_checkpoint(w2, tmp_path / "model.ckpt")
    converted = torch.load(out, weights_only=False)
    _assert_same(converted["state_dict"], live)
    assert "optimizer_states" not in converted and converted["global_step"] == 3
    # and Lightning reads it with no process group
    from lightning_helpers import RegressionModule

    model = RegressionModule.load_from_checkpoint(out)
    _assert_same(model.state_dict(), live)


@pytest.mark.parametrize("case", ["2->1", "1->2", "2->3"])
def test_resharded_weights_and_optimizer_state(resharded, w2, case, tmp_path):
    from lightning_zero import convert_checkpoint

    reference = torch.load(convert_checkpoint(w2, tmp_path / "full.ckpt", include_optimizer=True), weights_only=False)
    expected_optimizer = reference["optimizer_states"][0]
    for rank_result in resharded[case]:
        assert rank_result["step"] == 3
        _assert_same(rank_result["weights"], reference["state_dict"])
        state = rank_result["optimizer"]["state"]
        assert state.keys() == expected_optimizer["state"].keys()
        for index, entries in expected_optimizer["state"].items():
            for key, value in entries.items():
                assert torch.equal(state[index][key].float(), value.float()), (index, key)
        assert [g["lr"] for g in rank_result["optimizer"]["param_groups"]] == [g["lr"] for g in expected_optimizer["param_groups"]]


def test_model_checkpoint_keeps_only_what_it_should(results, root):
    results["model_checkpoint_top_k"]  # the fit that saved them finished on every rank
    topk = root / "topk"
    assert sorted(os.listdir(topk)) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert all((topk / name / "lightning_zero.json").is_file() for name in os.listdir(topk))


def test_mismatched_model_is_refused_on_every_rank(results):
    for message in results["mismatched_model"]:
        assert message is not None and "does not match the model" in message and "shapes differ" in message


# ---- faults ----------------------------------------------------------------------------------------------
def _killed_mid_save(rank: int, world_size: int, root: str) -> dict:
    import lightning_zero.checkpoint.directory as directory_module
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import fit_and_record

    real_write, calls = directory_module.write_directory, []

    def write_then_die(directory, *args, **kwargs):
        calls.append(directory)
        if len(calls) == 3 and rank == 1:  # the step-4 save: after step 2's checkpoint and last.ckpt
            os._exit(17)  # a rank lost mid-save, while rank 0 is writing its shard
        return real_write(directory, *args, **kwargs)

    directory_module.write_directory = write_then_die
    ckpt = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, save_last=True)
    fit_and_record("zero2", 4, callbacks=[ckpt], enable_checkpointing=True)
    return "finished"


AFTER_FAULT = CaseGroup(world_size=2)
"""Runs in the directory the killed save left behind."""
RESUMED_FROM = {"resume_last": "last.ckpt", "resume_step2": "epoch=0-step=2.ckpt"}
"""Case name: a checkpoint committed before the kill."""


@AFTER_FAULT.case
def uninterrupted_step2(ctx: RankContext) -> dict[str, torch.Tensor]:
    """The weights after 2 steps of a fit that nothing interrupts."""
    import lightning_zero  # noqa: F401
    from lightning_helpers import fit_and_record

    _, uninterrupted, _ = fit_and_record("zero2", 2)
    return uninterrupted[-1]


def resume_after_fault(ctx: RankContext, checkpoint: str) -> tuple[int, dict[str, torch.Tensor]]:
    """Resuming from `checkpoint`: the global step and the full weights it restores."""
    import lightning_zero  # noqa: F401
    from lightning_helpers import fit_and_record

    probe = _StateAtStart()
    fit_and_record("zero2", 4, callbacks=[probe], ckpt_path=os.path.join(ctx.tmpdir, checkpoint))
    return probe.global_step, probe.weights


for _name, _checkpoint in RESUMED_FROM.items():
    AFTER_FAULT.case(resume_after_fault, name=_name, checkpoint=_checkpoint)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    from lightning_zero.checkpoint import Manifest, is_sharded_checkpoint

    results = run_on_ranks(_killed_mid_save, str(tmp_path), world_size=2, init_process_group=False, tolerate_deaths=True, timeout=120)
    assert results[1] is None  # rank 1 died mid-save
    assert results[0] is None or "Connection" in results[0]  # rank 0 lost its peer (or was stopped waiting)
    names = sorted(os.listdir(tmp_path))
    assert "epoch=0-step=2.ckpt" in names and "last.ckpt" in names
    assert "epoch=0-step=4.ckpt" not in names  # the interrupted save never appears under its name
    leftovers = [n for n in names if ".tmp-" in n]
    assert leftovers and all(not is_sharded_checkpoint(tmp_path / n) for n in leftovers)
    with pytest.raises(ValueError, match="not a lightning-zero sharded checkpoint"):
        Manifest.read(tmp_path / leftovers[0])

    resumed = AFTER_FAULT.run(tmp_path)
    for rank, uninterrupted in enumerate(resumed["uninterrupted_step2"]):
        for name in RESUMED_FROM:
            step, weights = resumed[name][rank]
            assert step == 2
            _assert_same(weights, uninterrupted)


# ---- damaged checkpoints, in one process -------------------------------------------------------------------
def test_damaged_checkpoints_fail_clearly(w2, tmp_path):
    import shutil

    from lightning_zero import convert_checkpoint

    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_checkpoint(tmp_path / "nowhere", tmp_path / "out.ckpt")

    not_a_checkpoint = tmp_path / "empty_dir"
    not_a_checkpoint.mkdir()
    with pytest.raises(ValueError, match="no lightning_zero.json"):
        convert_checkpoint(not_a_checkpoint, tmp_path / "out.ckpt")

    truncated = tmp_path / "truncated"
    shutil.copytree(w2, truncated)
    shard = sorted(truncated.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    with pytest.raises(ValueError, match="__0_0.distcp is truncated or corrupted"):
        convert_checkpoint(truncated, tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()  # nothing half-written

    bad_manifest = tmp_path / "bad_manifest"
    shutil.copytree(w2, bad_manifest)
    (bad_manifest / "lightning_zero.json").write_text("{not json")
    with pytest.raises(ValueError, match="manifest .* is corrupted"):
        convert_checkpoint(bad_manifest, tmp_path / "out.ckpt")

    with pytest.raises(ValueError, match="overwrite its source"):
        convert_checkpoint(w2, w2)


def test_convert_command(w2, tmp_path, capsys):
    import subprocess
    import sys

    from lightning_zero.cli import main
    from lightning_zero.sizing import format_bytes

    out = tmp_path / "cli.ckpt"
    done = subprocess.run(
        [sys.executable, "-m", "lightning_zero", "convert", w2, str(out), "--with-optimizer"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "optimizer_states" in torch.load(out, weights_only=False)
    assert done.stdout == f"wrote {out} ({format_bytes(out.stat().st_size)})\n"  # a small file in KB, not "0.0 MB"
    # the refusal in this process: the command's exit status is main's return value or SystemExit's code
    try:
        status = main(["convert", str(tmp_path / "nowhere"), str(out)])
    except SystemExit as exit_info:
        status = exit_info.code
    assert status == 2 and "does not exist" in capsys.readouterr().err


def test_commit_replaces_only_when_complete_and_clears_stale_saves(tmp_path):
    from lightning_zero.checkpoint.atomic import commit, temporary_sibling

    path = tmp_path / "last.ckpt"
    path.mkdir()
    (path / "old").write_text("previous")
    stale = temporary_sibling(path, "dead0001")  # an interrupted save of the same path
    stale.mkdir()
    new = temporary_sibling(path, "live0002")
    new.mkdir()
    (new / "new").write_text("complete")
    commit(new, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert (path / "new").read_text() == "complete" and not (path / "old").exists()
