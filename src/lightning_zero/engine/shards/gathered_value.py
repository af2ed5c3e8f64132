"""What a read of a stage-3 parameter at rest hands out, and how a write is told from a read.

A read at rest (see [Note: reads at rest] in ``at_rest.py``) runs on a full copy gathered for that
one read. Under DDP, ``p.detach()``, ``p.view(-1)``, ``p.data`` or ``p.cpu()`` (on a CPU model) alias
the parameter, so a write through them reaches it; here they alias the copy, where a write would be
lost without a word. So a result that aliases a gathered copy is a :class:`GatheredValue`: it reads
as any tensor (its own reads give plain tensors, copies such as ``clone()`` are plain tensors), and
refuses to be written, saying where writes go instead. Writes are recognised by torch's naming
(``add_``, ``copy_``, ``__setitem__``, ``__iadd__``, ``out=``), as ``torch.nn.init`` and optimizers
write through them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

WRITE_HINT = (
    " HINT: edit parameters inside `with trainer.strategy.summon_full_params(writeback=True):` (entered on"
    " every rank), or assign a full tensor to `param.data`, which every rank keeps its chunk of."
)


def written_tensors(func: Any, args: tuple, kwargs: Optional[dict]) -> list[Tensor]:
    """The tensors ``func(*args, **kwargs)`` writes into (in-place methods and functions, item
    assignment, augmented assignment, ``out=``); [] for a read."""
    name = getattr(func, "__name__", "")
    targets: list[Any] = []
    if kwargs and kwargs.get("out") is not None:
        targets.extend(tree_flatten(kwargs["out"])[0])
    in_place = name.endswith("_") and not name.endswith("__")
    augmented = name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__int__", "__invert__")
    if args and (in_place or augmented or name in ("__setitem__", "set_")):
        targets.extend(tree_flatten(args[0])[0])
    return [t for t in targets if isinstance(t, Tensor)]


class GatheredValue(Tensor):
    """A tensor aliasing a full copy gathered for a read at rest: readable, never written."""

    _names: str
    """The parameter(s) it was read from, for the message."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            written = [t for t in written_tensors(func, args, kwargs) if isinstance(t, GatheredValue)]
            if written:
                raise RuntimeError(
                    f"`{getattr(func, '__name__', func)}` writes into values read from parameter {written[0]._names!r} at"
                    " rest (lightning-zero stage 3): they are a copy gathered for that read, and a write to it would"
                    " not reach the parameter." + WRITE_HINT
                )
            sources = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, GatheredValue)]
            result = func(*args, **(kwargs or {}))
            return keep_read_only(result, sources, sources[0]._names if sources else "")

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # printed as the plain tensor it reads as
        with torch._C.DisableTorchFunctionSubclass():
            return repr(self.as_subclass(Tensor))

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickled (torch.save) as the plain tensor it reads as
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(Tensor).__reduce_ex__(protocol)


def keep_read_only(result: Any, sources: list[Tensor], names: str) -> Any:
    """``result`` with every tensor that aliases one of ``sources`` (a gathered copy) made a
    :class:`GatheredValue`; other tensors and non-tensors as they are. Call it with torch
    functions of subclasses disabled."""
    storages = {s.untyped_storage().data_ptr() for s in sources if s.numel() > 0}
    if not storages:
        return result

    def mark(t: Any) -> Any:
        if type(t) is Tensor and t.numel() > 0 and t.untyped_storage().data_ptr() in storages:
            value = t.as_subclass(GatheredValue)
            value._names = names
            return value
        return t

    return tree_map(mark, result)
