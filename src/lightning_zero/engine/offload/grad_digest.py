"""What a step taken during backward read of its gradients' contents, so that the verdict can tell
an edit no version counter saw (see [Note: the host step during backward] in ``step_ahead.py``).

[Note: gradient digests]
Most edits of a gradient move its version counter (any in-place op through autograd's view of the
tensor, and every edit through ``param.grad``, see ``sharded_grad.py``), and the verdict compares
it. Some move none: an in-place op on ``shard.grad.data`` (a fresh version counter), a write
through a ``.numpy()`` view, ``shard.grad.data = ...``, a kernel that writes below autograd. Where
user code ran between backward and the step, the worker therefore also takes a digest of each
bucket's gradients before it steps them, and the verdict takes it again: a different digest means
different contents.

The digest reads a tensor's bytes once per sum, as rows of 128 bytes (16 64-bit words), in two sums
over the rows, each per lane (column): the words as integers, mod 2**64 (``W``), and the elements
as floating-point numbers (``F``, for a float dtype); the bytes that fill no whole row are kept as
they are. ``W`` is exact integer arithmetic, the same in any order on any thread; ``F`` is the same
kernel on the same tensor with the same threads, so the same bits. An unedited gradient always
gives the same digest (no false alarm), NaN and -0.0 included (``F`` is compared by its bits). Each
sum runs as fast as a flat sum (measured on one core: 64 MiB of fp32 in 3.4 ms for ``W``, 3.1 ms for
``F``, a flat sum 3.2 ms, ``_foreach_norm`` 3.8 ms), and taken 4 MiB at a time the second reads from
the cache.

Collisions: an edit goes unseen only where it leaves every lane of both sums as it was.

- ``W`` sees every edit confined to 16 consecutive words (32 fp32 elements, 128 bytes) for sure:
  each lane holds at most one changed word, and a changed word changes its lane's sum. Elsewhere a
  lane's ``W`` changes by the sum of its words' changes mod 2**64: edits whose changes depend on the
  data (scaling by anything but a power of two, noise, clamping, copying other values in) collide
  only by an exact cancellation mod 2**64 in each of the 16 lanes. Scaling by ``2**k`` adds
  ``k * 2**23`` to each normal fp32 element, zero mod 2**64 in a lane only where its low-half
  elements are all zero; zeroing, clamping and scaling by ``|c| < 1`` only lower magnitudes.
- ``W``'s blind spot is the sign bit: a flip adds ``+-2**31`` for an fp32 element in a word's low
  half but ``2**63 = -2**63`` (mod 2**64) in its high half, and every fp64 element is a high half.
  Sign flips (``neg_``, ``abs_``, ``copysign_``) are what ``F`` sees: a flipped lane's sum becomes
  ``F - 2 * (the flipped elements' sum)``, unseen only where that is below half an ulp of ``F``
  (a lone tensor's gradients that small against its bucket's: 2**-24 relative in fp32, 2**-53 in
  fp64) and, for fp32, where ``W`` also balances (as many low-half elements flipped each way in each
  lane, an even number of high-half ones: for a flipped chunk of ``M`` words with random signs at
  most ``2**-16``, at ``M = 32``; never where ``M`` is not a multiple of 32).
- An edit that changes values and then restores them exactly (ABA) between the worker's read and the
  verdict is not seen: the digest compares contents, not history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

LANES = 16
"""64-bit words per row: 128 bytes, where a (rows, 16) int64 sum (and a (rows, 128 / itemsize)
float sum) over the rows is as fast as a flat sum on the CPU."""
_WORD = 8
_ROW = LANES * _WORD
_BLOCK = 4 * 2**20
"""Bytes summed at a time, both sums in turn: the second reads what the first brought into the cache
(measured: a third less time than each sum over the whole tensor in turn, 64 MiB of fp32)."""
_SPLIT = 8
"""Groups of rows summed apart, then together (``_lane_sums``)."""
_FLOAT_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


Digest = tuple[Tensor, ...]
"""A tensor's digest: ``W``'s lanes, ``F``'s lanes as their bits (float dtypes), the bytes after the
last whole row and those before the first whole word, as they are."""


def digest(t: Tensor) -> Digest:
    """``t``'s contents (see [Note: gradient digests]): a few small tensors, compared with ``same``. A
    non-contiguous ``t`` is copied first."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    n = raw.numel()
    head = min(n, -raw.storage_offset() % _WORD)  # bytes before the first whole word
    body_end = head + (n - head) // _ROW * _ROW
    floating = flat.dtype in _FLOAT_BITS
    per_row = _ROW // flat.element_size()
    total = flat.dtype if flat.element_size() >= 4 else torch.float32  # half floats: summed in fp32
    words: Optional[Tensor] = None
    values: Optional[Tensor] = None
    for start in range(head, body_end, _BLOCK):  # block by block: the second sum reads from the cache
        block = raw[start : min(start + _BLOCK, body_end)]
        w = _lane_sums(block.view(torch.int64).view(-1, LANES), torch.int64)
        words = w if words is None else words.add_(w)
        if floating:
            v = _lane_sums(block.view(flat.dtype).view(-1, per_row), total)
            values = v if values is None else values.add_(v)
    found = [words if words is not None else torch.zeros(LANES, dtype=torch.int64)]
    if floating:
        found.append((values if values is not None else torch.zeros(per_row, dtype=total)).view(_FLOAT_BITS[total]))
    return (*found, raw[body_end:].clone(), raw[:head].clone())


def _lane_sums(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """(R, L) -> (L,): each lane's sum over the rows, in ``dtype``. Summed as ``_SPLIT`` groups of rows
    and then the groups: torch reduces a (rows, L) tensor over its rows on one thread, and (groups,
    rows, L) over the middle dimension on all of them (measured: 2.4x faster on 2 threads)."""
    whole = rows.shape[0] // _SPLIT * _SPLIT
    sums = rows[:whole].view(_SPLIT, -1, rows.shape[1]).sum(dim=1, dtype=dtype).sum(dim=0) if whole else None
    if whole == rows.shape[0]:
        assert sums is not None
        return sums
    rest = rows[whole:].sum(dim=0, dtype=dtype)
    return rest if sums is None else sums.add_(rest)


def same(a: Digest, b: Digest) -> bool:
    """Whether two digests are equal (bit for bit: a NaN sum equals itself)."""
    return len(a) == len(b) and [x.shape for x in a] == [y.shape for y in b] and all(map(torch.equal, a, b))


@dataclass
class GradContents:
    """The digests of what a bucket's step read (see [Note: gradient digests]): the bucket's gradient
    row ``row`` (every gradient that is a chunk of it: ``in_row``) and each other gradient on its own."""

    row: Tensor
    row_digest: Digest
    others: list[tuple[int, Digest]]
    """(position in the step's gradients, digest) of each gradient not in the row."""
    places: list[tuple[int, torch.Size]]
    """Each gradient's ``data_ptr()`` and shape as read ((0, ()): none): ``set_`` and ``.data =``
    keep the tensor object and move its storage."""

    @classmethod
    def take(cls, row: Tensor, grads: Sequence[Optional[Tensor]], in_row: Sequence[bool]) -> "GradContents":
        others = [(i, digest(g)) for i, (g, inside) in enumerate(zip(grads, in_row)) if g is not None and not inside]
        return cls(row, digest(row), others, _places(grads))

    def unchanged(self, grads: Sequence[Optional[Tensor]]) -> bool:
        """Whether ``grads`` (the same tensors the step read: the caller checks identity) still hold
        what they held when this was taken."""
        if _places(grads) != self.places:
            return False
        if not same(digest(self.row), self.row_digest):
            return False
        for i, taken in self.others:
            if not same(digest(grads[i]), taken):
                return False
        return True


def _places(grads: Sequence[Optional[Tensor]]) -> list[tuple[int, torch.Size]]:
    return [(g.data_ptr(), g.shape) if g is not None else (0, torch.Size()) for g in grads]
