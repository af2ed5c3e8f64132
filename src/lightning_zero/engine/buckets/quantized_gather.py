"""qwZ: a stage-3 bucket's all-gather sent as quantized blocks (see [Note: ZeRO++] in
``zero_plus_plus.py``).

[Note: quantized gather rows]
A bucket's plain gather sends each rank's row of S chunk elements and its unit tag in the
parameter dtype, (N, S + 1). Quantized, each rank sends one uint8 row instead::

    [ packed_bytes(S): the S elements as blocks (``quantization.py``) | 4 bytes: the tag, fp32 ]

and the N rows, (N, packed_bytes(S) + 4), are all-gathered on the same gather group in one
collective. Finishing dequantizes all N rows with one call per bucket into (N, S) rows of the
parameter dtype, which fill the unit's storage as a plain gather's rows do; the tags are read from
their own slots (an fp32 holds every tag exactly). The tag keeps its own slot rather than a column
of the quantized row: a block's scale would round it.

The row to quantize is staged in a pool buffer, zeroed first: the copy-in writes each parameter's
elements and never the padding after them, and whatever an earlier use left there (a NaN, a large
value) would enter its block's scale and spoil the block's real elements on every rank.

Only the copies a step computes with are quantized: the chunks the optimizer steps (and fp32 masters,
and chunks offloaded to the host) are never touched, and gathers that read the true weights
(``summon_full_params``, state dicts, reads at rest) are sent as they are
(``parameters.unit.GatherKind.EXACT``). A chunk quantizes to the same bytes every time, so backward's
gather (quantized again) computes with the very weights the forward did.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_zero.engine.buckets.pending import PendingParamGather
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.buffers import BufferPool
from lightning_zero.engine.comm.quantization import FORMATS

TAG_BYTES = 4
"""The unit tag's slot after a quantized row: one fp32."""


class QuantizedGather:
    """One bucket's quantized all-gather: ``shard_numel`` (S) elements a rank in ``weight_format``,
    over ``group`` (this rank sends row ``rank`` of ``world_size``), into rows of ``dtype``."""

    def __init__(
        self, weight_format: str, shard_numel: int, world_size: int, rank: int, group: collectives.ProcessGroup,
        dtype: torch.dtype, device: torch.device, pool: BufferPool,
    ) -> None:  # fmt: skip
        self.format = FORMATS[weight_format]
        self.shard_numel, self.world_size, self.rank, self.group = shard_numel, world_size, rank, group
        self.dtype, self.device, self.pool = dtype, device, pool
        self.packed_bytes = self.format.packed_bytes(shard_numel)
        self.row_bytes = self.packed_bytes + TAG_BYTES
        """Bytes of one rank's row as sent: the packed blocks, then the tag."""

    def start(self, bucket: object, write_row: Callable[[Tensor], None], tag: Optional[int], tags: object) -> PendingParamGather:
        """Stage this rank's row (``write_row`` copies the chunks into a zeroed (S,) row), quantize it
        into its row of the output with ``tag`` after it, and start the all-gather; finishing
        (``rows``) dequantizes. ``tags``: what checks every rank's tag once gathered (or None)."""
        s, width = self.shard_numel, self.row_bytes
        row = self.pool.take(s, self.dtype, self.device)  # (S,)
        row.zero_()  # the padding is never written by the copy-in: see [Note: quantized gather rows]
        write_row(row)
        gathered = self.pool.take(self.world_size * width, torch.uint8, self.device)  # (N * width,)
        send = gathered[self.rank * width : (self.rank + 1) * width]  # (width,): in place, as the plain gather
        self.format.quantize(row.view(1, s), send[: self.packed_bytes].view(1, -1))
        self.pool.give_back(row)  # read by the quantization only, queued before anything that reuses it
        send[self.packed_bytes :].view(torch.float32).fill_(float(tag or 0))
        work = collectives.start_all_gather(gathered, send, self.group)
        return PendingParamGather(bucket, work, gathered, tags, lent=[gathered], quantized=self)

    def rows(self, gathered: Tensor) -> tuple[Tensor, Tensor]:
        """Every rank's row of a finished gather, dequantized: (N, S) in the parameter dtype (one
        dequantize for the bucket), and the N tags (fp32, on the device)."""
        packed = gathered.view(self.world_size, self.row_bytes)  # (N, width)
        rows = self.format.dequantize(packed[:, : self.packed_bytes], self.shard_numel, self.dtype)  # (N, S)
        tags = packed[:, self.packed_bytes :].view(torch.float32)[:, 0]  # (N,)
        return rows, tags
