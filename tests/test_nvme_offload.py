"""NVMe offload (``offload_optimizer="nvme"``): the optimizer's state in scratch files, stepped one
bucket at a time through a few host buffers; with ``offload_params="nvme"`` (stage 3) the parameter
chunks in scratch files too, read in around each use.

- Parity: bitwise equal to CPU offload (``offload_optimizer=True``), with gradient accumulation and
  norm clipping, under Fabric here (the Trainer at stages 1-3 in fp32 and bf16-mixed is
  ``test_offload.py``'s); with two param groups and an LR scheduler; with SGD's momentum (state
  the optimizer assigns rather than updates in place). The parameter chunks on disk: AdamW with
  accumulation and clipping under the Trainer, no chunk in host memory between steps.
- Checkpoints: a zero3_offload_nvme checkpoint restores the saved optimizer state, resumes bitwise
  like zero3_offload, and reshards to one rank; so does it with the parameter chunks on disk, whose
  run also saves and validates after fit as CPU offload's. One rank then reads and writes the chunks
  every other way (summon with writeback, offload_to_cpu copies, ``param.data =``, weight averages).
- Faults: `nvme_path` missing on one rank, not writable, or on a full disk fails at setup on every
  rank with what was wrong (for the parameter chunks first); a scratch file (of the optimizer
  state or of the parameter chunks) truncated or removed mid-run fails the step naming it, and the
  last checkpoint stays intact.
- Memory: the host holds at most ``nvme_buffer_count`` buckets' state, by the engine's report and by
  the process's peak resident memory (one process, no Trainer); and at most ``nvme_buffer_count``
  buckets' parameter chunks while stepping, none at rest, one bucket's between steps (EMA updates,
  swaps, a full load, a write-back), with the weights of CPU offload.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from torch import nn

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


def regression_fit(ctx: RankContext, tier: Any, stage: int, optimizer: str, **options: Any) -> dict[str, Any]:
    import warnings

    from lightning_helpers import fit_and_record

    probe = _DiskProbe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, history, trainer = fit_and_record(
            _strategy(ctx, tier, stage, f"{optimizer}{stage}{options}", bucket_size_mb=0.0005, **options),
            max_steps=STEPS,
            module_kwargs={"optimizer": optimizer},
            callbacks=[probe],
            **FIT,
        )
    lrs = [group["lr"] for group in trainer.optimizers[0].param_groups]
    return {
        "history": history,
        "lrs": lrs,
        "warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)],
        "report": probe.reports[-1],
        "io": probe.io,
    }


for _tier in (True, "nvme"):
    GROUP.case(regression_fit, name=f"steplr_{_tier}", tier=_tier, stage=2, optimizer="two_groups_steplr")
    GROUP.case(regression_fit, name=f"sgd_{_tier}", tier=_tier, stage=3, optimizer="sgd_momentum")
GROUP.case(regression_fit, name="adamw_cpu", tier=True, stage=3, optimizer="adamw")
GROUP.case(regression_fit, name="adamw_params_nvme", tier="nvme", stage=3, optimizer="adamw", offload_params="nvme")


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


@GROUP.case
def save_params_nvme(ctx: RankContext) -> dict[str, Any]:
    """save_nvme's run with the parameter chunks on NVMe too; saved after fit, then validated."""
    from lightning_helpers import fit_gpt, token_data

    probe = _DiskProbe()
    module, history, trainer = fit_gpt(_strategy(ctx, "nvme", 3, "save_params", offload_params="nvme"), max_steps=2, callbacks=[probe])
    engine = trainer.strategy._state_engine
    path = os.path.join(ctx.tmpdir, "nvme_params_zero3.ckpt")
    trainer.save_checkpoint(path)
    validated = trainer.validate(module, token_data(), verbose=False)  # after fit: the chunks are read in again
    return {
        "saved": history[-1],
        "optimizer": engine.full_optimizer_state_dict(trainer.optimizers[0]),
        "reports": probe.reports,
        "io": probe.io,
        "in_memory_after_fit": sum(m.in_memory for m in engine.residency.masters_on_disk),
        "masters": len(engine.residency.masters_on_disk),
        "validated": validated,
    }


def resume(ctx: RankContext, tier: Any, **options: Any) -> dict[str, Any]:
    """Resume the checkpoint for 2 more steps: the state restored, and the weights after."""
    from lightning_helpers import fit_gpt
    from test_checkpoint import _StateAtStart

    probe = _StateAtStart()
    strategy = _strategy(ctx, tier, 3, f"resume{tier}{options}", **options)
    _, history, _ = fit_gpt(strategy, max_steps=4, callbacks=[probe], ckpt_path=_checkpoint(ctx))
    return {"restored": probe.weights, "optimizer": probe.optimizer, "history": history}


GROUP.case(resume, name="resume_nvme", tier="nvme")
GROUP.case(resume, name="resume_params_nvme", tier="nvme", offload_params="nvme")
GROUP.case(resume, name="resume_cpu", tier=True)


# ---- faults -----------------------------------------------------------------------------------
def _setup_error(ctx: RankContext, stage: int = 2, **options: Any) -> str:
    from lightning_helpers import fit_and_record

    from lightning_zero import ZeroStrategy

    try:
        fit_and_record(ZeroStrategy(stage=stage, offload_optimizer="nvme", **options), max_steps=1)
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

    from lightning_zero.engine.offload import disk_tier

    real = shutil.disk_usage
    shutil.disk_usage = lambda path: real(path)._replace(free=1000)  # this rank's process only
    try:
        message = _setup_error(ctx, nvme_path=_nvme_dir(ctx, "full"))
    finally:
        shutil.disk_usage = real
    adam = 2 * 2 * 4  # AdamW: two fp32 moments per element of this rank's chunks, in two slots (disk_tier.STATE_SLOTS)
    numel = sum(p.numel() for p in RegressionModule().parameters())  # both ranks' chunks, on one disk here
    return {"message": message, "upper_bound": adam * numel, "tensors": disk_tier.STATE_TENSORS_PER_PARAM["AdamW"]}


@GROUP.case
def disk_full_params(ctx: RankContext) -> dict[str, Any]:
    """With the parameter chunks on NVMe too, the check comes first, for their bytes."""
    import shutil

    from lightning_helpers import RegressionModule

    from lightning_zero.engine.offload.masters_on_disk import master_bytes_needed

    real = shutil.disk_usage
    shutil.disk_usage = lambda path: real(path)._replace(free=1000)
    try:
        message = _setup_error(ctx, stage=3, offload_params="nvme", nvme_path=_nvme_dir(ctx, "full_params"))
    finally:
        shutil.disk_usage = real
    return {"message": message, "chunks": master_bytes_needed(RegressionModule(), world_size=2)}


def fault_mid_run(ctx: RankContext, fault: str, prefix: str = "", **options: Any) -> dict[str, Any]:
    """Each rank's first scratch file (whose name starts with ``prefix``) is damaged after step 2;
    ModelCheckpoint saves every step."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import fit_and_record

    from lightning_zero.checkpoint.verify import verify_checkpoint

    class Damage(L.Callback):
        path = ""

        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step == 2:  # after the second step's checkpoint, before the third step
                files = sorted(f for f in Path(trainer.strategy.engine.disk.directory.path).iterdir() if f.name.startswith(prefix))
                Damage.path = str(files[0])
                os.truncate(files[0], 16) if fault == "truncate" else os.remove(files[0])

    dirpath = os.path.join(ctx.tmpdir, f"checkpoints_{fault}{prefix}")
    saver = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)
    try:
        fit_and_record(
            _strategy(ctx, "nvme", 3, f"fault_{fault}{prefix}", **options),
            max_steps=4,
            callbacks=[Damage(), saver],
            enable_checkpointing=True,
        )
        error = "no error"
    except (OSError, RuntimeError) as err:  # a failed step during backward: the worker's OSError is its cause
        while not isinstance(err, OSError) and err.__cause__ is not None:
            err = err.__cause__
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
GROUP.case(fault_mid_run, name="params_truncated", fault="truncate", prefix="params-", offload_params="nvme")
GROUP.case(fault_mid_run, name="params_removed", fault="remove", prefix="params-", offload_params="nvme")


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
        _engine_step(engine, optimizer, lambda: module.training_step((tokens,), 0))
        after[tier] = {k: v.clone() for k, v in engine.full_state_dict(module).items()}
        engine.close()
    assert _equal(after[True], after["nvme"])


def test_parameter_chunks_on_nvme_train_bitwise_like_cpu_offload(results: GroupResults) -> None:
    """offload_params="nvme": stage 3, AdamW, 2 micro-batches per step, clipping by norm."""
    for cpu, nvme in zip(results["adamw_cpu"], results["adamw_params_nvme"]):
        assert len(nvme["history"]) == len(cpu["history"]) == 2 * STEPS  # a record per micro-batch
        assert all(_equal(a, b) for a, b in zip(cpu["history"], nvme["history"]))
        # between steps no chunk is in host memory: they are in the files, with the optimizer state
        assert cpu["report"].host.parameters > 0 and nvme["report"].host.parameters == 0
        assert nvme["report"].disk > cpu["report"].host.parameters  # the chunks, and the optimizer state
        assert cpu["io"] is None and nvme["io"].reads > 0


def test_parameter_chunks_on_nvme_save_resume_and_validate_like_cpu_offload(results: GroupResults) -> None:
    for in_memory, on_disk in zip(results["save_nvme"], results["save_params_nvme"]):
        assert _equal(in_memory["saved"], on_disk["saved"])
        assert _optimizer_states_equal(in_memory["optimizer"], on_disk["optimizer"])
        assert all(report.host.parameters == 0 for report in on_disk["reports"])
        assert on_disk["masters"] > 0 and on_disk["in_memory_after_fit"] == 0
        assert on_disk["validated"] and all(v == v for v in on_disk["validated"][0].values())  # ran, finite
    for saved, cpu, nvme in zip(results["save_nvme"], results["resume_cpu"], results["resume_params_nvme"]):
        assert _equal(saved["saved"], nvme["restored"])
        assert _optimizer_states_equal(saved["optimizer"], nvme["optimizer"])
        assert len(nvme["history"]) == 2
        assert all(_equal(a, b) for a, b in zip(cpu["history"], nvme["history"]))


def test_a_full_disk_fails_setup_with_the_bytes_of_the_parameter_chunks(results: GroupResults) -> None:
    for rank in results["disk_full_params"]:
        expected = f"has 1,000 bytes free, and the parameter chunks of the 2 ranks on this disk needs {2 * rank['chunks']:,} bytes"
        assert expected in rank["message"]


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


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("truncated", "was truncated while training"),
        ("removed", "was removed while training"),
        ("params_truncated", "was truncated while training"),
        ("params_removed", "was removed while training"),
    ],
)
def test_a_damaged_scratch_file_fails_the_step_naming_it(results: GroupResults, case: str, says: str) -> None:
    for rank in results[case]:
        assert rank["error"].startswith("ScratchFileError") and says in rank["error"]
        assert os.path.basename(rank["damaged"]).startswith("params-" if case.startswith("params") else "optimizer")
        lost = "The parameter chunks in it are lost" if case.startswith("params") else "The optimizer state in it is lost"
        assert lost in rank["error"]
        assert rank["damaged"] in rank["error"]
        assert rank["saved"] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]  # the last one intact:
        assert rank["verified"].endswith(")") and ": OK (" in rank["verified"]
        assert not rank["scratch_left"]  # the failed run's scratch files are removed


# ---- memory: one process, the engine alone ------------------------------------------------------
def _in_fresh_process(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` in a new process (spawned: its heap holds nothing freed before)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result(timeout=300)


def _peak_step_growth(tier: Any, tmp_path: Path) -> tuple[list[int], Any, int]:
    """Resident memory each optimizer step adds at its peak, over what the process held before
    (VmHWM after resetting it), for a model whose Adam state dwarfs one bucket; the memory report;
    the staging buffers' size."""
    from lightning_zero.engine.config import ZeroConfig
    from lightning_zero.engine.engine import ZeroEngine
    from lightning_zero.engine.offload.staging import return_freed_memory

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the CPU control steps after backward, inside the window measured (its steps during backward
    # would allocate the state before it)
    options = {"nvme_path": str(tmp_path)} if tier == "nvme" else {"overlap_host_step": False}
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=2, bucket_size_mb=1, offload_optimizer=tier, **options))
    peaks = []
    for _ in range(2):
        _backward(engine, _linear_loss(model))
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


def _backward(engine: Any, loss: Callable[[], torch.Tensor]) -> None:
    """Forward and backward of ``loss()`` through the engine, up to the optimizer step."""
    engine.begin_step()
    loss().backward()
    engine.finish_backward()
    engine.end_step()


def _engine_step(engine: Any, optimizer: torch.optim.Optimizer, loss: Callable[[], torch.Tensor]) -> None:
    """One training step through the engine, the optimizer's included."""
    _backward(engine, loss)
    optimizer.step()
    engine.after_optimizer_step(optimizer)
    optimizer.zero_grad()


def _linear_loss(model: nn.Module) -> Callable[[], torch.Tensor]:
    return lambda: model(torch.randn(4, 512)).square().mean()


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
    # each tier in a fresh process: memory an earlier measurement (or test) freed and the allocator
    # kept resident would be reused unseen, and the control below then measured 25 of 34 MB under load
    nvme_growth, nvme_report, capacity = _in_fresh_process(_peak_step_growth, "nvme", tmp_path)
    cpu_growth, cpu_report, _ = _in_fresh_process(_peak_step_growth, True, tmp_path)
    state = 2 * 4 * LAYERS * (512 * 512 + 512)  # AdamW's two fp32 moments of every parameter (one rank)
    largest_bucket_state = 2 * 4 * 2 * (512 * 512 + 512)  # a bucket (1 MiB) holds at most 2 Linears' parameters
    print(f"peak growth per step: cpu offload {cpu_growth} B, nvme {nvme_growth} B; staging 4 x {capacity} B; state {state} B")
    assert capacity <= largest_bucket_state
    # by the engine's report: the moments left host memory for the files; 4 staging buffers came instead
    assert cpu_report.host.optimizer_state - nvme_report.host.optimizer_state == state - 4 * capacity
    assert 2 * state <= nvme_report.disk <= 2 * state + 16 * 4096  # two slots per bucket, the second page-aligned
    # measured: the resident peak of each step
    assert cpu_growth[0] >= 0.9 * state  # the control: CPU offload's first step allocates all of it
    # the first step allocates the staging buffers, and the optimizer makes each bucket's state in
    # turn (one bucket's worth at a time, freed once written); a later step may still touch staging
    # pages for the first time, and nothing else: over both steps, 4 buffers and one bucket's state
    assert sum(nvme_growth) <= 5 * capacity + 4 * 2**20 < state / 2


def test_the_host_holds_a_few_buckets_of_parameter_chunks(tmp_path, monkeypatch) -> None:
    """offload_params="nvme", one process, a meta-built model of 16 units: between steps no chunk
    is in host memory, and while stepping at most ``nvme_buffer_count`` buckets' chunks are (their
    storage, sampled at every read the engine starts)."""
    from lightning_zero.engine.config import ZeroConfig
    from lightning_zero.engine.engine import ZeroEngine
    from lightning_zero.engine.offload import masters_on_disk

    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path=str(tmp_path))
    engine = ZeroEngine(model, [optimizer], config, device=torch.device("cpu"))
    masters = engine.residency.masters_on_disk
    allocated: list[int] = []
    fetch = masters_on_disk.MasterOnDisk.fetch

    def counting_fetch(self) -> None:
        fetch(self)
        allocated.append(sum(m.master.untyped_storage().nbytes() for m in masters))

    monkeypatch.setattr(masters_on_disk.MasterOnDisk, "fetch", counting_fetch)
    at_rest = []
    for _ in range(3):
        _engine_step(engine, optimizer, _linear_loss(model))
        at_rest.append(sum(m.master.untyped_storage().nbytes() for m in masters))
    report, io = engine.memory_report(), copy.copy(engine.disk.io)
    engine.close()
    bucket = masters[0].nbytes
    print(f"chunk bytes in memory: at most {max(allocated)} of {len(masters) * bucket} while stepping, {at_rest} at rest; {io}")
    assert len(masters) == LAYERS and all(m.nbytes == bucket == 4 * (512 * 512 + 512) for m in masters)
    assert at_rest == [0, 0, 0] and report.host.parameters == 0
    assert 0 < max(allocated) <= config.nvme_buffer_count * bucket
    # per step every chunk is read for the forward, the backward and the step, and from the second
    # step on (the first makes it) each bucket's optimizer state
    assert io.reads == 3 * 3 * LAYERS + 2 * LAYERS


def _average_between_steps(params_tier: Any, tmp_path: Path, monkeypatch) -> dict[str, Any]:
    """offload_params=``params_tier``, one process, 16 units: an EMA of the weights updated after
    every step, swapped in and out, the weights loaded from a full state dict and edited inside
    ``gathered(writeback=True)``; with the chunks on disk, the bytes of chunks in memory at every
    read the engine starts during those (never during a training step, whose reads run ahead)."""
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    from lightning_zero.engine.config import ZeroConfig
    from lightning_zero.engine.engine import ZeroEngine
    from lightning_zero.engine.offload import masters_on_disk

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tmp_path.mkdir()
    config = ZeroConfig(stage=3, offload_optimizer="nvme", offload_params=params_tier, nvme_path=str(tmp_path))
    engine = ZeroEngine(model, [optimizer], config, device=torch.device("cpu"))
    masters = getattr(engine.residency, "masters_on_disk", [])
    sampling, in_memory = [False], []
    fetch = masters_on_disk.MasterOnDisk.fetch

    def counting_fetch(self) -> None:
        reads = not self.in_memory
        fetch(self)
        if sampling[0] and reads:
            in_memory.append(sum(m.master.untyped_storage().nbytes() for m in masters))

    monkeypatch.setattr(masters_on_disk.MasterOnDisk, "fetch", counting_fetch)
    ema = get_ema_multi_avg_fn(0.9)

    def between_steps(use: Callable[[], Any]) -> None:
        sampling[0] = True
        use()
        sampling[0] = False

    average = engine.average_weights()
    seen = []
    for step in range(3):
        _engine_step(engine, optimizer, _linear_loss(model))
        between_steps(lambda: average.update(torch.tensor(step), multi_avg_fn=ema))
        between_steps(average.swap)
        seen.append({k: v.clone() for k, v in engine.full_state_dict(model).items()})
        between_steps(average.swap)
    state = engine.full_state_dict(model)
    between_steps(lambda: engine.load_full_state_dict(model, {k: v * 0.5 for k, v in state.items()}))

    def edit() -> None:
        with engine.gathered(writeback=True):
            with torch.no_grad():
                model[0].weight.add_(1.0)

    between_steps(edit)
    weights = engine.full_state_dict(model)
    at_rest = sum(m.master.untyped_storage().nbytes() for m in masters)
    engine.close()
    return {
        "average": average.full_state_dict(), "swapped": seen, "weights": weights, "in_memory": in_memory,
        "at_rest": at_rest, "bucket": max((m.nbytes for m in masters), default=0), "masters": len(masters),
    }  # fmt: skip


def test_between_steps_the_chunks_on_disk_are_in_memory_one_bucket_at_a_time(tmp_path, monkeypatch) -> None:
    """EMA updates, swaps, a full load and a write-back read and write every chunk, one bucket at a
    time: with pinned masters on CUDA, each read takes a block that torch's pinned allocator keeps
    once freed, so reading all at once would pin every chunk for the rest of the process (see
    [Note: pinned blocks] in ``copy_memory.py``). The weights are CPU offload's, bit for bit."""
    in_memory = _average_between_steps(True, tmp_path / "cpu", monkeypatch)
    on_disk = _average_between_steps("nvme", tmp_path / "nvme", monkeypatch)
    bucket = on_disk["bucket"]
    print(f"chunk bytes in memory between steps: at most {max(on_disk['in_memory'])} of {on_disk['masters'] * bucket}")
    assert on_disk["masters"] == LAYERS and bucket == 4 * (512 * 512 + 512)
    # every use read every bucket once, one at a time: 3 updates, 6 swaps, the load, and the
    # write-back's gathers and its write
    assert len(on_disk["in_memory"]) == 12 * LAYERS
    assert max(on_disk["in_memory"]) == bucket and on_disk["at_rest"] == 0
    assert _equal(in_memory["average"], on_disk["average"]) and _equal(in_memory["weights"], on_disk["weights"])
    assert all(_equal(a, b) for a, b in zip(in_memory["swapped"], on_disk["swapped"]))


def _weights_between_steps(params_tier: Any, tmp_path: Path, saved: dict[str, Any]) -> dict[str, Any]:
    """One rank, stage 3, the 2-rank run's weights and optimizer state loaded (a reshard), then steps
    with every way of reading or writing the chunks between steps: an edit kept by
    ``gathered(writeback=True)``, one through ``offload_to_cpu`` copies, ``param.data = value`` at
    rest, and a weight average updated each step and swapped in and out."""
    from lightning_helpers import GPTModule, token_data

    from lightning_zero.engine.config import ZeroConfig
    from lightning_zero.engine.engine import ZeroEngine

    module = GPTModule()
    optimizer = module.configure_optimizers()
    tmp_path.mkdir()
    config = ZeroConfig(stage=3, offload_optimizer="nvme", offload_params=params_tier, nvme_path=str(tmp_path))
    engine = ZeroEngine(module, [optimizer], config, device=torch.device("cpu"))
    engine.load_full_state_dict(module, saved["saved"])
    engine.load_full_optimizer_state_dict(optimizer, copy.deepcopy(saved["optimizer"]))
    average = engine.average_weights()
    batches = iter(token_data())
    first = next(name for name, _ in module.named_parameters())
    for step in range(3):
        (tokens,) = next(batches)
        _engine_step(engine, optimizer, lambda: module.training_step((tokens,), 0))
        average.update(torch.tensor(step))
        with engine.gathered(writeback=True):
            module.get_parameter(first).data.mul_(0.5)
        with engine.gathered(writeback=True, offload_to_cpu=True):
            module.get_parameter(first).data.add_(1.0)
        module.get_parameter(first).data = torch.full_like(saved["saved"][first], 0.25)  # adopted at rest
        average.swap()
        swapped = {k: v.clone() for k, v in engine.full_state_dict(module).items()}
        average.swap()
    weights = {k: v.clone() for k, v in engine.full_state_dict(module).items()}
    at_rest = sum(m.master.untyped_storage().nbytes() for m in getattr(engine.residency, "masters_on_disk", []))
    engine.close()
    return {"weights": weights, "swapped": swapped, "average": average.full_state_dict(), "at_rest": at_rest}


def test_every_reader_and_writer_of_the_chunks_sees_what_cpu_offload_sees(results: GroupResults, tmp_path) -> None:
    saved = results["save_params_nvme"][0]
    in_memory = _weights_between_steps(True, tmp_path / "cpu", saved)
    on_disk = _weights_between_steps("nvme", tmp_path / "nvme", saved)
    for key in ("weights", "swapped", "average"):
        assert _equal(in_memory[key], on_disk[key]), key
    assert on_disk["at_rest"] == 0


def test_a_parameter_whose_chunk_lives_on_disk_reads_as_its_value_at_rest(tmp_path: Path) -> None:
    """A read at rest ([Note: reads at rest]) of a parameter whose chunk is in a file between uses:
    its bucket is read in for the read and leaves memory again."""
    from lightning_zero.engine.config import ZeroConfig
    from lightning_zero.engine.engine import ZeroEngine

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path=str(tmp_path))
    engine = ZeroEngine(model, [optimizer], config, device=torch.device("cpu"))
    masters = engine.residency.masters_on_disk
    assert masters and sum(m.master.untyped_storage().nbytes() for m in masters) == 0
    for name, p in model.named_parameters():
        assert torch.equal(p.clone(), expected[name]) and torch.equal(p.detach().view(-1), expected[name].view(-1)), name
    assert sum(m.master.untyped_storage().nbytes() for m in masters) == 0  # back on disk after each read
    engine.close()
