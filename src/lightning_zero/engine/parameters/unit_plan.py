"""Which parameters form a ZeRO-3 *unit*: the parameters gathered together, in one collective,
just before their module runs.

Policy: a module is a unit root when its class is named in ``unit_classes``; with no classes
given, when it is an element of a container (``nn.ModuleList``, ``nn.ModuleDict``,
``nn.Sequential``) — the shape of transformer blocks and most layer stacks. Either way a
candidate with fewer than ``min_unit_params`` parameters stays in its parent's unit. The top
module is always a unit (the *root unit*) holding every parameter no other unit claims: embeddings,
final norms, heads, and parameters used directly in ``training_step``. A parameter shared by
modules of different units (tied weights) belongs to their innermost common unit, so one gather
always brings all of its uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass
class UnitPlan:
    """One planned unit: its module, and the parameters (by name) it gathers."""

    name: str  # module path, "" for the root
    module: nn.Module
    param_names: list[str] = field(default_factory=list)

    @property
    def is_root(self) -> bool:
        return self.name == ""


def plan_units(
    module: nn.Module, unit_classes: Optional[Sequence[str]] = None, min_unit_params: int = 0
) -> list[UnitPlan]:
    """Units in module pre-order (the root first), each with its parameters' first names."""
    wanted = set(unit_classes or ())
    known = {type(m).__name__ for m in module.modules()}
    missing = wanted - known
    if missing:
        raise ValueError(
            f"unit_classes names {sorted(missing)}, but the model has no module of that class. Module"
            f" classes in the model: {sorted(known)}."
        )
    container_children = {id(child) for m in module.modules() if isinstance(m, _CONTAINERS) for child in m.children()}

    def is_unit_root(name: str, m: nn.Module) -> bool:
        if name == "":
            return True
        chosen = type(m).__name__ in wanted if wanted else id(m) in container_children and not isinstance(m, _CONTAINERS)
        return chosen and sum(p.numel() for p in m.parameters()) >= min_unit_params

    # the unit path (chain of unit names from the root) of every module
    unit_path: dict[int, tuple[str, ...]] = {}
    units: dict[str, UnitPlan] = {}
    for name, m in module.named_modules():
        parent_path = unit_path.get(id(_parent(module, name)), ()) if name else ()
        if is_unit_root(name, m):
            unit_path[id(m)] = parent_path + (name,)
            units[name] = UnitPlan(name, m)
        else:
            unit_path[id(m)] = parent_path

    # every parameter (once, under its first name) goes to the innermost unit shared by all its owners
    first_name: dict[int, str] = {}
    owners: dict[int, list[tuple[str, ...]]] = {}
    for module_name, m in module.named_modules():
        for local_name, p in m.named_parameters(recurse=False):
            first_name.setdefault(id(p), f"{module_name}.{local_name}" if module_name else local_name)
            owners.setdefault(id(p), []).append(unit_path[id(m)])
    for pid, paths in owners.items():
        common = paths[0]
        for path in paths[1:]:
            common = _common_prefix(common, path)
        units[common[-1]].param_names.append(first_name[pid])
    return [unit for unit in units.values() if unit.param_names or unit.is_root]


def _parent(root: nn.Module, name: str) -> nn.Module:
    parent_name = name.rpartition(".")[0]
    return root.get_submodule(parent_name) if parent_name else root


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
