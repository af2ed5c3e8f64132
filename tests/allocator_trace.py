"""Reading the CUDA caching allocator's history (``torch.cuda.memory._record_memory_history`` and
``torch.cuda.memory._snapshot()["device_traces"]``) for what the GPU tier's concurrency checks
assert (``test_cuda_concurrency.py``); pure Python, so its own tests run on the CPU.

[Note: what the allocator's trace can show]
Each entry is one action of the allocator with the block's address, its requested size and its
stream (the stream it was allocated on: a block belongs to one stream for its life):

- ``alloc``: a block handed out, on its stream;
- ``free_requested`` then ``free_completed``: a tensor let go of a block. Where another stream was
  declared to use it (``record_stream``, the engine's ``keep_alive``) the allocator records events on
  those streams and completes the free only once they ran (a *deferred* free, the two entries apart);
  otherwise both entries come at once;
- ``segment_free`` / ``segment_unmap``: memory given back to the driver (its addresses may then serve
  any stream).

So the trace tells, for memory the engine lends between streams: which stream allocated and freed
a block (a stage-3 unit's storage must live and die on the compute stream: its only readers are
compute kernels); whether a free waited for another stream; and whether a block was handed out
again before such a wait ended, or to another stream than the one that freed it (which the
allocator's per-stream pools must never do while that stream's kernels may still read it).
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any, Iterable, Optional

UNIT_STORAGE_FILE = "gathered_storage.py"
"""Where a stage-3 unit's storage is allocated (``GatheredStorage``): a frame of that file in an
``alloc`` entry's stack marks the block as a unit's storage."""

RELEASED = ("segment_free", "segment_unmap")


class _FreedRanges:
    """Address ranges freed (``free_completed``) and not handed out since, with their stream; kept
    sorted and disjoint."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ranges: dict[int, tuple[int, Any]] = {}  # start -> (end, stream)

    def add(self, start: int, end: int, stream: Any) -> None:
        self.remove(start, end)
        bisect.insort(self._starts, start)
        self._ranges[start] = (end, stream)

    def remove(self, start: int, end: int) -> list[tuple[int, int, Any]]:
        """Take out every range overlapping [start, end), keeping the parts outside it; the taken
        ranges (whole)."""
        taken = []
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while i < len(self._starts) and self._starts[i] < end:
            s = self._starts[i]
            e, stream = self._ranges[s]
            if e <= start:
                i += 1
                continue
            taken.append((s, e, stream))
            del self._starts[i], self._ranges[s]
            for left, right in ((s, start), (end, e)):  # what lies outside stays free
                if left < right:
                    bisect.insort(self._starts, left)
                    self._ranges[left] = (right, stream)
                    if left < start:
                        i += 1
        return taken


def _is_unit_storage(entry: dict) -> bool:
    return any(str(frame.get("filename", "")).endswith(UNIT_STORAGE_FILE) for frame in entry.get("frames") or ())


def allocator_findings(trace: Iterable[dict], compute_stream: int, roles: Optional[dict[int, str]] = None) -> dict:
    """What ``trace`` (one device's entries, in order) shows (see [Note: what the allocator's trace
    can show]): allocations per stream (named by ``roles`` where known), the unit storages' allocations
    and frees (and those off ``compute_stream`` or deferred), and every hand-out of memory that
    another stream freed (without the driver taking it back in between) or that a deferred free
    still held. Lists of findings are capped at 10 entries each, with counts beside them."""
    roles = dict(roles or {})
    roles.setdefault(compute_stream, "compute")
    freed = _FreedRanges()
    pending: dict[int, tuple[int, Any, int]] = {}  # addr -> (end, stream, index) of a free requested, not completed
    units: dict[int, int] = {}  # addr -> index of its alloc, for unit storages allocated now
    allocs: Counter = Counter()
    found: dict[str, Any] = {
        "entries": 0, "unit_allocs": 0, "unit_frees": 0, "unit_off_compute": [], "unit_deferred_frees": [],
        "deferred_frees": 0, "reused_across_streams": [], "reused_while_pending": [],
    }  # fmt: skip
    counts = Counter()

    def note(kind: str, what: dict) -> None:
        counts[kind] += 1
        if len(found[kind]) < 10:
            found[kind].append(what)

    for index, entry in enumerate(trace):
        found["entries"] += 1
        action, addr, size, stream = entry.get("action"), entry.get("addr", 0), entry.get("size", 0), entry.get("stream")
        if action == "alloc":
            allocs[roles.get(stream, str(stream))] += 1
            for start, end, by in freed.remove(addr, addr + size):
                if by != stream:
                    note("reused_across_streams", {"index": index, "addr": addr, "stream": stream, "freed_by": by})
            for start, (end, by, requested) in pending.items():
                if start < addr + size and addr < end:
                    note("reused_while_pending", {"index": index, "addr": addr, "stream": stream, "free_requested_at": requested})
            if _is_unit_storage(entry):
                found["unit_allocs"] += 1
                units[addr] = index
                if stream != compute_stream:
                    note("unit_off_compute", {"index": index, "action": action, "stream": stream})
        elif action == "free_requested":
            pending[addr] = (addr + size, stream, index)
        elif action == "free_completed":
            requested = pending.pop(addr, None)
            deferred = requested is not None and requested[2] != index - 1
            found["deferred_frees"] += deferred
            if units.pop(addr, None) is not None:
                found["unit_frees"] += 1
                if deferred:
                    note("unit_deferred_frees", {"index": index, "requested_at": requested[2]})
                if stream != compute_stream:
                    note("unit_off_compute", {"index": index, "action": action, "stream": stream})
            freed.add(addr, addr + size, stream)
        elif action in RELEASED:
            freed.remove(addr, addr + size)
    found["allocs_by_stream"] = dict(allocs)
    found["counts"] = {kind: counts[kind] for kind in ("unit_off_compute", "unit_deferred_frees", "reused_across_streams", "reused_while_pending")}
    return found
