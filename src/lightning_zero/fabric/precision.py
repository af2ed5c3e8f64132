"""Which of Fabric's precision plugins ``ZeroFabricStrategy`` trains with, and the grad scaler swap
that makes mixed precision's skipped steps agree across ranks."""

from __future__ import annotations

from typing import Optional

from lightning.fabric.plugins import Precision
from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

from lightning_zero.engine.gradients.grad_scaler import ZeroGradScaler

SUPPORTED_PRECISION = (Precision, DoublePrecision, HalfPrecision, MixedPrecision)
"""Fabric's precision plugins this strategy trains correctly with (exactly these classes)."""


def checked_precision(precision: Optional[Precision]) -> Optional[Precision]:
    """``precision``, refused unless supported, its grad scaler (if any) replaced by a ``ZeroGradScaler``."""
    if precision is not None and type(precision) not in SUPPORTED_PRECISION:
        raise ValueError(
            f"lightning-zero does not support Fabric's {type(precision).__name__}: it trains with"
            " precision='32-true', '64-true', '16-true', 'bf16-true', '16-mixed' or 'bf16-mixed'."
        )
    scaler = getattr(precision, "scaler", None)
    if scaler is not None and not isinstance(scaler, ZeroGradScaler):
        # each rank sees only its gradient shard: the skip decision must be taken together
        precision.scaler = ZeroGradScaler.like(scaler)  # type: ignore[union-attr]
    return precision
