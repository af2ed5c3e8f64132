"""Device values the host must see, read together in one sync per backward.

[Note: deferred verdicts]
A value read on the host inside forward or backward (``.item()``, ``.tolist()``) makes the host wait
for the device right there; on a GPU that drains the launch queue at every read. So each place that
needs a verdict from the device — every bucket's used-parameter flags, stage 3's unit tags (see
[Note: unit tags] in ``unit.py``) — leaves its tensor here with what to do with the values, and
``read`` fetches all of them at once: after each backward, before any optimizer step can use the
gradients they decide, and after each evaluation step.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

Consumer = Callable[[list[float]], None]


class HostReads:
    """A queue of (device tensor, consumer) pairs, emptied by one host sync."""

    def __init__(self) -> None:
        self._queued: list[tuple[Tensor, Consumer]] = []

    def add(self, values: Tensor, consume: Consumer) -> None:
        """Read ``values`` (any shape) at the next ``read``; ``consume`` gets them flat, as floats.
        They are copied (one small kernel), so the buffer they came from may be reused at once."""
        self._queued.append((values.detach().reshape(-1).to(torch.float32, copy=True), consume))

    @property
    def pending(self) -> bool:
        """Whether a ``read`` now would read anything (and so make a host sync)."""
        return bool(self._queued)

    def read(self) -> None:
        """One host sync for everything queued, then every consumer in the order they were added."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        values = (queued[0][0] if len(queued) == 1 else torch.cat([t for t, _ in queued])).tolist()
        start = 0
        for tensor, consume in queued:
            end = start + tensor.numel()
            consume(values[start:end])
            start = end
