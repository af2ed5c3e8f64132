"""Counts of the host work an aten-op count cannot see: storage resizes and hook registrations.

[Note: host work counts]
On a fast GPU in bf16 a step is host time, and part of that host time never reaches torch's
dispatcher: growing or shrinking a storage (``untyped_storage().resize_``), registering an autograd
or module hook. The engine counts each where it does it, in one process-wide :class:`HostWork`
(``HOST_WORK``), so the benchmark can report them per step and tests can assert them (after
warm-up a stage-3 step registers no hook and resizes at most two storages per unit: one grow, one
shrink per gather). Counting is one integer add; it is always on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class HostWork:
    """Running totals; read two snapshots and subtract (``since``)."""

    storage_resizes: int = 0
    """``untyped_storage().resize_`` calls made by the engine (grow or shrink)."""
    hook_registrations: int = 0
    """Autograd and module hooks the engine registered (tensor, multi-grad, module, accumulate-grad)."""

    def snapshot(self) -> "HostWork":
        return HostWork(**{f.name: getattr(self, f.name) for f in fields(self)})

    def since(self, earlier: "HostWork") -> "HostWork":
        """What was counted after ``earlier`` (a snapshot)."""
        return HostWork(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})


HOST_WORK = HostWork()
"""The process's counts (one engine per process in training; tests take differences)."""
