"""The reference run: a scenario on the CPU as usual, every collective's result kept for the recorded
run to take (see [Note: the schedule explorer]).

The recorded run does not communicate: on its simulated device a rank goes on past a collective its
peers reach only later (NCCL's contract), so it cannot wait for their data. Both runs issue the same
collectives in the same order per group (the engine's collective order never depends on timing; a
difference fails loudly), so the n-th collective of a kind over the same ranks takes the n-th
result of the reference run, and the recorded run computes exactly the reference run's values.
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_zero.engine.comm import collectives

Key = tuple[str, tuple[int, ...]]


class CollectiveLog:
    """Each collective's results, by kind and ranks, in issue order."""

    def __init__(self) -> None:
        self._results: dict[Key, list[Any]] = defaultdict(list)
        self._taken: Counter = Counter()

    @staticmethod
    def key(kind: str, group: Any) -> Key:
        return kind, collectives.group_ranks(group)

    def keep(self, key: Key, result: Any) -> None:
        self._results[key].append(result)

    def take(self, key: Key) -> Any:
        """The next result kept under ``key``; raises where the recorded run issues one more."""
        index = self._taken[key]
        kept = self._results.get(key, [])
        if index >= len(kept):
            raise RuntimeError(
                f"The recorded run issued {kind_and_ranks(key)} number {index + 1}, the reference run only {len(kept)}:"
                " the two runs' collectives differ."
            )
        self._taken[key] += 1
        return kept[index]

    def rewind(self) -> None:
        """The next recorded run takes the results from the first again."""
        self._taken.clear()

    def untaken(self) -> dict[Key, int]:
        """Results the recorded run never took (it issued fewer collectives)."""
        return {key: len(kept) - self._taken[key] for key, kept in self._results.items() if len(kept) > self._taken[key]}


def kind_and_ranks(key: Key) -> str:
    kind, ranks = key
    return f"{kind} over ranks {list(ranks)}"


class _Kept:
    """A collective's work in the reference run: waiting for it keeps its results."""

    def __init__(self, work: Any, writes: tuple[Tensor, ...], keep: Callable[[Any], None]) -> None:
        self._work, self._writes, self._keep = work, writes, keep

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        self._keep(tuple(t.detach().clone() for t in self._writes))

    def is_completed(self) -> bool:
        if self._work is None:
            return True
        completed = getattr(self._work, "is_completed", None)  # a torch work, or a PendingCollective (gloo's reduce-scatter)
        return completed() if completed is not None else self._work.done()


class ReferenceRun:
    """Installed with ``streams.simulating`` for the reference run: no streams (the CPU, gloo's
    path), and every collective's result kept in ``log``."""

    nccl_semantics = False

    def __init__(self, log: CollectiveLog) -> None:
        self.log = log

    def streams_of(self, device: torch.device) -> None:
        return None

    def thread_started(self) -> None:
        pass

    def collective(self, kind: str, group: Any, reads: tuple[Tensor, ...], writes: tuple[Tensor, ...], issue: Callable[[], Any]) -> Any:
        key = CollectiveLog.key(kind, group)
        index = len(self.log._results[key])
        self.log._results[key].append(None)  # its place, in issue order, filled once waited for
        result = issue()
        if not writes:  # an object collective: its value
            self.log._results[key][index] = copy.deepcopy(result)
            return result

        def keep(values: Any) -> None:
            self.log._results[key][index] = values

        return _Kept(result, writes, keep)


def fill(writes: tuple[Tensor, ...], values: Optional[tuple[Tensor, ...]], what: str) -> None:
    """Write a kept collective's results into the recorded run's tensors (checked alike)."""
    if values is None:
        raise RuntimeError(f"{what}: the reference run never waited for this collective, so its result is unknown")
    if len(values) != len(writes) or any(v.shape != w.shape or v.dtype != w.dtype for v, w in zip(values, writes)):
        raise RuntimeError(
            f"{what}: the reference run's collective had outputs {[(tuple(v.shape), v.dtype) for v in values]},"
            f" the recorded run's {[(tuple(w.shape), w.dtype) for w in writes]}: the two runs' collectives differ."
        )
    with torch.no_grad():
        for value, target in zip(values, writes):
            target.copy_(value)
