"""The host work of one training step that neither the aten-op count nor the collectives see.

[Note: host counts per step]
Every variant gets one more untimed step after its timed ones (`rank.py`), run with no dispatch
mode installed (the instrumented step's counters are Python themselves), in which three things are
counted:
- **Python calls**: every Python function call made by the step (`python_calls.py`, [Note: counting
  Python calls]): the model's forward, the implementation's hooks and bookkeeping, the optimizer;
- **storage resizes** and **hook registrations** the engine made (`engine/shards/host_work.py`, [Note: host
  work counts]); they are lightning-zero's own counts, so the baselines report 0 (DDP registers its
  hooks once in C++, FSDP2's are not counted).
Counting slows the step several-fold, so it never shares a step with the timed ones; every step of a
run does the same work after warm-up, so one counted step stands for all.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field

from torch import Tensor

from lightning_zero.bench.python_calls import count_python_calls
from lightning_zero.bench.wrappers import Wrapped
from lightning_zero.engine.shards.host_work import HOST_WORK

TOP_FUNCTIONS = int(os.environ.get("LIGHTNING_ZERO_BENCH_TOP_FUNCTIONS", "25"))
"""How many of the most called functions the JSON keeps per rank (to see where the calls go; the
environment variable keeps more, to read a variant's whole host work)."""


@dataclass(frozen=True)
class HostCounts:
    """One rank's counts of one step; see [Note: host counts per step]."""

    python_calls: int
    """Python function calls the step made."""
    storage_resizes: int
    """Storages lightning-zero's engine grew or shrank (`untyped_storage().resize_`)."""
    hook_registrations: int
    """Autograd and module hooks lightning-zero's engine registered."""
    top_functions: dict[str, int] = field(default_factory=dict)
    """The `TOP_FUNCTIONS` most called functions ("file.qualname:line") and their calls."""


def counted_step(wrapped: Wrapped, x: Tensor, y: Tensor) -> tuple[Tensor, HostCounts]:
    """One training step of `wrapped` with its host work counted; returns its loss and the counts.
    Cyclic garbage collection is held off meanwhile: the finalizers it runs are not the step's calls."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        before = HOST_WORK.snapshot()
        with count_python_calls() as calls:
            loss = wrapped.step(x, y)
        work = HOST_WORK.since(before)
    finally:
        if collecting:
            gc.enable()
    return loss, HostCounts(
        python_calls=calls.total,
        storage_resizes=work.storage_resizes,
        hook_registrations=work.hook_registrations,
        top_functions=calls.by_function(TOP_FUNCTIONS),
    )
