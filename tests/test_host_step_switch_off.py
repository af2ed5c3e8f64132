"""Issue 60, item 3: stepping during backward switches itself off where the host step is too short to
hide anything (``engine/offload/switch_off.py``), and the worker steps every bucket landed by its wake
in one call (``engine/offload/step_worker.py``).

The switch-off is a judgement of timings, off in the suite (``LIGHTNING_ZERO_JUDGE_HOST_STEPS_FROM_S``
is infinite, see ``conftest.py``); these cases turn it on and choose the threshold, so that what the
ranks measure decides it one way or the other: the same decision on every rank (the largest of their
measurements), reported with its reason, and the weights bitwise those of stepping after backward.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Optional

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext
from host_step_modes import StepRecorder, same_history

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.offload.switch_off import SWITCHED_OFF_REASON, TRIAL_REASON, TRIAL_STEPS

GROUP = CaseGroup(world_size=2, init_process_group=True)
WIDTH = 16
STEPS = TRIAL_STEPS + 3
SMALL_BUCKETS = 0.001
"""About one Linear per bucket: a backward lands several buckets."""


def _run(overlap: bool, steps: int = STEPS, stage: int = 2) -> dict:
    """``steps`` AdamW steps of 4 Linears under an offloading engine (on every rank of the group, or
    in this process); the weights after each step, how each step was taken, the report, the warnings."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    placement = {"offload_params": True, "unit_classes": ["Linear"]} if stage == 3 else {"bucket_size_mb": SMALL_BUCKETS}
    config = ZeroConfig(stage=stage, offload_optimizer=True, overlap_host_step=overlap, fused_host_step=False, **placement)
    engine = ZeroEngine(net, [opt], config, device=torch.device("cpu"))
    torch.manual_seed(1 + (torch.distributed.get_rank() if torch.distributed.is_initialized() else 0))
    record = StepRecorder(engine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(steps):
                engine.begin_step()
                net(torch.randn(4, WIDTH)).pow(2).mean().backward()
                engine.finish_backward()
                engine.end_step()
                opt.step()
                engine.after_optimizer_step(opt)
                opt.zero_grad()
                record.after_step(net)
        finally:
            engine.close()
    said = [str(w.message) for w in caught if "too short to hide" in str(w.message)]
    return {**record.results(), "warnings": said}


class _Judged:
    """Judging on (as outside the suite), with ``hide_from`` seconds as the threshold; where
    ``long_s`` is given, this rank's host step measures that long (a rank whose step is long)."""

    def __init__(self, hide_from: float, long_s: Optional[float] = None) -> None:
        from lightning_zero.engine.offload import backoff, switch_off

        self._modules = (backoff, switch_off)
        self._saved = (backoff.WORTH_JUDGING_S, switch_off.WORTH_HIDING_S, switch_off.SwitchOff.host_step_ended)
        backoff.WORTH_JUDGING_S = 0.02
        switch_off.WORTH_HIDING_S = hide_from
        if long_s is not None:
            ended = self._saved[2]

            def long_step(self: Any) -> None:
                ended(self)
                if self._timed:
                    self._timed[-1] = long_s

            switch_off.SwitchOff.host_step_ended = long_step  # type: ignore[method-assign]

    def __enter__(self) -> "_Judged":
        return self

    def __exit__(self, *exc: Any) -> None:
        backoff, switch_off = self._modules
        backoff.WORTH_JUDGING_S, switch_off.WORTH_HIDING_S, switch_off.SwitchOff.host_step_ended = self._saved


def _summary(ctx: RankContext, on: dict, off: dict) -> dict:
    return {
        "rank": ctx.rank,
        "bitwise": same_history(on, off),
        "modes": on["modes"],
        "switched_off": on["report"].switched_off,
        "reasons": on["report"].reasons,
        "warnings": on["warnings"],
    }


@GROUP.case
def every_rank_short(ctx: RankContext) -> dict:
    """Every rank's host step is under the threshold (an hour): switched off on every rank."""
    with _Judged(hide_from=3600.0):
        on = _run(True)
    return _summary(ctx, on, _run(False))


@GROUP.case
def one_rank_long(ctx: RankContext) -> dict:
    """Rank 1's host step measures 10 s, rank 0's its own few milliseconds, against 1 s: rank 0 alone
    would switch off; agreed, neither does."""
    with _Judged(hide_from=1.0, long_s=10.0 if ctx.rank == 1 else None):
        on = _run(True)
    return _summary(ctx, on, _run(False))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("host_step_switch_off"))


def test_switched_off_on_every_rank_with_its_reason(results):
    ranks = results["every_rank_short"]
    assert ranks[0]["switched_off"] and ranks[0]["switched_off"] == ranks[1]["switched_off"], ranks
    assert "too short to hide" in ranks[0]["switched_off"]
    for r in ranks:
        assert r["bitwise"], r  # the numerics are stepping after backward's
        assert r["modes"] == ["after_backward"] * STEPS, r["modes"]
        assert r["reasons"] == {TRIAL_REASON: TRIAL_STEPS, SWITCHED_OFF_REASON: STEPS - TRIAL_STEPS}, r["reasons"]
    assert len(ranks[0]["warnings"]) == 1 and ranks[1]["warnings"] == []  # rank zero warns, once


def test_a_long_step_on_one_rank_keeps_every_rank_stepping_ahead(results):
    for r in results["one_rank_long"]:
        assert r["bitwise"], r
        assert r["switched_off"] == "" and r["warnings"] == [], r
        assert r["modes"] == ["after_backward"] * TRIAL_STEPS + ["ahead"] * (STEPS - TRIAL_STEPS), r["modes"]
        assert r["reasons"] == {TRIAL_REASON: TRIAL_STEPS}, r["reasons"]


def test_not_judged_in_the_suite_no_trial():
    """Judging off (the suite's setting): every step is taken ahead from the first, nothing switched off."""
    on = _run(True, steps=3)
    assert on["modes"] == ["ahead"] * 3 and on["report"].switched_off == "" and on["warnings"] == []


@pytest.mark.parametrize("stage", [2, 3])
def test_buckets_landed_while_the_worker_is_busy_step_in_one_call(monkeypatch, stage):
    """The worker's first step is slow (a sleep): every bucket that lands meanwhile is stepped at its next
    wake, all in one call of the optimizer's update, bitwise as stepping after backward."""
    from lightning_zero.engine.offload import step_worker

    calls: list[int] = []
    step_shards = step_worker.StepWorker.step_shards

    def slow_first(self: Any, shards: Any) -> Any:
        calls.append(len(shards))
        if len(calls) == 1:
            time.sleep(0.3)  # backward goes on, its buckets land
        return step_shards(self, shards)

    monkeypatch.setattr(step_worker.StepWorker, "step_shards", slow_first)
    on = _run(True, steps=1, stage=stage)
    monkeypatch.setattr(step_worker.StepWorker, "step_shards", step_shards)
    off = _run(False, steps=1, stage=stage)
    assert same_history(on, off)
    assert on["modes"] == ["ahead"]
    stepped = on["report"].last.buckets
    assert len(stepped) > 2, stepped
    assert len(calls) < len(stepped), (calls, stepped)  # fewer wakes than buckets
    assert sum(calls) == 8  # every shard once: 4 weights, 4 biases
    starts = [start for _, start, _ in stepped]
    assert starts == sorted(starts) and all(end >= start for _, start, end in stepped)
