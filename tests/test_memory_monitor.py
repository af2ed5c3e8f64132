"""ZeroMemoryMonitor: each rank's model-state bytes by kind and place reach the Trainer's logger, next to
the estimator's prediction, and agree with it where the two count the same thing."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
from lightning_zero import estimate as est
from lightning_zero.cli import model_spec
from lightning_zero.engine import ZeroStage
from lightning_zero.estimate_schemes import SCHEMES, Layout
from lightning_zero.lightning.memory_monitor import PRECISION_SCHEMES, ZeroMemoryMonitor, estimate_per_rank
from lightning_zero.models.gpt import GPT, GPTConfig

GPT_SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16}
STRATEGIES = {"zero3": 1, "zero3_offload": 2}
"""Strategy name: batches per optimizer step."""
WORLD_SIZE = 2
STEPS = 2


def logged(metrics: dict[str, float], rank: int, place: str, kind: str) -> float:
    return metrics[f"memory/rank{rank}/{place}/{kind}_bytes"]


class TinyGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(**GPT_SHAPE))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch  # (B, T), (B, T)
        _, loss = self.model(inputs, targets)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _token_windows() -> DataLoader:
    tokens = torch.randint(0, 256, (16, GPT_SHAPE["block_size"] + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)


def _fit(strategy: str, log_dir: str, devices: int, accumulate_grad_batches: int) -> ZeroMemoryMonitor:
    monitor = ZeroMemoryMonitor(every_n_steps=1, unit="bytes")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate_grad_batches,
        logger=CSVLogger(log_dir, name=strategy, version=0),
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyGPT(), _token_windows())
    return monitor


GROUP = CaseGroup(world_size=WORLD_SIZE)


def monitored_fit(ctx: RankContext, strategy: str) -> dict[str, float]:
    """A fit under `strategy` with the monitor logging every step: its latest values."""
    # The offloaded run accumulates gradients over 2 batches: the monitor still measures once per step.
    return _fit(strategy, ctx.tmpdir, ctx.world_size, STRATEGIES[strategy]).latest


for _strategy in STRATEGIES:
    GROUP.case(monitored_fit, name=_strategy, strategy=_strategy)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("memory_monitor")


@pytest.fixture(scope="module")
def results(log_dir) -> GroupResults:
    return GROUP.run(log_dir)


def _predicted(layout: Layout) -> est.MemoryEstimate:
    num_params = model_spec.count_parameters("lightning_zero.models.gpt:GPT", {"config": GPT_SHAPE})
    return est.estimate(num_params, layout, SCHEMES["fp32"], est.Topology(devices=WORLD_SIZE))


def test_stage3_parameter_bytes_match_the_estimator(results):
    predicted = _predicted(Layout(ZeroStage.PARAMETERS)).device
    for metrics in results["zero3"]:  # every rank holds every rank's values
        for rank in range(WORLD_SIZE):
            # Chunks are padded per parameter, and Adam's step counters are unpriced: a fraction of a percent here.
            assert logged(metrics, rank, "device", "parameters") == pytest.approx(predicted.parameters, rel=0.03)
            assert logged(metrics, rank, "device", "gradients") == pytest.approx(predicted.gradients, rel=0.03)
            assert logged(metrics, rank, "device", "optimizer_state") == pytest.approx(predicted.optimizer_state, rel=0.03)
            assert logged(metrics, rank, "host", "optimizer_state") == 0
        # The monitor's own estimate columns are the estimator's figures for this layout.
        assert metrics["memory/estimate/device/parameters_bytes"] == predicted.parameters
        assert metrics["memory/estimate/device/optimizer_state_bytes"] == predicted.optimizer_state


def test_offloaded_run_logs_optimizer_state_on_host_only(results):
    layout = Layout(ZeroStage.PARAMETERS, offload_optimizer=True, offload_params=True)
    host_share = _predicted(layout).host.optimizer_state // WORLD_SIZE  # the estimator's host bytes are per node
    metrics = results["zero3_offload"][0]
    for rank in range(WORLD_SIZE):
        assert logged(metrics, rank, "device", "optimizer_state") == 0
        assert logged(metrics, rank, "host", "optimizer_state") == pytest.approx(host_share, rel=0.03)
        assert logged(metrics, rank, "device", "parameters") == 0
        assert logged(metrics, rank, "host", "parameters") > 0
    assert metrics["memory/estimate/host/optimizer_state_bytes"] == host_share
    assert metrics["memory/estimate/device/optimizer_state_bytes"] == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_values_reach_the_logger(results, log_dir, strategy):
    with open(log_dir / strategy / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("memory/rank1/total_bytes")]
    # Once per optimizer step, at the step Lightning logs that batch's own metrics at (0 for the first).
    assert [int(row["step"]) for row in rows] == list(range(STEPS))
    latest = results[strategy][0]
    assert {key: float(rows[-1][key]) for key in latest} == latest


def test_no_op_with_one_warning_under_another_strategy(tmp_path):
    monitor = ZeroMemoryMonitor(every_n_steps=1)
    trainer_args = dict(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        callbacks=[monitor],
        logger=CSVLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.warns(UserWarning, match="ZeroMemoryMonitor does nothing under SingleDeviceStrategy"):
        L.Trainer(**trainer_args).fit(TinyGPT(), _token_windows())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(**trainer_args).fit(TinyGPT(), _token_windows())
    assert not [w for w in caught if "ZeroMemoryMonitor" in str(w.message)]
    assert monitor.latest == {}


def test_estimate_per_rank_maps_precision_and_splits_host_bytes():
    strategy = lightning_zero.ZeroStrategy(stage=2, offload_optimizer=True)
    psi, devices, nodes = 1_000_000, 4, 2
    fp32 = estimate_per_rank(psi, strategy, "32-true", devices, nodes)
    assert fp32 is not None
    # stage 2 over 8 ranks: full fp32 weights here; on the host 1/8 of the gradients, and 1/8 of the
    # master copy and the moments (see [Note: offloaded state] in estimate.py)
    assert fp32.device == est.StateBytes(parameters=4 * psi, gradients=0, optimizer_state=0)
    assert fp32.host == est.StateBytes(gradients=4 * psi // 8, optimizer_state=12 * psi // 8)
    # autocast keeps fp32 model states; true half precision adds the engine's fp32 master chunk
    assert estimate_per_rank(psi, strategy, "bf16-mixed", devices, nodes) == fp32
    bf16 = estimate_per_rank(psi, strategy, "bf16-true", devices, nodes)
    assert bf16 is not None and bf16.host.optimizer_state == 12 * psi // 8
    assert PRECISION_SCHEMES["64-true"].total_bytes == 32
    assert estimate_per_rank(psi, strategy, "transformer-engine", devices, nodes) is None
    # NVMe: the moments go to disk in two slots (a step writes the slot its read did not come from),
    # the host keeps 4 buffers of a bucket's (before setup: the
    # configured bucket size, 1 MiB here = 262,144 fp32 parameters, 32,768 per rank)
    nvme = lightning_zero.ZeroStrategy(stage=2, offload_optimizer="nvme", nvme_path="/tmp", bucket_size_mb=1)
    on_disk = estimate_per_rank(psi, nvme, "32-true", devices, nodes)
    assert on_disk.device == fp32.device and on_disk.disk == 2 * 8 * psi // 8
    assert on_disk.host == est.StateBytes(gradients=4 * psi // 8, optimizer_state=4 * psi // 8 + 4 * 8 * 32_768)


def test_rejects_bad_options():
    with pytest.raises(ValueError, match="every_n_steps"):
        ZeroMemoryMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match="bytes, KB, MB, GB"):
        ZeroMemoryMonitor(unit="MiB")  # type: ignore[arg-type]
