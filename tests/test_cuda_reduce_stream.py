"""GPU tier, the reduce stream with real NCCL kernels on one GPU (world size 1, with
``LIGHTNING_ZERO_COLLECTIVES_AT_ONE_RANK=1``, so a one-rank NCCL group runs what a larger one runs;
see [Note: reduce stream] in ``reduce_stream.py``). Skipped without a CUDA device (``cuda_tier.py``).

- **Launched at readiness whatever the host's lead.** Before ``loss.backward()`` the compute stream
  spins (``torch.cuda._sleep``), so the host queues the whole backward, and runs every gradient hook,
  while the device has not started it: no reduce-scatter can have completed when the next bucket is
  ready. The buckets' full gradients waiting (``memory_report().waiting_gradients``) must stay within
  the buckets in flight, and a profiler trace of the step must show NCCL's reduce-scatter kernels
  running while backward's kernels still run on the compute stream (stages 2-3: stage 1 reduces
  after backward by design). Every variant trains as the same model without the engine (DDP at one
  rank divides by 1: the same arithmetic), bitwise where the optimizer steps on the GPU.
- **The ownership path** (a whole-tensor optimizer, Adafactor) with the same forced host lead.
- **An asynchronous save** (Fabric, zero3): afterwards this process has a CUDA context on its own
  device only (``torch.cuda.list_gpu_processes``; the writer thread sets the rank's device and uses
  DCP's loader that never touches CUDA).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from case_groups import CaseGroup, GroupResults, RankContext
from cuda_tier import MARKS, START_METHOD, setup_rank

pytestmark = MARKS

VARIANTS = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
SHAPE = dict(block_size=128, n_layer=4, n_head=8, n_embd=512)
"""Blocks of 3.1M parameters (12.6 MB in fp32): backward's kernels per block take a fraction of a
millisecond on an H100, about what a bucket's reduce-scatter takes, so the trace shows both."""
BUCKET_MB = 4.0
"""Several buckets per block at stages 1-2 (stage 3's buckets are its units, one per block)."""
SLEEP_CYCLES = 200_000_000
"""``torch.cuda._sleep`` before ``loss.backward()``: ~100 ms at 1.98 GHz, far longer than the host
takes to queue backward, so every gradient hook runs before the device started backward."""
STEPS = 3
MAX_IN_FLIGHT = 2
"""``ReduceDuringBackward``'s default: the buckets whose full gradients may wait at once."""

GROUP = CaseGroup(world_size=1, start_method=START_METHOD)


def _setup(deterministic: bool) -> Any:
    from lightning_zero.engine.comm.collectives import COLLECTIVES_AT_ONE_RANK

    os.environ[COLLECTIVES_AT_ONE_RANK] = "1"  # before any engine: real NCCL kernels at world size 1
    return setup_rank(deterministic)


def _models(variant: str, optimizer_class: Any, engine: bool) -> tuple:
    """A GPT on cuda:0 with its optimizer, under the engine (``engine``) or alone (the reference)."""
    import torch

    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.config import STRATEGY_NAMES
    from lightning_zero.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE)).to("cuda")
    optimizer = optimizer_class(model.parameters(), lr=1e-3)
    zero = ZeroEngine(model, [optimizer], ZeroConfig(**STRATEGY_NAMES[variant], bucket_size_mb=BUCKET_MB), device=torch.device("cuda", 0)) if engine else None
    return model, optimizer, zero


def _step(model: Any, optimizer: Any, engine: Any, tokens: Any, profiler: Any = None) -> None:
    """One step with the host forced ahead of the device before backward; ``profiler``: records
    from the step's start to the end of ``finish_backward`` (the optimizer step left out)."""
    import contextlib

    import torch

    with profiler if profiler is not None else contextlib.nullcontext():
        if engine is not None:
            engine.begin_step()
        loss = model(tokens[:, :-1], tokens[:, 1:])[1]
        torch.cuda._sleep(SLEEP_CYCLES)
        loss.backward()
        if engine is not None:
            engine.finish_backward()
        if profiler is not None:
            torch.cuda.synchronize()
    if engine is not None:
        engine.end_step()
    optimizer.step()
    if engine is not None:
        engine.after_optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)


def reduce_scatter_overlap(trace: dict) -> dict:
    """From a Chrome trace of the step up to ``finish_backward``: the compute stream (the one whose
    kernels ran longest), NCCL's reduce-scatter kernels, how many started before the compute stream's
    last kernel ended, and their time overlapping compute kernels against their total (ms)."""
    from cuda_tier import _intervals, _overlap, _stream

    kernels = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e]
    kernels = [e for e in kernels if not _is_sleep(e)]  # the forced host lead, not backward's work
    collective = [e for e in kernels if "ReduceScatter" in e["name"] or "reduce_scatter" in e["name"].lower()]
    per_stream: dict[Any, float] = {}
    for e in kernels:
        if e not in collective:
            per_stream[_stream(e)] = per_stream.get(_stream(e), 0.0) + e["dur"]
    compute = max(per_stream, key=per_stream.get) if per_stream else None
    on_compute = [e for e in kernels if _stream(e) == compute]
    last_compute_end = max((e["ts"] + e["dur"] for e in on_compute), default=0.0)
    busy = _intervals(on_compute)
    return {
        "reduce_scatters": len(collective),
        "streams": sorted({str(_stream(e)) for e in collective}),
        "compute_stream": str(compute),
        "before_backward_ended": sum(1 for e in collective if e["ts"] < last_compute_end),
        "under_backward_ms": sum(_overlap(e, busy) for e in collective) / 1e3,
        "total_ms": sum(e["dur"] for e in collective) / 1e3,
    }


def _is_sleep(event: dict) -> bool:
    """``torch.cuda._sleep``'s kernel (``spin_kernel`` in ATen)."""
    name = event["name"].lower()
    return "spin_kernel" in name or "sleep" in name


def host_lead(ctx: RankContext, variant: str) -> dict:
    """``STEPS`` steps of ``variant`` and of the model alone, each with the host forced ahead; the
    last engine step profiled. The weights of both, the last backward's waiting gradients, the largest
    bucket, and the trace's reduce-scatters."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    _setup(deterministic=True)
    tokens = torch.randint(0, 256, (8, SHAPE["block_size"] + 1), generator=torch.Generator().manual_seed(0)).to("cuda")
    out: dict = {}
    for label in ("plain", variant):
        model, optimizer, engine = _models(variant, torch.optim.AdamW, engine=label != "plain")
        prof = None
        for step in range(STEPS):
            prof = profile(activities=[ProfilerActivity.CUDA]) if engine is not None and step == STEPS - 1 else None
            _step(model, optimizer, engine, tokens, prof)
        weights = engine.full_state_dict(model) if engine is not None else model.state_dict()
        out[label] = {k: v.detach().cpu() for k, v in weights.items()}
        if engine is not None:
            path = os.path.join(ctx.tmpdir, f"reduce_trace_{variant}.json")
            prof.export_chrome_trace(path)
            out["trace"] = reduce_scatter_overlap(json.loads(Path(path).read_text()))
            out["waiting"] = engine.memory_report().waiting_gradients
            out["largest_bucket"] = max(b.param_bytes for b in engine.buckets)
            out["buckets"] = len(engine.buckets)
            engine.close()
    return out


for _variant in VARIANTS:
    GROUP.case(host_lead, name=f"host_lead_{_variant}", variant=_variant)


def ownership_path(ctx: RankContext) -> dict:
    """Adafactor (each parameter stepped whole by its owner) at stage 2 with the host forced ahead,
    against the model alone: the weights of both."""
    import torch

    _setup(deterministic=True)
    tokens = torch.randint(0, 256, (8, SHAPE["block_size"] + 1), generator=torch.Generator().manual_seed(0)).to("cuda")
    out = {}
    for label in ("plain", "zero2"):
        model, optimizer, engine = _models("zero2", torch.optim.Adafactor, engine=label != "plain")
        for _ in range(STEPS):
            _step(model, optimizer, engine, tokens)
        weights = engine.full_state_dict(model) if engine is not None else model.state_dict()
        out[label] = {k: v.detach().cpu() for k, v in weights.items()}
        if engine is not None:
            engine.close()
    return out


GROUP.case(ownership_path)


def async_save_contexts(ctx: RankContext) -> dict:
    """Fabric zero3 on cuda:0 with ``async_save``: two steps, a save, its wait; then which visible
    devices list this process among their CUDA contexts (``torch.cuda.list_gpu_processes``)."""
    import torch
    from fabric_loop import batches_for, fabric_for, small_gpt

    _setup(deterministic=False)
    fabric = fabric_for("zero3", accelerator="cuda", async_save=True)
    module = small_gpt()
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    for batch in batches_for(0, 2):
        batch = batch.to("cuda")
        fabric.backward(model(batch[:, :-1], batch[:, 1:])[1])
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(os.path.join(ctx.tmpdir, "async_on_cuda"), {"model": model, "optimizer": optimizer})
    fabric.strategy.wait_for_checkpoint()
    pid = str(os.getpid())
    listings = {d: torch.cuda.list_gpu_processes(d) for d in range(torch.cuda.device_count())}
    return {
        "own": torch.cuda.current_device(),
        "listed_on": sorted(d for d, text in listings.items() if any(line.split()[1:2] == [pid] for line in text.splitlines())),
        "nvml": all(text.startswith("GPU:") for text in listings.values()),  # else why NVML could not list
    }


GROUP.case(async_save_contexts)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("cuda_reduce_stream"))


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("variant", VARIANTS)
def test_reduce_scatters_launch_at_readiness_with_the_host_ahead_and_train_as_without_the_engine(results, variant):
    (out,) = results[f"host_lead_{variant}"]
    trace = out["trace"]
    assert out["buckets"] > MAX_IN_FLIGHT and trace["reduce_scatters"] >= out["buckets"], trace  # real NCCL kernels
    assert out["waiting"] <= MAX_IN_FLIGHT * out["largest_bucket"], (out["waiting"], out["largest_bucket"])
    if variant != "zero1":  # stage 1 reduces after backward
        assert trace["before_backward_ended"] > 0 and trace["under_backward_ms"] > 0, trace
    tolerance = 1e-5 if "offload" in variant else 0.0  # offloaded, AdamW steps on the host
    assert _max_diff(out["plain"], out[variant]) <= tolerance


def test_the_ownership_path_with_the_host_ahead_steps_as_without_the_engine(results):
    (out,) = results["ownership_path"]
    assert _max_diff(out["plain"], out["zero2"]) == 0.0


def test_an_async_save_leaves_a_cuda_context_on_its_own_device_only(results):
    (out,) = results["async_save_contexts"]
    if not out["nvml"]:
        pytest.skip("torch.cuda.list_gpu_processes needs pynvml (nvidia-ml-py) and the driver")
    if not out["listed_on"]:
        pytest.skip("NVML lists no process with this pid (the processes run in another pid namespace)")
    assert out["listed_on"] == [out["own"]]
