"""The GPT example end to end under every config in configs/ and under a strategy named on the command
line (a short `fit` on two processes each), and its data module's determinism.

The strategy named on the command line runs as a user runs it: `python examples/train_gpt.py fit ...`
in a subprocess, whose Lightning launcher starts the second rank. The configs run the same command
line in one group of two ranks (the script's `main()` in each), one after the other, which spares
the two processes' start-up (~10 CPU-seconds a run on 2 cores) and is the same fit."""

import csv
from pathlib import Path

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext
from example_runs import EXAMPLES, REPO, TINY_MODEL, run_example, run_example_in_rank
from lightning_zero.cli.model_spec import count_parameters

# configs/*.yaml are train_gpt.py's, but for the other examples' own (tests/test_examples_hf_litgpt.py)
OTHER_EXAMPLES_CONFIGS = {"hf_zero3.yaml", "litgpt_pretrain.yaml"}
CONFIGS = sorted(path for path in (REPO / "configs").glob("*.yaml") if path.name not in OTHER_EXAMPLES_CONFIGS)

# Small enough that a run takes a few seconds once its processes are up, big enough that every part
# runs: 2 blocks (two stage-3 units besides the root), the tied head, a validation pass and a checkpoint
# after step 2, and a memory measurement at every step.
TINY = [
    *TINY_MODEL,
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=2",
    "--trainer.devices=2",
    "--trainer.accelerator=cpu",
    "--memory_monitor.every_n_steps=1",
]


GROUP = CaseGroup(world_size=2)


def fit_config(ctx: RankContext, config: Path) -> str:
    """`train_gpt.py fit --config CONFIG` with TINY, in this rank; the run's log directory."""
    return str(run_example_in_rank(Path(ctx.tmpdir, config.stem), f"--config={config}", *TINY))


for _config in CONFIGS:
    GROUP.case(fit_config, name=_config.stem, config=_config)


@pytest.fixture(scope="module")
def config_runs(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("configs"))


def _read_run(run_dir: Path) -> list[dict[str, str]]:
    """The rows of a run's metrics.csv, once it is checked that the run saved a checkpoint and that
    validation ran and saw an untrained model's loss."""
    assert list((run_dir / "checkpoints").iterdir()), "the default ModelCheckpoint saved nothing"
    with open(run_dir / "metrics.csv") as metrics:
        rows = list(csv.DictReader(metrics))
    val_losses = [float(row["val_loss"]) for row in rows if row.get("val_loss")]
    assert val_losses, "validation never ran"
    # An untrained byte-level model predicts about uniformly: ln(256) = 5.55 nats per byte.
    assert all(4.0 < loss < 6.5 for loss in val_losses), val_losses
    return rows


def _assert_memory_matches_estimate(rows: list[dict[str, str]]) -> None:
    """ZeroMemoryMonitor logged both ranks' model states, and where the weights live (sharded or not, on
    the device or the host) is what the estimator predicts for the strategy the config names."""
    logged = [row for row in rows if row.get("memory/rank1/total_MB")]
    assert logged, "ZeroMemoryMonitor logged nothing: not a ZeroStrategy?"
    last = {key: float(value) for key, value in logged[-1].items() if key.startswith("memory/") and value}
    for rank in (0, 1):
        assert last[f"memory/rank{rank}/total_MB"] > 0
        for place in ("device", "host"):
            predicted = last[f"memory/estimate/{place}/parameters_MB"]
            assert last[f"memory/rank{rank}/{place}/parameters_MB"] == pytest.approx(predicted, rel=0.03), place


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.stem)
def test_train_gpt_with_each_config(config_runs, config):
    run_dir = Path(config_runs[config.stem][0])  # the ranks' run, logged by rank 0
    _assert_memory_matches_estimate(_read_run(run_dir))


def test_train_gpt_with_strategy_named_on_the_command_line(tmp_path):
    rows = _read_run(run_example(tmp_path, "--trainer.strategy=zero3", *TINY))
    _assert_memory_matches_estimate(rows)
    # Stage 3 it is: each of the 2 ranks holds half of the fp32 weights.
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}  # TINY's
    num_params = count_parameters("lightning_zero.models.gpt:GPT", {"config": shape})
    key = "memory/rank0/device/parameters_MB"
    logged = [float(row[key]) for row in rows if row.get(key)]
    assert logged and logged[-1] == pytest.approx(4 * num_params / 2 / 1e6, rel=0.03)


def test_stdlib_corpus_is_deterministic_and_byte_level(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from stdlib_corpus import StdlibCorpus, read_corpus

    first, second = (StdlibCorpus(block_size=32, batch_size=4, max_bytes=50_000, val_fraction=0.1) for _ in range(2))
    for datamodule in (first, second):
        datamodule.setup("fit")

    corpus = read_corpus(50_000)
    assert corpus.dtype == torch.uint8 and len(corpus) == 50_000
    assert torch.equal(torch.cat([first.train_data, first.val_data]), corpus)
    assert len(first.val_data) == 5_000  # the last 10%
    assert torch.equal(first.train_data, second.train_data) and torch.equal(first.val_data, second.val_data)
    assert b"def " in bytes(first.train_data.tolist())  # it is Python source

    for loader in ("train_dataloader", "val_dataloader"):
        a, b = getattr(first, loader)().dataset, getattr(second, loader)().dataset
        assert torch.equal(a.offsets, b.offsets), f"{loader}: windows differ between two builds"
        inputs, targets = a[len(a) - 1]
        assert inputs.shape == targets.shape == (32,) and inputs.dtype == torch.int64
        assert torch.equal(inputs[1:], targets[:-1])  # targets are the inputs shifted by one byte
        assert 0 <= int(inputs.min()) and int(inputs.max()) < 256

    # A different seed draws different training windows, over the same split.
    other = StdlibCorpus(block_size=32, batch_size=4, max_bytes=50_000, seed=7)
    other.setup("fit")
    assert not torch.equal(other.train_dataloader().dataset.offsets, first.train_dataloader().dataset.offsets)
