"""``ZeroMemoryMonitor``: the model-state bytes each rank holds, logged next to the estimator's figure.

``lightning-zero estimate`` predicts memory before a run; this callback measures it during one, from
``ZeroStrategy.memory_report()``, so a user can see the two agree (or where they do not) for their own
model, stage, offload, precision and world size.

[Note: per-rank values and the logger]
Ranks hold different amounts (the last rank's chunks are shorter; offload moves terms to the host),
so a value per rank is the point. Lightning's ``self.log`` with ``sync_dist`` would average them, and
without it only rank 0's values reach the logger (loggers write on rank 0). So the monitor all-gathers
one small integer tensor per logging step, and rank 0 writes every rank's values under
``memory/rank{r}/...`` keys. It writes to ``trainer.loggers`` directly, at its own interval, rather
than through ``self.log``, whose values wait for the Trainer's ``log_every_n_steps``.

[Note: the estimator's scheme for each Lightning precision]
The estimator prices a parameter as weights + gradients + optimizer state (``estimate_schemes.SCHEMES``).
What the engine holds under each Lightning precision:
- ``32-true``: fp32 weights and gradients, Adam's two fp32 moments: the "fp32" scheme (4 + 4 + 8).
- ``bf16-mixed`` / ``16-mixed``: autocast casts activations, not model states; the weights stay fp32,
  so this is the "fp32" scheme too, not the paper's "mixed".
- ``bf16-true`` / ``16-true``: half weights and gradients; the engine keeps an fp32 master chunk that
  the optimizer steps, with fp32 moments: the paper's "mixed" scheme (2 + 2 + 12).
- ``64-true``: twice the fp32 scheme (8 + 8 + 16), a scheme of its own here.
Any other precision is logged without an estimate.

Where measurement and estimate differ by design:
- With offload, the engine keeps each offloaded bucket's gradient row on the host for good (the CPU
  optimizer steps them there), and so does the estimator; during accumulation a second row (the
  landing buffer, see ``engine/offload/host_chunks.py``) is not in the estimate.
- The estimator has no buffers term; the engine's ``buffers`` are logged, not estimated.
- The estimator rounds Ψ/N up once; the engine pads each parameter's chunk, so the first ranks hold
  up to N-1 elements per parameter more, the last ones less (a fraction of a percent for real models).
- Adam's per-parameter ``step`` counters are optimizer state the estimator does not price.
- Frozen parameters have no gradients or optimizer state; the estimator counts them as trained.
- Stage 3 counts the full weights of units gathered at the moment of measurement; measuring at the end
  of a training batch, after every unit is freed again, leaves only the chunks.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_zero import estimate as est
from lightning_zero.engine import MemoryReport, StateBytes
from lightning_zero.engine.config import resolve_shard_group_size
from lightning_zero.estimate_schemes import SCHEMES, Layout, PrecisionScheme
from lightning_zero.lightning.strategy import ZeroStrategy

ByteUnit = Literal["bytes", "KB", "MB", "GB"]

UNITS: dict[str, int] = {"bytes": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}
"""Decimal units, as the estimator prints them (and GPU spec sheets state capacities)."""

KINDS = ("parameters", "gradients", "optimizer_state", "buffers")
"""The engine's ``StateBytes`` fields, in the order they travel in the gathered tensor."""

PLACES = ("device", "host")

PRECISION_SCHEMES: dict[str, PrecisionScheme] = {
    "32-true": SCHEMES["fp32"],
    "bf16-mixed": SCHEMES["fp32"],
    "16-mixed": SCHEMES["fp32"],
    "bf16-true": SCHEMES["mixed"],
    "16-true": SCHEMES["mixed"],
    "64-true": PrecisionScheme(
        "fp64",
        weight_bytes=8,
        gradient_bytes=8,
        optimizer_bytes=16,
        description="fp64 weights, gradients and Adam moments (Lightning's 64-true)",
    ),
}
"""The estimator's scheme for each Lightning precision: see [Note: the estimator's scheme for each
Lightning precision]."""


def estimate_per_rank(
    num_params: int, strategy: ZeroStrategy, precision: str, devices: int, nodes: int, frozen_params: int = 0
) -> Optional[MemoryReport]:
    """The estimator's prediction for one rank of `strategy` training `num_params` parameters,
    `frozen_params` of them frozen (weights only: see [Note: frozen parameters] in
    `lightning_zero.estimate`), as a report of the engine's kind (buffers 0), or None when
    `precision` has no scheme (see `PRECISION_SCHEMES`)."""
    scheme = PRECISION_SCHEMES.get(precision)
    if scheme is None:
        return None
    config = strategy.zero_config
    layout = Layout(config.zero_stage, config.offload_optimizer, config.offload_params)
    shard_group_size = resolve_shard_group_size(strategy.shard_group_size, devices * nodes, devices)
    # NVMe's host buffers are sized by the largest bucket (at stage 3 a unit): the engine's own, where it exists
    buckets = strategy.engine.buckets if strategy.engine is not None else ()
    bucket_bytes = max((b.param_bytes for b in buckets), default=config.bucket_bytes)
    nvme = est.NvmeStaging(bucket_bytes=bucket_bytes, buffer_count=config.nvme_buffer_count)
    topology = est.Topology(devices, nodes, shard_group_size)
    predicted = est.estimate(
        num_params, layout, scheme, topology, nvme, frozen_params=frozen_params, keep_frozen_units_mb=config.keep_frozen_units_mb
    )
    return MemoryReport(
        device=predicted.device,
        host=predicted.host_per_rank,
        disk=predicted.disk_per_rank,
        kept_frozen_units=predicted.kept_frozen_units_per_rank,
    )


class ZeroMemoryMonitor(Callback):
    """Logs the model-state bytes every rank holds, by kind and place, beside the estimator's figure.

    Every ``every_n_steps`` optimizer steps (at the end of the training batch, when gradients and
    optimizer state exist and stage 3's units are freed again) it logs, through every logger the
    Trainer has (rank 0 writes; see [Note: per-rank values and the logger])::

        memory/rank{r}/{device,host}/{parameters,gradients,optimizer_state,buffers}_{unit}
        memory/rank{r}/total_{unit}
        memory/estimate/{device,host}/{parameters,gradients,optimizer_state}_{unit}   (one rank's share)
        memory/estimate/total_{unit}

    The latest values are also kept in ``latest`` (the same dict on every rank), for use without a
    logger. Under a strategy other than ``ZeroStrategy`` it warns once and does nothing.

    Args:
        every_n_steps: optimizer steps between measurements; None follows the Trainer's
            ``log_every_n_steps``. Each measurement is one small all-gather.
        unit: "bytes", or decimal "KB", "MB" or "GB" (the estimator's units); it is part of each key.
    """

    def __init__(self, every_n_steps: Optional[int] = None, unit: ByteUnit = "MB") -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive number of steps or None, got {every_n_steps}")
        if unit not in UNITS:
            raise ValueError(f"unknown unit {unit!r}; choose one of: {', '.join(UNITS)}")
        self.every_n_steps = every_n_steps
        self.unit = unit
        self.latest: dict[str, float] = {}
        self._estimate: Optional[MemoryReport] = None
        self._active = False
        self._warned: set[str] = set()
        self._last_step = 0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        self._active = isinstance(strategy, ZeroStrategy) and strategy.engine is not None
        self._last_step = trainer.global_step  # not 0 when resuming
        if not self._active:
            self._warn_once(
                f"ZeroMemoryMonitor does nothing under {type(strategy).__name__}: it reads the memory report"
                " of lightning_zero.ZeroStrategy. HINT: train with strategy='zero1', 'zero2', 'zero3', ... or"
                " remove the callback."
            )
            return
        assert strategy.engine is not None  # checked above; for type checkers
        # every parameter at its full size (at stage 3 too: a chunk keeps its parameter's shape), the
        # frozen ones in no optimizer included (stages 1-2 keep them whole, outside the engine)
        managed = {id(sp.param): sp.layout.numel for sp in strategy.engine.params}
        params = list(pl_module.parameters())
        num_params = sum(managed.get(id(p), p.numel()) for p in params)
        frozen = sum(managed.get(id(p), p.numel()) for p in params if not p.requires_grad)
        precision = str(trainer.precision)
        self._estimate = estimate_per_rank(num_params, strategy, precision, trainer.num_devices, trainer.num_nodes, frozen)
        if self._estimate is None:
            self._warn_once(
                f"ZeroMemoryMonitor logs no estimate for precision {precision!r}: the estimator has no"
                f" bytes-per-parameter scheme for it (known: {', '.join(PRECISION_SCHEMES)})."
            )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # Only after a batch that stepped the optimizer (not between the micro-batches of gradient
        # accumulation, nor before the first step): then gradients and optimizer state both exist.
        stepped, self._last_step = step != self._last_step, step
        interval = self.every_n_steps or trainer.log_every_n_steps
        if not self._active or not stepped or step % interval:
            return
        assert isinstance(trainer.strategy, ZeroStrategy)
        per_rank = self._gather(trainer, trainer.strategy.memory_report(), pl_module.device)
        self.latest = self._metrics(per_rank)
        if trainer.is_global_zero:
            # The step Lightning's own logging (and its DeviceStatsMonitor) gives this batch, so these
            # values share a row with `train_loss` in tabular loggers.
            logged_step = trainer.fit_loop.epoch_loop._batches_that_stepped
            for logger in trainer.loggers:
                logger.log_metrics(self.latest, step=logged_step)

    def _gather(self, trainer: Trainer, report: MemoryReport, device: torch.device) -> list[list[int]]:
        """Every rank's report as rows of ``PLACES`` x ``KINDS`` byte counts, in rank order."""
        local = [getattr(getattr(report, place), kind) for place in PLACES for kind in KINDS]
        # int64: byte counts past 2^31 are common; one collective for all ranks' values
        gathered = trainer.strategy.all_gather(torch.tensor(local, dtype=torch.int64, device=device))
        return gathered.reshape(trainer.world_size, len(local)).tolist()

    def _metrics(self, per_rank: list[list[int]]) -> dict[str, float]:
        size, suffix = UNITS[self.unit], self.unit
        metrics: dict[str, float] = {}
        for rank, row in enumerate(per_rank):
            values = iter(row)
            for place in PLACES:
                for kind in KINDS:
                    metrics[f"memory/rank{rank}/{place}/{kind}_{suffix}"] = next(values) / size
            metrics[f"memory/rank{rank}/total_{suffix}"] = sum(row) / size
        if self._estimate is not None:
            for place in PLACES:
                predicted: StateBytes = getattr(self._estimate, place)
                for kind in KINDS[:-1]:  # the estimator has no buffers term
                    metrics[f"memory/estimate/{place}/{kind}_{suffix}"] = getattr(predicted, kind) / size
            metrics[f"memory/estimate/total_{suffix}"] = self._estimate.total / size
        return metrics

    def _warn_once(self, message: str) -> None:
        """Warn about each problem once per callback, not at every `fit` the callback is reused in."""
        if message not in self._warned:
            self._warned.add(message)
            rank_zero_warn(message)
