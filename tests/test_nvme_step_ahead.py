"""NVMe offload stepping during backward (issue 61): with ``offload_optimizer="nvme"`` each bucket's
state is read from its file as its gradients land, stepped on the host step's worker and written to
the other slot of its file, which ``optimizer.step()`` commits once the verdict keeps the step (see
``engine/offload/disk_step_ahead.py``).

Every 2-rank case fits the GPT through the Trainer with the state on NVMe, stepping during backward,
and compares the weights after every batch bitwise with CPU offload and with NVMe offload both
stepping after backward (``overlap_host_step=False``); ``host_step_report()`` must count steps taken
ahead (so a run that silently stepped after backward fails), and redone ones where the verdict
changes the step: stages 1-3, clipping by norm that applies on some steps and not others, loss
scaling with an inf on one rank, gradient accumulation, a sharded save and a resume mid-run, and a
disk write that fails mid-run (every rank raises, naming the file; the last checkpoint is intact).
With the parameter chunks on NVMe too the step runs after backward (bitwise the same). In one
process: a failed write leaves the state as the last committed step left it.
"""

from __future__ import annotations

import errno
import os
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from case_groups import CaseGroup, GroupResults, RankContext
from host_step_modes import StepRecorder, same_history
from test_host_step_ahead import CLIP_NORM, GradNorms, WaitForHostStep, _diffs, _fit

STEPS = 3
GROUP = CaseGroup(world_size=2, timeout=600)
STAGES = {
    1: {"stage": 1, "bucket_size_mb": 0.02},
    2: {"stage": 2, "bucket_size_mb": 0.02},
    3: {"stage": 3, "offload_params": True},
}
"""Several buckets at stages 1-2 (stage 3's are the GPT's units)."""


def _nvme(ctx: RankContext, stage: int, name: str, **extra: Any) -> dict:
    path = os.path.join(ctx.tmpdir, "nvme", f"{name}_rank{ctx.rank}")
    os.makedirs(path, exist_ok=True)
    return {**STAGES[stage], "offload_optimizer": "nvme", "nvme_path": path, **extra}


def _cpu(stage: int) -> dict:
    return {**STAGES[stage], "offload_optimizer": True}


def _compare(ahead: dict, *references: dict) -> dict:
    return {
        "diffs": [_diffs(ref["history"], ahead["history"]) for ref in references],
        "modes": ahead["modes"],
        "report": ahead["report"],
        "rollback": ahead["rollback"],
    }


# ---- stages 1-3: NVMe ahead = NVMe after backward = CPU offload after backward -------------------------


def plain(ctx: RankContext, stage: int) -> dict:
    ahead = _fit(_nvme(ctx, stage, f"plain{stage}"), True)
    after = _fit(_nvme(ctx, stage, f"plain{stage}_after"), False)
    cpu = ctx.once(("cpu", stage), lambda: _fit(_cpu(stage), False))
    return _compare(ahead, after, cpu)


for _stage in STAGES:
    GROUP.case(plain, name=f"plain_stage{_stage}", stage=_stage)


@GROUP.case
def params_on_disk(ctx: RankContext) -> dict:
    """``offload_params="nvme"``: the chunks are streamed with the state after backward."""
    on_disk = _fit(_nvme(ctx, 3, "params", offload_params="nvme"), True)
    return _compare(on_disk, ctx.once(("cpu", 3), lambda: _fit(_cpu(3), False)))


# ---- clipping by norm: applies on some steps (redone), not on others (kept) ---------------------------


@GROUP.case
def clip_norm(ctx: RankContext) -> dict:
    options = dict(steps=4, gradient_clip_val=CLIP_NORM)
    norms = GradNorms()
    cpu = _fit(_cpu(2), False, callbacks=(norms,), **options)
    ahead = _fit(_nvme(ctx, 2, "clip"), True, callbacks=(WaitForHostStep(),), **options)
    return {**_compare(ahead, cpu), "norms": norms.norms}


# ---- 16-mixed: loss scaling, rank 1's loss inf at batch 1 -------------------------------------------


@GROUP.case
def loss_scaling(ctx: RankContext) -> dict:
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugins() -> list:
        return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1))]

    options = dict(module="inf_on_rank1", steps=4)
    cpu = _fit(_cpu(2), False, plugins=plugins(), **options)
    ahead = _fit(_nvme(ctx, 2, "scaled"), True, plugins=plugins(), **options)
    return _compare(ahead, cpu)


# ---- gradient accumulation -------------------------------------------------------------------------


@GROUP.case
def accumulate(ctx: RankContext) -> dict:
    options = dict(steps=2, accumulate_grad_batches=3)
    cpu = _fit(_cpu(3), False, **options)
    ahead = _fit(_nvme(ctx, 3, "accumulate"), True, **options)
    return _compare(ahead, cpu)


# ---- a sharded checkpoint mid-run, and a resume from it ---------------------------------------------


@GROUP.case
def save_and_resume(ctx: RankContext) -> dict:
    """4 steps stepping ahead with a sharded checkpoint after step 2 (the save reads the files' current
    slots); steps 3-4 resumed from it, ahead; against CPU offload's uninterrupted run after backward.
    An epoch is 2 steps, so the resumed run sees the batches the uninterrupted one did."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    options = dict(steps=4, samples=8)
    dirpath = os.path.join(ctx.tmpdir, "nvme_save_and_resume")
    saving = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    saved = _fit(_nvme(ctx, 3, "saved"), True, callbacks=(saving,), enable_checkpointing=True, **options)
    resumed = _fit(_nvme(ctx, 3, "resumed"), True, ckpt_path=os.path.join(dirpath, "step=2.ckpt"), **options)
    cpu = _fit(_cpu(3), False, **options)
    return {
        "saved": _diffs(cpu["history"], saved["history"]),
        "resumed": _diffs(cpu["history"][2:], resumed["history"]),
        "report": resumed["report"],
        "saved_report": saved["report"],
    }


# ---- a disk write that fails mid-run -------------------------------------------------------------------


class FailWrites(Callback):
    """From step 2 on (after its checkpoint), every scratch file is open read-only: each write to it
    fails (EBADF), as a disk gone read-only would."""

    def on_train_batch_start(self, trainer, *args: Any) -> None:
        if trainer.global_step != 2:
            return
        disk = trainer.strategy.engine.disk
        for file in [b.file for state in disk.states for b in state.buckets]:
            read_only = os.open(file.path, os.O_RDONLY)
            os.dup2(read_only, file._fd)
            os.close(read_only)


def write_fails(ctx: RankContext, overlap: bool) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zero.checkpoint.verify import verify_checkpoint

    dirpath = os.path.join(ctx.tmpdir, f"write_fails_{overlap}")
    saver = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    error = "no error"
    try:
        _fit(_nvme(ctx, 2, f"write_fails_{overlap}"), overlap, steps=4, callbacks=(FailWrites(), saver), enable_checkpointing=True)
    except (OSError, RuntimeError) as err:
        chain = []
        while err is not None:
            chain.append(f"{type(err).__name__}: {err}")
            err = err.__cause__
        error = " <- ".join(chain)
    saved = sorted(os.listdir(dirpath))
    return {"error": error, "saved": saved, "verified": verify_checkpoint(os.path.join(dirpath, saved[-1]))}


GROUP.case(write_fails, name="write_fails_ahead", overlap=True)
GROUP.case(write_fails, name="write_fails_after_backward", overlap=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("nvme_ahead"))


def _bitwise(diffs: Optional[list[float]], steps: int) -> bool:
    return diffs == [0.0] * steps


@pytest.mark.parametrize("stage", list(STAGES))
def test_nvme_steps_during_backward_bitwise_like_stepping_after_it(results: GroupResults, stage: int) -> None:
    for r in results[f"plain_stage{stage}"]:
        after, cpu = r["diffs"]
        assert _bitwise(after, STEPS) and _bitwise(cpu, STEPS), r["diffs"]
        assert r["report"].ahead == STEPS and r["modes"] == ["ahead"] * STEPS
        # the Trainer keeps no rollback copy where nothing can change the step (no clipping, no hook)
        assert r["rollback"][-1] == 0


def test_parameter_chunks_on_nvme_step_after_backward_bitwise(results: GroupResults) -> None:
    for r in results["params_on_disk"]:
        assert _bitwise(r["diffs"][0], STEPS), r["diffs"]
        assert r["report"] is None and r["modes"] == [None] * STEPS


def test_clipping_redoes_the_steps_it_changes_and_keeps_the_others(results: GroupResults) -> None:
    for r in results["clip_norm"]:
        assert _bitwise(r["diffs"][0], 4), r["diffs"]
        clipped = [norm > CLIP_NORM for norm in r["norms"]]
        assert any(clipped) and not all(clipped), r["norms"]
        report = r["report"]
        assert report.ahead > 0 and report.redone > 0, (r["modes"], report.reasons)
        assert r["rollback"][-1] > 0  # the masters' copies (the state on disk needs none)


def test_loss_scaling_undoes_the_step_the_scaler_skips(results: GroupResults) -> None:
    for r in results["loss_scaling"]:
        assert _bitwise(r["diffs"][0], 4), r["diffs"]
        assert r["report"].ahead > 0, (r["modes"], r["report"].reasons)


def test_gradient_accumulation_steps_ahead_on_the_last_micro_batch(results: GroupResults) -> None:
    for r in results["accumulate"]:
        assert _bitwise(r["diffs"][0], 6), r["diffs"]
        assert r["report"].ahead == 2, (r["modes"], r["report"].reasons)


def test_a_checkpoint_mid_run_saves_and_resumes_the_committed_state(results: GroupResults) -> None:
    for r in results["save_and_resume"]:
        assert _bitwise(r["saved"], 4) and _bitwise(r["resumed"], 2), r
        assert r["saved_report"].ahead > 0 and r["report"].ahead > 0


@pytest.mark.parametrize("name", ["write_fails_ahead", "write_fails_after_backward"])
def test_a_failed_write_fails_every_rank_and_keeps_the_last_checkpoint(results: GroupResults, name: str) -> None:
    for r in results[name]:
        assert "ScratchFileError" in r["error"] and "Bad file descriptor" in r["error"], r["error"]
        assert "optimizer0-bucket" in r["error"] and "is not kept" in r["error"]
        assert r["saved"] == ["step=1.ckpt", "step=2.ckpt"]
        assert ": OK (" in r["verified"]


# ---- one process: a failed write leaves the last committed state ----------------------------------------


def _engine_run(tmp_path: Any, overlap: bool, fail_at: Optional[int] = None, steps: int = 3) -> dict:
    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.offload import scratch_files

    tmp_path.mkdir()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    config = ZeroConfig(stage=2, bucket_size_mb=0.001, offload_optimizer="nvme", nvme_path=str(tmp_path), overlap_host_step=overlap)
    engine = ZeroEngine(net, [opt], config, device=torch.device("cpu"))
    torch.manual_seed(1)
    record = StepRecorder(engine)
    states, error = [], None
    real = scratch_files.ScratchFile._write
    try:
        for step in range(steps):
            if step == fail_at:
                scratch_files.ScratchFile._write = lambda self, offset, view: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error"))
            try:  # the worker's failed write raises where the engine waits for it (backward's end) or at the step
                engine.begin_step()
                net(torch.randn(4, 16)).pow(2).mean().backward()
                engine.finish_backward()
                engine.end_step()
                opt.step()
            except (OSError, RuntimeError) as err:
                error = err
                scratch_files.ScratchFile._write = real
                break
            engine.after_optimizer_step(opt)
            opt.zero_grad()
            record.after_step(net)
            chunked = engine.optimizer_chunked_state(opt).state_dict["state"]
            states.append({i: {k: v.clone() for k, v in entry.items() if torch.is_tensor(v)} for i, entry in chunked.items()})
        if error is not None:  # what the files hold now: the state the last committed step left
            chunked = engine.optimizer_chunked_state(opt).state_dict["state"]
            states.append({i: {k: v.clone() for k, v in entry.items() if torch.is_tensor(v) and k != "step"} for i, entry in chunked.items()})
    finally:
        scratch_files.ScratchFile._write = real
        engine.close()
    return {**record.results(), "states": states, "error": error}


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failed_write_leaves_the_state_of_the_last_committed_step(tmp_path, overlap: bool, monkeypatch) -> None:
    monkeypatch.setenv("LIGHTNING_ZERO_JUDGE_HOST_STEPS_FROM_S", "inf")
    run = _engine_run(tmp_path / "a", overlap, fail_at=2)
    clean = _engine_run(tmp_path / "b", overlap)
    assert run["error"] is not None
    if overlap:
        assert run["modes"] == ["ahead", "ahead"]
    last_committed, on_disk = run["states"][1], run["states"][2]
    assert on_disk.keys() == last_committed.keys()
    for i in on_disk:  # the moments as step 2 left them, not step 3's half-written ones
        assert all(torch.equal(on_disk[i][k], last_committed[i][k]) for k in on_disk[i])
    assert same_history({"history": run["history"]}, {"history": clean["history"][:2]})
