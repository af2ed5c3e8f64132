"""Every process of the test suite reads each group of entry points once.

Lightning looks up its external callbacks every time a ``Trainer`` or a ``Fabric`` is made
(``lightning.fabric.utilities.registry._load_external_callbacks`` calls
``importlib.metadata.entry_points(group=...)``), and Python 3.11 answers that by opening the
``entry_points.txt`` of every installed distribution: ~50 ms on the 2-core CI machine, about a
quarter of the CPU time of a one-step fit of the tests' GPT. The suite makes ~1,000 Trainers and
Fabrics, most of them in rank processes, so this module replaces ``importlib.metadata.entry_points``
(before Lightning imports it, from ``sitecustomize``) with one that keeps each answer for the life
of the process. The installed distributions do not change while the tests run; an answer is kept
per ``sys.path`` as well, so a test that puts a directory on the path is answered afresh. Calls
without a selection (``entry_points()``, a mutable mapping before Python 3.12) are passed through.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
from typing import Any

_uncached = getattr(importlib.metadata.entry_points, "__wrapped__", importlib.metadata.entry_points)
_answers: dict[Any, Any] = {}


@functools.wraps(_uncached)
def entry_points(**params: Any) -> Any:
    if not params:
        return _uncached()
    key = (tuple(sys.path), tuple(sorted(params.items())))
    if key not in _answers:
        _answers[key] = _uncached(**params)
    return _answers[key]


def install() -> None:
    """Make ``importlib.metadata.entry_points`` this module's (once per process)."""
    importlib.metadata.entry_points = entry_points
