"""GPU tier, the engine on ``cuda:0`` (world size 1): no host sync in forward and backward, the
device model state against the estimator's floor, and offload's pinned buffers and side-stream
copies overlapping compute. Skipped without a CUDA device (see ``cuda_tier.py``).

Where a step may wait for the device, and each check:

- ``begin_step``, forward and backward run under ``torch.cuda.set_sync_debug_mode("error")``: any
  synchronizing CUDA call in them raises, with its Python stack, and fails the case.
- ``finish_backward`` + ``end_step`` may make one host sync: the read of the buckets' used flags
  (``HostReads``), which with offload also waits for the copies to the host (the compute stream
  waits for the copy stream first, ``CopyStream.join_compute_stream``). The step (clipping, the
  optimizer, ``after_optimizer_step``) may make one too. Both are counted with the debug mode at
  "warn", which names the file and line of each sync.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
from case_groups import CaseGroup, GroupResults, RankContext
from cuda_tier import MARKS, START_METHOD, copy_overlap, setup_rank

pytestmark = MARKS

VARIANTS = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
PRECISIONS = ("fp32", "bf16-mixed")
SYNC_SHAPE = dict(block_size=64, n_layer=3, n_head=4, n_embd=128)
MEMORY_SHAPE = dict(block_size=64, n_layer=2, n_head=4, n_embd=256)
"""Every tensor of this GPT (and its gradient and Adam moments) is a multiple of 512 B, the caching
allocator's rounding, so ``torch.cuda.memory_allocated`` counts the model state without padding."""
PROFILE_SHAPE = dict(block_size=256, n_layer=4, n_head=16, n_embd=1024)
"""Blocks of 12.6M parameters (50 MB in fp32) and 8 x 256 tokens: each unit's copy and each
block's kernels take about a millisecond on an H200, long enough for the trace to show them side by side."""
BOOKKEEPING_BYTES = 64 * 1024
"""What the engine keeps on the device beside model state and its buffer pool: used flags and unit
tags (a few scalars per bucket or unit), each rounded up to 512 B by the allocator."""
SYNC_MESSAGE = "synchronizing CUDA operation"

GROUP = CaseGroup(world_size=1, start_method=START_METHOD)


def _engine_run(
    variant: str,
    shape: dict,
    batch_size: int = 4,
    seed: int = 0,
    device: Any = None,
    optimizer_options: Optional[dict] = None,
    optimizer_class: Any = None,
    **options: Any,
):
    """A GPT on ``device`` (default cuda:0), AdamW (or ``optimizer_class``, with ``optimizer_options``),
    and the engine with the options ``variant`` names and ``options`` on top; a batch of tokens."""
    import torch

    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.config import STRATEGY_NAMES
    from lightning_zero.models.gpt import GPT, GPTConfig

    device = torch.device("cuda", 0) if device is None else torch.device(device)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**shape)).to(device)
    optimizer = (optimizer_class or torch.optim.AdamW)(model.parameters(), lr=1e-3, **(optimizer_options or {}))
    engine = ZeroEngine(model, [optimizer], ZeroConfig(**STRATEGY_NAMES[variant], **options), device=device)
    tokens = torch.randint(0, 256, (batch_size, shape["block_size"] + 1), device=device)  # (B, T + 1)
    return model, optimizer, engine, tokens


def _full_parameters(shape: dict) -> list:
    """The GPT's parameters as built, before any engine shards them (on the meta device: shapes only,
    in ``model.parameters()`` order, a tied weight once)."""
    import torch

    from lightning_zero.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        return list(GPT(GPTConfig(**shape)).parameters())


def _autocast(precision: str):
    import torch

    return torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()


@contextlib.contextmanager
def _sync_debug(mode: str) -> Iterator[None]:
    import torch

    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _syncs_in(fn: Callable[[], Any]) -> list[str]:
    """Run ``fn`` with the debug mode at "warn": where each host sync was made (file:line)."""
    with warnings.catch_warnings(record=True) as caught, _sync_debug("warn"):
        warnings.simplefilter("always")
        fn()
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if SYNC_MESSAGE in str(w.message)]


# ---- no host sync in forward and backward ------------------------------------------------------------


def plain_forward_backward(ctx: RankContext) -> bool:
    """The control: the GPT without an engine, forward and backward under "error" (a sync here
    would be torch's or the model's, and would make the engine's cases meaningless)."""
    import torch

    from lightning_zero.models.gpt import GPT, GPTConfig

    setup_rank(deterministic=False)
    model = GPT(GPTConfig(**SYNC_SHAPE)).cuda()
    tokens = torch.randint(0, 256, (4, SYNC_SHAPE["block_size"] + 1), device="cuda")
    for precision in PRECISIONS:
        for watched in (False, True):  # the first pass loads the kernels and allocates workspaces
            with _sync_debug("error" if watched else "default"), _autocast(precision):
                model(tokens[:, :-1], tokens[:, 1:])[1].backward()
    return True


GROUP.case(plain_forward_backward)


def host_syncs(ctx: RankContext, variant: str, precision: str) -> list[dict]:
    """Two warm-up steps, then two steps with forward and backward under "error" and the rest
    counted: per counted step, where ``finish_backward`` + ``end_step`` and where the step synced."""
    import torch

    from lightning_zero.engine.gradients.norms import clip_grads_by_global_norm_

    device = setup_rank(deterministic=False)
    model, optimizer, engine, tokens = _engine_run(variant, SYNC_SHAPE)
    shards = [p for group in optimizer.param_groups for p in group["params"]]

    def forward_backward() -> None:
        engine.begin_step()
        with _autocast(precision):
            loss = model(tokens[:, :-1], tokens[:, 1:])[1]
        loss.backward()

    def after_backward() -> None:
        engine.finish_backward()
        engine.end_step()

    def step() -> None:
        clip_grads_by_global_norm_(shards, 1.0, device=device)  # reduced on the compute device, as the plugins do
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    counted = []
    try:
        for _ in range(2):  # the first step allocates the optimizer state and the buffer pool
            forward_backward()
            after_backward()
            step()
        for _ in range(2):
            with _sync_debug("error"):
                forward_backward()
            counted.append({"after_backward": _syncs_in(after_backward), "step": _syncs_in(step)})
        torch.cuda.synchronize()
    finally:
        engine.close()
    return counted


for _variant in VARIANTS:
    for _precision in PRECISIONS:
        GROUP.case(host_syncs, name=f"syncs_{_variant}_{_precision}", variant=_variant, precision=_precision)


# ---- device model state -------------------------------------------------------------------------------


def _allocated() -> int:
    import torch

    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def device_model_state(ctx: RankContext, variant: str) -> dict:
    """Two fp32 steps (gradients kept after the second, as the estimator counts them); then what
    ``torch.cuda.memory_allocated`` falls by when the model, optimizer and engine are dropped,
    the engine's own report, and the estimator's floor for the layout."""
    from lightning_zero import estimate as est
    from lightning_zero.engine.config import STRATEGY_NAMES, ZeroStage
    from lightning_zero.estimate_schemes import SCHEMES, Layout

    setup_rank(deterministic=False)
    # the full model's count: once the engine has sharded it, stage 3's parameters hold 0 elements
    num_params = sum(p.numel() for p in _full_parameters(MEMORY_SHAPE))
    model, optimizer, engine, tokens = _engine_run(variant, MEMORY_SHAPE)
    options = STRATEGY_NAMES[variant]
    layout = Layout(
        ZeroStage(options["stage"]), options.get("offload_optimizer", False), options.get("offload_params", False)
    )
    floor = est.estimate(num_params, layout, SCHEMES["fp32"], est.Topology(devices=1)).device.total
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        engine.begin_step()
        loss = model(tokens[:, :-1], tokens[:, 1:])[1]
        loss.backward()
        engine.finish_backward()
        engine.end_step()
        optimizer.step()
        engine.after_optimizer_step(optimizer)
    del loss
    with_state = _allocated()
    report = engine.memory_report()
    engine.close()
    del model, optimizer, engine
    without = _allocated()
    del tokens
    return {
        "floor": floor,
        "allocated": with_state - without,
        "comm_buffers": report.comm_buffers,
        "reported_device": report.device.total,
        "reported_host": report.host.total,
    }


for _variant in VARIANTS:
    GROUP.case(device_model_state, name=f"memory_{_variant}", variant=_variant)


# ---- offload: pinned host buffers, copies on their own stream overlapping compute ----------------------


def _pinned(engine) -> dict[str, bool]:
    buffers = {}
    for bucket in engine.residency.buckets_with_host:
        host = bucket.host
        for kind, row in (("master", host.master), *(("gradients", r) for r in host.gradient_rows)):
            buffers[f"bucket {bucket.index} {kind} {row.data_ptr():#x}"] = row.is_pinned()
    return buffers


def offload_copies(ctx: RankContext, variant: str) -> dict:
    """Whether every host buffer of the offloaded buckets is pinned (after setup, and after two
    steps, when accumulation's landing rows exist too), and a profiled third step's copies."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    setup_rank(deterministic=False)
    model, optimizer, engine, tokens = _engine_run(variant, PROFILE_SHAPE, batch_size=8)
    pinned_at_setup = _pinned(engine)

    def train_step() -> None:
        engine.begin_step()
        model(tokens[:, :-1], tokens[:, 1:])[1].backward()
        engine.finish_backward()
        engine.end_step()
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    try:
        for _ in range(2):
            train_step()
        torch.cuda.synchronize()
        pinned_after_steps = _pinned(engine)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            train_step()
            torch.cuda.synchronize()
        report = engine.memory_report()
        pinned_rows = sum(row.numel() * row.element_size() for b in engine.residency.buckets_with_host
                          for row in (b.host.master, *b.host.gradient_rows))  # fmt: skip
    finally:
        engine.close()
    path = os.path.join(ctx.tmpdir, f"trace_{variant}.json")
    prof.export_chrome_trace(path)
    return {
        "pinned_at_setup": pinned_at_setup,
        "pinned_after_steps": pinned_after_steps,
        "pinned_host": report.pinned_host,
        "pinned_rows": pinned_rows,
        "copy_buffers": report.copy_buffers,
        **copy_overlap(json.loads(Path(path).read_text())),
    }


for _variant in ("zero2_offload", "zero3_offload"):
    GROUP.case(offload_copies, name=f"copies_{_variant}", variant=_variant)


# ---- NVMe offload: the optimizer state, and the parameter chunks, in files --------------------------
NVME_VARIANTS = ("zero3_offload", "zero3_offload_nvme_params")
"""The Trainer's parity of both NVMe tiers in two precisions is ``test_cuda_lightning.py``'s."""


def nvme_offload(ctx: RankContext) -> dict:
    """zero3_offload, and the same with Adam's moments and the parameter chunks on disk: 3 fp32 steps
    each from one seed; the losses and weights, and whether the chunks read back from disk land in
    pinned memory (``resize_`` of a pinned storage) and leave it between steps."""
    setup_rank(deterministic=True)
    os.environ["LIGHTNING_ZERO_NVME_PATH"] = os.path.join(ctx.tmpdir, "nvme")
    os.makedirs(os.environ["LIGHTNING_ZERO_NVME_PATH"], exist_ok=True)
    out: dict[str, Any] = {}
    for variant in NVME_VARIANTS:
        model, optimizer, engine, tokens = _engine_run(variant, SYNC_SHAPE)
        masters = getattr(engine.residency, "masters_on_disk", [])
        losses, pinned, at_rest = [], [], []
        try:
            for _ in range(3):
                engine.begin_step()
                loss = model(tokens[:, :-1], tokens[:, 1:])[1]
                loss.backward()
                engine.finish_backward()
                engine.end_step()
                for m in masters:  # read in for the step, as the optimizer's stream does
                    m.acquire()
                    pinned.append(m.master.is_pinned())
                    m.release()
                optimizer.step()
                engine.after_optimizer_step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
                at_rest.append(sum(m.master.untyped_storage().nbytes() for m in masters))
            weights = {k: v.cpu() for k, v in engine.full_state_dict(model).items()}
        finally:
            engine.close()
        out[variant] = {"losses": losses, "weights": weights, "pinned": pinned, "at_rest": at_rest, "masters": len(masters)}
    return out


GROUP.case(nvme_offload, name="nvme_offload")


def whole_tensor_optimizer(ctx: RankContext, variant: str) -> dict:
    """Adafactor, a whole-tensor optimizer (each parameter stepped whole on its owner rank; on the host
    under offload), 3 fp32 steps: the weights, against the same steps with no engine, and where its
    state lives."""
    import torch

    setup_rank(deterministic=True)
    runs = {}
    for label in ("plain", variant):
        model, optimizer, engine, tokens = _engine_run(variant, SYNC_SHAPE, optimizer_class=torch.optim.Adafactor)
        if label == "plain":
            engine.close()  # the optimizer steps the module's own parameters again
            model, optimizer = _plain_copy(model, torch.optim.Adafactor)
        for _ in range(3):
            if label != "plain":
                engine.begin_step()
            loss = model(tokens[:, :-1], tokens[:, 1:])[1]
            loss.backward()
            if label != "plain":
                engine.finish_backward()
                engine.end_step()
            optimizer.step()
            if label != "plain":
                engine.after_optimizer_step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        state_devices = sorted({t.device.type for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()})
        weights = engine.full_state_dict(model) if label != "plain" else model.state_dict()
        runs[label] = {"weights": {k: v.detach().cpu() for k, v in weights.items()}, "state_devices": state_devices}
        if label != "plain":
            engine.close()
    return runs


def _plain_copy(model: Any, optimizer_class: Any) -> tuple:
    """A fresh copy of ``model``'s initial weights (same seed) with its own optimizer."""
    import torch

    from lightning_zero.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    plain = GPT(GPTConfig(**SYNC_SHAPE)).to("cuda")
    return plain, optimizer_class(plain.parameters(), lr=1e-3)


for _variant in VARIANTS:
    GROUP.case(whole_tensor_optimizer, name=f"whole_tensor_{_variant}", variant=_variant)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("cuda_engine"))


def test_the_model_alone_makes_no_host_sync(results):
    assert results["plain_forward_backward"] == [True]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_no_host_sync_in_forward_and_backward(results, variant, precision):
    # forward and backward ran under "error": reaching here means none synced
    for counted in results[f"syncs_{variant}_{precision}"]:
        for step in counted:
            assert len(step["after_backward"]) <= 1, f"finish_backward + end_step synced at {step['after_backward']}"
            assert len(step["step"]) <= 1, f"the step synced at {step['step']}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_device_model_state_is_the_estimators_floor(results, variant):
    (r,) = results[f"memory_{variant}"]
    assert r["reported_device"] == r["floor"], r  # the engine's own count of what it holds
    held = r["allocated"] - r["comm_buffers"]  # what the allocator saw go, less the buffer pool
    assert r["floor"] <= held <= r["floor"] + BOOKKEEPING_BYTES, r
    if variant == "zero3_offload":
        assert r["floor"] == r["reported_device"] == 0 and r["reported_host"] > 0, r


@pytest.mark.parametrize("variant", ["zero2_offload", "zero3_offload"])
def test_offloaded_host_buffers_are_pinned(results, variant):
    (r,) = results[f"copies_{variant}"]
    for when in ("pinned_at_setup", "pinned_after_steps"):
        assert r[when] and all(r[when].values()), (when, r[when])


@pytest.mark.parametrize("variant", ["zero2_offload", "zero3_offload"])
def test_offload_copies_run_beside_compute(results, variant):
    (r,) = results[f"copies_{variant}"]
    copies = r["copies"]
    directions = {"DtoH"} | ({"HtoD"} if variant == "zero3_offload" else set())  # gradients out; stage 3 also weights in
    for direction in directions:
        assert any(direction in c["name"] for c in copies), (direction, copies)
    on_compute = [c for c in copies if c["stream"] == r["compute_stream"]]
    assert not on_compute, f"copies on the compute stream {r['compute_stream']}: {on_compute}"
    # gradients leave for the host while backward computes; at stage 3 units also arrive during it
    for direction in directions:
        overlapped = sum(c["overlapped_us"] for c in copies if direction in c["name"])
        assert overlapped > 0, (direction, copies)


@pytest.mark.parametrize("variant", ["zero2_offload", "zero3_offload"])
def test_the_memory_report_counts_pinned_blocks_and_copy_rows(results, variant):
    """Issue 39 (4, 5): the pinned host blocks the engine holds (torch's pinned cache keeps them) and,
    at stage 3, the device rows its copies land in."""
    (r,) = results[f"copies_{variant}"]
    assert r["pinned_host"] >= r["pinned_rows"] > 0, r
    if variant == "zero3_offload":  # units arrive through the copy stream
        assert r["copy_buffers"] > 0, r


def meta_build(ctx: RankContext) -> dict:
    """A GPT built on the meta device and materialized on cuda:0 against the same GPT built eagerly on
    the CPU from the same seed (``test_meta_materialize.py``; issue 39 (5): no draw from CUDA's generator)."""
    from test_meta_materialize import meta_build_against_eager_cpu_build

    return meta_build_against_eager_cpu_build(setup_rank(deterministic=True))


GROUP.case(meta_build)


def test_a_meta_build_on_the_gpu_holds_the_eager_cpu_builds_weights(results):
    (r,) = results["meta_build"]
    assert r["compared"] > 10 and r["mismatched"] == [], r
    assert r["on_device"] and r["tied"]


def test_nvme_offload_trains_bitwise_like_cpu_offload_with_pinned_chunks(results):
    (r,) = results["nvme_offload"]
    import torch

    reference = r["zero3_offload"]
    for variant in NVME_VARIANTS[1:]:
        assert r[variant]["losses"] == reference["losses"], variant
        assert all(torch.equal(reference["weights"][k], r[variant]["weights"][k]) for k in reference["weights"]), variant
    chunks = r["zero3_offload_nvme_params"]
    assert chunks["masters"] > 0 and chunks["pinned"] and all(chunks["pinned"])  # read back into pinned memory
    assert chunks["at_rest"] == [0, 0, 0]  # and out of host memory between steps


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_whole_tensor_optimizer_steps_as_without_the_engine(results, variant):
    (runs,) = results[f"whole_tensor_{variant}"]
    plain, zero = runs["plain"]["weights"], runs[variant]["weights"]
    # offloaded, the owner steps on the host: the same arithmetic on another processor
    tolerance = 1e-5 if "offload" in variant else 0.0
    assert max((plain[k].float() - zero[k].float()).abs().max().item() for k in plain) <= tolerance
    assert runs[variant]["state_devices"] == (["cpu"] if "offload" in variant else ["cuda"])
