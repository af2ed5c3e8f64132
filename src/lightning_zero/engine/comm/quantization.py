"""Block-wise quantization for ZeRO++'s collectives (qwZ's weight gathers, qgZ's gradient reduction).

[Note: quantized rows]
A row of L floats is cut into blocks of ``block`` elements (the last one zero-padded); each block is
sent as one fp32 scale (its largest magnitude over the format's largest value) and one code per
element, rounded to nearest (ties to even: the same bits on every rank and every run):

* "int8": codes in [-127, 127], a byte each;
* "int4": codes in [-7, 7], two a byte (low nibble first), as ZeRO++'s qgZ sends gradients;
* "fp8": float8 e4m3 codes (largest 448), a byte each.

A packed row is bytes: ``[scales: 4·blocks][codes]``, padded to a multiple of 4 bytes so that rows
stack into one uint8 tensor ``(R, packed_bytes)`` whose scale columns view as fp32: one collective
moves the rows of every rank, and one dequantize reads them all. A block of zeros has scale 0 and
codes 0, and dequantizes to exact zeros. Non-finite values are not representable: a block holding
an inf or NaN dequantizes to NaN throughout, so it still reads as non-finite (what an overflow
check or a ``GradScaler`` looks for).

Memory: quantizing R rows of L elements holds one fp32 temporary of R·L (the padded rows, scaled in
place) and a byte per element of codes; dequantizing, one fp32 (R, L) besides its result. On a GPU
these are the caching allocator's for the span of the collective's packing; ``memory_report()`` does
not count them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class BlockFormat:
    """One quantized format: its codes, its block length, and how big a packed row is."""

    name: str
    block: int
    """Elements per scale."""
    largest: float
    """The largest code magnitude: a block's scale is its largest magnitude / this."""
    codes_per_byte: int

    def blocks(self, numel: int) -> int:
        return max(1, math.ceil(numel / self.block))

    def packed_bytes(self, numel: int) -> int:
        """Bytes of one packed row of ``numel`` elements (a multiple of 4)."""
        blocks = self.blocks(numel)
        code_bytes = blocks * self.block // self.codes_per_byte
        return 4 * blocks + _round_up(code_bytes, 4)

    def quantize(self, rows: Tensor, out: Tensor) -> Tensor:
        """Pack ``rows`` (R, L), any float dtype, into ``out`` (R, packed_bytes(L)) uint8; returns ``out``.
        One fp32 temporary of the rows' size (see [Note: quantized rows]'s last paragraph)."""
        r, length = rows.shape
        blocks = self.blocks(length)
        scaled = rows.new_zeros((r, blocks * self.block), dtype=torch.float32)  # (R, nb·B): the padding stays 0
        scaled[:, :length] = rows
        blocked = scaled.view(r, blocks, self.block)  # (R, nb, B)
        low, high = torch.aminmax(blocked, dim=2, keepdim=True)  # (R, nb, 1) each; NaN propagates
        # the largest magnitude (abs: a block of zeros signed either way has scale +0) / the largest code
        scales = torch.maximum(high, low.neg_()).abs_().div_(self.largest)
        inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))  # a zero block: codes 0
        blocked.mul_(inverse)
        out[:, : 4 * blocks].view(torch.float32).copy_(scales.view(r, blocks))
        codes_out = out[:, 4 * blocks : 4 * blocks + blocks * self.block // self.codes_per_byte]
        if self.name == "fp8":
            codes_out.copy_(scaled.to(torch.float8_e4m3fn).view(torch.uint8))
        else:
            codes = scaled.round_().clamp_(-self.largest, self.largest).to(torch.int8)  # (R, nb·B), a byte each
            if self.codes_per_byte == 1:
                codes_out.copy_(codes.view(torch.uint8))
            else:  # int4: two codes a byte, offset by 8 into [1, 15], low nibble first
                nibbles = codes.add_(8).view(torch.uint8).view(r, -1, 2)
                codes_out.copy_(nibbles[:, :, 0] | (nibbles[:, :, 1] << 4))
        return out

    def dequantize(self, packed: Tensor, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """The rows ``packed`` (R, packed_bytes(numel)) uint8 stand for, (R, numel) in ``dtype``."""
        r = packed.shape[0]
        blocks = self.blocks(numel)
        scales = packed[:, : 4 * blocks].view(torch.float32).view(r, blocks, 1)  # (R, nb, 1)
        codes = packed[:, 4 * blocks : 4 * blocks + blocks * self.block // self.codes_per_byte]
        if self.name == "fp8":
            values = codes.view(torch.float8_e4m3fn).to(torch.float32)
        elif self.codes_per_byte == 1:
            values = codes.view(torch.int8).to(torch.float32)
        else:
            values = torch.stack([codes & 0xF, codes >> 4], dim=2).view(r, -1).to(torch.float32).sub_(8)
        values.view(r, blocks, self.block).mul_(scales)  # (R, nb, B), in place: one fp32 temporary
        return values[:, :numel].to(dtype)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


FORMATS: dict[str, BlockFormat] = {
    "int8": BlockFormat("int8", block=256, largest=127.0, codes_per_byte=1),
    "int4": BlockFormat("int4", block=128, largest=7.0, codes_per_byte=2),
    "fp8": BlockFormat("fp8", block=256, largest=448.0, codes_per_byte=1),
}
"""The formats by the name the options take. int4 blocks are shorter: with 15 levels a block's
largest value decides more of the others' error."""
