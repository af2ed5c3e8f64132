"""Optimizer methods outside the step that reach the module: schedule-free optimizers' ``train()``
and ``eval()``, which move the weights, and every optimizer's ``zero_grad()``, which frees the
gradients ``param.grad`` shows (see ``gradients/grad_window.py``).

A schedule-free optimizer (``schedulefree.AdamWScheduleFree`` and its kin) trains at one point and
evaluates at another: ``optimizer.eval()`` moves every parameter to the averaged point before
validation, ``optimizer.train()`` back. Under ZeRO those methods move what the optimizer holds, the
chunks (or, for a whole-tensor optimizer, the owners' whole tensors), so the module's weights must
follow, as after a step: stages 1-2 all-gather the chunks into the parameters, stage 3 refreshes
what is gathered or copied to the device.

So a bound optimizer's ``train`` and ``eval`` (where it has them: ``torch.optim.Optimizer`` has
neither) run where the optimizer can run them (``around()``: whole tensors on owners, or nothing),
then ``refresh()`` makes the module see the result; ``zero_grad`` is followed by
``after_zero_grad()``, so that a parameter whose gradient chunk it freed shows None, as under DDP.
They are wrapped on a subclass made for this one
optimizer, not on the instance: Lightning's and Fabric's optimizer wrappers copy the optimizer's
class and find methods there before they reach the optimizer. A collective: call them on every
rank, as Lightning hooks do.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional

from torch.optim import Optimizer

SWAP_METHODS = ("train", "eval")


class WeightSwaps:
    """``optimizer``'s ``train()``/``eval()``, followed by ``refresh()`` and run inside ``around()``;
    its ``zero_grad()``, followed by ``after_zero_grad()``."""

    def __init__(
        self,
        optimizer: Optimizer,
        refresh: Callable[[], None],
        around: Callable[[], AbstractContextManager],
        after_zero_grad: Optional[Callable[[], None]] = None,
    ) -> None:
        self._optimizer = optimizer
        self._user_class = cls = type(optimizer)
        methods = {name: _then_refresh(getattr(cls, name), refresh, around) for name in SWAP_METHODS if callable(getattr(cls, name, None))}
        if after_zero_grad is not None:
            methods["zero_grad"] = _then_refresh(cls.zero_grad, after_zero_grad, nullcontext)
        if methods:

            def __reduce_ex__(self: Optimizer, protocol: Any) -> Any:  # noqa: N807
                # pickled and copied as the user's class: the engine's wrapping stays in this process
                return _rebuilt, (cls, self.__getstate__())

            names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__reduce_ex__": __reduce_ex__}
            optimizer.__class__ = type(cls.__name__, (cls,), {**methods, **names})

    @property
    def wraps(self) -> bool:
        return type(self._optimizer) is not self._user_class

    def close(self) -> None:
        """The optimizer's own class again."""
        if self.wraps:
            self._optimizer.__class__ = self._user_class


def _rebuilt(cls: type, state: Any) -> Any:
    """An instance of ``cls`` with ``state`` (what ``pickle`` and ``copy`` make of a wrapped optimizer)."""
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


def _then_refresh(method: Callable[..., Any], refresh: Callable[[], None], around: Callable[[], AbstractContextManager]) -> Callable[..., Any]:
    @functools.wraps(method)
    def then_refresh(self: Optimizer, *args: Any, **kwargs: Any) -> Any:
        with around():
            result = method(self, *args, **kwargs)
        refresh()
        return result

    return then_refresh
