"""Bucket collectives one after another with a bounded number in flight: the next one starts while
earlier ones finish, and the temporary buffers of only a few buckets exist at once."""

from __future__ import annotations

from collections import deque
from typing import Iterable, Protocol


class PendingBucketWork(Protocol):
    """A started bucket collective (``PendingGradientReduction`` or ``PendingParamGather``)."""

    def finish(self) -> None: ...


def finish_pipelined(started: Iterable[PendingBucketWork], max_in_flight: int) -> None:
    """Finish every operation ``started`` yields, in order, with at most ``max_in_flight`` unfinished
    at a time: the next one starts (when the iterator is advanced) while earlier ones are in flight,
    and the temporary buffers of at most ``max_in_flight`` buckets exist at once."""
    in_flight: deque[PendingBucketWork] = deque()
    for pending in started:
        in_flight.append(pending)
        if len(in_flight) >= max_in_flight:
            in_flight.popleft().finish()
    while in_flight:
        in_flight.popleft().finish()
