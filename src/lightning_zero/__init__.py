"""lightning-zero: ZeRO stages 1-3 as a PyTorch Lightning strategy.

``import lightning_zero`` registers the strategy names (``zero1``, ``zero2``, ...) in Lightning's
``StrategyRegistry``, so ``Trainer(strategy="zero2")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.checkpoint import convert_checkpoint
from lightning_zero.engine import MemoryReport, StateBytes, ZeroConfig, ZeroEngine, ZeroStage
from lightning_zero.strategy import ZeroStrategy
from lightning_zero.memory_monitor import ZeroMemoryMonitor  # noqa: E402 - imports the strategy module

ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "MemoryReport",
    "StateBytes",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroStage",
    "ZeroStrategy",
    "ZeroMemoryMonitor",
    "convert_checkpoint",
]
