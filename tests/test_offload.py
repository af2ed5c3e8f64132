"""CPU offload: the same training with optimizer state (and, at stage 3, parameter chunks) in host
memory; the fused host step; the memory report by location after training and after every restore
path; no host allocation per step; checkpoints shared with the non-offloaded runs."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch.callbacks import Callback

from case_groups import CaseGroup, GroupResults, RankContext

STEPS = 4
PRECISIONS = ("32-true", "bf16-mixed")
VARIANTS = {
    # name: (not offloaded, offloaded) strategy arguments
    "stage1": ({"stage": 1}, {"stage": 1, "offload_optimizer": True}),
    "stage2": ({"stage": 2}, {"stage": 2, "offload_optimizer": True}),
    "stage3_optimizer": ({"stage": 3}, {"stage": 3, "offload_optimizer": True}),
    "stage3_all": ({"stage": 3}, {"stage": 3, "offload_optimizer": True, "offload_params": True}),
}
# the fused host step's documented bound against the user's unfused kernel, on the first step
# (float rounding; later steps drift further, as with any change of kernel, see host_step.py)
FIRST_STEP_TOLERANCE = 1e-6

FUSED = {"fused_host_step": True}  # torch's fused CPU kernel: float rounding from DDP, not its bits
CHECKPOINTS = {
    # label: the strategy that saves it (ZeroStrategy arguments, or a registered name)
    "offloaded_full": {"stage": 3, "offload_optimizer": True, "offload_params": True, "state_dict_type": "full"},
    "offloaded_sharded": {"stage": 3, "offload_optimizer": True, "offload_params": True},
    "plain_sharded": "zero3",
}
RESUMES = {
    # name: (strategy arguments, checkpoint it resumes from)
    "zero2_from_offloaded_full": ({"stage": 2}, "offloaded_full"),
    "zero3_from_offloaded_sharded": ({"stage": 3}, "offloaded_sharded"),
    "zero2_from_offloaded_sharded": ({"stage": 2}, "offloaded_sharded"),
    "zero2_offload_from_plain_sharded": ({"stage": 2, "offload_optimizer": True}, "plain_sharded"),
    "zero3_offload_from_plain_sharded": ({"stage": 3, "offload_optimizer": True, "offload_params": True}, "plain_sharded"),
    "zero1_offload_from_offloaded_full": ({"stage": 1, "offload_optimizer": True}, "offloaded_full"),
    "zero3_offload_from_offloaded_full": ({"stage": 3, "offload_optimizer": True, "offload_params": True}, "offloaded_full"),
    # the fused host step after a restore (its arithmetic differs from DDP's: placement and kernel only)
    "zero3_offload_fused_from_offloaded_sharded": ({"stage": 3, "offload_optimizer": True, "offload_params": True, **FUSED}, "offloaded_sharded"),
}


class _Placement(Callback):
    """Where the engine keeps things, at the start of every batch (so also right after a restore)
    and at the end of the last one."""

    def __init__(self) -> None:
        self.at_start: list[dict] = []
        self.report = None

    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        self.at_start.append(_placement(trainer.strategy))

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.report = trainer.strategy.memory_report()


def _placement(strategy) -> dict:
    engine = strategy.engine
    buckets = engine.residency.buckets_with_host
    masters = {b.host.master.untyped_storage().data_ptr() for b in buckets}
    in_buckets = [p for b in buckets for p in b.params]
    return {
        "report": strategy.memory_report(),
        "host_allocations": engine.host_allocations,
        "shards_in_host_buffers": all(p.shard.untyped_storage().data_ptr() in masters for p in in_buckets),
        "fused": [g.get("fused") for opt in engine.optimizers for g in opt.param_groups],
        "reported_fused": [g.get("fused") for opt in engine.optimizers for g in opt.state_dict()["param_groups"]],
    }


GROUP = CaseGroup(world_size=2)


def offloaded_training(ctx: RankContext, label: str, precision: str) -> dict:
    """The offloaded variant and its not-offloaded twin fitted alike (clipping, two micro-batches
    per step): per-step weight differences against the twin with AdamW's default kernel (the
    default ``fused_host_step=False``), the same with ``fused_host_step=True`` against the twin
    with AdamW's default kernel and with its fused one, and where things were kept."""
    import lightning_zero
    from lightning_helpers import fit_gpt, max_abs_diff

    plain, offloaded = VARIANTS[label]
    extra = dict(precision=precision, gradient_clip_val=0.5, accumulate_grad_batches=2)

    def history(strategy_args: dict, fused_adamw: bool = False, callbacks=()) -> list:
        module_kwargs = {"fused_adamw": fused_adamw}
        strategy = lightning_zero.ZeroStrategy(**strategy_args)
        return fit_gpt(strategy, STEPS, module_kwargs=module_kwargs, callbacks=list(callbacks), **extra)[1]

    def diffs(a: list, b: list) -> list:  # after each micro-batch (two per step)
        return [max_abs_diff(x, y) for x, y in zip(a, b)] if len(a) == len(b) == 2 * STEPS else []

    # stage 3's two offload variants share their not-offloaded twins: fitted once per precision
    key = (tuple(sorted(plain.items())), precision)
    reference = ctx.once(("plain",) + key, lambda: history(plain))
    placement = _Placement()
    fused = history({**offloaded, **FUSED}, callbacks=[placement])
    exact = history(offloaded)  # the default: the user's kernel
    # Lightning refuses to clip a user's fused optimizer under mixed precision (it may unscale
    # internally), so the user-fused twin runs in fp32 only; the engine's switch is not refused
    fused_twin = precision == "32-true"
    fused_reference = ctx.once(("plain fused",) + key, lambda: history(plain, fused_adamw=True)) if fused_twin else None
    # NVMe offload (tests/test_nvme_offload.py) steps the same bits; small buckets, so that it streams several
    on_disk = None
    if precision == "32-true" or label == "stage3_all":
        nvme_path = os.path.join(ctx.tmpdir, f"nvme_{label}_{precision}")
        os.makedirs(nvme_path, exist_ok=True)
        on_disk = history({**offloaded, "offload_optimizer": "nvme", "nvme_path": nvme_path, "bucket_size_mb": 0.02})
    return {
        "nvme_vs_offloaded": diffs(exact, on_disk) if on_disk is not None else None,
        "fused_vs_plain": diffs(reference, fused),
        "fused_vs_fused_adamw": diffs(fused_reference, fused) if fused_twin else None,
        "exact_vs_plain": diffs(reference, exact),
        "placement": placement.at_start,
        "report": placement.report,
    }


for _label in VARIANTS:
    for _precision in PRECISIONS:
        GROUP.case(offloaded_training, name=f"train_{_label}_{_precision}", label=_label, precision=_precision)


# checkpoints: saved offloaded, resumed without; saved without, resumed offloaded. The
# reference is DDP resumed from the same state in its own (full) format.


def _last_checkpoint(ctx: RankContext, label: str) -> str:
    return os.path.join(ctx.tmpdir, label, "last.ckpt")


def save_checkpoint(ctx: RankContext, label: str) -> None:
    """Two steps under `CHECKPOINTS[label]`, saved as `<tmpdir>/<label>/last.ckpt` for the resumes."""
    import lightning_zero
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_helpers import fit_gpt

    strategy = CHECKPOINTS[label]
    if isinstance(strategy, dict):
        strategy = lightning_zero.ZeroStrategy(**strategy)
    dirpath = os.path.dirname(_last_checkpoint(ctx, label))
    fit_gpt(strategy, 2, callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True)], enable_checkpointing=True)


for _label in CHECKPOINTS:
    GROUP.case(save_checkpoint, name=f"save_{_label}", label=_label)


@GROUP.case
def resume_reference(ctx: RankContext) -> None:
    """DDP resumed from the offloaded full checkpoint: the history every resume is compared with."""
    from lightning_helpers import fit_gpt

    _, ctx.kept["resume_reference"], _ = fit_gpt("ddp", 4, ckpt_path=_last_checkpoint(ctx, "offloaded_full"))


def resume(ctx: RankContext, resume_name: str) -> dict:
    """A resume: per-step differences from the DDP reference, and where things were kept right
    after the restore. Lightning's move-of-optimizer-state-to-the-device is watched: it must not
    be handed an offloaded optimizer."""
    from unittest import mock

    import lightning.pytorch.strategies.strategy as lightning_strategy
    import lightning_zero
    from lightning_helpers import fit_gpt, max_abs_diff

    strategy_args, source = RESUMES[resume_name]
    placement = _Placement()
    moved = []
    original = lightning_strategy._optimizer_to_device

    def watched(optimizer, device):
        moved.append(str(device))
        return original(optimizer, device)

    with mock.patch.object(lightning_strategy, "_optimizer_to_device", watched):
        _, history, _ = fit_gpt(
            lightning_zero.ZeroStrategy(**strategy_args), 4, callbacks=[placement], ckpt_path=_last_checkpoint(ctx, source)
        )
    return {
        "diffs": [max_abs_diff(a, b) for a, b in zip(ctx.kept["resume_reference"], history)],
        "placement": placement.at_start[0],
        "moved_to_device": moved,
    }


for _name in RESUMES:
    GROUP.case(resume, name=f"resume_{_name}", resume_name=_name)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("offload"))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("label", list(VARIANTS))
def test_offloaded_training_matches(results, label, precision):
    for r in results[f"train_{label}_{precision}"]:
        # the offloaded path (buffers, copies, casts) changes no arithmetic: bitwise with the same kernel
        assert r["exact_vs_plain"] == [0.0] * 2 * STEPS, r["exact_vs_plain"]
        if precision == "32-true":
            assert r["fused_vs_fused_adamw"] == [0.0] * 2 * STEPS, r["fused_vs_fused_adamw"]
        # the fused host step against AdamW's default kernel: float rounding after the first step
        first_step = r["fused_vs_plain"][:2]
        assert len(first_step) == 2 and max(first_step) <= FIRST_STEP_TOLERANCE, r["fused_vs_plain"]
        if precision == "32-true" or label == "stage3_all":  # the optimizer's state in files instead: the same bits
            assert r["nvme_vs_offloaded"] == [0.0] * 2 * STEPS, r["nvme_vs_offloaded"]


@pytest.mark.parametrize("label", list(VARIANTS))
def test_no_host_allocation_after_the_first_step(results, label):
    for r in results[f"train_{label}_32-true"]:
        allocations = [p["host_allocations"] for p in r["placement"]]
        assert allocations[0] > 0  # the buckets' host buffers exist from setup on
        # batch 0 and 1 make the first step (the second micro-batch lands in the landing buffer)
        assert len(set(allocations[2:])) == 1, allocations


@pytest.mark.parametrize("label", list(VARIANTS))
def test_fused_host_step_is_the_engines_choice(results, label):
    for r in results[f"train_{label}_32-true"]:
        for placement in r["placement"]:
            assert placement["fused"] == [True] and placement["reported_fused"] == [None]


def test_location_report(results):
    reports = {label: results[f"train_{label}_32-true"][0]["report"] for label in VARIANTS}
    for label in ("stage1", "stage2", "stage3_optimizer"):
        report = reports[label]
        assert report.device.optimizer_state == 0 and report.host.optimizer_state > 0
        assert report.host.gradients > 0  # gradient chunks are stepped on the host
    assert reports["stage3_optimizer"].device.parameters > 0  # chunks kept on the device to gather from
    all_offloaded = reports["stage3_all"]
    assert all_offloaded.device.parameters == 0 and all_offloaded.host.parameters > 0
    assert all_offloaded.device.optimizer_state == 0 and all_offloaded.device.gradients == 0


@pytest.mark.parametrize("name", [name for name, (args, _) in RESUMES.items() if "fused" not in name])
def test_checkpoints_cross_offload(results, name):
    for r in results[f"resume_{name}"]:
        assert r["diffs"] == [0.0, 0.0]  # steps 3 and 4, after resuming at step 2


@pytest.mark.parametrize("name", [name for name, (args, _) in RESUMES.items() if args.get("offload_optimizer")])
def test_offloaded_state_stays_on_the_host_after_restore(results, name):
    for r in results[f"resume_{name}"]:
        placement = r["placement"]  # at the first batch after the restore
        report = placement["report"]
        assert report.device.optimizer_state == 0 and report.host.optimizer_state > 0, report
        assert placement["shards_in_host_buffers"]
        assert r["moved_to_device"] == []  # no restore path hands offloaded state to Lightning's mover
        switched = RESUMES[name][0].get("fused_host_step", False)
        assert placement["fused"] == [True if switched else None]  # loading keeps the engine's kernel
        assert placement["reported_fused"] == [None]  # and state_dict reports the user's


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_params_refused_below_stage3(stage):
    import lightning_zero

    with pytest.raises(ValueError, match="needs stage 3"):
        lightning_zero.ZeroStrategy(stage=stage, offload_optimizer=True, offload_params=True)


def test_offload_params_needs_offload_optimizer():
    import lightning_zero

    with pytest.raises(ValueError, match="needs `offload_optimizer=True`"):
        lightning_zero.ZeroStrategy(stage=3, offload_params=True)


def _run_script(rank: int, world_size: int, script: str, args: list[str]) -> None:
    """``python SCRIPT ARGS`` in this rank: the script run as ``__main__`` with that command line.

    ``OMP_NUM_THREADS`` is set to the rank server's thread count (1), which the offloaded step then
    keeps: the offloaded run would otherwise set the cores ÷ ranks (2 here) while the plain one steps
    with the rank's 1, and torch's fused CPU Adam rounds its vectorised body and scalar tail
    differently, so its bits depend on how the elements are split among threads (seen with torch 2.6)."""
    import os
    import runpy
    import sys

    import torch

    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def test_one_device_script(tmp_path):
    """scripts/offload_one_device.py (issue 6's GPU check) on the CPU: same losses, state moved to the host.

    The script runs as its ``__main__`` in a process forked from the tests' rank server (world size
    1, its own process group, as on the command line), which spares a new interpreter's imports
    (~4 CPU-seconds); its imports from a fresh interpreter are the GPU check's dry run's
    (``scripts/offload_gpu.py`` imports it, tests/test_gpu_check_script.py)."""
    import json
    from pathlib import Path

    from multiprocess import run_on_ranks

    script = Path(__file__).resolve().parents[1] / "scripts" / "offload_one_device.py"
    out = tmp_path / "figures.json"
    # --fused: the user's kernel is the one the offloaded step switches to, so losses match bitwise
    args = ["--device", "cpu", "--n-layer", "2", "--n-embd", "32", "--steps", "2", "--fused", "--out", str(out)]
    run_on_ranks(_run_script, str(script), args, world_size=1, init_process_group=False, timeout=120)
    results = json.loads(out.read_text())["results"]
    plain, offloaded = results["zero3"], results["zero3_offload"]
    assert plain["losses"] == offloaded["losses"]
    assert plain["model_state_host_bytes"] == 0 and offloaded["model_state_device_bytes"] == 0
    assert offloaded["model_state_host_bytes"] - offloaded["host_gradient_bytes"] == plain["model_state_device_bytes"]
    assert offloaded["host_gradient_bytes"] > 0 and plain["host_gradient_bytes"] == 0
