"""torch's report of its pinned host pool, which torch 2.6 does not have.

``torch.cuda.host_memory_stats`` (the ``CachingHostAllocator``'s counters) arrived in torch 2.7.
Without it the memory report counts the engine's pinned blocks uncapped (``engine/comm/copy_memory.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

_host_memory_stats = getattr(torch.cuda, "host_memory_stats", None)


def pinned_pool_bytes() -> Optional[int]:
    """Bytes of torch's pinned host pool (blocks in use and cached); None where torch reports none
    (no CUDA, CUDA not initialized yet, or a torch without the report)."""
    if _host_memory_stats is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    value = _host_memory_stats().get("allocated_bytes.current")
    return int(value) if value is not None else None
