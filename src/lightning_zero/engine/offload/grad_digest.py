"""What a step taken during backward read of its gradients' contents, so that the verdict can tell
an edit no version counter saw (see [Note: the host step during backward] in ``step_ahead.py``).

[Note: gradient digests]
Most edits of a gradient move its version counter (any in-place op through autograd's view of the
tensor, and every edit through ``param.grad``, see ``sharded_grad.py``), and the verdict compares
it. Some move none: an in-place op on ``shard.grad.data`` or ``shard.grad.detach()`` (a fresh
version counter each), a write through a ``.numpy()`` view, a kernel that writes below autograd.
Where user code ran between backward and the step, the worker therefore also takes a digest of each
bucket's gradients before it steps them, and the verdict takes it again: a different digest means
different contents.

The digest of a tensor is its bytes read as little-endian 64-bit words ``w_0, w_1, ...``, summed
mod 2**64 in ``LANES`` lanes (lane ``l`` sums ``w_l, w_{l+LANES}, ...``), the few bytes that do not
fill whole words kept as they are. It is exact integer arithmetic, so the sum is the same whatever
the order, the thread or the threads torch reduces with: an unedited gradient always gives the same
digest (no false alarm), NaN and -0.0 included. A (rows, 16) int64 sum over rows runs as fast as a
flat sum on the CPU (measured: 2.7 ms for 64 MiB on one core, a flat sum 2.6 ms, ``_foreach_norm`` 3.1).

Collisions (an edit that leaves every lane's sum as it was):

- an edit confined to 16 consecutive words (32 fp32 elements, 128 bytes) is always seen: each lane
  holds at most one changed word, and a changed word changes its lane's sum;
- a lane's sum changes by the sum of its words' changes mod 2**64. Edits whose changes are data
  dependent (scaling by anything but a power of two, adding noise, clamping, copying other values
  in) collide in a lane only by an exact cancellation mod 2**64, and must do so in all 16 lanes;
- structured edits change one fixed bit pattern per element. Scaling by ``2**k`` adds ``k * 2**23``
  to each normal fp32 element; in a lane that sum is ``k * 2**23 * (a + 2**32 * b)`` (``a``, ``b``:
  changed elements in the words' low and high halves), zero mod 2**64 only where ``a = 0``: every
  low-half element of the lane is zero. Zeroing, clamping and scaling by ``|c| < 1`` only lower each
  element's magnitude bits. A sign flip (``neg_``) adds ``+-2**31`` per low-half element and
  ``+-2**63`` per high-half one: a lane's sum stays only if its changed low-half elements are
  half positive and half negative, and the high-half ones an even count. A flip of a chunk of ``M``
  words is seen for sure unless ``M`` is a multiple of 32; with random signs it goes unseen with
  probability ``(C(q, q/2) / 2**q) ** 16`` (``q = M / 16``): at most ``2**-16`` (``M = 32``, an
  fp32 chunk of exactly 64 elements), below ``2e-7`` from ``M = 64`` on, and the verdict redoes
  the step if any bucket's digest moved, so flipping several tensors multiplies these;
- an edit that changes the values and then restores them exactly (ABA) between the worker's read
  and the verdict is not seen: the digest compares contents, not history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

LANES = 16
"""Lanes of 64-bit words (see [Note: gradient digests]): 128 bytes, where a (rows, LANES) int64 sum
is as fast as a flat one."""
_WORD = 8


def digest(t: Tensor) -> Tensor:
    """``t``'s contents as ``2 * LANES + 1`` int64 (see [Note: gradient digests]): each lane's sum
    of whole words, then the bytes left over as they are, zero-padded (fewer than a row of words at
    the end, fewer than a word before the first whole one). Reads ``t`` once; a non-contiguous ``t``
    is copied first."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    n = raw.numel()
    head = min(n, -raw.storage_offset() % _WORD)  # bytes before the first whole word
    rows = (n - head) // (_WORD * LANES)
    body_end = head + rows * _WORD * LANES
    lanes = raw[head:body_end].view(torch.int64).view(rows, LANES).sum(dim=0) if rows else torch.zeros(LANES, dtype=torch.int64)
    rest = torch.zeros((LANES + 1) * _WORD, dtype=torch.uint8)
    tail = raw[body_end:]  # fewer than LANES * 8 bytes
    rest[: tail.numel()] = tail
    rest[LANES * _WORD : LANES * _WORD + head] = raw[:head]
    return torch.cat([lanes, rest.view(torch.int64)])


@dataclass
class GradContents:
    """The digests of what a bucket's step read (see [Note: gradient digests]): the bucket's gradient
    row ``row`` (every gradient that is a chunk of it: ``in_row``) and each other gradient on its own."""

    row: Tensor
    row_digest: Tensor
    others: list[tuple[int, Tensor]]
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
        if not torch.equal(digest(self.row), self.row_digest):
            return False
        return all(torch.equal(digest(grads[i]), taken) for i, taken in self.others)


def _places(grads: Sequence[Optional[Tensor]]) -> list[tuple[int, torch.Size]]:
    return [(g.data_ptr(), g.shape) if g is not None else (0, torch.Size()) for g in grads]
