"""``import lightning_zero`` registers the strategy names in Lightning's registries, as soon as
Lightning is imported: at once if it is already, else right after the program imports it.

Lightning's import costs about 2.5 CPU-seconds (most of it ``torch._dynamo``, which Fabric's
wrappers import). The ``lightning-zero`` console tools (``estimate``, ``convert``, ``bench``) and the
benchmark's rank processes use the engine alone, so importing Lightning only where the program
does keeps them from paying for it. A program that builds a ``Trainer`` or ``Fabric`` has imported
Lightning by then, so the names are registered whichever of the two imports came first.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

LIGHTNING = "lightning"
ADAPTERS = ("lightning_zero.lightning", "lightning_zero.fabric")
"""The packages whose import registers the names (the Trainer's registry, Fabric's)."""


def register_with_lightning() -> None:
    """Register now if Lightning is imported, else as soon as it is."""
    if LIGHTNING in sys.modules:
        _import_adapters()
    elif not any(isinstance(finder, _AfterLightning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightning())


def _import_adapters() -> None:
    for name in ADAPTERS:
        importlib.import_module(name)


class _AfterLightning(importlib.abc.MetaPathFinder):
    """Finds ``lightning`` as the other finders would, and imports the adapters right after its
    ``__init__`` has run (Lightning's registries then exist and are filled with its own names)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != LIGHTNING:
            return None
        sys.meta_path.remove(self)  # once; and find the real package below without this finder
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _import_adapters()

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec
