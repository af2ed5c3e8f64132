"""Reads at rest inside a training step and their agreement (issue 59: N6, N8, N9).

- N6: a penalty over ``self.parameters()`` in ``training_step`` (L2, EWC) differentiates through the
  stage-3 parameters at rest, as under DDP (before: no gradient for any of them).
- N8: a unit parameter read in ``on_before_optimizer_step`` with offloaded fp32 weights and the host
  step during backward gives DDP's value before the step (before: the step taken ahead), and training
  stays bitwise the run without the host step during backward.
- N9: a read made on one rank only fails in the agreement timeout (``LIGHTNING_ZERO_READ_AT_REST_TIMEOUT``),
  not the process group's; a rank that gives up and a late one never both act (the late one never
  enters an all-gather the early one abandoned); reads off the training thread are refused.

One spawned group of 2 CPU ranks; the Trainer runs are compared with DDP doing the same.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any, Optional

import lightning as L
import pytest
import torch
from torch import nn

from case_groups import CaseGroup, GroupResults, RankContext
from lightning_helpers import full_weights, make_trainer, max_abs_diff, regression_data

STEPS = 3
PENALTY = 1e-2
AGREEMENT_TIMEOUT_VARIABLE = "LIGHTNING_ZERO_READ_AT_REST_TIMEOUT"
GROUP = CaseGroup(world_size=2, timeout=300)


class PenalizedStack(L.LightningModule):
    """A stack whose blocks are stage-3 units (elements of a ModuleList); the training step adds an
    L2 penalty over every parameter, and ``on_before_optimizer_step`` reads a block's weight (after
    waiting for the host step during backward, so that a read racing it would see the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 3)
        self.reads: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        return loss + PENALTY * sum((p**2).sum() for p in self.parameters())

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None:
            engine.wait_for_host_step()
        self.reads.append(self.blocks[1].weight.detach().clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _strategy(variant: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    timeout = timedelta(seconds=60)  # a hang becomes an error
    if variant == "ddp":
        return DDPStrategy(timeout=timeout)
    if variant == "zero3":
        return ZeroStrategy(stage=3, timeout=timeout)
    overlap = variant == "zero3_offload"
    return ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True, overlap_host_step=overlap, timeout=timeout)


@GROUP.case
def penalty_and_read_before_the_step(ctx: RankContext) -> dict[str, Any]:
    results = {}
    for variant in ["ddp", "zero3", "zero3_offload", "zero3_offload_no_overlap"]:
        L.seed_everything(0, verbose=False)
        module = PenalizedStack()
        trainer = make_trainer(_strategy(variant), STEPS)
        trainer.fit(module, regression_data(64))
        results[variant] = {"weights": full_weights(module, trainer.strategy), "reads": module.reads}
    return results


# ---- the agreement (engine level) -------------------------------------------------------------------
def _engine(timeout_s: float, agreement_s: Optional[float] = None) -> tuple[Any, Any]:
    """A stage-3 engine over the small test model (gloo process group made here if no Trainer made
    one), whose process groups wait ``timeout_s`` and whose reads at rest agree within ``agreement_s``."""
    import torch.distributed as dist

    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from models import OddShapes

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = OddShapes()
    previous = os.environ.pop(AGREEMENT_TIMEOUT_VARIABLE, None)
    if agreement_s is not None:
        os.environ[AGREEMENT_TIMEOUT_VARIABLE] = str(agreement_s)
    try:
        engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3), timeout=timedelta(seconds=timeout_s))
    finally:
        os.environ.pop(AGREEMENT_TIMEOUT_VARIABLE, None)
        if previous is not None:
            os.environ[AGREEMENT_TIMEOUT_VARIABLE] = previous
    return model, engine


def _attempt(read: Any) -> tuple[Optional[str], float]:
    """(the error's message or None, seconds taken)."""
    start = time.monotonic()
    try:
        read()
        return None, time.monotonic() - start
    except RuntimeError as error:
        return str(error), time.monotonic() - start


def _barrier() -> None:
    from lightning_zero.engine.comm import collectives

    collectives.all_reduce(torch.zeros(1), None)


@GROUP.case
def a_read_on_rank_zero_only(ctx: RankContext) -> dict[str, Any]:
    """The process group waits 60 s, reads agree within 2 s: rank 0 reads a weight alone (as a logger
    reading parameters on rank 0 does); the other rank waits in a collective meanwhile. Then the other
    rank's next read pairs with the abandoned one and fails too, and reads work again."""
    model, engine = _engine(timeout_s=60, agreement_s=2)
    out: dict[str, Any] = {"timeout_s": getattr(engine.residency.reads, "timeout", timedelta(0)).total_seconds()}
    if ctx.rank == 0:
        out["alone"] = _attempt(lambda: model.hidden.weight.clone())
    _barrier()
    if ctx.rank != 0:
        out["alone"] = _attempt(lambda: model.hidden.weight.clone())
    out["recovered"] = _attempt(lambda: model.hidden.weight.clone())[0]
    engine.close()
    return out


class _LateDecisionStore:
    """The store as one rank sees it, where every write after a wait that timed out is held back
    ``delay`` seconds: the early rank decides (posts its give-up) only after the late rank posted and
    looked for it."""

    def __init__(self, store: Any, delay: float) -> None:
        self._store, self._delay, self._timed_out = store, delay, False

    def wait(self, *args: Any) -> None:
        try:
            self._store.wait(*args)
        except RuntimeError:
            self._timed_out = True
            raise

    def set(self, *args: Any) -> None:
        self._late()
        self._store.set(*args)

    def compare_set(self, *args: Any) -> Any:
        self._late()
        return self._store.compare_set(*args)

    def _late(self) -> None:
        if self._timed_out:
            self._timed_out = False
            time.sleep(self._delay)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@GROUP.case
def a_late_rank_and_one_that_gave_up(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 stops waiting for rank 1 and is slow to act on it; rank 1 reads the same weight just
    after rank 0 stopped waiting. They must act alike: both read the weight (rank 1 decided first
    that every rank posted), or both fail naming the disagreement (rank 0 decided first that it gave
    up); never one of them inside an all-gather the other abandoned (which fails on the gather
    group's 4 s timeout instead)."""
    from lightning_zero.engine.comm import collectives

    model, engine = _engine(timeout_s=4, agreement_s=1)
    expected = model.hidden.weight.clone()
    reads = engine.residency.reads
    wait_s = getattr(reads, "timeout", timedelta(seconds=4)).total_seconds()  # (before issue 59: the group's)
    out: dict[str, Any] = {}
    original = collectives.default_store
    if ctx.rank == 0:
        late = _LateDecisionStore(original(), delay=2.0)
        collectives.default_store = lambda: late
    values: list[torch.Tensor] = []
    try:
        if ctx.rank != 0:
            time.sleep(wait_s + 0.5)  # after rank 0 stopped waiting, before it acts on it
        out["read"] = _attempt(lambda: values.append(model.hidden.weight.clone()))[0]
    finally:
        collectives.default_store = original
    out["right_value"] = bool(values) and torch.equal(values[0], expected)
    _barrier()
    out["recovered"] = _attempt(lambda: model.hidden.weight.clone())[0]
    engine.close()
    return out


@GROUP.case
def a_read_off_the_training_thread(ctx: RankContext) -> dict[str, Any]:
    """``model.state_dict()`` and ``w.clone()`` in a background thread (on both ranks): refused at once,
    naming the parameter and the threads; on the training thread they work."""
    model, engine = _engine(timeout_s=60)
    errors: list[Optional[str]] = []

    def in_a_thread() -> None:
        errors.append(_attempt(lambda: model.state_dict())[0])
        errors.append(_attempt(lambda: model.hidden.weight.clone())[0])

    thread = threading.Thread(target=in_a_thread, name="background-save")
    thread.start()
    thread.join()
    _barrier()
    on_the_training_thread = _attempt(lambda: model.state_dict())[0]
    engine.close()
    return {"errors": errors, "training_thread": on_the_training_thread}


@pytest.fixture(scope="module")
def results(tmp_path_factory: Any) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("reads_in_the_step"))


@pytest.mark.parametrize("variant", ["zero3", "zero3_offload", "zero3_offload_no_overlap"])
def test_a_penalty_over_the_parameters_in_the_training_step_trains_as_under_ddp(results: GroupResults, variant: str) -> None:
    for rank, runs in enumerate(results["penalty_and_read_before_the_step"]):
        assert max_abs_diff(runs[variant]["weights"], runs["ddp"]["weights"]) <= 1e-6, f"rank {rank}"


def test_a_read_before_the_optimizer_step_gives_ddps_weights_before_the_step(results: GroupResults) -> None:
    for rank, runs in enumerate(results["penalty_and_read_before_the_step"]):
        ddp = runs["ddp"]["reads"]
        assert len(ddp) == STEPS
        for variant in ["zero3", "zero3_offload", "zero3_offload_no_overlap"]:
            for step, (ours, theirs) in enumerate(zip(runs[variant]["reads"], ddp, strict=True)):
                assert torch.allclose(ours, theirs, rtol=0, atol=1e-6), f"rank {rank} {variant} step {step}"
        # the host step during backward is undone for the read and taken again: bitwise the run without it
        on, off = runs["zero3_offload"], runs["zero3_offload_no_overlap"]
        assert all(torch.equal(a, b) for a, b in zip(on["reads"], off["reads"], strict=True)), f"rank {rank}"
        assert max_abs_diff(on["weights"], off["weights"]) == 0.0, f"rank {rank}"


def test_a_read_on_one_rank_only_fails_within_the_agreement_timeout(results: GroupResults) -> None:
    rank0, rank1 = results["a_read_on_rank_zero_only"]
    assert rank0["timeout_s"] == 2.0
    error, seconds = rank0["alone"]
    assert error is not None and "'hidden.weight'" in error and "LIGHTNING_ZERO_READ_AT_REST_TIMEOUT" in error, rank0
    assert 1.5 < seconds < 20, seconds  # the agreement's 2 s, not the group's 60 s
    error, _ = rank1["alone"]
    assert error is not None and "stopped waiting" in error, rank1
    assert rank0["recovered"] is None and rank1["recovered"] is None


def test_a_rank_that_gave_up_and_a_late_one_act_alike_without_an_abandoned_collective(results: GroupResults) -> None:
    rank0, rank1 = results["a_late_rank_and_one_that_gave_up"]
    error0, error1 = rank0["read"], rank1["read"]
    if error0 is None or error1 is None:  # the late rank decided first: both read
        assert error0 is None and error1 is None, (error0, error1)
        assert rank0["right_value"] and rank1["right_value"]
    else:  # the rank that gave up decided first: both fail, neither in a collective
        assert "did not read it" in error0 and "stopped waiting" in error1, (error0, error1)
    assert rank0["recovered"] is None and rank1["recovered"] is None


def test_a_read_at_rest_off_the_training_thread_is_refused(results: GroupResults) -> None:
    for rank, out in enumerate(results["a_read_off_the_training_thread"]):
        assert len(out["errors"]) == 2, out
        for error in out["errors"]:
            assert error is not None and "background-save" in error and "MainThread" in error and "HINT" in error, f"rank {rank}: {error}"
        assert out["training_thread"] is None, f"rank {rank}: {out['training_thread']}"


def test_the_agreement_timeout_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_zero.engine.parameters import reads_at_rest
    from lightning_zero.engine.parameters.reads_at_rest import DEFAULT_AGREEMENT_TIMEOUT, agreement_timeout

    assert reads_at_rest.AGREEMENT_TIMEOUT_VARIABLE == AGREEMENT_TIMEOUT_VARIABLE

    monkeypatch.delenv(AGREEMENT_TIMEOUT_VARIABLE, raising=False)
    assert agreement_timeout(timedelta(minutes=30)) == DEFAULT_AGREEMENT_TIMEOUT == timedelta(seconds=60)
    assert agreement_timeout(timedelta(seconds=5)) == timedelta(seconds=5)  # never longer than the group's
    monkeypatch.setenv(AGREEMENT_TIMEOUT_VARIABLE, "300")
    assert agreement_timeout(timedelta(minutes=30)) == timedelta(seconds=300)
    for bad in ["soon", "0", "-1"]:
        monkeypatch.setenv(AGREEMENT_TIMEOUT_VARIABLE, bad)
        with pytest.raises(ValueError, match=AGREEMENT_TIMEOUT_VARIABLE):
            agreement_timeout(None)
