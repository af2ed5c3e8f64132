"""The engine's start and end under ``ZeroStrategy``: at the Trainer's ``setup`` it is built
(stage 3 shards the module where it is; stages 1-2 first give every replica rank 0's weights, as
DDP does), or an earlier run's engine that kept the module sharded goes on; at ``teardown`` stage 3
leaves the module sharded where its chunks are (see [Note: after fit] in ``engine/parameters/module_link.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch.nn import Module

from lightning_zero.engine import ZeroEngine
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.node_links import NodeLinks
from lightning_zero.engine.config import ShardGroupSize, ZeroConfig, ZeroStage
from lightning_zero.engine.engine import linked_engine
from lightning_zero.engine.optimizer.sharded_optimizer import check_optimizer_type
from lightning_zero.lightning.model_summary import use_true_sizes_in_model_summary
from lightning_zero.lightning.precision import set_norm_group
from lightning_zero.lightning.uneven_evaluation import run_first


def start_engine(
    strategy: DDPStrategy,
    config: ZeroConfig,
    shard_group_size: ShardGroupSize,
    trainer: Trainer,
    fitting: bool,
    groups: tuple[collectives.ProcessGroup, collectives.ProcessGroup],
    links: Optional[NodeLinks] = None,
) -> Optional[ZeroEngine]:
    """The engine for this run of ``trainer`` (None when evaluating at stages 1-2, which need none);
    when ``fitting``, the strategy's optimizers are set up first, to be sharded by it. ``strategy``
    is the ``ZeroStrategy`` whose ``config`` and ``shard_group_size`` these are."""
    assert strategy.model is not None
    shard_group, replicate_group = groups
    set_norm_group(strategy.precision_plugin, shard_group, strategy.root_device)
    kept = _engine_to_resume(strategy, config, shard_group_size, shard_group)
    if kept is None:  # a module kept sharded has its dtypes already
        strategy.precision_plugin.convert_module(strategy.model)
    if config.zero_stage is ZeroStage.PARAMETERS:
        if fitting:  # before sharding, so that `configure_optimizers` sees the true shapes
            strategy.setup_optimizers(trainer)
        if kept is not None:  # the module stayed sharded after an earlier run (see [Note: after fit])
            kept.resume_training(strategy.optimizers if fitting else None)
            engine = kept
        else:
            engine = ZeroEngine(
                strategy.lightning_module,
                strategy.optimizers if fitting else [],
                config,
                group=shard_group,
                device=strategy.root_device,
                timeout=strategy._timeout,  # also for the all-gathers' own process group
                replicate_group=replicate_group,
                links=links,
            )
        use_true_sizes_in_model_summary(trainer, engine)
        run_first(trainer)  # ranks may run uneven evaluation inputs (see uneven_evaluation.py)
        return engine
    strategy.model_to_device()
    # every replica starts from rank 0's weights and buffers, as under DDP
    collectives.broadcast_tensors_(_module_tensors(strategy.model), src=0, group=None)
    if not fitting:
        return None
    strategy.setup_optimizers(trainer)
    return ZeroEngine(
        strategy.lightning_module, strategy.optimizers, config, group=shard_group,
        timeout=strategy._timeout, replicate_group=replicate_group,
    )  # fmt: skip


def check_optimizer_types(strategy: DDPStrategy) -> None:
    """Right after ``configure_optimizers``: refuse an optimizer the engine cannot shard."""
    try:
        for optimizer in strategy.optimizers:
            check_optimizer_type(optimizer)
    except TypeError:
        strategy.optimizers, strategy.lr_scheduler_configs = [], []  # nothing half-built to tear down
        raise


def _engine_to_resume(
    strategy: DDPStrategy, config: ZeroConfig, shard_group_size: ShardGroupSize, shard_group: collectives.ProcessGroup
) -> Optional[ZeroEngine]:
    """The engine an earlier run left holding the module sharded (see [Note: after fit] in
    ``engine/parameters/module_link.py``), if this run can go on with it: the same configuration over as
    many ranks, and no parameter it set up frozen unfrozen since. Any other engine first gives the
    module its full weights back (on every rank)."""
    held = linked_engine(strategy.lightning_module)
    if held is None:
        return None
    if (
        config.zero_stage is ZeroStage.PARAMETERS
        and held.config == config
        and collectives.world_size(held.group) == collectives.world_size(shard_group)
        and held.shard_group_size == shard_group_size
        and not held.unfrozen_since_setup  # which parameters train is fixed at an engine's setup
    ):
        return held
    held.release_parameters(strategy.root_device)
    return None


def teardown_keeping_shards(strategy: DDPStrategy) -> None:
    """Stage 3's teardown: the module stays sharded where its chunks are, as under Lightning's
    FSDPStrategy (Lightning's teardown would move it to the CPU, reading every parameter at rest)."""
    assert strategy.cluster_environment is not None and strategy.accelerator is not None
    strategy.cluster_environment.teardown()
    strategy.precision_plugin.teardown()
    strategy.accelerator.teardown()
    strategy.checkpoint_io.teardown()


def _module_tensors(module: Module) -> list[torch.Tensor]:
    return [p.data for p in module.parameters()] + list(module.buffers())
