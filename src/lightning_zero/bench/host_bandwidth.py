"""How fast the host's memory is, and how much of it the host step moves (issue 53, item 3).

An offloaded optimizer step (fused CPU AdamW) does a few flops per byte it moves, so its floor is
the bytes it moves over the memory's bandwidth, not the cores' flops. The bench sets the step's
achieved bytes/s (`adamw_step_bytes` over its time) against `measure_host_bandwidth`, taken in the
same process with the same threads, so "the host step runs at 70% of the memory's speed" compares
figures from one machine at one moment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

PROBE_BYTES = 256 * 2**20
"""Bytes of each of the probe's two tensors: far beyond any cache, a fraction of a second per pass."""
PROBE_REPEATS = 5
"""Timed passes; the best is kept (the others lost time to something other than the memory)."""
ADAMW_TENSORS_READ = 4
"""AdamW reads the parameter, its gradient, exp_avg and exp_avg_sq..."""
ADAMW_TENSORS_WRITTEN = 3
"""...and writes the parameter, exp_avg and exp_avg_sq back."""


@dataclass(frozen=True)
class HostBandwidth:
    """The host memory's bandwidth as one large in-place update sees it."""

    bytes_per_s: float
    """Bytes read plus bytes written per second by the best update."""
    tensor_bytes: int
    """Size of each of the two tensors (the update moves three times this)."""
    best_s: float
    """The best update's seconds."""
    threads: int
    """torch's intra-op threads during the updates (`torch.get_num_threads()`)."""


def measure_host_bandwidth(nbytes: int = PROBE_BYTES, repeats: int = PROBE_REPEATS) -> HostBandwidth:
    """`a += b` over two float32 tensors of `nbytes` each (multithreaded over torch's intra-op pool,
    as the fused CPU AdamW is), `repeats` times after one untimed pass; the best pass's bytes moved
    (read a and b, write a: 3 x `nbytes`) per second.

    In place, as AdamW updates its tensors: a `copy_` into another tensor writes lines it never read,
    which the CPU reads first anyway (write-allocate), so it moves 3n bytes for the 2n it is credited
    with and understates the bandwidth (on this project's 2-core machine: 25 GB/s by copy, 41 GB/s by
    `a += b`, and the fused AdamW itself 40 GB/s by `adamw_step_bytes`)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 4:
        raise ValueError(f"`nbytes` must be an integer of at least 4 (one float32), got {nbytes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"`repeats` must be a positive integer, got {repeats!r}")
    a = torch.zeros(nbytes // 4, dtype=torch.float32)  # (n,) both written once: their pages are resident
    b = torch.ones_like(a)
    a.add_(b)  # untimed: the first pass may still meet lazily mapped pages
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a.add_(b)
        best = min(best, time.perf_counter() - start)
    tensor_bytes = a.numel() * a.element_size()
    return HostBandwidth(bytes_per_s=3 * tensor_bytes / best, tensor_bytes=tensor_bytes, best_s=best, threads=torch.get_num_threads())


def adamw_step_bytes(numel: int, element_bytes: int = 4) -> int:
    """Bytes AdamW's host step moves for `numel` parameters of `element_bytes` each (fp32: 28 B per
    parameter): it reads the parameter, the gradient, exp_avg and exp_avg_sq and writes the
    parameter, exp_avg and exp_avg_sq, once each (fused: one pass). Not counted: the step counter
    and the scalars, amsgrad's max_exp_avg_sq (off by default), the copies of gradients to the host
    and of updated chunks to the device (other phases), and any extra traffic the caches add."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"`numel` must be a non-negative number of parameters, got {numel!r}")
    if isinstance(element_bytes, bool) or not isinstance(element_bytes, int) or element_bytes < 1:
        raise ValueError(f"`element_bytes` must be a positive number of bytes, got {element_bytes!r}")
    return (ADAMW_TENSORS_READ + ADAMW_TENSORS_WRITTEN) * element_bytes * numel
