"""The Trainer's adapter (beside ``lightning_zero.fabric``, Fabric's): the packages that import Lightning.

``ZeroStrategy`` connects the Trainer's hooks to ``lightning_zero.engine``; its precision plugins,
model summary and checkpoint plumbing sit beside it, and ``ZeroMemoryMonitor`` is a callback.
Importing this package registers the strategy names (``zero1``, ``zero2``, ...) in Lightning's
``StrategyRegistry``, so ``Trainer(strategy="zero2")`` works, and lets ``load_from_checkpoint`` read
sharded checkpoint directories (``load_from_checkpoint.py``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.engine.gradients.grad_scaler import ZeroGradScaler
from lightning_zero.lightning import load_from_checkpoint
from lightning_zero.lightning.memory_monitor import ZeroMemoryMonitor
from lightning_zero.lightning.precision import ZeroPrecision
from lightning_zero.lightning.strategy import STRATEGY_NAMES, ZeroStrategy

ZeroStrategy.register_strategies(StrategyRegistry)
load_from_checkpoint.install()

__all__ = ["STRATEGY_NAMES", "ZeroGradScaler", "ZeroMemoryMonitor", "ZeroPrecision", "ZeroStrategy"]
