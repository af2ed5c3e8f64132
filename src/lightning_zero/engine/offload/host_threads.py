"""The threads an offloading rank's host step runs on (``ZeroConfig.host_threads``).

The host step (the fused CPU AdamW over the rank's chunks) is bound by memory bandwidth and runs on
torch's intra-op pool. The ranks of a node share its cores, and each rank's pool defaults to every
core the process may run on: N ranks then run N pools of that many threads on the same cores, and
OpenMP's spin-waiting threads slow one another down (the benchmark measured a 2-rank DDP step at
15 ms with one thread per rank, 57 ms to 3.5 s with two on two cores: ``bench/options.py``). So a
rank takes its share of the cores; a user who sets ``OMP_NUM_THREADS`` per rank has chosen already.
"""

from __future__ import annotations

import os

import torch

from lightning_zero.engine.config import ZeroConfig

LOCAL_RANKS_VARIABLE = "LOCAL_WORLD_SIZE"
"""The ranks on this node, as torchrun, Lightning's launchers and the benchmark's workers set it."""
OMP_VARIABLE = "OMP_NUM_THREADS"


def apply_host_threads(config: ZeroConfig) -> int:
    """With ``config.offload_optimizer``: set torch's intra-op threads (``torch.set_num_threads``,
    process-wide) to ``host_threads_for(config)`` and return that count. Without offload the
    optimizer steps on the device and the count is left alone (returned as it is)."""
    if not config.offload_optimizer:
        return torch.get_num_threads()
    threads = host_threads_for(config)
    torch.set_num_threads(threads)
    return threads


def host_threads_for(config: ZeroConfig) -> int:
    """The host step's threads: ``config.host_threads`` where given; else ``OMP_NUM_THREADS`` where
    set (the user's own choice per rank); else the cores this process may run on divided by the
    ranks of its node (``LOCAL_WORLD_SIZE``, 1 where unset), at least 1."""
    if config.host_threads is not None:
        return config.host_threads
    omp = os.environ.get(OMP_VARIABLE, "").strip()
    if omp:
        return _positive(omp.split(",")[0], OMP_VARIABLE, omp)  # "4,2": nested levels, the outer one is ours
    return max(1, usable_cores() // local_ranks())


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a rank pinned by its launcher or a
    container's cpuset sees its own), or ``os.cpu_count()`` where affinity cannot be read (macOS,
    Windows)."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return len(affinity(0))
    return os.cpu_count() or 1


def local_ranks() -> int:
    """The ranks sharing this node's cores: ``LOCAL_WORLD_SIZE``, or 1 where it is not set."""
    value = os.environ.get(LOCAL_RANKS_VARIABLE, "").strip()
    return _positive(value, LOCAL_RANKS_VARIABLE, value) if value else 1


def _positive(text: str, variable: str, whole: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{variable}={whole!r} is not a positive number, so the host step cannot tell how many threads to use."
            f" HINT: set {variable} to a positive integer, or pass `host_threads=` to the strategy."
        )
    return value
