"""The engine under every order a GPU's streams and the host step's thread allow, on 2 CPU ranks (see
[Note: the schedule explorer] in ``tests/schedules/__init__.py``).

Each scenario is recorded on both ranks, once per host-thread seed (the host step's worker and the
training thread switched at their handoffs by a seeded random), on a simulated device taking NCCL's
path; the reference run steps after backward on the CPU as usual. Then:

- the recorded run's weights are the reference run's, bit for bit, whatever the interleaving of the
  two host threads (and whatever user code edits between backward and the step);
- the ranks' recordings replayed under adversarial orders (the host far ahead of its device, the device
  eager, the most recently ready stream first, the reduce stream or a copy stream starved) never
  deadlock, and no two accesses to the same bytes are left unordered by the waits (checked for every
  order at once, through vector clocks).

The scenario ``stage3_params_offloaded_late_rank`` is review N2: stage 3 with parameters offloaded and
fp32 weights, rank 1's backward not reaching blocks 0-2 (its residual stream detached), the first
backward. With one copy stream for both directions its replays deadlock (every seed, every policy:
the cycle runs rank 0's compute stream -> its copy stream -> its reduce stream -> the reduce-scatter
-> rank 1's reduce stream -> rank 1's compute stream -> the all-gather -> rank 0's compute stream).
"""

from __future__ import annotations

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from schedules.explorer import Replay
from schedules.policies import adversaries, random_order, starving
from schedules.scenarios import Scenario

pytestmark = pytest.mark.schedules

HOST_SEEDS = (0, 1)
"""Interleavings of the host step's worker with the training thread recorded per scenario."""
REPLAY_SEED = 0
"""Seed of the adversarial replay policies. A recording is checked for races in every order at once
(one replay with vector clocks), and a deadlock, a cycle of waits, shows in any order; the first
host seed's recording is also replayed under every adversarial policy, which shows the orders and
measures the reduce stream's lag."""

STAGE3 = {"stage": 3, "unit_classes": ["Block"]}
SCENARIOS = {
    s.name: s
    for s in (
        Scenario("stage3_params_offloaded_late_rank", {**STAGE3, "offload_optimizer": True, "offload_params": True}, steps=2, detach_after={1: 2}),
        Scenario("stage3_late_rank", STAGE3, steps=2, detach_after={1: 2}),
        Scenario(
            "stage3_bf16_offloaded_late_rank", {**STAGE3, "offload_optimizer": True, "offload_params": True},
            steps=2, detach_after={1: 2}, dtype=torch.bfloat16,
        ),  # fmt: skip
        Scenario(
            "stage3_nvme_late_rank", {**STAGE3, "offload_optimizer": "nvme", "offload_params": "nvme"}, steps=2, detach_after={1: 2},
        ),  # fmt: skip
        Scenario(
            # with 2 steps both this and stage3_params_offloaded_late_rank once found a deadlock: a gather of a
            # bucket during backward joined a worker batch that waited for a copy of a later reduction (now the
            # read calls off a step the worker has not taken: StepAhead._settle_bucket)
            "stage3_nvme_state_late_rank", {**STAGE3, "offload_optimizer": "nvme", "offload_params": True}, steps=2, detach_after={1: 2},
        ),  # fmt: skip
        Scenario("stage3_optimizer_offloaded", {**STAGE3, "offload_optimizer": True}, steps=2, optimizer="sgd"),
        Scenario("stage2", {"stage": 2, "bucket_size_mb": 0.0005}, steps=2),
        Scenario("stage2_offloaded", {"stage": 2, "offload_optimizer": True, "bucket_size_mb": 0.0005}, steps=2, optimizer="sgd"),
        Scenario("stage2_nvme", {"stage": 2, "offload_optimizer": "nvme", "bucket_size_mb": 0.0005}, steps=2),
        Scenario("stage1_offloaded", {"stage": 1, "offload_optimizer": True, "bucket_size_mb": 0.0005}, steps=2),
        Scenario(
            "stage2_offloaded_copies_back", {"stage": 2, "offload_optimizer": True, "bucket_size_mb": 0.0005},
            steps=2, plan={"keep_rollback": False, "check_contents": False},
        ),  # fmt: skip
        Scenario(
            "stage1_bf16_offloaded_copies_back_rank1_after_backward", {"stage": 1, "offload_optimizer": True, "bucket_size_mb": 0.0005},
            steps=2, dtype=torch.bfloat16, plan={"keep_rollback": False, "check_contents": False}, after_backward_on=1,
        ),  # fmt: skip
        Scenario(
            "stage2_offloaded_edit_through_data", {"stage": 2, "offload_optimizer": True, "bucket_size_mb": 0.0005},
            steps=2, optimizer="sgd", edit="halve gradients through .data",
        ),  # fmt: skip
    )
}

GROUP = CaseGroup(world_size=2)


def _record(ctx: RankContext, scenario: str) -> list:
    from schedules.scenarios import record

    return record(SCENARIOS[scenario], ctx.rank, HOST_SEEDS)


for _name in SCENARIOS:
    GROUP.case(_record, name=_name, scenario=_name)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("schedules"))


def _recordings(results: GroupResults, scenario: str) -> list[list]:
    """Per host seed, the ranks' recordings."""
    per_rank = results[scenario]
    return [[rank_recordings[i] for rank_recordings in per_rank] for i in range(len(HOST_SEEDS))]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_interleaving_of_the_host_threads_trains_the_reference_weights_bitwise(results, scenario):
    for recordings in _recordings(results, scenario):
        for rank, recording in enumerate(recordings):
            assert recording["same_weights"], (
                f"{scenario}, host seed {recording['seed']}, rank {rank}: the recorded run's weights differ from"
                " the run stepping after backward"
            )


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_order_the_waits_allow_is_free_of_deadlocks_and_races(results, scenario):
    for index, recordings in enumerate(_recordings(results, scenario)):
        traces = [recording["trace"] for recording in recordings]
        outcome = Replay(traces).run(random_order(recordings[0]["seed"]), races=True)
        assert outcome.clean, f"{scenario}, host seed {recordings[0]['seed']}:\n{outcome.summary()}"
        for policy in adversaries([REPLAY_SEED]) if index == 0 else ():
            outcome = Replay(traces).run(policy)
            assert outcome.clean, f"{scenario}, host seed {recordings[0]['seed']}:\n{outcome.summary()}"


@pytest.mark.parametrize("scenario", ["stage2", "stage3_late_rank"])
def test_a_slow_reduce_stream_holds_at_most_max_in_flight_plus_one_buckets_of_full_gradients(results, scenario):
    """Review N4: with the reduce stream starved (communication slower than compute), the full
    gradients the host dropped but the reduce stream still has to copy in (kept alive for it, so the
    allocator cannot reuse them) stay within ``max_in_flight + 1`` buckets from the second backward on:
    every rank then launches every bucket during its backward, and a launch's gradients are held by the
    host until the compute stream waited for their copy-in, ``max_in_flight`` launches later. The first
    backward only learns which parameters it does not reach, and its lag is not bounded."""
    from lightning_zero.engine.gradients.grad_sync import MAX_IN_FLIGHT

    bound_buckets = MAX_IN_FLIGHT + 1
    recordings = _recordings(results, scenario)[0]
    traces = [recording["trace"] for recording in recordings]
    outcome = Replay(traces).run(starving("reduce", REPLAY_SEED))
    unbounded = []
    for rank, recording in enumerate(recordings):
        bound = bound_buckets * recording["largest_bucket"]
        later = [peak for (r, role, phase), peak in outcome.kept_alive_by_phase.items() if (r, role) == (rank, "reduce") and phase >= 2]
        assert max(later, default=0) <= bound, (scenario, rank, later, bound)
        unbounded.append(outcome.kept_alive_by_phase.get((rank, "reduce", 1), 0) > bound)
    assert any(unbounded), "the first backward should show the unbounded lag: the scenario is too small to tell"


def test_the_host_seeds_interleave_the_worker_differently(results):
    for scenario in ("stage2_offloaded", "stage3_optimizer_offloaded"):
        per_seed = _recordings(results, scenario)
        orders = {tuple(type(e).__name__ + str(e.thread) for e in recordings[0]["trace"].entries) for recordings in per_seed}
        assert len(orders) == len(HOST_SEEDS), f"{scenario}: the seeds gave the same order of the two threads"
        assert all(recordings[0]["switches"] > 0 for recordings in per_seed)
