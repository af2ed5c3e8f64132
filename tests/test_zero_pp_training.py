"""ZeRO++ as users run it: the example GPT (`examples/train_gpt.py fit`, LightningCLI) on 4 CPU ranks as
2 nodes × 2 (`--trainer.num_nodes=2 --trainer.devices=2`, each rank with the NODE_RANK / LOCAL_RANK a
launcher gives it), 50 steps per variant, one group of ranks for every run:

* hpZ alone trains bitwise as zero3 (the same loss at every step, the same final weights);
* qwZ, qgZ and `zero3pp` follow zero3's loss curve within a stated tolerance, and the master weights
  they save are never quantized (off the int8 grid of their own blocks);
* `zero3pp`'s checkpoint loads at zero1, zero2 and zero3 on the same 4 ranks and at zero3 on 2 ranks
  with the weights it saved, and a zero3 checkpoint resumes under `zero3pp`.
"""

from __future__ import annotations

import contextlib
import csv
import os
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext
from example_runs import TINY_MODEL, run_example_in_rank
from multiprocess import run_on_ranks

WORLD_SIZE, RANKS_PER_NODE, STEPS = 4, 2, 50
GROUP = CaseGroup(world_size=WORLD_SIZE, timeout=600)
SHAPE = [
    *TINY_MODEL,
    "--trainer.accelerator=cpu",
    f"--trainer.num_nodes={WORLD_SIZE // RANKS_PER_NODE}",
    f"--trainer.devices={RANKS_PER_NODE}",
    "--trainer.log_every_n_steps=1",
    "--trainer.limit_val_batches=1",
    "--memory_monitor.every_n_steps=50",  # the example measures memory every step by default
]
OURS = "--trainer.strategy=lightning_zero.ZeroStrategy"
VARIANTS: dict[str, list[str]] = {
    "zero3": [OURS, "--trainer.strategy.stage=3"],
    "hpz": [OURS, "--trainer.strategy.stage=3", "--trainer.strategy.secondary_shard_size=node"],
    "qwz": [OURS, "--trainer.strategy.stage=3", "--trainer.strategy.quantize_weights=int8"],
    "qgz": [OURS, "--trainer.strategy.stage=3", "--trainer.strategy.quantize_gradients=int8"],
    "qgz_int4": [OURS, "--trainer.strategy.stage=3", "--trainer.strategy.quantize_gradients=int4"],
    "zero3pp": ["--trainer.strategy=zero3pp"],
}
STEP_TOLERANCE = 0.025
"""How far, relatively, a quantized variant's training loss may be from zero3's at any of the 50 steps
(the loss falls from ~5.5 to ~3.0). Measured on 2026-12-07: qwZ 1.3%, qgZ int8 0.7%, zero3pp 1.2% at
their worst step (one batch's loss: a different rounding of the weights moves it most where the loss
is steep)."""
TAIL_TOLERANCE = 0.02
"""How far the mean loss of the last 10 steps may be from zero3's (absolute). Measured: qwZ 0.002,
qgZ int8 0.006, zero3pp 0.001."""


@contextlib.contextmanager
def as_two_nodes(ctx: RankContext) -> Iterator[None]:
    """This rank as a launcher starts it on node ``rank // 2``: NODE_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE."""
    saved = {k: os.environ.get(k) for k in ("NODE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")}
    os.environ.update(
        NODE_RANK=str(ctx.rank // RANKS_PER_NODE), LOCAL_RANK=str(ctx.rank % RANKS_PER_NODE),
        LOCAL_WORLD_SIZE=str(RANKS_PER_NODE), WORLD_SIZE=str(ctx.world_size),
    )  # fmt: skip
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def train(ctx: RankContext, variant: str) -> dict[str, Any]:
    """50 steps of the example under ``variant``; the losses by step and the final checkpoint's path."""
    with as_two_nodes(ctx):
        run = run_example_in_rank(Path(ctx.tmpdir, variant), *SHAPE, f"--trainer.max_steps={STEPS}", *VARIANTS[variant])
    checkpoint = str(max((run / "checkpoints").glob("*.ckpt")))
    ctx.kept[variant] = checkpoint
    return {"losses": _losses(run), "checkpoint": checkpoint}


def _losses(run: Path) -> dict[int, float]:
    with open(run / "metrics.csv") as f:
        return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")}


for _variant in VARIANTS:
    GROUP.case(train, name=_variant, variant=_variant)


def zero3pp_loads_flat(ctx: RankContext) -> dict[str, dict[str, torch.Tensor]]:
    """``zero3pp``'s checkpoint validated at zero1, zero2 and zero3 on the same 4 ranks, as one node."""
    return {stage: _load(ctx.kept["zero3pp"], stage) for stage in ("zero1", "zero2", "zero3")}


def zero3_loads_under_zero3pp(ctx: RankContext) -> dict[str, torch.Tensor]:
    """And back: zero3's checkpoint validated under ``zero3pp`` on 2 nodes × 2."""
    with as_two_nodes(ctx):
        return _load(ctx.kept["zero3"], "zero3pp", num_nodes=WORLD_SIZE // RANKS_PER_NODE, devices=RANKS_PER_NODE)


GROUP.case(zero3pp_loads_flat)
GROUP.case(zero3_loads_under_zero3pp)


def fabric_fit(ctx: RankContext, **options: Any) -> dict[str, Any]:
    """Fabric's loop (``fabric_loop.train``: gradient accumulation 2, clipping by norm) on 2 nodes × 2."""
    from fabric_loop import train as fabric_train

    with as_two_nodes(ctx):
        return fabric_train(ctx, "zero3", steps=3, accumulate=2, clip="norm", num_nodes=WORLD_SIZE // RANKS_PER_NODE, **options)


GROUP.case(fabric_fit, name="fabric_zero3")
GROUP.case(fabric_fit, name="fabric_hpz", secondary_shard_size="node")
GROUP.case(fabric_fit, name="fabric_zero3pp", secondary_shard_size="node", quantize_weights=True, quantize_gradients=True)


def _load(path: str, strategy: str, **trainer_kwargs: Any) -> dict[str, torch.Tensor]:
    """The example's module validated under ``strategy`` from the checkpoint at ``path``: the full
    weights it then holds (on every rank)."""
    import sys

    from example_runs import EXAMPLES
    from lightning_helpers import full_weights, make_trainer

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    from train_gpt import GPTLightningModule

    module = GPTLightningModule(block_size=32, n_layer=2, n_head=2, n_embd=32)
    trainer = make_trainer(strategy, 1, limit_val_batches=1, **trainer_kwargs)
    trainer.validate(module, _batches(), ckpt_path=path, verbose=False)
    return {k.removeprefix("model."): v for k, v in full_weights(module, trainer.strategy).items()}


def _batches():
    from torch.utils.data import DataLoader, TensorDataset

    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)


def _load_on_2_ranks(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    os.environ["WORLD_SIZE"] = str(world_size)
    return _load(path, "zero3")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("zero_pp"))


def _saved_weights(path: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    from lightning_zero import convert_checkpoint

    state = torch.load(convert_checkpoint(path, tmp_path / f"{Path(path).parent.parent.parent.parent.name}.pt"), weights_only=False)
    return {k.removeprefix("model."): v for k, v in state["state_dict"].items()}


def test_hpz_trains_bitwise_as_zero3(results: GroupResults, tmp_path: Path) -> None:
    zero3, hpz = results["zero3"][0], results["hpz"][0]
    assert len(zero3["losses"]) == STEPS and hpz["losses"] == zero3["losses"]
    saved, with_hpz = _saved_weights(zero3["checkpoint"], tmp_path), _saved_weights(hpz["checkpoint"], tmp_path)
    assert saved.keys() == with_hpz.keys()
    for name, value in saved.items():
        assert torch.equal(with_hpz[name], value), name


@pytest.mark.parametrize("variant", ["qwz", "qgz", "qgz_int4", "zero3pp"])
def test_quantized_variants_follow_zero3(results: GroupResults, variant: str) -> None:
    reference, quantized = results["zero3"][0]["losses"], results[variant][0]["losses"]
    assert quantized.keys() == reference.keys() and len(reference) == STEPS
    worst = max(abs(quantized[s] - reference[s]) / reference[s] for s in reference)
    assert worst <= STEP_TOLERANCE, (variant, worst)
    tail = range(STEPS - 10, STEPS)
    assert abs(sum(quantized[s] - reference[s] for s in tail) / len(tail)) <= TAIL_TOLERANCE, variant
    assert quantized[STEPS - 1] < reference[0] - 2.0  # and it trained
    assert any(quantized[s] != reference[s] for s in reference)  # the quantized collectives ran


def test_zero3pp_checkpoints_load_at_every_stage_and_world_size_and_back(results: GroupResults, tmp_path: Path) -> None:
    saved = _saved_weights(results["zero3pp"][0]["checkpoint"], tmp_path)
    for rank_result in results["zero3pp_loads_flat"]:
        for stage, loaded in rank_result.items():
            assert all(torch.equal(loaded[k], v) for k, v in saved.items()), stage
    for loaded in run_on_ranks(_load_on_2_ranks, results["zero3pp"][0]["checkpoint"], world_size=2, init_process_group=False):
        assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    from_zero3 = _saved_weights(results["zero3"][0]["checkpoint"], tmp_path)
    for loaded in results["zero3_loads_under_zero3pp"]:
        assert all(torch.equal(loaded[k], v) for k, v in from_zero3.items())


def test_fabric_trains_with_zero_plus_plus(results: GroupResults) -> None:
    """Fabric on 2 nodes × 2 with accumulation and clipping by norm: hpZ bitwise zero3 (losses, clipped
    norms, weights); all three within the loss tolerance of zero3, its norms within 5%."""
    for zero3, hpz, zpp in zip(results["fabric_zero3"], results["fabric_hpz"], results["fabric_zero3pp"]):
        assert hpz["losses"] == zero3["losses"] and hpz["norms"] == zero3["norms"]
        assert all(torch.equal(hpz["weights"][k], v) for k, v in zero3["weights"].items())
        assert zpp["losses"] != zero3["losses"]
        assert all(abs(q - z) <= STEP_TOLERANCE * abs(z) for q, z in zip(zpp["losses"], zero3["losses"]))
        assert all(abs(q - z) <= 0.05 * z for q, z in zip(zpp["norms"], zero3["norms"]))
