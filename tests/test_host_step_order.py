"""The host step during backward (issue 53), driven through the engine: the order of events when
backward is slowed (a sleep in an early block's backward frees the host, as a GPU's backward does),
rollbacks that keep the result bitwise, and what is refused. Not timed: the checks compare the
host step's recorded start times with the end of backward, never durations."""

from __future__ import annotations

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext

from lightning_zero.engine.offload.backoff import BACKOFF_REASON

SLEEP_S = 0.3
BLOCKS = 4
STEPS = 4

GROUP = CaseGroup(world_size=2, init_process_group=True)


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: backward's end comes late, the host is free meanwhile."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        import time

        time.sleep(SLEEP_S)
        return grad


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor, slow: bool) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0 and slow:
                x = _SleepInBackward.apply(x)
        return x


def _run(ctx: RankContext, stage: int, overlap: bool, clip: float | None = None, slow: bool = False, skip_step: int = -1) -> dict:
    """``STEPS`` steps of ``_Model`` under the engine with CPU offload; the weights after each step
    and the host step report. ``skip_step``: that step's backward is not followed by
    ``optimizer.step()`` (its step taken ahead must be undone)."""
    from lightning_zero.engine import ZeroEngine
    from lightning_zero.engine.config import ZeroConfig
    from lightning_zero.engine.gradients.norms import clip_grads_by_global_norm_

    torch.manual_seed(0)
    model = _Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"offload_params": True, "unit_classes": ["Sequential"]} if stage == 3 else {"bucket_size_mb": 64 * 65 * 4 / 2**20}
    config = ZeroConfig(stage=stage, offload_optimizer=True, overlap_host_step=overlap, **options)
    engine = ZeroEngine(model, [optimizer], config, device=torch.device("cpu"))
    torch.manual_seed(1 + ctx.rank)
    history = []
    for step in range(STEPS):
        engine.begin_step()
        loss = model(torch.randn(8, 64), slow).pow(2).mean() * (1 + 10 * (step % 2))
        loss.backward()
        engine.finish_backward()
        engine.end_step()
        if step == skip_step:
            continue
        if clip is not None:
            clip_grads_by_global_norm_([p for g in optimizer.param_groups for p in g["params"]], clip, torch.device("cpu"))
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()
        with engine.gathered():
            history.append([p.detach().clone() for p in model.parameters()])
    report = engine.host_step_report()
    last_block = next(b.index for b in engine.buckets if any(p.name.startswith(f"blocks.{BLOCKS - 1}.") for p in b.params))
    rollback = engine.memory_report().host_step_rollback
    engine.close()
    return {"history": history, "report": report, "last_block_bucket": last_block, "rollback": rollback}


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


@GROUP.case
def slowed_backward(ctx: RankContext) -> dict:
    """Per stage: with a sleep in block 0's backward, when the last block's bucket started stepping
    against when backward ended; and the weights against the host step after backward. With NCCL's
    waits (they block no host, so a reduction is finished, and its row sent to the host, as it is
    launched); on gloo a reduction is seen done only at a later gradient hook, and none runs during
    the sleep (see [Note: no waiting in backward] in ``grad_sync.py``)."""
    from lightning_zero.engine.comm import collectives

    out = {}
    saved, collectives.waits_block_host = collectives.waits_block_host, lambda group, device: False
    try:
        runs = {stage: (_run(ctx, stage, overlap=True, slow=True), _run(ctx, stage, overlap=False, slow=True)) for stage in (2, 3)}
    finally:
        collectives.waits_block_host = saved
    for stage, (ahead, after) in runs.items():
        timing = ahead["report"].last
        starts = {index: start for index, start, _ in timing.buckets}
        out[stage] = {
            "bitwise": _same(ahead["history"], after["history"]),
            "mode": timing.mode,
            "last_block_started_before_backward_end": starts[ahead["last_block_bucket"]] < timing.backward_end,
            "overlap": timing.overlap,
            "ahead": ahead["report"].ahead,
            "after_backward_report": after["report"],
        }
    return out


@GROUP.case
def clipping_rolls_back(ctx: RankContext) -> dict:
    """Clipping that applies on the steps with the large loss and not on the others: those steps are
    rolled back and redone, the others kept, and the weights are the host step after backward's."""
    out = {}
    for stage in (1, 2, 3):
        ahead = _run(ctx, stage, overlap=True, clip=0.2)
        after = _run(ctx, stage, overlap=False, clip=0.2)
        report = ahead["report"]
        out[stage] = {
            "bitwise": _same(ahead["history"], after["history"]),
            "ahead": report.ahead,
            "redone": report.redone,
            "after_backward": report.after_backward,
            "reasons": report.reasons,
            "rollback": ahead["rollback"],
        }
    return out


@GROUP.case
def step_never_taken(ctx: RankContext) -> dict:
    """A backward no `optimizer.step()` follows (a loop that skips a step): the step taken ahead is
    undone at the next step, as if it had never run."""
    out = {}
    for stage in (2, 3):
        ahead = _run(ctx, stage, overlap=True, skip_step=1)
        after = _run(ctx, stage, overlap=False, skip_step=1)
        out[stage] = {"bitwise": _same(ahead["history"], after["history"]), "reasons": ahead["report"].reasons}
    return out


def _scaled_run(ctx: RankContext, overlap: bool) -> dict:
    """Loss scaling (a ``ZeroGradScaler`` on the CPU, as ``16-mixed`` has on a GPU): rank 1's gradient
    overflows at step 1, so every rank skips that step and the scale backs off."""
    from lightning_zero.engine import ZeroEngine
    from lightning_zero.engine.config import ZeroConfig
    from lightning_zero.engine.gradients.grad_scaler import ZeroGradScaler

    torch.manual_seed(0)
    model = _Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, offload_optimizer=True, offload_params=True, unit_classes=["Sequential"], overlap_host_step=overlap))
    scaler = ZeroGradScaler("cpu", init_scale=1024.0, growth_interval=1)
    engine.plan_host_step(loss_scale=lambda: scaler._scale)
    torch.manual_seed(1 + ctx.rank)
    history, scales = [], []
    for step in range(STEPS):
        engine.begin_step()
        loss = model(torch.randn(8, 64), False).pow(2).mean()
        if step == 1 and ctx.rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        engine.finish_backward()
        engine.end_step()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
        with engine.gathered():
            history.append([p.detach().clone() for p in model.parameters()])
    report = engine.host_step_report()
    engine.close()
    return {"history": history, "scales": scales, "report": report}


@GROUP.case
def loss_scaling(ctx: RankContext) -> dict:
    ahead, after = _scaled_run(ctx, True), _scaled_run(ctx, False)
    return {"bitwise": _same(ahead["history"], after["history"]), "scales": (ahead["scales"], after["scales"]), "report": ahead["report"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("host_step_order"))


@pytest.mark.nccl_semantics
@pytest.mark.parametrize("stage", [2, 3])
def test_the_last_blocks_step_starts_before_backward_ends(results, stage):
    for r in results["slowed_backward"]:
        seen = r[stage]
        assert seen["bitwise"]
        assert seen["mode"] == "ahead" and seen["ahead"] == STEPS
        assert seen["last_block_started_before_backward_end"]
        assert seen["overlap"] > 0
        assert seen["after_backward_report"] is None  # overlap_host_step=False builds no step ahead


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_that_applies_is_rolled_back_and_redone(results, stage):
    for r in results["clipping_rolls_back"]:
        seen = r[stage]
        assert seen["bitwise"]
        # steps 1 and 3 clip; step 2 is after backward, backing off from step 1's redo
        assert (seen["ahead"], seen["redone"], seen["after_backward"]) == (1, 2, 1)
        assert seen["reasons"] == {"gradients changed after backward": 2, BACKOFF_REASON: 1}
        assert seen["rollback"] > 0


@pytest.mark.parametrize("stage", [2, 3])
def test_a_step_never_taken_is_undone(results, stage):
    for r in results["step_never_taken"]:
        assert r[stage]["bitwise"]
        assert r[stage]["reasons"] == {"no `optimizer.step()` followed the backward": 1}


def test_rollback_copy_restores_master_and_state():
    from lightning_zero.engine.offload.rollback import RollbackCopy

    master = torch.arange(6, dtype=torch.float32)
    shards = [master[:4], master[4:]]
    state: dict = {shards[0]: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4)}}
    copy = RollbackCopy(master, shards)
    copy.save(state)
    master.add_(1)
    state[shards[0]]["exp_avg"].mul_(5)
    state[shards[0]]["new"] = torch.zeros(1)
    state[shards[1]] = {"step": torch.tensor(1.0)}
    copy.restore(state)
    assert torch.equal(master, torch.arange(6, dtype=torch.float32))
    assert set(state) == {shards[0]} and set(state[shards[0]]) == {"step", "exp_avg"}
    assert torch.equal(state[shards[0]]["exp_avg"], torch.ones(4)) and state[shards[0]]["step"].item() == 3.0
    assert copy.nbytes == (6 + 1 + 4) * 4


@pytest.mark.parametrize("option, value", [("overlap_host_step", False), ("host_threads", 2)])
def test_host_step_options_need_offload(option, value):
    from lightning_zero.engine.config import ZeroConfig

    with pytest.raises(ValueError, match=f"`{option}` only applies with `offload_optimizer`"):
        ZeroConfig(stage=2, **{option: value})


@pytest.mark.parametrize("option, value", [("overlap_host_step", "yes"), ("host_threads", 0), ("host_threads", True)])
def test_host_step_options_refuse_bad_values(option, value):
    from lightning_zero.engine.config import ZeroConfig

    with pytest.raises((TypeError, ValueError), match=f"`{option}` must be"):
        ZeroConfig(stage=2, offload_optimizer=True, **{option: value})


def test_loss_scaling_unscales_ahead_and_undoes_a_skipped_step(results):
    ranks = results["loss_scaling"]
    for r in ranks:
        assert r["bitwise"]
        ahead_scales, after_scales = r["scales"]
        assert ahead_scales == after_scales == [2048.0, 1024.0, 2048.0, 4096.0]
        # not the first step (no scale before its backward), and the skipped one is no step
        assert r["report"].ahead == STEPS - 2 and r["report"].after_backward == 1
        assert r["report"].reasons == {
            "loss scale not known before the backward": 1,
            "inf or NaN gradients: loss scaling skipped the step": 1,
        }


def test_only_optimizers_that_count_per_parameter_step_bucket_by_bucket():
    from lightning_zero.engine.optimizer.optimizer_kinds import steps_bucket_by_bucket

    params = [torch.nn.Parameter(torch.zeros(2))]

    class CountsInItsGroups(torch.optim.AdamW):  # as schedule-free counts `k` in each param group
        def step(self, closure=None):  # noqa: ANN001, ANN202
            for group in self.param_groups:
                group["k"] = group.get("k", 0) + 1
            return super().step(closure)

    assert steps_bucket_by_bucket(torch.optim.AdamW(params)) and steps_bucket_by_bucket(torch.optim.SGD(params, lr=0.1))
    assert not steps_bucket_by_bucket(CountsInItsGroups(params))


def test_a_remembered_norm_serves_only_the_gradient_it_was_taken_from():
    from lightning_zero.engine.shards.precomputed_norms import norms_of, remember_grad_norms, remembered_grad_norms

    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    remember_grad_norms([p])
    assert torch.equal(remembered_grad_norms([p], 2.0)[0], norms_of([p.grad], 2.0)[0])
    assert remembered_grad_norms([p], 1.0)[0] is None  # another norm type
    p.grad.mul_(2)  # edited in place: its version moved
    assert remembered_grad_norms([p], 2.0)[0] is None
    remember_grad_norms([p])
    p.grad = p.grad.clone()  # replaced
    assert remembered_grad_norms([p], 2.0)[0] is None
