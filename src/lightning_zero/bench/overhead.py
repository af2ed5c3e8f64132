"""What a step costs the host besides compute: operators dispatched and host-device syncs.

[Note: why count instead of time]
On a GPU the host queues kernels ahead of the device, so work proportional to the number of
parameters hides behind compute until something makes the host wait for the device (a sync); then
every queued Python call and kernel launch adds to the step. Two counts predict that cost on any
machine, CPU included, and do not drift with load:

- **aten ops per step**: every operator call torch's dispatcher sees in the step (forward, backward,
  optimizer, and whatever the implementation adds around them). A kernel launch on CUDA is roughly
  one op; copies, views and fills done per parameter show up here.
- **host syncs per step**: calls that make the host wait for the device's result: ``.item()``,
  ``.tolist()``, ``.numpy()``, ``bool(tensor)``, and copies of a device tensor to the CPU (``.cpu()``,
  ``.to("cpu")``). On a CPU-only run they do not wait for anything, but the same calls sync on a
  GPU, so they are counted all the same (except copies whose source already is on the CPU). Each
  is attributed to lightning-zero when one of the frames calling it is in the package's engine or
  Lightning adapter (not this benchmark, not the model) and none between is torch's optimizers' (an
  offloaded step runs the user's optimizer, whose calls DDP's step makes too), and to the forward/backward part of the
  step when it happens before the step's ``"backward"`` probe point.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_PACKAGE = Path(__file__).resolve().parents[1]
_OURS = tuple(str(_PACKAGE / name) for name in ("engine", "lightning", "checkpoint"))
"""Source folders whose calls are "ours" (the bench and the models are not)."""
_OPTIMIZERS = str(Path(torch.optim.__file__).parent)
"""torch's optimizers: a call of theirs is the optimizer's, also where the engine steps it on the host."""


@dataclass(frozen=True)
class Overhead:
    """One step's dispatcher and host-sync counts on one rank; see [Note: why count instead of time]."""

    aten_ops: int
    """aten operators dispatched in the step."""
    host_syncs: int
    """Host-device syncs in the step, from anywhere (torch, the model, the implementation)."""
    host_syncs_ours: int
    """Of those, the ones lightning-zero's code made."""
    host_syncs_ours_forward_backward: int
    """Of ours, the ones made during forward and backward (the target is 0)."""
    host_syncs_ours_by_call: dict[str, int]
    """Ours, by call and the function that made it (e.g. ``tolist in _finish_gradient_reduction``)."""


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops:`` counts the aten operators dispatched inside (``ops.count``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.recording = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        if self.recording and func.namespace == "aten":
            self.count += 1
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """Counts host-device sync calls while installed (see [Note: why count instead of time])."""

    def __init__(self) -> None:
        self.total = 0
        self.ours = 0
        self.ours_forward_backward = 0
        self.ours_by_call: Counter[str] = Counter()
        self.in_forward_backward = True
        self.recording = True
        self._thread = threading.current_thread()

    def record(self, call: str) -> None:
        # a read on another thread (the host step during backward reads landed host rows) stalls
        # no training thread: only the thread that installed the counter counts
        if not self.recording or threading.current_thread() is not self._thread:
            return
        self.total += 1
        frame = sys._getframe(2)  # the caller of the patched method
        while frame is not None:
            if frame.f_code.co_filename.startswith(_OPTIMIZERS):
                return  # the optimizer's own (a step counter's `.item()`), as under DDP, where the engine steps it too
            if frame.f_code.co_filename.startswith(_OURS):
                self.ours += 1
                self.ours_forward_backward += self.in_forward_backward
                self.ours_by_call[f"{call} in {frame.f_code.co_name}"] += 1
                return
            frame = frame.f_back

    @contextlib.contextmanager
    def installed(self) -> Iterator[HostSyncCounter]:
        """Patch the sync-making ``torch.Tensor`` methods for the duration of the block."""
        originals: dict[str, Callable[..., Any]] = {}

        def counting(name: str, is_sync: Callable[..., bool]) -> Callable[..., Any]:
            original = originals[name] = getattr(torch.Tensor, name)

            def method(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if is_sync(tensor, *args, **kwargs):
                    self.record(name)
                return original(tensor, *args, **kwargs)

            return method

        always = lambda tensor, *args, **kwargs: True  # noqa: E731
        patches = {
            "item": always,
            "tolist": always,
            "numpy": always,
            "__bool__": always,
            "cpu": lambda tensor, *args, **kwargs: tensor.device.type != "cpu",
            "to": lambda tensor, *args, **kwargs: tensor.device.type != "cpu" and _targets_cpu(args, kwargs),
        }
        for name, is_sync in patches.items():
            setattr(torch.Tensor, name, counting(name, is_sync))
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)


def _targets_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` moves to the CPU."""
    for value in (*args, kwargs.get("device")):
        if isinstance(value, (str, torch.device)) and torch.device(value).type == "cpu":
            return True
    return False


def overhead_of(ops: OpCounter, syncs: HostSyncCounter) -> Overhead:
    return Overhead(
        aten_ops=ops.count,
        host_syncs=syncs.total,
        host_syncs_ours=syncs.ours,
        host_syncs_ours_forward_backward=syncs.ours_forward_backward,
        host_syncs_ours_by_call=dict(syncs.ours_by_call),
    )
