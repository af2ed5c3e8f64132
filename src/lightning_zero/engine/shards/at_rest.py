"""A stage-3 parameter at rest refuses to be read, instead of reading freed memory.

[Note: parameters at rest]
Between its unit's uses a stage-3 parameter is a view of a storage shrunk to 0 bytes (see [Note:
stage-3 storage] in ``gathered_storage.py``), with its true shape. Code that reads it then — a
callback averaging weights, ``p.clone()``, ``module.state_dict()``, ``copy.deepcopy(module)`` —
would read freed memory. So while at rest the parameter's class is :class:`ParameterAtRest`, whose
``__torch_function__`` lets through what describes the tensor (shape, dtype, device,
``requires_grad``, ``grad``, ``numel``, hooks) and refuses everything that would read or write its
values, naming the parameter and ``summon_full_params``. Gathering puts the parameter's own class
back, so a unit's forward and backward pay nothing for this: while gathered it is exactly an
``nn.Parameter``, as Dynamo and torch's fast paths expect. The switch is one ``__class__``
assignment per parameter in a loop over the unit (no Python call; 51 ns per parameter measured on
the CPU); a class per unit switched once would cost less but makes Dynamo guard on each unit's
class and recompile a compiled block once per unit. The engine's own reads of ``.grad`` at rest
run under ``torch._C.DisableTorchFunctionSubclass()``.

One write is adopted where it happens: ``param.data = full_tensor`` (loading pretrained weights
into a built model between steps) goes to the engine's adopter for the parameter, which keeps this
rank's chunk of the value, as stages 1-2 keep the tensor, and leaves the parameter at rest (a new
shape or dtype fails there, naming both).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

DESCRIBING = frozenset(
    {
        "numel", "nelement", "dim", "size", "stride", "is_contiguous", "storage_offset", "element_size",
        "data_ptr", "untyped_storage", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
        "__hash__", "__len__",
    }
)  # fmt: skip
"""Tensor methods that describe a tensor without its values (property getters and setters pass too,
except ``.data``, whose getter would hand out the empty placeholder)."""


class ParameterAtRest(nn.Parameter):
    """The class of a stage-3 parameter while only this rank's chunk of it exists."""

    names: dict[int, str] = {}
    """``id(param)`` → its name in the module, for the message (filled and emptied by the engine)."""
    adopters: dict[int, Callable[[torch.Tensor], bool]] = {}
    """``id(param)`` → what takes a tensor assigned to its ``.data``, True once it did (filled and
    emptied by the engine)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if _adopted(func, args):
            return None
        if _describes(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        at_rest = next((a for a in args if isinstance(a, ParameterAtRest)), None)
        raise RuntimeError(cls.refusal(at_rest, getattr(func, "__name__", str(func))))

    @staticmethod
    def refusal(param: Any, operation: str) -> str:
        """The message for ``operation`` on ``param`` (a subclass refuses for its own reason)."""
        return _message(param, operation)

    def __deepcopy__(self, memo: dict) -> Any:
        raise RuntimeError(type(self).refusal(self, "copy.deepcopy"))

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(type(self).refusal(self, "pickle"))

    def __repr__(self) -> str:
        name = ParameterAtRest.names.get(id(self), "?")
        return f"ParameterAtRest({name!r}, shape={tuple(self.shape)}: sharded by lightning-zero stage 3, at rest)"


def _describes(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property: only `.data`'s getter hands out values
        return not (name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") == "data")
    return name in DESCRIBING or name.startswith(("is_", "_is_"))  # predicates (`is_contiguous`, `_is_view`)


def _adopted(func: Any, args: tuple) -> bool:
    """Whether ``func(*args)`` is ``param.data = value`` and the engine adopted ``value``."""
    if getattr(func, "__name__", "") != "__set__" or getattr(getattr(func, "__self__", None), "__name__", "") != "data":
        return False
    adopt = ParameterAtRest.adopters.get(id(args[0]))
    return adopt is not None and adopt(args[1])


def _message(param: Any, operation: str) -> str:
    name = ParameterAtRest.names.get(id(param), "a parameter") if param is not None else "a parameter"
    return (
        f"`{operation}` on parameter {name!r}, which lightning-zero holds sharded (stage 3): outside its"
        " unit's forward and backward only this rank's chunk exists, so it would see no values. HINT:"
        " read or edit it inside `with trainer.strategy.summon_full_params():` (`writeback=True` keeps"
        " edits), which gathers every parameter on every rank."
    )


def is_at_rest(param: Any) -> bool:
    """Whether ``param`` refuses reads now (a stage-3 parameter whose unit is at rest)."""
    return isinstance(param, ParameterAtRest)


def put_to_rest(param: nn.Parameter) -> None:
    """After the placeholder is in: reads now fail loudly (plain ``nn.Parameter`` only)."""
    if type(param) is nn.Parameter:
        param.__class__ = ParameterAtRest


def wake(param: nn.Parameter) -> None:
    """Before the full data is in: the parameter's own class again."""
    if type(param) is ParameterAtRest:
        param.__class__ = nn.Parameter
