"""lightning-zero: ZeRO stages 1-3 as a PyTorch Lightning strategy.

``import lightning_zero`` registers the strategy names (``zero1``, ``zero2``, ...) in Lightning's
``StrategyRegistry``, so ``Trainer(strategy="zero2")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.engine import MemoryReport, ZeroConfig, ZeroEngine, ZeroStage
from lightning_zero.strategy import ZeroStrategy

ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = ["MemoryReport", "ZeroConfig", "ZeroEngine", "ZeroStage", "ZeroStrategy"]
