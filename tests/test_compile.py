"""``torch.compile`` of the model inside a LightningModule, and of a module set up by Fabric, at
every stage, compared with compiled DDP under the Trainer and under Fabric.

``aot_eager`` runs the same graph capture and autograd tracing as inductor without generating
kernels, so it finds what the capture breaks on within seconds on CPU; inductor itself (the
default backend, whose crash at stage 3 was reported) is checked at stage 3 too. The Fabric cases
run in the Trainer cases' ranks: inductor's first compilation in a process costs ~10 s on 2 cores,
and the Fabric loop's GPT has the Trainer's shapes, so its kernels come from inductor's cache.

The reference for inductor at stage 3 is uncompiled DDP (``aot_eager`` runs eager's kernels: it
equals eager DDP bitwise), which inductor's own rounding keeps within 2e-5. Inductor DDP is a
second reference only where torch's inductor computes the whole model right: torch 2.6's CPU
code generation stores the embedding's backward (``embedding_dense_backward``'s scatter with
accumulation) instead of adding it, in the fused kernel of the whole GPT's backward, so a token id
that occurs twice in a rank's batch gets the gradient of its last occurrence only: the tied
embedding steps 0.02 (2 x lr, Adam's sign flipped) away from eager after one step, and every
weight follows. It is torch's, not DDP's or ours: inductor on one process without any strategy,
and inductor zero1, give the same numbers; torch 2.13 adds. Stage 3's graphs end at its units
(see [Note: gathers under torch.compile]), so its embedding backward runs apart and is right."""

from __future__ import annotations

import pytest

from case_groups import CaseGroup, GroupResults, RankContext
from fabric_loop import assert_same, train

STEPS = 4
STAGES = (1, 2, 3)


def compiled_fit(ctx: RankContext, strategy: str, backend: str = "aot_eager", **trainer_kwargs) -> dict:
    import lightning as L
    import torch
    from lightning_helpers import GPTModule, WeightRecorder, make_trainer, token_data
    from recompiles import RecompileCounter

    from torch._dynamo.utils import counters

    class GraphCount(L.Callback):
        def __init__(self) -> None:
            self.graphs: list[int] = []

        def on_train_batch_end(self, *args) -> None:
            self.graphs.append(counters["stats"]["unique_graphs"])

    L.seed_everything(0, verbose=False)
    torch._dynamo.reset()
    counters.clear()
    module = GPTModule()
    module.model = torch.compile(module.model, backend=backend)
    recorder, graphs = WeightRecorder(), GraphCount()
    with RecompileCounter() as recompiles:
        make_trainer(strategy, STEPS, callbacks=[recorder, graphs], **trainer_kwargs).fit(module, token_data())
    return {"history": recorder.history, "graphs": graphs.graphs, "recompiles": recompiles.count, "reasons": recompiles.reasons}


GROUP = CaseGroup(world_size=2, timeout=400)
for _strategy in ("ddp", *(f"zero{s}" for s in STAGES)):
    GROUP.case(compiled_fit, name=_strategy, strategy=_strategy)
for _strategy in ("ddp", "zero3"):
    GROUP.case(compiled_fit, name=f"inductor_{_strategy}", strategy=_strategy, backend="inductor")
for _strategy in ("ddp", *(f"zero{s}" for s in STAGES)):
    GROUP.case(train, name=f"fabric_{_strategy}", strategy=_strategy, compile_model=True, steps=4)
for _strategy in ("ddp", "zero3"):
    GROUP.case(train, name=f"fabric_inductor_{_strategy}", strategy=_strategy, compile_model=True, backend="inductor", steps=3)
# the right reference for the 3-step inductor runs: DDP uncompiled (seconds, nothing to compile)
GROUP.case(train, name="fabric_eager_ddp_3_steps", strategy="ddp", steps=3)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("compile"))


@pytest.mark.parametrize("stage", STAGES)
def test_a_compiled_model_trains_as_under_compiled_ddp(results, stage):
    from lightning_helpers import max_abs_diff

    for ddp, zero in zip(results["ddp"], results[f"zero{stage}"]):
        assert [max_abs_diff(a, b) for a, b in zip(ddp["history"], zero["history"])] == [0.0] * STEPS


@pytest.mark.parametrize("stage", STAGES)
def test_the_compiled_graphs_settle_by_the_third_step(results, stage):
    for r in results[f"zero{stage}"]:
        assert r["graphs"][2] == r["graphs"][-1]  # nothing new captured after step 3
        assert r["recompiles"] == 0, r["reasons"]


# inductor's kernels round differently from eager's, and it fuses DDP's one graph differently from
# the per-unit graphs of stage 3 (the unit hooks run eagerly, see [Note: gathers under
# torch.compile]): float rounding, nothing more. How much depends on the kernels inductor picks for
# the CPU it runs on: 1.1e-5 after 4 AdamW steps on the 2026-12-02 CI machine, under 1e-5 on the
# one before; inductor zero3 against eager DDP, 1.1e-5 on torch 2.6.0 (2026-12-05). A gradient
# lost or doubled anywhere moves some weight by lr = 1e-2 in Adam's first step.
INDUCTOR_ATOL = 2e-5


def inductor_ddp_is_wrong(results: GroupResults) -> bool:
    """Whether torch's inductor trains the whole GPT wrong (torch 2.6 on the CPU, module docstring),
    which is then asserted to be that fault: after the first step, inductor DDP is off eager DDP
    in the tied embedding only (a step of 2 x lr where a repeated token's gradient was dropped)."""
    from lightning_helpers import max_abs_diff

    embedding = ("wte.weight", "lm_head.weight")
    for ours, eager in zip(results["inductor_ddp"], results["ddp"]):
        if max(max_abs_diff(a, b) for a, b in zip(ours["history"], eager["history"])) <= INDUCTOR_ATOL:
            continue
        first, eager_first = ours["history"][0], eager["history"][0]
        others = {k: v for k, v in first.items() if not k.endswith(embedding)}
        assert max_abs_diff(others, {k: eager_first[k] for k in others}) <= INDUCTOR_ATOL, "inductor DDP off eager beyond the embedding"
        assert max_abs_diff(first, eager_first) > 1e-3, "inductor DDP off eager, but not as a dropped embedding gradient"
        return True
    return False


def test_inductor_at_stage_3_trains_as_uncompiled_ddp(results):
    from lightning_helpers import max_abs_diff

    for ddp, zero in zip(results["ddp"], results["inductor_zero3"]):
        diffs = [max_abs_diff(a, b) for a, b in zip(ddp["history"], zero["history"])]
        assert len(diffs) == STEPS and max(diffs) <= INDUCTOR_ATOL, diffs
        assert zero["graphs"][2] == zero["graphs"][-1] and zero["recompiles"] == 0, zero["reasons"]


def test_inductor_at_stage_3_trains_as_inductor_ddp(results):
    from lightning_helpers import max_abs_diff

    if inductor_ddp_is_wrong(results):
        pytest.xfail(
            f"torch {torch_version()}'s inductor drops the embedding gradient of repeated tokens in the whole GPT's graph on the CPU; "
            "stage 3 is checked against uncompiled DDP instead"
        )
    for ddp, zero in zip(results["inductor_ddp"], results["inductor_zero3"]):
        assert max(max_abs_diff(a, b) for a, b in zip(ddp["history"], zero["history"])) <= INDUCTOR_ATOL


def test_the_recompile_counter_counts_recompilations():
    import torch
    from recompiles import RecompileCounter

    torch._dynamo.reset()
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    with RecompileCounter() as recompiles:
        for size in (2, 3, 4):
            double(torch.ones(size))
    assert recompiles.count == 2  # a new shape each time after the first


@pytest.mark.parametrize("stage", STAGES)
def test_a_module_compiled_under_fabric_trains_as_under_compiled_fabric_ddp(results: GroupResults, stage: int) -> None:
    ours = results[f"fabric_zero{stage}"]
    assert_same(ours, results["fabric_ddp"])
    for rank in ours:
        assert rank["graphs"][1:] == [rank["graphs"][1]] * (len(rank["graphs"]) - 1), "graphs captured after step 2"
        assert rank["recompiles"] == 0, rank["reasons"]


def test_inductor_under_fabric_at_stage_3_matches_uncompiled_fabric_ddp_to_float_rounding(results: GroupResults) -> None:
    ours = results["fabric_inductor_zero3"]
    assert_same(ours, results["fabric_eager_ddp_3_steps"], atol=INDUCTOR_ATOL)
    for rank in ours:
        assert rank["recompiles"] == 0, rank["reasons"]


def test_inductor_under_fabric_at_stage_3_matches_inductor_fabric_ddp_to_float_rounding(results: GroupResults) -> None:
    # Fabric's results keep no weights per step, so where its inductor DDP is off uncompiled DDP the
    # Trainer's runs (the same GPT's shapes, the same kernels) say whether that is torch's fault
    try:
        assert_same(results["fabric_inductor_ddp"], results["fabric_eager_ddp_3_steps"], atol=INDUCTOR_ATOL)
    except AssertionError:
        if inductor_ddp_is_wrong(results):
            pytest.xfail(f"torch {torch_version()}'s inductor drops the embedding gradient of repeated tokens in the whole GPT's graph on the CPU")
    assert_same(results["fabric_inductor_zero3"], results["fabric_inductor_ddp"], atol=1e-5)


def torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]
