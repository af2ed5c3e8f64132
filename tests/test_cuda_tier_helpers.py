"""The GPU tier's helpers that run anywhere: reading which stream each copy of a torch.profiler
trace ran on and how much of it overlapped the compute stream's kernels (``cuda_tier.copy_overlap``),
on a trace shaped as Kineto writes it."""

from __future__ import annotations

from cuda_tier import MIN_COPY_BYTES, copy_overlap


def _event(cat: str, name: str, stream: int, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur, "args": {"device": 0, "stream": stream, **args}}


def test_copies_are_placed_and_their_overlap_measured():
    big = MIN_COPY_BYTES
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 500},
        _event("kernel", "gemm", 7, 100, 50),
        _event("kernel", "gemm", 7, 140, 60),  # overlaps the previous one: 100-200 busy
        _event("kernel", "gemm", 7, 300, 100),  # 300-400 busy
        _event("kernel", "tiny", 9, 0, 10),  # another stream, less kernel time: not the compute stream
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 9, 180, 140, bytes=big),  # 20 + 20 us under kernels
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 9, 500, 10, bytes=big),  # after every kernel
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 7, 410, 1, bytes=4),  # a small read: left out
        _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 7, 420, 5, bytes=big),  # not host <-> device
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0},  # no duration: left out
    ]}  # fmt: skip
    found = copy_overlap(trace)
    assert found["compute_stream"] == 7 and found["kernels"] == 4
    copies = [(c["name"].split()[1], c["stream"], c["overlapped_us"]) for c in found["copies"]]
    assert copies == [("DtoH", 9, 40.0), ("HtoD", 9, 0.0)]


def test_a_trace_without_device_activity_has_no_compute_stream():
    assert copy_overlap({"traceEvents": []}) == {"compute_stream": None, "kernels": 0, "copies": []}
