"""lightning-zero: ZeRO stages 1-3 as a PyTorch Lightning strategy.

``import lightning_zero`` registers the strategy names (``zero1``, ``zero2``, ...) in Lightning's
``StrategyRegistry`` and in Fabric's, so ``Trainer(strategy="zero2")`` and ``Fabric(strategy="zero2")``
work: at once where Lightning is imported, else as soon as the program imports it
(``registration.py``), so that the console tools, which need only the engine, start without it.

The packages, with dependencies pointing one way (``cli`` → ``bench``, ``checkpoint``,
``lightning``, ``fabric`` → ``engine``; nothing imports ``cli``):

- ``engine``: ZeRO itself, torch only (partitioning, buckets, collectives, hooks, offload, the
  sharded optimizer, the memory report);
- ``checkpoint``: the sharded on-disk format (manifest, atomic commit, DCP I/O, converter);
- ``lightning``: the Trainer's adapter; ``fabric``: Fabric's (the only packages that import Lightning);
- ``estimate``: ZeRO's memory arithmetic, shared by the monitor, the bench and the CLI;
- ``bench``: the benchmark library; ``cli``: the ``lightning-zero`` console script;
- ``models``: the GPT the example, the bench and the tests train;
- ``compat``: what differs between the supported torch and Lightning releases, and the range
  itself, checked first here.
"""

import importlib
from typing import TYPE_CHECKING, Any

from lightning_zero.compat.versions import check_supported_versions

check_supported_versions()  # before anything that would fail deep inside on an older torch or Lightning

from lightning_zero.engine import MemoryReport, StateBytes, ZeroConfig, ZeroEngine, ZeroStage  # noqa: E402
from lightning_zero.registration import register_with_lightning  # noqa: E402

if TYPE_CHECKING:  # for type checkers and the API reference; at run time `__getattr__` imports them
    from lightning_zero.checkpoint import checkpoint_file, convert_checkpoint
    from lightning_zero.fabric import ZeroFabricStrategy
    from lightning_zero.lightning import ZeroMemoryMonitor, ZeroStrategy
    from lightning_zero.lightning.cli import ZeroCLI

_IMPORTED_ON_FIRST_USE = {
    "ZeroCLI": "lightning_zero.lightning.cli",
    "ZeroFabricStrategy": "lightning_zero.fabric",
    "ZeroMemoryMonitor": "lightning_zero.lightning",
    "ZeroStrategy": "lightning_zero.lightning",
    "checkpoint_file": "lightning_zero.checkpoint",
    "convert_checkpoint": "lightning_zero.checkpoint",
}
"""The names whose packages import Lightning (the adapters, see ``registration.py``; ``ZeroCLI`` also
its LightningCLI) or torch.distributed.checkpoint and DTensor (``checkpoint``, ~0.9 CPU-seconds): a
console tool that needs neither starts without them."""


def __getattr__(name: str) -> Any:
    if name in _IMPORTED_ON_FIRST_USE:
        return getattr(importlib.import_module(_IMPORTED_ON_FIRST_USE[name]), name)
    raise AttributeError(f"module 'lightning_zero' has no attribute {name!r}")


register_with_lightning()

__all__ = [
    "MemoryReport",
    "StateBytes",
    "ZeroCLI",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroFabricStrategy",
    "ZeroStage",
    "ZeroStrategy",
    "ZeroMemoryMonitor",
    "checkpoint_file",
    "convert_checkpoint",
]
