"""pytest plugin (``-p collect_candidates``, with ``--collect-only``): writes to ``$LZ_CANDIDATES`` the ids of
collected tests that may start ranks with a DDP strategy: not skipped by a mark here, and naming DDP
(``ddp`` in the id, in the test's source or in a same-module function it calls, a DDP name or a
``DDPStrategy`` among its parameters or the module constants it names). A sieve only: ``derive_ids.py``
then probes which of them really launch.
"""

from __future__ import annotations

import inspect
import os
import re


def _skipped(item) -> bool:
    for mark in item.iter_markers("skip"):
        return True
    for mark in item.iter_markers("skipif"):
        condition = mark.args[0] if mark.args else mark.kwargs.get("condition", False)
        if not isinstance(condition, str) and condition:
            return True
    return False


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _is_ddp(value, depth: int = 0) -> bool:
    """A DDP strategy name or ``DDPStrategy``, or a container holding one (a module constant)."""
    from lightning.pytorch.strategies import DDPStrategy

    if isinstance(value, str):
        return value.lower().startswith("ddp")
    if isinstance(value, DDPStrategy):
        return True
    if isinstance(value, dict) and depth < 2:
        value = list(value.values())
    return isinstance(value, (list, tuple, set)) and depth < 2 and any(_is_ddp(v, depth + 1) for v in value)


def _names_ddp(item) -> bool:
    if "ddp" in item.nodeid.lower():
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    if any(_is_ddp(v) for v in params.values()):
        return True
    function = getattr(item, "function", None)
    module = inspect.getmodule(function)
    texts = [_source(function)]
    for name in set(re.findall(r"\b([A-Za-z_]\w*)\b", texts[0])):  # the module constants it names
        value = getattr(module, name, None)
        if not callable(value) and _is_ddp(value):
            return True
    for name in set(re.findall(r"\b([A-Za-z_]\w*)\(", texts[0])):  # one level into the module's helpers it calls
        helper = getattr(module, name, None)
        if inspect.isfunction(helper) and helper.__module__ == getattr(module, "__name__", None):
            texts.append(_source(helper))
    return any("ddp" in text.lower() for text in texts)


def pytest_collection_modifyitems(session, config, items):
    path = os.environ["LZ_CANDIDATES"]
    with open(path, "w") as f:
        for item in items:
            if not _skipped(item) and _names_ddp(item):
                f.write(item.nodeid + "\n")
