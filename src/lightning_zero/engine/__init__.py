"""The ZeRO engine: partitioning, buckets, collectives, hooks and the sharded optimizer.

Imports torch only, never Lightning, so it runs under any training loop.
"""

from lightning_zero.engine.config import ZeroConfig, ZeroStage
from lightning_zero.engine.zero import MemoryReport, StateBytes, ZeroEngine

__all__ = ["MemoryReport", "StateBytes", "ZeroConfig", "ZeroEngine", "ZeroStage"]
