"""lightning-zero: ZeRO stages 1-3 as a PyTorch Lightning strategy.

``import lightning_zero`` registers the strategy names (``zero1``, ``zero2``, ...) in Lightning's
``StrategyRegistry`` and in Fabric's, so ``Trainer(strategy="zero2")`` and ``Fabric(strategy="zero2")``
work.

The packages, with dependencies pointing one way (``cli`` → ``bench``, ``checkpoint``,
``lightning``, ``fabric`` → ``engine``; nothing imports ``cli``):

- ``engine``: ZeRO itself, torch only (partitioning, buckets, collectives, hooks, offload, the
  sharded optimizer, the memory report);
- ``checkpoint``: the sharded on-disk format (manifest, atomic commit, DCP I/O, converter);
- ``lightning``: the Trainer's adapter; ``fabric``: Fabric's (the only packages that import Lightning);
- ``estimate``: ZeRO's memory arithmetic, shared by the monitor, the bench and the CLI;
- ``bench``: the benchmark library; ``cli``: the ``lightning-zero`` console script;
- ``models``: the GPT the example, the bench and the tests train.
"""

from lightning_zero.checkpoint import checkpoint_file, convert_checkpoint
from lightning_zero.engine import MemoryReport, StateBytes, ZeroConfig, ZeroEngine, ZeroStage
from lightning_zero.fabric import ZeroFabricStrategy
from lightning_zero.lightning import ZeroMemoryMonitor, ZeroStrategy

__all__ = [
    "MemoryReport",
    "StateBytes",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroFabricStrategy",
    "ZeroStage",
    "ZeroStrategy",
    "ZeroMemoryMonitor",
    "checkpoint_file",
    "convert_checkpoint",
]
