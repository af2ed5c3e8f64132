"""lightning-zero: ZeRO stages 1-3 as a PyTorch Lightning strategy."""

from lightning_zero.engine import MemoryReport, ZeroConfig, ZeroEngine, ZeroStage

__all__ = ["MemoryReport", "ZeroConfig", "ZeroEngine", "ZeroStage"]
