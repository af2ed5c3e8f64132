"""The ZeRO engine: partitioning, buckets, collectives, hooks and the sharded optimizer.

Imports torch only, never Lightning, so it runs under any training loop (the Lightning adapter is
``lightning_zero.lightning``).
"""

from lightning_zero.engine.averaged_shards import AveragedShards, Buffers
from lightning_zero.engine.config import ZeroConfig, ZeroStage
from lightning_zero.engine.engine import ZeroEngine
from lightning_zero.engine.memory import MemoryReport, StateBytes

__all__ = ["AveragedShards", "Buffers", "MemoryReport", "StateBytes", "ZeroConfig", "ZeroEngine", "ZeroStage"]
