"""Which way an optimizer steps under ZeRO: flat chunks, or whole tensors on owner ranks.

[Note: step granularity]
An element-wise optimizer (SGD, Adam, AdamW, ...) updates each element from that element's
gradient and state and a few scalars, so stepping this rank's flat chunk of a parameter gives the
same values as stepping the whole parameter: the chunk path, where every rank steps its chunks.

A whole-tensor optimizer looks across a tensor: Muon orthogonalizes the 2-D momentum, Adafactor
factors second moments over rows and columns, Shampoo and SOAP keep per-dimension preconditioners,
LAMB and LARS scale by per-tensor norms. On a flat chunk each would train a different model (or
refuse the 1-D gradient). Such an optimizer steps each of its parameters as the full tensor on one
owner rank (``tensor_owners.py``, ``whole_tensor_step.py``), at a cost of moving each parameter's
gradient and weight to its owner and the update back.

The choice is the engine's, never the user's to get wrong silently: known element-wise classes take
the chunk path; everything else, including a class the engine does not know, takes the whole-tensor
path (always right), and a class the engine does not know gets one line saying how to declare it
element-wise for speed (``ZeroConfig.elementwise_optimizers``). No optimizer is special-cased in
the step itself.
"""

from __future__ import annotations

import enum
import warnings
from typing import Sequence

from torch.optim import Optimizer

from lightning_zero.engine.comm import collectives


class StepGranularity(enum.Enum):
    """What an optimizer's step is handed for each parameter (see [Note: step granularity])."""

    CHUNKS = "flat chunks"
    WHOLE_TENSORS = "whole tensors on owner ranks"


TORCH_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop")
"""torch.optim's element-wise optimizers."""

LIBRARY_ELEMENTWISE: dict[str, tuple[str, ...]] = {
    # schedule-free (Defazio et al.): Adam/SGD-style element-wise updates; `train()`/`eval()` move the
    # weights between two points, element-wise too (see `weight_swaps.py`)
    "schedulefree": (
        "AdamWScheduleFree", "AdamWScheduleFreeReference", "AdamWScheduleFreeClosure", "AdamWScheduleFreePaper",
        "SGDScheduleFree", "SGDScheduleFreeReference", "SGDScheduleFreeClosure", "RAdamScheduleFree",
        "RAdamScheduleFreeClosure",
    ),
}  # fmt: skip
"""Element-wise optimizer classes of well-known libraries, by top-level package."""

WHOLE_TENSOR = {
    "torch": ("Muon", "Adafactor"),
    "pytorch_optimizer": (
        "Lamb", "LARS", "SOAP", "Shampoo", "ScalableShampoo", "Muon", "AdaMuon", "AdaGO", "Adafactor",
        "CAME", "SM3", "Kron", "PSGD", "Scion", "SCIONLight", "Galore", "Lomo", "AdaLomo", "Ranger21",
    ),
    "distributed_shampoo": ("DistributedShampoo",),
}  # fmt: skip
"""Whole-tensor optimizer classes the engine knows, by top-level package: they take the whole-tensor
path like any unknown class, but without the hint line."""

REFUSED = {
    "LBFGS": "re-evaluates the loss several times per step through its closure, and each evaluation"
    " would need its own gradient reduction",
    "SparseAdam": "steps sparse gradients, which ZeRO's reduce-scatter of dense buckets does not produce",
}
"""torch.optim classes no path can step, and why."""


def _package(cls: type) -> str:
    return cls.__module__.split(".")[0]


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_declared(cls: type, declared: Sequence[str]) -> bool:
    return any(name in (cls.__name__, cls.__qualname__, _qualified(cls)) for name in declared)


def _in(table: dict[str, tuple[str, ...]], cls: type) -> bool:
    return cls.__name__ in table.get(_package(cls), ())


def check_steppable(optimizer: Optimizer) -> None:
    """Raise for a class no path can step (``REFUSED``), naming why and what works."""
    for base in type(optimizer).__mro__:
        if _package(base) == "torch" and base.__name__ in REFUSED:
            raise ValueError(
                f"{type(optimizer).__name__} {REFUSED[base.__name__]}; lightning-zero cannot step it. Every other"
                " torch.optim optimizer works, element-wise ones (Adam, AdamW, SGD, ...) on flat chunks and"
                " whole-tensor ones (Muon, Adafactor, ...) on owner ranks."
            )


def step_granularity(optimizer: Optimizer, declared_elementwise: Sequence[str] = ()) -> StepGranularity:
    """How ``optimizer`` steps (see [Note: step granularity]), decided by its class: the most derived
    class the engine knows (or the user declared) counts, so a subclass of AdamW is element-wise."""
    cls = type(optimizer)
    for base in cls.__mro__:
        if base is Optimizer or base is object:
            break
        if _is_declared(base, declared_elementwise):
            return StepGranularity.CHUNKS
        if _package(base) == "torch" and base.__name__ in TORCH_ELEMENTWISE and base.__module__.startswith("torch.optim"):
            return StepGranularity.CHUNKS
        if _in(LIBRARY_ELEMENTWISE, base):
            return StepGranularity.CHUNKS
        if _in(WHOLE_TENSOR, base):
            return StepGranularity.WHOLE_TENSORS
    _hint_once(cls)
    return StepGranularity.WHOLE_TENSORS


def steps_bucket_by_bucket(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s own ``step``, run once per bucket on the bucket's parameters, gives what
    one step over all of them gives: torch's element-wise optimizers, whose steps keep everything
    they count per parameter. Others may count steps in their param groups (schedule-free's ``k``),
    which a step per bucket would advance once per bucket; their host step stays after backward
    (see [Note: the host step during backward] in ``offload/step_ahead.py``)."""
    step = type(optimizer).step
    step = getattr(step, "__wrapped__", step)  # torch's hook wrapper
    name = type(optimizer).__name__
    return name in TORCH_ELEMENTWISE and getattr(step, "__module__", "").startswith("torch.optim")


_HINTED: set[str] = set()


def _hint_once(cls: type) -> None:
    """One line per unknown class, on rank 0: it works as it is; declaring it element-wise is faster."""
    name = _qualified(cls)
    if name in _HINTED or collectives.rank() != 0:
        return
    _HINTED.add(name)
    warnings.warn(
        f"lightning-zero steps {cls.__name__}, an optimizer it does not know, on whole tensors (each parameter on"
        " one owner rank), which trains exactly as unsharded. If its update is element-wise (no per-tensor norms"
        f" or shapes), `ZeroStrategy(elementwise_optimizers=[{name!r}])` steps flat chunks instead, which is faster.",
        stacklevel=3,
    )
