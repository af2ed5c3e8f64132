"""GPU tier, the contracts of CUDA and NCCL that one device can show, with an offloaded optimizer on
``cuda:0`` (world size 1). Skipped without a CUDA device (see ``cuda_tier.py``).

- **A non-blocking device-to-host copy lands after the host reads it.** ``16-mixed`` with offload
  unscales gradient chunks that live in host memory while the scale lives on the device. torch's
  ``GradScaler._unscale_grads_`` copies the scale's inverse and the inf flag to the host with
  ``non_blocking=True`` and the CPU kernel reads them at once (see [Note: the scaler and host
  gradients] in ``grad_scaler.py``). Here ``torch.cuda._sleep`` keeps the compute stream busy right
  before ``scaler.unscale_``, so a copy that does not wait lands long after the host read it: a finite
  step must still unscale exactly, and an overflow step must still be skipped and back the scale off;
  with torch's fused CPU kernel (the engine's default for offloaded optimizers, ``host_step.py``),
  the optimizer must never be handed the device's ``grad_scale`` or ``found_inf``.
- **NCCL takes device tensors only.** Under ``device_roles.tracking_host_tensors(cuda:0)`` every
  collective refuses a host tensor, at any world size (at world size 1 the collective itself returns
  early, the check does not): a step with clipping by norm, ``engine.grad_norms`` and the full
  optimizer state of an offloaded optimizer must hand none to a collective.

What one device cannot show (ranks that disagree, waits that order streams across ranks) is
emulated on gloo by ``test_nccl_semantics.py``; ``docs/gpu-check.md`` says how.
"""

from __future__ import annotations

import pytest
from case_groups import CaseGroup, GroupResults, RankContext
from cuda_tier import MARKS, START_METHOD, setup_rank

pytestmark = MARKS

OFFLOADED = ("zero2_offload", "zero3_offload")
KERNELS = ("foreach", "fused")
"""The offloaded AdamW's step: ``foreach=True`` kept as configured (``fused_host_step=False``), or
``fused=True``, the engine's fused CPU kernel, built fused so that it also claims
``_step_supports_amp_scaling`` (the path on which ``GradScaler`` hands an optimizer the device's
``grad_scale`` and ``found_inf``)."""
SHAPE = dict(block_size=64, n_layer=2, n_head=4, n_embd=128)
"""A GPT of 0.44M parameters: the host unscales its gradient chunks in well under a millisecond."""
SLEEP_CYCLES = 50_000_000
"""``torch.cuda._sleep``'s spin on the compute stream before the scaler reads: ~25 ms at the H200's
1.98 GHz, so a copy to the host queued behind it lands long after the host's unscaling kernel ran."""
INIT_SCALE, BACKOFF = 1024.0, 0.5
"""A power of two: unscaling multiplies by 2**-10, exactly, so the unscaled chunks must equal the
scaled ones times it bit for bit."""
MAX_NORM = 0.05
"""Below this GPT's gradient norm after one step (about 1), so clipping scales the chunks."""

GROUP = CaseGroup(world_size=1, start_method=START_METHOD)


# ---- the loss scaler with gradients in host memory, its copies landing late --------------------------


def _where(value) -> str | None:
    """What the optimizer was handed as ``grad_scale`` / ``found_inf``: None, or the tensor's device."""
    return None if value is None else str(getattr(value, "device", type(value).__name__))


def scaled_steps(device, variant: str, kernel: str, sleep_cycles: int = 0) -> dict:
    """Two ``16-mixed`` steps through ``ZeroGradScaler`` with the optimizer offloaded: a finite one,
    then one whose loss is inf. Before each ``unscale_`` the compute stream spins ``sleep_cycles``.
    Per step: the host chunks and the optimizer state before and after, the scaled and unscaled
    gradient chunks, the scale after ``update``; and what every ``optimizer.step`` call was handed."""
    import torch

    from lightning_zero.engine.gradients.grad_scaler import ZeroGradScaler
    from test_cuda_engine import _engine_run

    fused = kernel == "fused"
    model, optimizer, engine, tokens = _engine_run(
        variant, SHAPE, device=device, optimizer_options={"fused": True} if fused else {"foreach": True},
        fused_host_step=fused,
    )  # fmt: skip
    handed: list[dict] = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: handed.append(
            {"grad_scale": _where(getattr(opt, "grad_scale", None)), "found_inf": _where(getattr(opt, "found_inf", None)), "kwargs": sorted(kwargs)}
        )
    )
    shards = [p for group in optimizer.param_groups for p in group["params"]]
    autocast = torch.autocast(device.type, dtype=torch.float16)
    scaler = ZeroGradScaler(device.type, init_scale=INIT_SCALE, backoff_factor=BACKOFF, growth_interval=1000)
    out: dict = {
        "shard_devices": sorted({p.device.type for p in shards}),
        "kernel": [(group.get("fused"), group.get("foreach")) for group in optimizer.param_groups],
        "steps": [],
        "handed": handed,
    }

    def state() -> list:
        return [v.detach().clone() for p in shards for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v)]

    try:
        for overflow in (False, True):
            engine.begin_step()
            with autocast:
                loss = model(tokens[:, :-1], tokens[:, 1:])[1]
            if overflow:
                loss = loss * float("inf")  # every gradient inf or NaN, whatever the kernels round
            scaler.scale(loss).backward()
            engine.finish_backward()
            engine.end_step()
            before, state_before = [p.detach().clone() for p in shards], state()
            scaled = [p.grad.detach().clone() for p in shards]  # host chunks: reading them waits for nothing
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)  # what the scaler queues on the stream from here runs late
            scaler.unscale_(optimizer)
            unscaled = [p.grad.detach().clone() for p in shards]
            scaler.step(optimizer)
            scaler.update()
            engine.after_optimizer_step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            out["steps"].append({
                "overflow": overflow, "scale": scaler.get_scale(), "before": before, "after": [p.detach().clone() for p in shards],
                "state_before": state_before, "state_after": state(), "scaled": scaled, "unscaled": unscaled,
            })  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        engine.close()
    return out


def scaler_with_late_copies(ctx: RankContext, variant: str, kernel: str) -> dict:
    device = setup_rank(deterministic=False)
    return scaled_steps(device, variant, kernel, sleep_cycles=SLEEP_CYCLES)


for _variant in OFFLOADED:
    for _kernel in KERNELS:
        GROUP.case(scaler_with_late_copies, name=f"scaler_{_variant}_{_kernel}", variant=_variant, kernel=_kernel)


# ---- host tensors never handed to a collective -------------------------------------------------------


def tracked_step(device, variant: str) -> dict:
    """One step of an offloaded GPT with ``tracking_host_tensors(device)`` open throughout: forward
    and backward, ``engine.grad_norms(2.0)``, clipping by norm as the precision plugins clip, the
    optimizer step, and the full optimizer state gathered. Any host tensor handed to a collective
    raises ``HostTensorInCollective`` and fails the case. What each call returned, summarized."""
    import torch

    from lightning_zero.engine.device_roles import tracking_host_tensors
    from lightning_zero.engine.gradients.norms import clip_grads_by_global_norm_
    from test_cuda_engine import _engine_run, _full_parameters

    full = _full_parameters(SHAPE)
    model, optimizer, engine, tokens = _engine_run(variant, SHAPE, device=device)
    shards = [p for group in optimizer.param_groups for p in group["params"]]
    try:
        with tracking_host_tensors(device):
            engine.begin_step()
            model(tokens[:, :-1], tokens[:, 1:])[1].backward()
            engine.finish_backward()
            engine.end_step()
            norms = engine.grad_norms(2.0)
            clip_norm = clip_grads_by_global_norm_(shards, MAX_NORM, device=device)
            clipped_total = engine.grad_norms(2.0)["total"]
            optimizer.step()
            engine.after_optimizer_step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            gathered = engine.full_optimizer_state_dict(optimizer)
        if device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        engine.close()
    state = gathered["state"]
    return {
        "shard_devices": sorted({p.device.type for p in shards}),
        "norm_names": len(norms),
        "norm_devices": sorted({str(v.device) for v in norms.values()}),
        "norms_finite": all(bool(torch.isfinite(v).all()) for v in norms.values()),
        "total": norms["total"].item(),
        "clip_norm": clip_norm.item(),
        "clip_device": str(clip_norm.device),
        "clipped_total": clipped_total.item(),
        "full_shapes": [tuple(p.shape) for p in full],
        "state_indices": sorted(state),
        "moments": {
            i: {k: (tuple(v.shape), v.device.type, bool(torch.isfinite(v).all())) for k, v in entry.items() if k in ("exp_avg", "exp_avg_sq")}
            for i, entry in state.items()
        },
    }


def host_tensors_in_collectives(ctx: RankContext, variant: str) -> dict:
    device = setup_rank(deterministic=False)
    return tracked_step(device, variant)


for _variant in OFFLOADED:
    GROUP.case(host_tensors_in_collectives, name=f"tracked_{_variant}", variant=_variant)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("cuda_nccl_contracts"))


# ---- the tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", OFFLOADED)
def test_a_finite_scaled_step_with_host_gradients_unscales_them_exactly_when_copies_land_late(results, variant, kernel):
    import torch

    (r,) = results[f"scaler_{variant}_{kernel}"]
    assert r["shard_devices"] == ["cpu"], r["shard_devices"]  # the gradient chunks live in host memory
    assert all(bool(fused) == (kernel == "fused") for fused, _ in r["kernel"]), r["kernel"]
    finite = r["steps"][0]
    for scaled, unscaled in zip(finite["scaled"], finite["unscaled"]):
        assert torch.isfinite(scaled).all()
        assert torch.equal(unscaled, scaled * (1.0 / INIT_SCALE))  # by the scale's inverse, not a stale read
    assert any(not torch.equal(a, b) for a, b in zip(finite["after"], finite["before"]))  # it stepped
    assert all(torch.isfinite(a).all() for a in finite["after"])
    assert finite["scale"] == INIT_SCALE  # no inf seen where there was none


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", OFFLOADED)
def test_an_overflow_with_host_gradients_skips_the_step_and_backs_off_when_copies_land_late(results, variant, kernel):
    import torch

    (r,) = results[f"scaler_{variant}_{kernel}"]
    overflow = r["steps"][1]
    assert overflow["overflow"] and not all(torch.isfinite(g).all() for g in overflow["scaled"])  # it did overflow
    for after, before in zip(overflow["after"], overflow["before"]):
        assert torch.equal(after, before)  # skipped: the master chunks unchanged
        assert torch.isfinite(after).all()  # no inf/NaN reached them
    assert len(overflow["state_after"]) == len(overflow["state_before"]) > 0
    for after, before in zip(overflow["state_after"], overflow["state_before"]):
        assert torch.equal(after, before)  # Adam's moments and step count untouched
    assert overflow["scale"] == INIT_SCALE * BACKOFF  # backed off once


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", OFFLOADED)
def test_the_offloaded_optimizer_is_never_handed_the_devices_grad_scale_or_found_inf(results, variant, kernel):
    (r,) = results[f"scaler_{variant}_{kernel}"]
    assert r["handed"], "optimizer.step never ran"  # the finite step at least
    for call in r["handed"]:
        assert call["kwargs"] == [], call  # no grad_scaler keyword either
        for key in ("grad_scale", "found_inf"):
            assert call[key] is None or not call[key].startswith("cuda"), call  # a CPU kernel reading device memory


@pytest.mark.parametrize("variant", OFFLOADED)
def test_clipping_grad_norms_and_the_full_optimizer_state_hand_no_host_tensor_to_a_collective(results, variant):
    (r,) = results[f"tracked_{variant}"]  # reaching it: no HostTensorInCollective was raised
    assert r["shard_devices"] == ["cpu"], r
    # engine.grad_norms: every parameter's norm and the total, on the compute device, finite
    assert r["norm_names"] == len(r["full_shapes"]) + 1 and r["norms_finite"], r
    assert r["norm_devices"] == ["cuda:0"] and r["clip_device"] == "cuda:0", r
    assert r["clip_norm"] == pytest.approx(r["total"], rel=1e-6) and r["total"] > MAX_NORM, r
    assert r["clipped_total"] == pytest.approx(MAX_NORM, rel=1e-4), r  # the chunks were clipped
    # the full optimizer state: Adam's moments of every parameter, full-sized, finite
    assert r["state_indices"] == list(range(len(r["full_shapes"]))), r["state_indices"]
    for index, shape in enumerate(r["full_shapes"]):
        moments = r["moments"][index]
        assert sorted(moments) == ["exp_avg", "exp_avg_sq"], (index, moments)
        assert all(m[0] == shape and m[2] for m in moments.values()), (index, shape, moments)
