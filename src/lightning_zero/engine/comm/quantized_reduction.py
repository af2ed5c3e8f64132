"""qgZ: a bucket's gradient reduction as two quantized all-to-alls, within the node then across nodes.

[Note: quantized gradient reduction]
A bucket's reduction starts from its packed rows (N, S + F): row r is what rank r is to receive, S
gradient columns (padding zeroed, already scaled by 1/N as DDP averages) then F exact columns (used
flags and stop votes, see [Note: used flags] in ``bucket.py``). Ranks are ``node·K + local`` (K
ranks a node, M nodes, N = M·K). ZeRO++'s hierarchical all-to-all replaces the reduce-scatter:

* **hop 1, within the node** (``links.within_node``, K ranks): to its local peer l a rank sends the
  rows of ranks ``m·K + l`` for every node m (M rows), each row quantized on its own (blocks never
  straddle two destinations' chunks, ``quantization.py``), then the F exact columns once, as fp32
  bytes (every row carries the same flags). It receives its K node peers' versions of its M rows,
  dequantizes and sums them in fp32: M partial sums, one for each node's rank at its own position.
* **hop 2, across nodes** (``links.across_nodes``, M ranks at this rank's local position; skipped on
  one node): it quantizes the M partial sums, sends partial m to node m's rank, receives every
  node's partial of its own row, dequantizes and sums them in fp32. With one rank a node (K = 1),
  hop 1 is skipped instead: the rows are the partial sums, unquantized.

Every sum runs over a fixed dimension of a fixed shape (``Tensor.sum``), so a rank gets the same bits
every run. The result, cast to the bucket's dtype, lands in the reduction's ``received`` row (S + F),
where a reduce-scatter would have left it: the used flags, the stop votes, ``accept_gradients`` and an
offloaded bucket's copy to the host read it unchanged.

Flags stay exact: fp32 bytes beside the codes, summed in fp32 at each hop (counts of ranks times
1/N). Non-finite gradients stay non-finite: a block holding an inf or NaN dequantizes to NaN
throughout (``quantization.py``), its partial sum is NaN, which hop 2's block keeps NaN; so a
``GradScaler``'s (or the host step's) found-inf check on the reduced shards still sees it.

Per rank and bucket, with P = ``packed_bytes(S)``: hop 1 sends K·(M·P + 4F) bytes (its own K-th
included, as an all-to-all's input), hop 2 sends M·(P + 4F); the reduce-scatter sent N·(S + F)
elements. Error bound per element, with Q the format's largest code (127 for int8, 7 for int4) and
rounding to nearest: each quantized value is off by at most half its block's scale, so the result is
off by at most (Σ_r blockmax|g_r| + Σ_m blockmax|partial_m|) / 2Q ≤ (1/Q) · Σ_r blockmax|g_r| with g_r
the 1/N-scaled rows: at most max|local gradient| / Q.

What blocks where (see [Note: no waiting in backward] in ``grad_sync.py``): hop 1 is issued
asynchronously at the launch. Where waits do not block the host (NCCL), hop 2 is chained at once
behind it on the reduction's stream: the host queues the whole chain and never waits. Where they do
(gloo), ``done()`` advances the chain without blocking: once hop 1 has completed it sums it and
issues hop 2, and once hop 2 has completed it writes the result; ``wait()`` (``finish``, after
backward or to make room) blocks for whatever is left. ``done()`` and ``wait()`` must be called on a
backward's reductions in the order they were started (``reduce_during_backward.py`` does): every
rank then issues its hop-2 all-to-alls in bucket order, the order collectives on one group match in.

[Note: no error feedback]
Error feedback (1-bit Adam, PowerSGD) keeps each rank's quantization error and adds it to its next
step's gradient, so the errors cancel over steps. qgZ keeps none, as ZeRO++ does not. Hop 1
quantizes a rank's whole local gradient (all N rows), so the residual would be a full-size fp32
buffer per rank, 4Ψ bytes: more than all the state stage 3 keeps per rank once N > 4 (16Ψ/N with
Adam), the replicated state ZeRO exists to remove, and a checkpoint would have to carry it (per
rank, so not reshardable) for a resumed run to train as an uninterrupted one. Without it each
step's error is bounded per block (above), from the step's own gradient alone; over steps it moves
the weights as gradient noise of that size does (``tests/test_zero_pp_gradients.py`` bounds the
losses' drift from plain stage 3 over 10 steps). Rounding is to nearest, ties
to even (``quantization.py``): deterministic, the same bits on every run, where stochastic rounding
would be unbiased but need a seeded generator per rank and step. A run that needs exact gradients
leaves ``quantize_gradients`` off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.buffers import BufferPool
from lightning_zero.engine.comm.quantization import FORMATS, BlockFormat
from lightning_zero.engine.comm.reduce_stream import ReduceStream

FLAG_BYTES = 4
"""Each exact column travels as fp32."""


@dataclass(frozen=True)
class HopShapes:
    """The sizes of one bucket's two hops."""

    fmt: BlockFormat
    ranks_per_node: int  # K
    nodes: int  # M
    shard_numel: int  # S
    flag_count: int  # F

    @property
    def packed(self) -> int:
        """P: bytes of one quantized row of S elements."""
        return self.fmt.packed_bytes(self.shard_numel)

    @property
    def within_node_bytes(self) -> int:
        """B1: what hop 1 sends each node peer: M quantized rows, then F fp32 flags."""
        return self.nodes * self.packed + FLAG_BYTES * self.flag_count

    @property
    def across_nodes_bytes(self) -> int:
        """B2: what hop 2 sends each node: one quantized partial sum, then F fp32 flags."""
        return self.packed + FLAG_BYTES * self.flag_count


class Partial(NamedTuple):
    """Sums in fp32: ``rows`` (R, S), ``flags`` (F,)."""

    rows: Tensor
    flags: Tensor


def pack_within_node(rows: Tensor, flags: Tensor, shapes: HopShapes, out: Tensor) -> Tensor:
    """Hop 1's message: ``rows`` (N, S) quantized, to peer l the rows ``m·K + l``, each followed by
    ``flags`` (F,) as fp32 bytes; into ``out`` (K, B1) uint8, returned."""
    k, m, p = shapes.ranks_per_node, shapes.nodes, shapes.packed
    quantized = shapes.fmt.quantize(rows, torch.empty(rows.shape[0], p, dtype=torch.uint8, device=rows.device))  # (N, P)
    out[:, : m * p].view(k, m, p).copy_(quantized.view(m, k, p).transpose(0, 1))  # row m·K + l to peer l
    out[:, m * p :].view(torch.float32).copy_(flags.expand(k, -1))
    return out


def sum_within_node(received: Tensor, shapes: HopShapes) -> Partial:
    """Hop 1's result: ``received`` (K, B1), each peer's M rows for this rank's position, dequantized
    and summed over the peers in fp32 → rows (M, S), flags (F,)."""
    k, m, p = shapes.ranks_per_node, shapes.nodes, shapes.packed
    codes = received[:, : m * p].reshape(k * m, p)  # (K·M, P): one dequantize for every peer
    values = shapes.fmt.dequantize(codes, shapes.shard_numel).view(k, m, -1)  # (K, M, S) fp32
    return Partial(values.sum(dim=0), received[:, m * p :].view(torch.float32).sum(dim=0))


def pack_across_nodes(partial: Partial, shapes: HopShapes, out: Tensor) -> Tensor:
    """Hop 2's message: partial m (quantized) then the flags, to node m; into ``out`` (M, B2), returned."""
    p = shapes.packed
    shapes.fmt.quantize(partial.rows, out[:, :p])
    out[:, p:].view(torch.float32).copy_(partial.flags.expand(shapes.nodes, -1))
    return out


def sum_across_nodes(received: Tensor, shapes: HopShapes) -> Partial:
    """Hop 2's result: ``received`` (M, B2), every node's partial of this rank's row, summed in fp32 →
    rows (1, S), flags (F,)."""
    p = shapes.packed
    values = shapes.fmt.dequantize(received[:, :p], shapes.shard_numel)  # (M, S) fp32
    return Partial(values.sum(dim=0, keepdim=True), received[:, p:].view(torch.float32).sum(dim=0))


def reduce_locally(rows: Tensor, flags: Tensor, shapes: HopShapes, rank: int) -> Tensor:
    """The test oracle, in one process: what ``rank`` receives (S + F,) in fp32 when rank r's packed
    rows are ``rows[r]`` (N, S) and its flags ``flags[r]`` (F,), both hops' math run for every
    simulated rank that feeds it."""
    k, m = shapes.ranks_per_node, shapes.nodes
    node, local = divmod(rank, k)

    def partial_of(r: int) -> Partial:  # rank r's hop-1 result: its M partial sums
        if k == 1:
            return Partial(rows[r].float(), flags[r].float())
        first = r // k * k
        sent = [pack_within_node(rows[first + j], flags[first + j].float(), shapes, _message(k, shapes.within_node_bytes)) for j in range(k)]
        return sum_within_node(torch.stack([message[r % k] for message in sent]), shapes)

    if m == 1:
        mine = partial_of(rank)
    else:
        sent = [pack_across_nodes(partial_of(each * k + local), shapes, _message(m, shapes.across_nodes_bytes)) for each in range(m)]
        mine = sum_across_nodes(torch.stack([message[node] for message in sent]), shapes)
    return torch.cat([mine.rows.reshape(-1), mine.flags])


def _message(rows: int, row_bytes: int) -> Tensor:
    return torch.empty(rows, row_bytes, dtype=torch.uint8)


@dataclass(frozen=True)
class QuantizedGradients:
    """qgZ for the buckets of an engine: the block format and the node layout's groups."""

    fmt: BlockFormat
    within_node: collectives.ProcessGroup
    across_nodes: collectives.ProcessGroup
    ranks_per_node: int
    nodes: int

    @classmethod
    def of(cls, links: object, format_name: Optional[str]) -> Optional["QuantizedGradients"]:
        """From a ``NodeLinks`` and ``ZeroConfig.gradient_quantization``; None where qgZ is off."""
        if format_name is None or links is None:
            return None
        layout = links.layout  # type: ignore[attr-defined]
        return cls(FORMATS[format_name], links.within_node, links.across_nodes, layout.ranks_per_node, layout.nodes)  # type: ignore[attr-defined]

    def shapes(self, shard_numel: int, flag_count: int) -> HopShapes:
        return HopShapes(self.fmt, self.ranks_per_node, self.nodes, shard_numel, flag_count)

    def start(self, rows: Tensor, flags: Tensor, received: Tensor, pool: BufferPool, stream: ReduceStream, give_back_rows: Callable[[], None]) -> "QuantizedReduction":
        """Start reducing ``rows`` (N, S) with ``flags`` (F,) into ``received`` (S + F,), on the
        current stream; ``give_back_rows`` is called once hop 1's message is packed (the rows are
        read no more). See [Note: quantized gradient reduction]."""
        return QuantizedReduction(self, self.shapes(rows.shape[1], flags.numel()), rows, flags, received, pool, stream, give_back_rows)


class QuantizedReduction(collectives.PendingCollective):
    """A bucket's two hops in flight: ``done()`` advances them without blocking, ``wait()`` finishes
    them (see "What blocks where" in [Note: quantized gradient reduction])."""

    def __init__(
        self, qgz: QuantizedGradients, shapes: HopShapes, rows: Tensor, flags: Tensor, received: Tensor,
        pool: BufferPool, stream: ReduceStream, give_back_rows: Callable[[], None],
    ) -> None:  # fmt: skip
        super().__init__()
        self._qgz, self._shapes, self._received, self._pool, self._stream = qgz, shapes, received, pool, stream
        self._lent: list[Tensor] = []
        self._partial: Optional[Partial] = None
        self._hop: Optional[collectives.PendingCollective] = None
        self._last_hop = False
        self._finished = False
        if shapes.ranks_per_node > 1:  # hop 1
            send = self._take(shapes.ranks_per_node, shapes.within_node_bytes)
            pack_within_node(rows, flags.float(), shapes, send)
            give_back_rows()
            self._hop = collectives.start_all_to_all(self._take(shapes.ranks_per_node, shapes.within_node_bytes), send, qgz.within_node)
            self._output = self._lent[-1]
        else:  # one rank a node: the rows are the partial sums (hop 2 copies them into its message)
            self._partial = Partial(rows.float(), flags.float())
            self._start_across_nodes()
            give_back_rows()
        self._chains = not collectives.waits_block_host(qgz.within_node if qgz.within_node is not None else qgz.across_nodes, received.device)
        if self._chains:  # NCCL: the whole chain queued on this stream now, the host never waits
            self.wait()

    def _take(self, rows: int, row_bytes: int) -> Tensor:
        buffer = self._pool.take(rows * row_bytes, torch.uint8, self._received.device).view(rows, row_bytes)
        self._lent.append(buffer)
        return buffer

    def _give_back(self) -> None:
        for buffer in self._lent:  # after the hop's wait: nothing queued later reads them
            self._pool.give_back(buffer)
        self._lent.clear()

    def _start_across_nodes(self) -> None:
        """Hop 2 (or, on one node, the result at once)."""
        shapes = self._shapes
        if shapes.nodes == 1:
            self._write(self._partial)
            return
        send = self._take(shapes.nodes, shapes.across_nodes_bytes)
        pack_across_nodes(self._partial, shapes, send)
        self._partial = None
        self._output = self._take(shapes.nodes, shapes.across_nodes_bytes)
        self._hop = collectives.start_all_to_all(self._output, send, self._qgz.across_nodes)
        self._last_hop = True

    def _write(self, result: Partial) -> None:
        s = self._shapes.shard_numel
        self._received[:s].copy_(result.rows.view(-1))  # fp32 → the bucket's dtype
        self._received[s:].copy_(result.flags)
        self._give_back()
        self._hop = None
        self._finished = True

    def _advance(self) -> None:
        """The hop in flight has completed (or is waited on): sum it and start what follows."""
        if self._hop is None:
            return
        self._hop.wait()
        output = self._output
        if self._last_hop:
            self._write(sum_across_nodes(output, self._shapes))
            return
        self._partial = sum_within_node(output, self._shapes)
        self._give_back()  # hop 1's buffers: read
        self._start_across_nodes()

    def done(self) -> bool:
        while not self._finished:
            if not self._hop.done():
                return False
            self._finishing(self._advance)
        return True

    def wait(self) -> None:
        while not self._finished:
            self._finishing(self._advance)

    def _finishing(self, step: Callable[[], None]) -> None:
        if self._stream.stream is None:
            step()
            return
        with self._stream.finishing():
            step()
