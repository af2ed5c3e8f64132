"""NVMe offload (``offload_optimizer="nvme"``): the optimizer's state in scratch files, stepped one
bucket at a time through a few host buffers.

- Parity: bitwise equal to CPU offload (``offload_optimizer=True``), with gradient accumulation and
  norm clipping, under Fabric here (the Trainer at stages 1-3 in fp32 and bf16-mixed is
  ``test_offload.py``'s); with two param groups and an LR scheduler; with SGD's momentum (state
  the optimizer assigns rather than updates in place).
- Checkpoints: a zero3_offload_nvme checkpoint restores the saved optimizer state, resumes bitwise
  like zero3_offload, and reshards to one rank.
- Faults: `nvme_path` missing on one rank, not writable, or on a full disk fails at setup on every
  rank with what was wrong; a scratch file truncated or removed mid-run fails the step naming it,
  and the last checkpoint stays intact.
- Memory: the host holds at most ``nvme_buffer_count`` buckets' state, by the engine's report and by
  the process's peak resident memory (one process, no Trainer).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from case_groups import CaseGroup, GroupResults, RankContext

STEPS = 3
FIT = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
SMALL_BUCKETS = 0.02
"""MiB: several buckets at stages 1-2 for the test GPT (stage 3's buckets are its units)."""

GROUP = CaseGroup(world_size=2, timeout=400)


def _nvme_dir(ctx: RankContext, name: str) -> str:
    path = os.path.join(ctx.tmpdir, "nvme", name)
    os.makedirs(path, exist_ok=True)
    return path


def _strategy(ctx: RankContext, tier: Any, stage: int, name: str, **options: Any):
    from datetime import timedelta

    from lightning_zero import ZeroStrategy

    if tier == "nvme":
        options["nvme_path"] = _nvme_dir(ctx, name)
    if stage < 3:
        options.setdefault("bucket_size_mb", SMALL_BUCKETS)
    else:
        options.setdefault("offload_params", True)
    return ZeroStrategy(stage=stage, offload_optimizer=tier, timeout=timedelta(seconds=90), **options)


class _DiskProbe:
    """At the end of every batch: the engine's memory report and what the disk did."""

    def __new__(cls):
        import lightning as L

        class Probe(L.Callback):
            def __init__(self) -> None:
                self.reports: list[Any] = []
                self.io = None
                self.directory = ""

            def on_train_batch_end(self, trainer, *args) -> None:
                engine = trainer.strategy.engine
                self.reports.append(engine.memory_report())
                if engine.disk is not None:
                    self.io = copy.copy(engine.disk.io)
                    self.directory = engine.disk.directory.path

        return Probe()


def regression_fit(ctx: RankContext, tier: Any, stage: int, optimizer: str) -> dict[str, Any]:
    import warnings

    from lightning_helpers import fit_and_record

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, history, trainer = fit_and_record(
            _strategy(ctx, tier, stage, f"{optimizer}{stage}", bucket_size_mb=0.0005),
            max_steps=STEPS,
            module_kwargs={"optimizer": optimizer},
            **FIT,
        )
    lrs = [group["lr"] for group in trainer.optimizers[0].param_groups]
    return {"history": history, "lrs": lrs, "warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]}


for _tier in (True, "nvme"):
    GROUP.case(regression_fit, name=f"steplr_{_tier}", tier=_tier, stage=2, optimizer="two_groups_steplr")
    GROUP.case(regression_fit, name=f"sgd_{_tier}", tier=_tier, stage=3, optimizer="sgd_momentum")


def fabric_fit(ctx: RankContext, tier: Any) -> dict[str, Any]:
    """test_fabric's loop at zero3 with both offloads, 2 micro-batches per step, clipping by norm."""
    from test_fabric import train

    options = {"nvme_path": _nvme_dir(ctx, "fabric")} if tier == "nvme" else {}
    return train(ctx, "zero3", accumulate=2, clip="norm", offload_optimizer=tier, offload_params=True, **options)


for _tier in (True, "nvme"):
    GROUP.case(fabric_fit, name=f"fabric_{_tier}", tier=_tier)


# ---- checkpoints ------------------------------------------------------------------------------
def _checkpoint(ctx: RankContext) -> str:
    return os.path.join(ctx.tmpdir, "nvme_zero3.ckpt")


@GROUP.case
def save_nvme(ctx: RankContext) -> dict[str, Any]:
    """zero3_offload_nvme fits 2 steps and saves a sharded checkpoint after fit; what the disk did."""
    from lightning_helpers import fit_gpt

    probe = _DiskProbe()
    _, history, trainer = fit_gpt(_strategy(ctx, "nvme", 3, "save"), max_steps=2, callbacks=[probe])
    engine = trainer.strategy._state_engine  # the finished fit's: it keeps the state for a save after fit
    kept_after_fit = os.path.isdir(probe.directory)
    trainer.save_checkpoint(_checkpoint(ctx))  # reads the finished run's state from its files
    return {
        "saved": history[-1],
        "optimizer": engine.full_optimizer_state_dict(trainer.optimizers[0]),
        "path": _checkpoint(ctx),
        "report": probe.reports[-1],
        "io": probe.io,
        "staging": engine.disk.staging.allocations,
        "kept_after_fit": kept_after_fit,
        "directory": probe.directory,
    }


def resume(ctx: RankContext, tier: Any) -> dict[str, Any]:
    """Resume the checkpoint for 2 more steps: the state restored, and the weights after."""
    from test_checkpoint import _StateAtStart

    from lightning_helpers import fit_gpt

    probe = _StateAtStart()
    _, history, _ = fit_gpt(_strategy(ctx, tier, 3, f"resume{tier}"), max_steps=4, callbacks=[probe], ckpt_path=_checkpoint(ctx))
    return {"restored": probe.weights, "optimizer": probe.optimizer, "history": history}


GROUP.case(resume, name="resume_nvme", tier="nvme")
GROUP.case(resume, name="resume_cpu", tier=True)


# ---- faults -----------------------------------------------------------------------------------
def _setup_error(ctx: RankContext, **options: Any) -> str:
    from lightning_helpers import fit_and_record

    from lightning_zero import ZeroStrategy

    try:
        fit_and_record(ZeroStrategy(stage=2, offload_optimizer="nvme", **options), max_steps=1)
    except ValueError as err:
        return str(err)
    return "no error"


@GROUP.case
def path_missing_on_one_rank(ctx: RankContext) -> str:
    path = os.path.join(ctx.tmpdir, f"only_on_rank0_{ctx.rank}")
    if ctx.rank == 0:
        os.makedirs(path, exist_ok=True)
    return _setup_error(ctx, nvme_path=path)


@GROUP.case
def path_not_writable(ctx: RankContext) -> str:
    return _setup_error(ctx, nvme_path="/sys")  # root may write anywhere else


@GROUP.case
def disk_full(ctx: RankContext) -> dict[str, Any]:
    import shutil

    from lightning_helpers import RegressionModule

    from lightning_zero.engine import disk_tier

    real = shutil.disk_usage
    shutil.disk_usage = lambda path: real(path)._replace(free=1000)  # this rank's process only
    try:
        message = _setup_error(ctx, nvme_path=_nvme_dir(ctx, "full"))
    finally:
        shutil.disk_usage = real
    adam = 2 * 4  # AdamW: two fp32 moments per element of this rank's chunks
    numel = sum(p.numel() for p in RegressionModule().parameters())  # both ranks' chunks, on one disk here
    return {"message": message, "upper_bound": adam * numel, "tensors": disk_tier.STATE_TENSORS_PER_PARAM["AdamW"]}


def fault_mid_run(ctx: RankContext, fault: str) -> dict[str, Any]:
    """Each rank's first scratch file is damaged after step 2; ModelCheckpoint saves every step."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_helpers import fit_and_record

    from lightning_zero.checkpoint.verify import verify_checkpoint

    class Damage(L.Callback):
        path = ""

        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step == 2:  # after the second step's checkpoint, before the third step
                files = sorted(Path(trainer.strategy.engine.disk.directory.path).iterdir())
                Damage.path = str(files[0])
                os.truncate(files[0], 16) if fault == "truncate" else os.remove(files[0])

    dirpath = os.path.join(ctx.tmpdir, f"checkpoints_{fault}")
    saver = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)
    try:
        fit_and_record(
            _strategy(ctx, "nvme", 3, f"fault_{fault}"), max_steps=4, callbacks=[Damage(), saver], enable_checkpointing=True
        )
        error = "no error"
    except OSError as err:
        error = f"{type(err).__name__}: {err}"
    saved = sorted(os.listdir(dirpath))
    return {
        "error": error,
        "damaged": Damage.path,
        "saved": saved,
        "verified": verify_checkpoint(os.path.join(dirpath, saved[-1])),
        "scratch_left": os.path.exists(os.path.dirname(Damage.path)),
    }


GROUP.case(fault_mid_run, name="truncated", fault="truncate")
GROUP.case(fault_mid_run, name="removed", fault="remove")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("nvme"))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _optimizer_states_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["state"].keys() != b["state"].keys() or a["param_groups"] != b["param_groups"]:
        return False
    return all(_equal(a["state"][i], b["state"][i]) for i in a["state"])


def test_the_state_lives_in_the_files_while_training(results: GroupResults) -> None:
    # bitwise parity with CPU offload at every stage, fp32 and bf16-mixed: test_offload.py
    for rank in results["save_nvme"]:
        assert rank["report"].disk > 0
        io = rank["io"]
        assert io.reads > 0 and io.writes >= io.reads  # the first step writes without reading
        assert 1 <= rank["staging"] <= 4  # the buffers, allocated once (fewer with fewer buckets)
        # the scratch files outlive fit (a checkpoint saved after it reads them), and go with the process
        assert rank["kept_after_fit"] and not os.path.exists(rank["directory"])


def test_param_groups_and_an_lr_scheduler_step_as_with_cpu_offload(results: GroupResults) -> None:
    for cpu, nvme in zip(results["steplr_True"], results["steplr_nvme"]):
        assert all(_equal(a, b) for a, b in zip(cpu["history"], nvme["history"]))
        assert nvme["lrs"] == cpu["lrs"] == [1e-2 * 0.5**STEPS, 3e-2 * 0.5**STEPS]
        assert nvme["warnings"] == []  # the scheduler saw its optimizer step


def test_state_the_optimizer_assigns_reaches_the_files(results: GroupResults) -> None:
    # SGD makes its momentum buffer by assignment on the first step, then updates it in place
    for cpu, nvme in zip(results["sgd_True"], results["sgd_nvme"]):
        assert all(_equal(a, b) for a, b in zip(cpu["history"], nvme["history"]))


def test_fabric_steps_as_with_cpu_offload(results: GroupResults) -> None:
    for cpu, nvme in zip(results["fabric_True"], results["fabric_nvme"]):
        assert _equal(cpu["weights"], nvme["weights"])
        assert cpu["losses"] == nvme["losses"] and cpu["norms"] == nvme["norms"]


def test_a_checkpoint_restores_and_resumes_like_cpu_offload(results: GroupResults) -> None:
    for saved, on_disk, in_memory in zip(results["save_nvme"], results["resume_nvme"], results["resume_cpu"]):
        assert _equal(saved["saved"], on_disk["restored"])
        assert _optimizer_states_equal(saved["optimizer"], on_disk["optimizer"])
        assert _optimizer_states_equal(on_disk["optimizer"], in_memory["optimizer"])
        assert len(on_disk["history"]) == 2
        assert all(_equal(a, b) for a, b in zip(in_memory["history"], on_disk["history"]))


def test_a_saved_state_reshards_to_one_rank(results: GroupResults, tmp_path) -> None:
    """The 2-rank run's optimizer state, loaded by one rank (its chunks are now whole parameters),
    goes to the files and steps bitwise like CPU offload; ``state_dict()`` reads it back unchanged."""
    from lightning_helpers import GPTModule, token_data

    from lightning_zero.engine.config import ZeroConfig
    from lightning_zero.engine.engine import ZeroEngine

    saved = results["save_nvme"][0]
    (tokens,) = next(iter(token_data()))
    after: dict[Any, dict[str, torch.Tensor]] = {}
    for tier in (True, "nvme"):
        module = GPTModule()
        module.load_state_dict(saved["saved"])
        optimizer = module.configure_optimizers()
        options = {"nvme_path": str(tmp_path)} if tier == "nvme" else {}
        engine = ZeroEngine(module, [optimizer], ZeroConfig(stage=2, bucket_size_mb=SMALL_BUCKETS, offload_optimizer=tier, **options))
        engine.load_full_optimizer_state_dict(optimizer, copy.deepcopy(saved["optimizer"]))  # torch's load aliases `step`
        if tier == "nvme":
            assert engine.memory_report().disk > 0 and _optimizer_states_equal(engine.full_optimizer_state_dict(optimizer), saved["optimizer"])
        engine.begin_step()
        module.training_step((tokens,), 0).backward()
        engine.finish_backward()
        engine.end_step()
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        after[tier] = {k: v.clone() for k, v in engine.full_state_dict(module).items()}
        engine.close()
    assert _equal(after[True], after["nvme"])


def test_nvme_path_missing_on_one_rank_fails_setup_on_every_rank(results: GroupResults) -> None:
    rank0, rank1 = results["path_missing_on_one_rank"]
    assert "does not exist" in rank1 and "only_on_rank0_1" in rank1
    assert rank0.startswith("rank 1 of 2 failed this check:") and "only_on_rank0_1" in rank0


def test_an_unwritable_nvme_path_fails_setup(results: GroupResults) -> None:
    for message in results["path_not_writable"]:
        assert "`nvme_path='/sys'` is not writable here" in message


def test_a_full_disk_fails_setup_with_the_bytes_needed(results: GroupResults) -> None:
    for rank in results["disk_full"]:
        assert "has 1,000 bytes free, and the optimizer state of the 2 ranks on this disk needs" in rank["message"]
        needed = int(rank["message"].split("needs ")[1].split(" ")[0].replace(",", ""))
        assert rank["tensors"] == 2 and needed == rank["upper_bound"]


@pytest.mark.parametrize(("case", "says"), [("truncated", "was truncated while training"), ("removed", "was removed while training")])
def test_a_damaged_scratch_file_fails_the_step_naming_it(results: GroupResults, case: str, says: str) -> None:
    for rank in results[case]:
        assert rank["error"].startswith("ScratchFileError") and says in rank["error"]
        assert rank["damaged"] in rank["error"]
        assert rank["saved"] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]  # the last one intact:
        assert rank["verified"].endswith(")") and ": OK (" in rank["verified"]
        assert not rank["scratch_left"]  # the failed run's scratch files are removed


# ---- memory: one process, the engine alone ------------------------------------------------------
def _peak_step_growth(tier: Any, tmp_path: Path) -> tuple[list[int], Any, int]:
    """Resident memory each optimizer step adds at its peak, over what the process held before
    (VmHWM after resetting it), for a model whose Adam state dwarfs one bucket; the memory report;
    the staging buffers' size."""
    from lightning_zero.engine.config import ZeroConfig
    from lightning_zero.engine.engine import ZeroEngine
    from lightning_zero.engine.staging import return_freed_memory

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"nvme_path": str(tmp_path)} if tier == "nvme" else {}
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=2, bucket_size_mb=1, offload_optimizer=tier, **options))
    peaks = []
    for _ in range(2):
        engine.begin_step()
        model(torch.randn(4, 512)).square().mean().backward()
        engine.finish_backward()
        engine.end_step()
        return_freed_memory()  # what earlier tests freed would otherwise hide what this step allocates
        before = _resident()
        Path("/proc/self/clear_refs").write_text("5")
        optimizer.step()
        peaks.append(_peak() - before)
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()
    report = engine.memory_report()
    capacity = engine.disk.staging.capacity if engine.disk is not None else 0
    engine.close()
    return peaks, report, capacity


LAYERS = 16
"""Linear(512, 512) layers: 4.2M parameters, whose AdamW state (34 MB) is 16 buckets' worth."""


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _resident() -> int:
    return _status_kib("VmRSS")


def _peak() -> int:
    return _status_kib("VmHWM")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc to reset the peak")
def test_the_host_holds_at_most_four_buckets_of_state(tmp_path) -> None:
    nvme_growth, nvme_report, capacity = _peak_step_growth("nvme", tmp_path)
    cpu_growth, cpu_report, _ = _peak_step_growth(True, tmp_path)
    state = 2 * 4 * LAYERS * (512 * 512 + 512)  # AdamW's two fp32 moments of every parameter (one rank)
    largest_bucket_state = 2 * 4 * 2 * (512 * 512 + 512)  # a bucket (1 MiB) holds at most 2 Linears' parameters
    print(f"peak growth per step: cpu offload {cpu_growth} B, nvme {nvme_growth} B; staging 4 x {capacity} B; state {state} B")
    assert capacity <= largest_bucket_state
    # by the engine's report: the moments left host memory for the files; 4 staging buffers came instead
    assert cpu_report.host.optimizer_state - nvme_report.host.optimizer_state == state - 4 * capacity
    assert state <= nvme_report.disk <= state + 12 * 4 * 64  # each entry aligned to 64 bytes
    # measured: the resident peak of each step
    assert cpu_growth[0] >= 0.9 * state  # the control: CPU offload's first step allocates all of it
    # the first step allocates the staging buffers, and the optimizer makes each bucket's state in
    # turn (one bucket's worth at a time, freed once written); a later step may still touch staging
    # pages for the first time, and nothing else: over both steps, 4 buffers and one bucket's state
    assert sum(nvme_growth) <= 5 * capacity + 4 * 2**20 < state / 2
