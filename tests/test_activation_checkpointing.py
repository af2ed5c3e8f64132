"""Activation checkpointing at every stage, as Lightning users enable it for FSDP: torch's
``checkpoint_wrapper`` on every transformer block, reentrant and not, and
``torch.utils.checkpoint.checkpoint`` called inside a block (a unit) on its MLP, compared with DDP
doing the same. At stage 3 the recomputation in backward runs a block's forward again, which must find its
unit gathered (or gather it) without reducing gradients twice or freeing it too early."""

from __future__ import annotations

import pytest

from case_groups import CaseGroup, GroupResults, RankContext

STEPS = 3
STAGES = (1, 2, 3)
MODES = ("reentrant", "non_reentrant", "inside_reentrant", "inside_non_reentrant")


class _CheckpointedCall:
    """A module's forward through ``torch.utils.checkpoint.checkpoint`` (applied inside a unit)."""

    def __init__(self, module, use_reentrant: bool) -> None:
        self.forward, self.use_reentrant = module.forward, use_reentrant

    def __call__(self, *args):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.forward, *args, use_reentrant=self.use_reentrant)


def _checkpointed_module(mode: str):
    from lightning_helpers import GPTModule
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from lightning_zero.models.gpt import Block

    module = GPTModule()
    if mode.startswith("inside_"):
        for block in module.model.blocks:
            assert isinstance(block, Block)
            block.mlp.forward = _CheckpointedCall(block.mlp, use_reentrant=mode == "inside_reentrant")
        return module
    impl = CheckpointImpl.REENTRANT if mode == "reentrant" else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(
        module.model,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, Block),
    )
    return module


def checkpointed_fit(ctx: RankContext, strategy: str, mode: str) -> list:
    """Weights after each step of a GPT whose blocks recompute their activations in backward."""
    import lightning as L
    from lightning_helpers import WeightRecorder, make_trainer, token_data

    L.seed_everything(0, verbose=False)
    module = _checkpointed_module(mode)
    recorder = WeightRecorder()
    make_trainer(strategy, STEPS, callbacks=[recorder]).fit(module, token_data())
    return recorder.history


GROUP = CaseGroup(world_size=2, timeout=300)
for _mode in MODES:
    for _strategy in ("ddp", *(f"zero{s}" for s in STAGES)):
        GROUP.case(checkpointed_fit, name=f"{_strategy}_{_mode}", strategy=_strategy, mode=_mode)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("activation_checkpointing"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", STAGES)
def test_activation_checkpointing_trains_as_under_ddp(results, stage, mode):
    from lightning_helpers import max_abs_diff

    for ddp, zero in zip(results[f"ddp_{mode}"], results[f"zero{stage}_{mode}"]):
        assert len(zero) == STEPS
        assert [max_abs_diff(a, b) for a, b in zip(ddp, zero)] == [0.0] * STEPS
