"""The Fabric adapter: ``ZeroFabricStrategy``, on the same engine as the Trainer's ``ZeroStrategy``.

Importing this package registers the strategy names (``zero1``, ``zero2``, ...) in Fabric's
``STRATEGY_REGISTRY``, so ``Fabric(strategy="zero3")`` works.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_zero.fabric.strategy import ZeroFabricStrategy

ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["ZeroFabricStrategy"]
