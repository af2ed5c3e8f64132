"""Every process of the test suite imports torchmetrics without its two optional heavy imports, and
reads each group of entry points once (``entry_points_once.py``, next to this file).

Lightning imports torchmetrics, and torchmetrics imports, wherever they are installed (the test
extra installs both):

- ``transformers``, for its BERTScore (``torchmetrics.functional.text.bert``), ~1.3 CPU-seconds;
- ``matplotlib``, for its ``.plot()`` methods (``torchmetrics.utilities.plot``), ~0.6 CPU-seconds.

No test uses either through torchmetrics, and the suite starts ~50 Python processes of its own
(scripts, command-line tools, torchrun and spawned ranks, test workers), so ``conftest.py`` puts this
folder on ``PYTHONPATH`` for all of them and Python runs this file at start-up (``site``'s
``sitecustomize``); ``rank_imports.py`` imports it too. Tests that use ``transformers`` or
``matplotlib`` (the Hugging Face example, the benchmark's chart) import them themselves, unchanged.
Being first on ``PYTHONPATH``, this file hides any other ``sitecustomize`` from the test processes;
the folder is not named ``site`` so that nothing can take it for the standard library's module.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

_SKIPPED = {
    "_TRANSFORMERS_GREATER_EQUAL_4_4": "transformers is not imported by torchmetrics in the tests (tests/startup/sitecustomize.py)",
    "_MATPLOTLIB_AVAILABLE": "matplotlib is not imported by torchmetrics in the tests (tests/startup/sitecustomize.py)",
}


class _TorchmetricsWithoutOptionalImports(importlib.abc.MetaPathFinder):
    """Runs ``torchmetrics.utilities.imports`` as usual, then marks its checks for the two packages
    (lightning-utilities ``RequirementCache`` objects, evaluated lazily) as not met."""

    MODULE = "torchmetrics.utilities.imports"

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.MODULE:
            return None
        sys.meta_path.remove(self)  # once; and find the real module below without this finder
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            for flag, message in _SKIPPED.items():
                check = getattr(module, flag, None)
                if check is not None:  # another torchmetrics: no such flag, nothing skipped
                    check.available = False
                    check.message = message

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if "torchmetrics" not in sys.modules and not any(isinstance(f, _TorchmetricsWithoutOptionalImports) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchmetricsWithoutOptionalImports())

import entry_points_once  # noqa: E402 - this folder is on sys.path wherever this file runs

entry_points_once.install()
