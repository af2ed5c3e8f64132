"""The GPU tier (``tests/test_cuda_*.py``): its pytest marks, and how each of its processes is set up.

Every CUDA case runs at world size 1 on ``cuda:0`` in a spawned process (``case_groups.CaseGroup``
with one rank), so the pytest process never initializes CUDA and a case that breaks the CUDA
context takes only its own group down. Without a CUDA device the tier is collected and skipped with
``NO_CUDA`` as its reason: plain ``pytest -q`` (what CI runs) only imports these modules. On a
machine with one, ``pytest -m cuda`` runs the tier alone, and ``scripts/gpu_check.sh`` runs it
first (a few minutes on an H200).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

NO_CUDA = "no CUDA device here: the GPU tier runs where torch sees one (`bash scripts/gpu_check.sh`)"
MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
"""``pytestmark`` of every GPU-tier module."""

START_METHOD = "spawn"
"""How the tier's ``CaseGroup`` starts its rank: a new interpreter, never a fork of the tests' rank
server (``tests/rank_imports.py``), so that no import made before the fork can have touched CUDA."""

PROCESS_GROUP_BACKEND = "cpu:gloo,cuda:nccl"
"""One group of one rank serves every Trainer and Fabric in a process, on either device: Lightning
keeps a process group it finds, and a CPU run in the same process then still has gloo for its
CPU tensors (a checkpoint saved on CUDA resumes on the CPU in the same process)."""


def setup_rank(deterministic: bool) -> torch.device:
    """Ready this process for a case on ``cuda:0``; call first in every case (it is idempotent).

    ``deterministic``: parity cases compare two runs bit for bit up to their arithmetic, so they
    ask torch for deterministic kernels (cuBLAS needs its workspace setting before its first call,
    which this makes before any case computes) and attention's math kernel (the fused ones may
    accumulate with atomics in backward). The other cases measure what users run: torch's defaults.
    """
    import torch.distributed as dist

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.cuda.set_device(0)
    if not dist.is_initialized():  # run_on_ranks set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE
        dist.init_process_group(PROCESS_GROUP_BACKEND)
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(not deterministic)
    torch.backends.cuda.enable_mem_efficient_sdp(not deterministic)
    torch.backends.cuda.enable_cudnn_sdp(not deterministic)
    return torch.device("cuda", 0)


# ---- reading a torch.profiler trace ----------------------------------------------------------------

MIN_COPY_BYTES = 64 * 1024
"""Smaller host<->device copies are not the engine's bucket copies (e.g. the used flags' read)."""


def _intervals(events: list[dict]) -> list[tuple[float, float]]:
    """Merged [start, end) intervals (µs) covered by ``events``."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _overlap(event: dict, busy: list[tuple[float, float]]) -> float:
    start, end = event["ts"], event["ts"] + event["dur"]
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)


def copy_overlap(trace: dict) -> dict:
    """From a Chrome trace of torch.profiler (CUDA activity): the compute stream (the one whose
    kernels ran longest), the host<->device copies of at least ``MIN_COPY_BYTES`` with their stream,
    and how much of their time overlapped kernels on the compute stream."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    per_stream: dict[Any, float] = {}
    for e in kernels:
        per_stream[_stream(e)] = per_stream.get(_stream(e), 0.0) + e["dur"]
    compute = max(per_stream, key=per_stream.get) if per_stream else None
    busy = _intervals([e for e in kernels if _stream(e) == compute])
    copies = [
        e for e in events
        if e.get("cat") == "gpu_memcpy" and ("HtoD" in e["name"] or "DtoH" in e["name"])
        and e.get("args", {}).get("bytes", 0) >= MIN_COPY_BYTES
    ]  # fmt: skip
    return {
        "compute_stream": compute,
        "kernels": len(kernels),
        "copies": [
            {"name": e["name"], "stream": _stream(e), "bytes": e["args"]["bytes"], "us": e["dur"], "overlapped_us": _overlap(e, busy)}
            for e in copies
        ],
    }


def _stream(event: dict) -> Any:
    """A device event's stream: in its args, and as its "tid" (the trace's row)."""
    return event.get("args", {}).get("stream", event.get("tid"))
