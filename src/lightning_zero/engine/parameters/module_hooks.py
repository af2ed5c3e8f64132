"""Forward hooks (and the link to the engine) that the engine puts in the user's modules, left out of
copies and pickles of them.

[Note: engine entries are not copied]
Stage 3 gathers a unit in a forward pre-hook of its module and frees it in a forward hook, Fabric's
strategy hooks the root module at every stage to see where its steps begin and end, and a module the
engine holds sharded keeps a link to it (``module_link.py``). torch keeps a module's hooks, like its
attributes, in the module's ``__dict__``, so ``torch.save(model)`` or ``copy.deepcopy(model)`` while
an engine holds the module (a callback saving the LightningModule inside ``fit``) would pickle the
engine's closures, which fails ("Can't pickle local object"), or copy them, giving a copy whose
forward gathers and frees the *original*'s units. DDP keeps nothing in the module (its reducer lives
in the wrapper): its pickle and its copy are plain modules.

So a module the engine keeps entries in gets, in its instance ``__dict__``, a ``__getstate__``
(:class:`_StateWithoutEngineEntries`): the module's own state, as its class gives it (torch's
``Module.__getstate__``, or the user's, such as ``LightningModule``'s, which drops the Trainer),
less the engine's entries in the hook dicts, less the engine's attributes (``leave_out_of_copies``)
and less itself. ``pickle`` and ``copy`` (through ``object.__reduce_ex__``) look ``__getstate__`` up
on the instance, so both take it: the pickle or copy keeps the user's own hooks and attributes,
names nothing of lightning-zero, and loads where it is not installed. It goes with the module's
last engine entry. The hook dicts stay the ones torch made, so every handle (the user's too) keeps
working and ``torch.compile`` sees torch's own dicts. It is done here, on the engine's entries,
because the module's class is the user's: a class switched per module (FSDP2's ``FSDP<Cls>``, which
refuses ``deepcopy``) would change what ``type(module)`` says. The values the pickle or copy holds:
a stage-3 parameter at rest pickles and copies as a full ``nn.Parameter`` (gathered: a collective,
see [Note: reads at rest] in ``shards/at_rest.py``); one gathered (inside a step) is a full
``nn.Parameter`` already; stages 1-2 keep full parameters, whose own pickling leaves out the
engine's gradient hooks.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Callable, Optional

from torch import nn
from torch.utils.hooks import RemovableHandle

_STATE = "__getstate__"
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
"""The dicts of a module's ``__dict__`` that hold forward hooks or their flags, keyed by handle id."""


class ModuleHooks:
    """The forward hooks one part of the engine puts on modules; ``remove`` takes them all off."""

    def __init__(self) -> None:
        self._added: list[tuple[weakref.ref[nn.Module], RemovableHandle]] = []

    def __bool__(self) -> bool:
        """Whether any hook is on."""
        return bool(self._added)

    def add_forward_pre(self, module: nn.Module, hook: Callable[..., Any], with_kwargs: bool = False) -> None:
        self._keep(module, module.register_forward_pre_hook(hook, with_kwargs=with_kwargs))

    def add_forward(self, module: nn.Module, hook: Callable[..., Any], with_kwargs: bool = False) -> None:
        self._keep(module, module.register_forward_hook(hook, with_kwargs=with_kwargs))

    def _keep(self, module: nn.Module, handle: RemovableHandle) -> None:
        _entries_of(module).hook_ids.add(handle.id)
        self._added.append((weakref.ref(module), handle))

    def remove(self) -> None:
        for module_ref, handle in self._added:
            handle.remove()
            module = module_ref()
            if module is not None:
                _forget(module, hook_id=handle.id)
        self._added.clear()


def leave_out_of_copies(module: nn.Module, attribute: str) -> None:
    """The engine's ``attribute`` of ``module`` is left out of its pickles and copies from now on."""
    _entries_of(module).attributes.add(attribute)


def keep_in_copies(module: nn.Module, attribute: str) -> None:
    """Undoes ``leave_out_of_copies`` (the engine dropped the attribute)."""
    _forget(module, attribute=attribute)


def _entries_of(module: nn.Module) -> "_StateWithoutEngineEntries":
    held = module.__dict__.get(_STATE)
    if not isinstance(held, _StateWithoutEngineEntries):
        held = _StateWithoutEngineEntries(module)
        module.__dict__[_STATE] = held  # not `setattr`: Module.__setattr__ has nothing to do with it
    return held


def _forget(module: nn.Module, hook_id: Optional[int] = None, attribute: Optional[str] = None) -> None:
    """The engine's hook ``hook_id`` or its ``attribute`` is gone from ``module``; with the last of
    them, so is the module's ``__getstate__``."""
    held = module.__dict__.get(_STATE)
    if isinstance(held, _StateWithoutEngineEntries):
        held.hook_ids.discard(hook_id)
        held.attributes.discard(attribute)
        if not held.hook_ids and not held.attributes:
            del module.__dict__[_STATE]


class _StateWithoutEngineEntries:
    """The ``__getstate__`` of a module the engine keeps entries in (see [Note: engine entries are
    not copied])."""

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)  # the module holds this: no cycle
        self.hook_ids: set[int] = set()
        """Handle ids of the engine's hooks on the module."""
        self.attributes: set[str] = set()
        """Names of the engine's attributes of the module."""

    def __call__(self) -> Any:
        module = self._module()
        if module is None:  # the module is gone; nothing can pickle it
            raise RuntimeError("lightning-zero: the module this state belongs to no longer exists.")
        state = type(module).__getstate__(module)
        if not isinstance(state, Mapping):
            return state  # a class of the user's that pickles otherwise: its own business
        state = dict(state)  # never edit what a `__getstate__` returning `self.__dict__` hands out
        state.pop(_STATE, None)
        for attribute in self.attributes:
            state.pop(attribute, None)
        for key in _HOOK_DICTS:
            hooks = state.get(key)
            if isinstance(hooks, dict) and not self.hook_ids.isdisjoint(hooks):
                state[key] = type(hooks)((k, v) for k, v in hooks.items() if k not in self.hook_ids)
        return state
