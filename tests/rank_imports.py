"""What every rank of ``multiprocess.run_on_ranks`` imports, once per test worker.

Importing torch, Lightning and lightning-zero costs a rank process ~4 CPU-seconds on the 2-core CI
machine, more than most groups of cases spend running. ``run_on_ranks`` therefore forks its ranks
from a server process that imported this module (a ``multiprocessing`` forkserver of its own): each
rank starts as a fresh copy of a process that has imported everything and run nothing, as a spawned
rank would be once its imports are done.

One import is left out, in the ranks only: torchmetrics (imported by Lightning) imports
``transformers`` at import time wherever it is installed (``torchmetrics.functional.text.bert``
holds ``AutoModel`` / ``AutoTokenizer`` for its BERTScore), ~1 CPU-second that no rank uses. Its
flag for that is turned off before torchmetrics reads it; a rank that imports ``transformers``
itself (the Hugging Face example's tests) still gets it.
"""

from __future__ import annotations

import gc
import importlib.abc
import importlib.util
import sys
from typing import Any


class _NoTransformersForBertScore(importlib.abc.MetaPathFinder):
    """Runs ``torchmetrics.utilities.imports`` as usual, then marks its ``transformers>=4.4`` check
    (a lightning-utilities ``RequirementCache``, evaluated lazily) as not met."""

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
            check = getattr(module, "_TRANSFORMERS_GREATER_EQUAL_4_4", None)
            if check is not None:  # another torchmetrics: no such flag, nothing skipped
                check.available = False
                check.message = "transformers is not imported in test ranks (tests/rank_imports.py)"

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if "torchmetrics" not in sys.modules:
    sys.meta_path.insert(0, _NoTransformersForBertScore())

import pytest  # noqa: E402,F401 - every test module imports it, and the ranks import the test modules
import torch  # noqa: E402,F401
import lightning  # noqa: E402,F401
import lightning_zero  # noqa: E402,F401

import lightning_helpers  # noqa: E402,F401 - and with it the test models and multiprocess

# Everything imported so far lives as long as the ranks: out of the collector's sight, a full
# collection in a rank (test_sharded_averaging counts live modules after one) walks only what the
# rank made, and the forked pages holding these objects are not copied by the walk.
gc.freeze()
