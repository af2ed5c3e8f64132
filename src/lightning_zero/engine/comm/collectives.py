"""The only module that calls ``torch.distributed``.

Every collective takes its process group explicitly, and every call is counted in
:data:`COLLECTIVE_STATS` (calls and bytes sent per rank, by kind), which is how the tests and the
benchmark check that communication scales with buckets rather than with parameters.

Torch-version differences live here: torch 2.13 deprecates ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` in favour of ``all_gather_single`` / ``reduce_scatter_single``; we call
whichever the installed torch offers.
"""

from __future__ import annotations

import atexit
import os
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d
from torch import Tensor

from lightning_zero.engine.comm import streams
from lightning_zero.engine.config import ShardGroupSize, resolve_shard_group_size
from lightning_zero.engine.device_roles import check_compute_tensors

ProcessGroup = Optional[dist.ProcessGroup]

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# [Note: collectives issued on the group]
# The hot collectives (a bucket's all-gather and reduce-scatter, gloo's all-reduces of a
# reduce-scatter) are issued on the process group itself: the C++ call torch's Python functions
# above make in the end (``all_gather_single``, from torch 2.13; ``_allgather_base`` before), after
# checks that hold here by construction (plain dense tensors, this rank in the group, no coalescing
# manager) and a logging decorator: ~8 Python calls a collective, a tenth of stage 3's host work at
# the launch-bound shape (issue 60). Same op, same dispatch, same work object. Without a group object
# (``None``: the default group, outside an engine) the Python functions are used.
_group_all_gather = getattr(dist.ProcessGroup, "all_gather_single", None) or dist.ProcessGroup._allgather_base
_group_reduce_scatter = getattr(dist.ProcessGroup, "reduce_scatter_single", None) or dist.ProcessGroup._reduce_scatter_base
_group_all_reduce = dist.ProcessGroup.allreduce
_GATHER_OPTIONS = _c10d.AllgatherOptions()  # asynchronous, the default timeout
_SUM_OPTIONS = _c10d.ReduceScatterOptions()  # a sum (the default op), asynchronous
_ALL_REDUCE_SUM = _c10d.AllreduceOptions()  # a sum (the default op), asynchronous where torch says so


@dataclass
class CollectiveStats:
    """Running count of collectives issued by this process, by kind ("all_gather", ...)."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    """Bytes of the full (unsharded) buffer each collective moved, as torch reports sizes:
    for all-gather the output, for reduce-scatter the input, for all-reduce the tensor."""
    bytes_by_group: Counter = field(default_factory=Counter)
    """The same bytes by (kind, global ranks of the process group): where the traffic went, e.g.
    within a node or across nodes under hybrid sharding."""

    def record(self, kind: str, tensor: Tensor, group: ProcessGroup = None) -> "_GroupFacts":
        """Count a ``kind`` collective over ``group`` moving ``tensor``; returns the group's facts (the
        first thing every collective does: one call for both)."""
        facts = _FACTS.get(weakref.ref(group)) if group is not None else None  # see _described
        if facts is None:
            facts = _described(group)
        size = tensor.numel() * tensor.element_size()
        self.calls[kind] += 1
        self.bytes[kind] += size
        self.bytes_by_group[(kind, facts.ranks)] += size
        return facts

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.bytes_by_group.clear()


COLLECTIVE_STATS = CollectiveStats()


def resolved(group: ProcessGroup) -> ProcessGroup:
    """``group``, with None (the whole world) as the world's own group object where one exists: a
    collective then finds what it asks of its group without first asking torch which group is the
    world (several Python calls each time).

    An engine resolves its group when built, and that is when ``COLLECTIVES_AT_ONE_RANK`` is read:
    groups are described afresh from here, so the variable set before an engine is built applies."""
    _FACTS.clear()
    return dist.group.WORLD if group is None and is_initialized() else group


def group_ranks(group: ProcessGroup) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: the whole world; () outside a process group)."""
    return _described(group).ranks


@dataclass(frozen=True)
class _GroupFacts:
    """What every collective asks of its group, read from ``torch.distributed`` and the environment
    once per group (a dozen Python calls per question to torch, four per environment read; a
    stage-3 step issues one collective per bucket and unit)."""

    ranks: tuple[int, ...]
    size: int
    rank: int
    gloo: bool
    skips: bool
    """``skips_collectives``: one rank, and ``COLLECTIVES_AT_ONE_RANK`` is not "1"."""
    shortcuts: bool
    """``takes_one_rank_shortcuts``: one rank, and ``COLLECTIVES_AT_ONE_RANK`` is neither "1" nor "path"."""


_OUTSIDE = _GroupFacts(ranks=(), size=1, rank=0, gloo=False, skips=True, shortcuts=True)
_FACTS: "dict[weakref.ref, _GroupFacts]" = {}
"""By a weak reference to the group, which hashes and compares as the group: a lookup makes no
Python call. An entry goes with its group; ``resolved`` empties it (the environment is read again)."""


def _described(group: ProcessGroup) -> _GroupFacts:
    if group is not None:  # a group exists only inside a process group
        pg = group
    elif is_initialized():
        pg = dist.group.WORLD  # a new world after a re-init is a new key
    else:
        return _OUTSIDE
    facts = _FACTS.get(weakref.ref(pg))
    if facts is None:
        ranks = tuple(range(dist.get_world_size())) if group is None else tuple(dist.get_process_group_ranks(group))
        at_one_rank = os.environ.get(COLLECTIVES_AT_ONE_RANK)
        alone = len(ranks) == 1
        skips, shortcuts = alone and at_one_rank != "1", alone and at_one_rank not in ("1", "path")
        facts = _GroupFacts(ranks, len(ranks), dist.get_rank(group), str(dist.get_backend(group)) == "gloo", skips, shortcuts)
        _FACTS[weakref.ref(pg, lambda key: _FACTS.pop(key, None))] = facts
    return facts


class PendingCollective:
    """An issued asynchronous collective. ``wait()``: its output is ready for what runs next — on
    gloo the host waits for it; on NCCL the current stream does (the host goes on, and kernels
    queued on that stream afterwards wait for every peer to join).

    Synchronous backends (or a world of one) hand back an already-finished instance.
    """

    def __init__(self, work: Optional[dist.Work] = None) -> None:
        self._work = work

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

    def done(self) -> bool:
        """Whether the collective has completed on every backend's terms, so that ``wait()`` would
        make nothing wait (neither the host nor a stream). Never blocks: on NCCL a query of the
        collective's CUDA event. See [Note: no waiting in backward] in ``grad_sync.py``."""
        return self._work is None or self._work.is_completed()


FINISHED = PendingCollective()
"""What a skipped collective returns: finished, with nothing to wait for (shared: it never changes)."""


def _pending(work: Any) -> PendingCollective:
    """What ``streams.issue_collective`` returned (every collective is issued through the stream
    layer, see [Note: the stream layer] in ``streams.py``), as a ``PendingCollective``."""
    return work if isinstance(work, PendingCollective) else PendingCollective(work)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: ProcessGroup = None) -> int:
    return _described(group).size


def rank(group: ProcessGroup = None) -> int:
    return _described(group).rank


COLLECTIVES_AT_ONE_RANK = "LIGHTNING_ZERO_COLLECTIVES_AT_ONE_RANK"
"""Environment variable for a group of one rank, for tests and the benchmark. Unset (or "0"), the
engine takes its one-rank shortcuts (a bucket's gradient is its shard's as it is, no buffers) and
collectives return early. "1": collectives are issued through torch anyway (and buckets reduce
through them), so a one-rank NCCL group runs NCCL's kernels and streams as a larger one would.
"path": the engine takes the sharded path of N >= 2 ranks (buffers, packing, tags, the reduction's
bookkeeping), each collective a local copy: the benchmark's CPU stand-in for a fast GPU, whose host
work it measures without gloo's per-call latency (a GPU's NCCL launch is asynchronous). Read when
a group is first described after ``resolved`` (an engine's construction), not by each collective."""


def skips_collectives(group: ProcessGroup) -> bool:
    """Whether collectives over ``group`` return early because it has one rank (no process group
    counts as one), unless ``COLLECTIVES_AT_ONE_RANK`` is "1" (read as ``resolved`` says)."""
    return _described(group).skips


def takes_one_rank_shortcuts(group: ProcessGroup) -> bool:
    """Whether the engine skips the sharded path's work for ``group`` of one rank, unless
    ``COLLECTIVES_AT_ONE_RANK`` is "1" or "path" (read as ``resolved`` says)."""
    return _described(group).shortcuts


def waits_block_host(group: ProcessGroup, device: torch.device) -> bool:
    """Whether ``PendingCollective.wait()`` on ``group``, for tensors on ``device``, makes the host
    wait: on gloo (and any backend but NCCL), and on NCCL with ``TORCH_NCCL_BLOCKING_WAIT=1``; on
    NCCL otherwise only the current stream waits. A group made with several backends
    (``"cpu:gloo,cuda:nccl"``, torch's default without one named) uses NCCL for CUDA tensors. Where
    collectives are skipped nothing ever waits (False). See [Note: reduce stream] in
    ``reduce_stream.py``."""
    if skips_collectives(group):
        return False
    if streams.waits_order_streams():  # a simulated device keeping NCCL's contract (see [Note: the stream layer])
        return False
    backend = str(dist.get_backend(group))
    nccl = backend == "nccl" or (torch.device(device).type == "cuda" and "cuda:nccl" in backend)
    if not nccl:
        return True
    return os.environ.get("TORCH_NCCL_BLOCKING_WAIT", os.environ.get("NCCL_BLOCKING_WAIT", "0")) == "1"


def start_all_gather(output: Tensor, shard: Tensor, group: ProcessGroup) -> PendingCollective:
    """Gather every rank's equal-sized ``shard`` into ``output`` (rank-major, 1D)."""
    facts = COLLECTIVE_STATS.record("all_gather", output, group)
    check_compute_tensors("all-gather", (output, shard))
    if facts.skips:
        output.copy_(shard)
        return FINISHED
    if group is None:
        issue = lambda: _all_gather_flat(output, shard, group=group, async_op=True)  # noqa: E731
        return _pending(streams.issue_collective("all_gather", group, (shard,), (output,), issue))
    # see [Note: collectives issued on the group]
    work = streams.issue_collective("all_gather", group, (shard,), (output,), _group_all_gather, group, output, shard, _GATHER_OPTIONS)
    return work if isinstance(work, PendingCollective) else PendingCollective(work)  # `_pending`, inline


def start_reduce_scatter(output: Tensor, inputs: Tensor, group: ProcessGroup) -> PendingCollective:
    """Sum ``inputs`` (rank-major, 1D) over ranks; rank r receives its slice in ``output``. On gloo
    ``inputs`` is overwritten (``_reduce_scatter_gloo``): hand it a buffer nothing reads after."""
    facts = COLLECTIVE_STATS.record("reduce_scatter", inputs, group)
    check_compute_tensors("reduce-scatter", (output, inputs))
    if facts.skips:
        output.copy_(inputs)
        return FINISHED
    if facts.gloo:
        issue = lambda: _reduce_scatter_gloo(output, inputs.view(facts.size, -1), group)  # noqa: E731
    elif group is None:
        issue = lambda: _reduce_scatter_flat(output, inputs, op=dist.ReduceOp.SUM, group=group, async_op=True)  # noqa: E731
    else:  # see [Note: collectives issued on the group]
        work = streams.issue_collective("reduce_scatter", group, (inputs,), (output,), _group_reduce_scatter, group, output, inputs, _SUM_OPTIONS)
        return work if isinstance(work, PendingCollective) else PendingCollective(work)  # `_pending`, inline
    return _pending(streams.issue_collective("reduce_scatter", group, (inputs,), (output,), issue))


def all_to_all(output: Tensor, inputs: Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup) -> Tensor:
    """Rank r sends ``inputs``' r'-th slice (``input_splits[r']`` elements, 1D, in rank order) to
    rank r' and receives rank r''s slice for it into ``output`` (``output_splits[r']`` elements,
    in rank order). Returns once ``output`` is ready for what runs next: on gloo the host has waited
    for the exchange; on NCCL the current stream waits for it and the host goes on (kernels queued
    afterwards see ``output``; a host read of it syncs). Every rank must pass splits that match its
    peers' (``input_splits[r']`` here is ``output_splits[r]`` on rank r'): NCCL does not check them,
    and mismatched splits hang or corrupt, so callers derive them from values every rank agrees on."""
    facts = COLLECTIVE_STATS.record("all_to_all", inputs, group)
    check_compute_tensors("all-to-all", (output, inputs))
    if facts.skips:
        output.copy_(inputs)
        return output
    issue = lambda: dist.all_to_all_single(output, inputs, output_splits, input_splits, group=group, async_op=True)  # noqa: E731
    _pending(streams.issue_collective("all_to_all", group, (inputs,), (output,), issue)).wait()
    return output


def start_all_to_all(output: Tensor, inputs: Tensor, group: ProcessGroup) -> PendingCollective:
    """Start an all-to-all of equal slices: ``inputs`` (R, B), R the ranks of ``group``, sends row r'
    to rank r'; ``output`` (R, B) receives rank r''s row for this rank in row r'. Equal slices, so no
    splits to agree on (see ``all_to_all``). ``output`` holds the rows once the result is waited on."""
    facts = COLLECTIVE_STATS.record("all_to_all", inputs, group)
    check_compute_tensors("all-to-all", (output, inputs))
    if facts.skips:
        output.copy_(inputs)
        return FINISHED
    # gloo's all_to_all_single is one work that reports its completion (``done`` sees it), unlike its list form
    issue = lambda: dist.all_to_all_single(output.view(-1), inputs.view(-1), group=group, async_op=True)  # noqa: E731
    return _pending(streams.issue_collective("all_to_all", group, (inputs,), (output,), issue))


class _AllOf(PendingCollective):
    """Several collectives that finish together (``_reduce_scatter_gloo``)."""

    def __init__(self, parts: list[PendingCollective]) -> None:
        super().__init__()
        self._parts = parts

    def wait(self) -> None:
        for part in self._parts:
            part.wait()

    def done(self) -> bool:
        return all(part.done() for part in self._parts)


def _reduce_scatter_gloo(output: Tensor, rows: Tensor, group: ProcessGroup) -> PendingCollective:
    """gloo's reduce-scatter as gloo itself runs it (torch 2.13): one all-reduce per rank's row,
    this rank's row summed in ``output``, the others in place in ``rows`` (N, S), which it overwrites.

    Issued here rather than by ``dist.reduce_scatter`` for two reasons. gloo's list form wraps the
    all-reduces in a composite work whose ``is_completed()`` stays False until ``wait()`` is called,
    so ``done()`` could never say it finished, and [Note: no waiting in backward] then kept every
    bucket's full gradients until the flush after backward (issue 44: 4 B per parameter on every
    rank at the peak). Each all-reduce's own work does report completion. And gloo clones the other
    ranks' rows first ((N - 1) / N of the buffer more while it runs), where ours are ours to overwrite.
    The same all-reduces over the same rows, so the same bits; the list form was faster than the flat
    form, 21 vs 30 ms for 29 MB on 2 ranks."""
    me = rank(group)
    output.copy_(rows[me])
    parts = []
    for r in range(rows.shape[0]):
        target = output if r == me else rows[r]
        if group is None:
            parts.append(PendingCollective(dist.all_reduce(target, op=dist.ReduceOp.SUM, group=group, async_op=True)))
        else:  # see [Note: collectives issued on the group]
            parts.append(PendingCollective(_group_all_reduce(group, [target], _ALL_REDUCE_SUM)))
    return _AllOf(parts)


def all_reduce(tensor: Tensor, group: ProcessGroup, op: str = "sum") -> Tensor:
    """In-place all-reduce (``op`` is "sum", "max" or "min"); returns ``tensor``."""
    facts = COLLECTIVE_STATS.record("all_reduce", tensor, group)
    check_compute_tensors("all-reduce", (tensor,))
    if not facts.skips:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        issue = lambda: dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True)  # noqa: E731
        _pending(streams.issue_collective("all_reduce", group, (tensor,), (tensor,), issue)).wait()
    return tensor


def start_all_reduce(tensor: Tensor, group: ProcessGroup) -> PendingCollective:
    """Start summing ``tensor`` in place over ``group``; it holds the sum once the result is waited on."""
    facts = COLLECTIVE_STATS.record("all_reduce", tensor, group)
    check_compute_tensors("all-reduce", (tensor,))
    if facts.skips:
        return FINISHED
    issue = lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)  # noqa: E731
    return _pending(streams.issue_collective("all_reduce", group, (tensor,), (tensor,), issue))


def gather_objects(obj: Any, group: ProcessGroup = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (a collective; just ``[obj]`` without peers)."""
    if world_size(group) == 1:
        return [obj]
    gathered: list[Any] = [None] * world_size(group)

    def issue() -> list[Any]:
        dist.all_gather_object(gathered, obj, group=group)
        return gathered

    return streams.issue_collective("all_gather_object", group, (), (), issue)


def raise_if_any_rank(problem: Optional[str], group: ProcessGroup = None, error: type[Exception] = ValueError) -> None:
    """Every rank raises ``error`` if any rank's ``problem`` (a message, None where all is well) is
    set: a failing rank its own message, the others the lowest failing rank's, so no rank goes on
    to a collective that a rank which gave up never joins."""
    if world_size(group) > 1:
        problems = gather_objects(problem, group)
        failing = [(r, p) for r, p in enumerate(problems) if p is not None]
        if problem is None and failing:
            r, other = failing[0]
            problem = f"rank {r} of {len(problems)} failed this check: {other}"
    if problem is not None:
        raise error(problem)


def default_timeout() -> timedelta:
    """How long torch's process groups wait for peers unless told otherwise."""
    return getattr(dist, "default_pg_timeout", timedelta(minutes=30))


def default_store() -> Any:
    """The default process group's store (``store_agreement.py`` agrees through it)."""
    return dist.distributed_c10d._get_default_store()


def broadcast_(tensor: Tensor, src: int, group: ProcessGroup) -> Tensor:
    facts = COLLECTIVE_STATS.record("broadcast", tensor, group)
    check_compute_tensors("broadcast", (tensor,))
    if not facts.skips:
        issue = lambda: dist.broadcast(tensor, src=dist.get_global_rank(group, src) if group else src, group=group, async_op=True)  # noqa: E731
        _pending(streams.issue_collective("broadcast", group, (tensor,), (tensor,), issue)).wait()
    return tensor


BROADCAST_BUCKET_BYTES = 25 * 2**20
"""What ``broadcast_tensors_`` copies into one flat buffer at most (a model-sized buffer would be a
second copy of the model on every rank)."""


def broadcast_tensors_(tensors: list[Tensor], src: int, group: ProcessGroup) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values (used to start all replicas
    from the same weights, as DDP does): small tensors of one dtype and device coalesced into
    buckets of up to ``BROADCAST_BUCKET_BYTES``, larger ones broadcast in place."""
    if skips_collectives(group) or not tensors:
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for members in by_kind.values():
        bucket: list[Tensor] = []
        bucket_bytes = 0
        for t in members:
            nbytes = t.numel() * t.element_size()
            if nbytes >= BROADCAST_BUCKET_BYTES and t.is_contiguous():
                broadcast_(t.detach(), src, group)
                continue
            bucket.append(t)
            bucket_bytes += nbytes
            if bucket_bytes >= BROADCAST_BUCKET_BYTES:
                _broadcast_coalesced(bucket, src, group)
                bucket, bucket_bytes = [], 0
        if bucket:
            _broadcast_coalesced(bucket, src, group)


def _broadcast_coalesced(tensors: list[Tensor], src: int, group: ProcessGroup) -> None:
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    broadcast_(flat, src, group)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def new_group_like(group: ProcessGroup, timeout: Optional[timedelta] = None) -> ProcessGroup:
    """A second process group over the same ranks (every rank must call this, in the same order).

    Collectives on different groups are ordered independently: stage 3 issues all-gathers in
    forward/backward order and reduce-scatters in bucket order, and giving each its own group keeps
    those two orders from having to agree across ranks. ``timeout``: how long a collective waits
    for its peers before failing (the user's, e.g. Lightning's ``timeout``; None: torch's default,
    which a new group takes instead of the default group's).
    """
    if skips_collectives(group):
        return group
    if group is not None and group in _PARTITIONS:  # a hybrid-sharding group: each rank is in one sibling
        return _new_partition(_PARTITIONS[group], timeout)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return dist.new_group(ranks=ranks, timeout=timeout)


def destroy_group(group: ProcessGroup) -> None:
    """Free a group made by ``new_group_like`` (a local call, once no collective on it is pending):
    each setup makes new ones, and a process that runs many fits would otherwise keep every old
    group's worker threads and sockets."""
    if is_initialized() and group is not None and group is not dist.group.WORLD:
        dist.destroy_process_group(group)


def let_workers_finish_at_exit() -> None:
    """At interpreter exit, give torch's communication threads a moment to let go of the tensors of
    the last collectives before finalization starts. [Note: gloo at exit]: a gloo worker thread
    releases a finished collective's work object (and so its tensors) after ``wait()`` has returned;
    when Python dropped those tensors first, the release decrefs them and needs the GIL, and a thread
    asking for the GIL once finalization began is ended mid-destructor: ``std::terminate``,
    "terminate called without an active exception", exit code 134 for a run that finished (2 to 5
    of 30 two-rank zero3 CPU runs on torch 2.13, seen in a core dump: ``~AsyncAllgatherWork`` →
    ``decref_pyobject`` → ``take_gil`` → ``pthread_exit``). Sleeping in an ``atexit`` handler, which
    runs before finalization, hands those threads the GIL. Registered once per process."""
    global _LETS_WORKERS_FINISH
    if not _LETS_WORKERS_FINISH:
        atexit.register(time.sleep, EXIT_GRACE_SECONDS)
        _LETS_WORKERS_FINISH = True


EXIT_GRACE_SECONDS = 0.05
_LETS_WORKERS_FINISH = False


_PARTITIONS: "weakref.WeakKeyDictionary[dist.ProcessGroup, list[list[int]]]" = weakref.WeakKeyDictionary()
"""For each group made by ``_new_partition``: all the groups it was made with (their global ranks)."""


def _new_partition(partition: list[list[int]], timeout: Optional[timedelta]) -> ProcessGroup:
    """One process group per list of ranks in ``partition`` (disjoint, covering the world), made on
    every rank — ``torch.distributed.new_group`` must be entered by all ranks for every group, members
    or not — and this rank's returned. ``new_group_like`` of it makes the same partition again."""
    me, mine = dist.get_rank(), None
    for ranks in partition:
        group = dist.new_group(ranks=ranks, timeout=timeout)
        if me in ranks:
            mine = group
    assert mine is not None, f"rank {me} is in no group of {partition}"
    _PARTITIONS[mine] = partition
    return mine


def data_parallel_groups(
    shard_group_size: ShardGroupSize, world_size: int, ranks_per_node: int, timeout: Optional[timedelta] = None
) -> tuple[ProcessGroup, ProcessGroup]:
    """(shard group, replicate group) for a strategy's ``shard_group_size`` option (None, an int or
    "node"): (None, None) when every rank shards, else ``hybrid_groups``. Raises on every rank alike
    for a size that does not divide ``world_size``, before any group is made."""
    size = resolve_shard_group_size(shard_group_size, world_size, ranks_per_node)
    return hybrid_groups(size, timeout) if size is not None else (None, None)


def hybrid_groups(shard_group_size: int, timeout: Optional[timedelta] = None) -> tuple[ProcessGroup, ProcessGroup]:
    """Hybrid sharding's two process groups for this rank: its shard group (``shard_group_size``
    consecutive ranks, e.g. one node) and its replicate group (the ranks at the same position in
    every shard group). Every rank must call this, in the same order: each group is created on all
    ranks. The world size must be a multiple of ``shard_group_size`` (see
    ``config.check_shard_group_size``)."""
    return consecutive_groups(shard_group_size, timeout), strided_groups(shard_group_size, timeout)


def consecutive_groups(size: int, timeout: Optional[timedelta] = None) -> ProcessGroup:
    """This rank's group of ``size`` consecutive ranks (ranks ``[k·size, (k+1)·size)``), each such group
    made on every rank (every rank must call this, in the same order). ``size`` divides the world."""
    n = dist.get_world_size()
    return _new_partition([list(range(first, first + size)) for first in range(0, n, size)], timeout)


def strided_groups(stride: int, timeout: Optional[timedelta] = None) -> ProcessGroup:
    """This rank's group of the ranks at its position in every block of ``stride`` consecutive
    ranks (``r mod stride`` equal), made as ``consecutive_groups`` makes its groups."""
    n = dist.get_world_size()
    return _new_partition([list(range(position, n, stride)) for position in range(stride)], timeout)
