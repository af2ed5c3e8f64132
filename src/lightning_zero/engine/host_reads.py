"""Device values the host must see, read together in one sync per backward.

[Note: deferred verdicts]
A value read on the host inside forward or backward (``.item()``, ``.tolist()``) makes the host wait
for the device right there; on a GPU that drains the launch queue at every read. So each place that
needs a verdict from the device — today every bucket's used-parameter flags — leaves its tensor
here with what to do with the values, and ``read`` fetches all of them at once after backward,
before any optimizer step can use the gradients they decide.

Stage 3's unit tags are not deferred this way (see ``Bucket.start_param_gather``): ranks whose
forwards diverged would issue different numbers of all-gathers and hang before a deferred verdict
is read.
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
        """Read ``values`` (any shape) at the next ``read``; ``consume`` gets them flat, as floats."""
        self._queued.append((values.detach().reshape(-1).float(), consume))

    def read(self) -> None:
        """One host sync for everything queued, then every consumer in the order they were added."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        values = torch.cat([t for t, _ in queued]).tolist()
        start = 0
        for tensor, consume in queued:
            end = start + tensor.numel()
            consume(values[start:end])
            start = end
