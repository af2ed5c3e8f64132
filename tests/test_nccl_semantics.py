"""NCCL's contracts, emulated on gloo and the CPU, so that code which breaks them fails where CI runs.

Users train on GPUs with NCCL; CI has no GPU, and a single GPU cannot show these either (at world
size 1 every collective returns before reaching NCCL). Three contracts, each with what emulates it:

- **NCCL takes device tensors only.** Under ``device_roles.tracking_host_tensors()`` every
  collective refuses host memory (offloaded chunks and their gradients, pinned buffers, NVMe
  staging, what is computed from them; see [Note: device roles]). Clipping by norm,
  ``strategy.grad_norm``, the full optimizer state and a whole-tensor optimizer's exchanges with its
  owner ranks (with a sharded save and resume), through the Trainer at ``zero2_offload`` and
  ``zero3_offload`` on two ranks, each against DDP doing the same.
- **On NCCL, ``wait()`` does not block the host: it makes the current stream wait**, and
  ``Work.is_completed()`` turns true only once the GPU ran the kernel, which lags the host by the
  queued work. The engine launches every reduce-scatter at readiness and orders the rest on its
  reduce stream (see [Note: reduce stream]); where waits block the host (gloo here) it finishes a
  reduction inside backward only once completed, since waiting there for a peer that skipped a unit
  would hang. So: the runs of ``test_reliability.py`` in which one rank skips a middle unit, or ranks
  skip units at random (and one rank of 3 or 4 skips), under the tracking above and a short collective
  timeout (a hang becomes an error), must train as DDP; and a host ahead of its device (``HostAhead``:
  completions reported only ``LAG_HOOKS`` gradient hooks late, NCCL's non-blocking waits) must not
  delay any launch, nor leave more full gradients waiting than the buckets in flight.
- **A non-blocking copy lands after the host reads it.** ``16-mixed`` with offload unscales
  gradients that live on the host; a ``TorchFunctionMode`` makes every ``non_blocking`` copy
  (``.to`` or ``copy_``, either direction) land only after the next kernel ran (what
  ``torch.cuda._sleep`` does on a GPU, see ``tests/test_cuda_nccl_contracts.py``): the overflow step
  must still be skipped and the scale back off.
- **Splits of an all-to-all must match across ranks** (NCCL does not check them): on the ownership
  path a ``param.grad = None`` on one rank only raises the same error on every rank.
- **A one-rank group can run real collectives** (``LIGHTNING_ZERO_COLLECTIVES_AT_ONE_RANK=1``), as
  ``tests/test_cuda_reduce_stream.py`` does with NCCL: here they reach torch and train the same bits.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional

import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from lightning.pytorch.callbacks import Callback
from skipping_runs import RANDOM_BLOCKS, block_6_from_step_2, engine_or_ddp_run, random_skips
from torch import Tensor
from torch.overrides import TorchFunctionMode

pytestmark = pytest.mark.nccl_semantics

TIMEOUT = timedelta(seconds=20)
"""A hang becomes an error after this (each run here takes a few seconds)."""
OFFLOADED = ("zero2_offload", "zero3_offload")
TOLERANCE = 1e-5
"""Offloaded optimizers step with torch's fused CPU kernel: the same arithmetic as DDP's AdamW in
another order (see ``host_step.py``)."""

GROUP = CaseGroup(world_size=2)


def _strategy(name: str, **options: Any):
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy
    from lightning_zero.engine.config import STRATEGY_NAMES

    if name == "ddp":
        return DDPStrategy(timeout=TIMEOUT)
    return ZeroStrategy(**STRATEGY_NAMES[name], timeout=TIMEOUT, **options)


def tracked(ctx: RankContext, run: Callable[..., Any], strategy: str, **kwargs: Any) -> Any:
    """``run(ctx, strategy, **kwargs)``, with host tensors tracked (and refused by every collective)
    under ZeRO."""
    from lightning_zero.engine.device_roles import tracking_host_tensors

    if strategy == "ddp":
        return run(ctx, strategy, **kwargs)
    with tracking_host_tensors("cpu"):
        return run(ctx, strategy, **kwargs)


# ---- host tensors never reach a collective ---------------------------------------------------------
class _GradNorms(Callback):
    """Each step's gradient norms before the optimizer step: ``strategy.grad_norm`` under ZeRO,
    Lightning's ``grad_norm`` under DDP."""

    def __init__(self) -> None:
        self.seen: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from lightning.pytorch.strategies import DDPStrategy
        from lightning.pytorch.utilities import grad_norm

        strategy = trainer.strategy
        norms = grad_norm(pl_module, 2) if type(strategy) is DDPStrategy else strategy.grad_norm(2)
        self.seen.append({k: v.item() for k, v in norms.items()})


def clip_by_norm(ctx: RankContext, strategy: str) -> list[dict[str, Tensor]]:
    """The weights after each of 2 steps clipped by the global gradient norm."""
    from lightning_helpers import fit_gpt

    return fit_gpt(_strategy(strategy), 2, gradient_clip_val=0.05, gradient_clip_algorithm="norm")[1]


def grad_norms(ctx: RankContext, strategy: str) -> list[dict[str, float]]:
    """Every parameter's gradient norm and the total, before each of 2 steps."""
    from lightning_helpers import fit_gpt

    norms = _GradNorms()
    fit_gpt(_strategy(strategy), 2, callbacks=[norms])
    return norms.seen


def full_optimizer_state(ctx: RankContext, strategy: str) -> Optional[dict[int, dict[str, Tensor]]]:
    """The optimizer state in a one-file checkpoint after 2 steps (ZeRO: ``state_dict_type="full"``,
    which gathers it on rank 0); None on the other ranks."""
    import os

    from lightning_helpers import fit_gpt

    options = {} if strategy == "ddp" else {"state_dict_type": "full"}
    trainer = fit_gpt(_strategy(strategy, **options), 2)[2]
    path = os.path.join(ctx.tmpdir, f"full_{strategy}_{ctx.rank}.ckpt")
    trainer.save_checkpoint(path)
    if ctx.rank != 0:
        return None
    state = torch.load(path, weights_only=False)["optimizer_states"][0]["state"]
    return {int(i): {k: v for k, v in entry.items() if isinstance(v, Tensor)} for i, entry in state.items()}


def lifecycle(ctx: RankContext, strategy: str) -> dict[str, Tensor]:
    """Everything else a user runs, under the same tracking: fit with validation and an EMA of the
    weights (where Lightning has EMAWeightAveraging, from 2.6.0), a sharded checkpoint, resume from
    it, validate after fit, summon the full weights."""
    import os

    from lightning_helpers import HAS_WEIGHT_AVERAGING, GPTModule, fit_gpt, full_weights, make_trainer, token_data

    def averaging() -> list:
        from lightning.pytorch.callbacks import EMAWeightAveraging

        return [EMAWeightAveraging()]

    options = {}
    if "nvme" in strategy:
        options["nvme_path"] = os.path.join(ctx.tmpdir, f"nvme_{ctx.rank}")
        os.makedirs(options["nvme_path"], exist_ok=True)
    callbacks = averaging if HAS_WEIGHT_AVERAGING else list
    trainer = fit_gpt(_strategy(strategy, **options), 2, callbacks=callbacks(), limit_val_batches=2, val_check_interval=1)[2]
    path = os.path.join(ctx.tmpdir, f"lifecycle_{strategy}")
    trainer.save_checkpoint(path)
    module = GPTModule()
    resumed = make_trainer(_strategy(strategy, **options), 3, callbacks=callbacks())
    resumed.fit(module, token_data(), token_data(8), ckpt_path=path)
    resumed.validate(module, token_data(4), verbose=False)
    return full_weights(module, resumed.strategy)


def whole_tensor_optimizer(ctx: RankContext, strategy: str) -> list[dict[str, Tensor]]:
    """A whole-tensor optimizer (Adafactor: each parameter stepped whole on its owner rank, which
    steps on the host under offload) clipped by norm, saved sharded and resumed: the weights after
    every step of the resumed fit."""
    import os

    from lightning_helpers import fit_and_record

    kwargs = dict(module_kwargs={"optimizer": "adafactor_groups"}, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
    trainer = fit_and_record(_strategy(strategy), 2, **kwargs)[2]
    path = os.path.join(ctx.tmpdir, f"whole_tensor_{strategy}")
    trainer.save_checkpoint(path)  # the owners' state scattered to every rank's chunks
    return fit_and_record(_strategy(strategy), 4, ckpt_path=path, **kwargs)[1]  # and gathered back to the owners


CHECKS = {"whole_tensor_optimizer": whole_tensor_optimizer, "clip_by_norm": clip_by_norm, "grad_norms": grad_norms, "full_optimizer_state": full_optimizer_state}
for _check, _run in CHECKS.items():
    for _strategy_name in ("ddp", *OFFLOADED):
        GROUP.case(tracked, name=f"{_check}_{_strategy_name}", run=_run, strategy=_strategy_name)
for _strategy_name in (*OFFLOADED, "zero3_offload_nvme_params"):
    GROUP.case(tracked, name=f"lifecycle_{_strategy_name}", run=lifecycle, strategy=_strategy_name)


# ---- no wait in backward for a peer that has not joined ---------------------------------------------
SKIPPING_RUNS = {
    "middle_skip": (block_6_from_step_2, 8, True, {"zero2": {}, "zero3": {}, "zero3_prefetch_2": {"prefetch_units": 2}}),
    "random_skips": (random_skips, RANDOM_BLOCKS, False, {"zero2": {}, "zero3": {"unit_classes": ["Sequential"]}}),
}
for _run_name, (_schedule, _blocks, _gpt, _labels) in SKIPPING_RUNS.items():
    for _label, _options in {"ddp": {}, **_labels}.items():
        GROUP.case(
            tracked, name=f"{_run_name}_{_label}", run=engine_or_ddp_run, strategy=_label.split("_prefetch")[0],
            schedule=_schedule, blocks=_blocks, gpt=_gpt, timeout=TIMEOUT, **_options,
        )  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("nccl_semantics"))


@pytest.mark.parametrize("strategy", OFFLOADED)
def test_clipping_by_norm_with_an_offloaded_optimizer_hands_no_host_tensor_to_a_collective(results, strategy):
    from lightning_helpers import max_abs_diff

    for ddp, zero in zip(results["clip_by_norm_ddp"], results[f"clip_by_norm_{strategy}"]):
        assert len(zero) == len(ddp) == 2
        assert max(max_abs_diff(a, b) for a, b in zip(ddp, zero)) < TOLERANCE


@pytest.mark.parametrize("strategy", OFFLOADED)
def test_a_whole_tensor_optimizer_with_offload_exchanges_device_tensors_only(results, strategy):
    from lightning_helpers import max_abs_diff

    for ddp, zero in zip(results["whole_tensor_optimizer_ddp"], results[f"whole_tensor_optimizer_{strategy}"]):
        assert len(zero) == len(ddp) == 2
        assert max(max_abs_diff(a, b) for a, b in zip(ddp, zero)) < TOLERANCE


@pytest.mark.parametrize("strategy", OFFLOADED)
def test_grad_norm_with_an_offloaded_optimizer_hands_no_host_tensor_to_a_collective(results, strategy):
    for ddp, zero in zip(results["grad_norms_ddp"], results[f"grad_norms_{strategy}"]):
        assert len(zero) == len(ddp) == 2
        for ddp_step, zero_step in zip(ddp, zero):
            assert zero_step.keys() == ddp_step.keys()
            assert zero_step == pytest.approx(ddp_step, rel=1e-5)


@pytest.mark.parametrize("strategy", OFFLOADED)
def test_the_full_optimizer_state_of_an_offloaded_optimizer_is_gathered_on_the_device(results, strategy):
    ddp, zero = results["full_optimizer_state_ddp"][0], results[f"full_optimizer_state_{strategy}"][0]
    assert zero.keys() == ddp.keys() and ddp
    for index, entry in ddp.items():
        assert zero[index].keys() == entry.keys()
        for key, value in entry.items():
            assert zero[index][key].shape == value.shape, (index, key)
            assert torch.allclose(zero[index][key].float(), value.float(), atol=TOLERANCE), (index, key)


@pytest.mark.parametrize("strategy", (*OFFLOADED, "zero3_offload_nvme_params"))
def test_a_whole_offloaded_lifecycle_hands_no_host_tensor_to_a_collective(results, strategy):
    """Fit with validation and EMA, a sharded checkpoint, resume, validate, summon: nothing raised,
    and the ranks hold the same full weights."""
    first, second = results[f"lifecycle_{strategy}"]
    assert first.keys() == second.keys() and first
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("label", [f"{run}_{label}" for run, spec in SKIPPING_RUNS.items() for label in spec[3]])
def test_ranks_skipping_different_units_train_as_ddp_when_waits_order_streams(results, label):
    from lightning_helpers import max_abs_diff

    run = label.split("_zero")[0]
    for ddp, zero in zip(results[f"{run}_ddp"], results[label]):
        assert torch.equal(zero["losses"], ddp["losses"])  # every step, bitwise
        assert max_abs_diff(zero["weights"], ddp["weights"]) == 0.0


# ---- the same at world sizes 3 and 4 ------------------------------------------------------------------
WIDER = {world_size: CaseGroup(world_size=world_size) for world_size in (3, 4)}
"""Rank 1 skips the middle block from the second step on, the other ranks do not: more ranks
launch the skipped bucket's reduce-scatter during their backward, one only after its own."""
WIDER_LABELS = {"zero2": {}, "zero3": {}, "zero3_prefetch_2": {"prefetch_units": 2}}
for _world_size, _group in WIDER.items():
    for _label, _options in {"ddp": {}, **WIDER_LABELS}.items():
        _group.case(
            tracked, name=f"middle_skip_{_label}", run=engine_or_ddp_run, strategy=_label.split("_prefetch")[0],
            schedule=block_6_from_step_2, blocks=8, gpt=True, timeout=TIMEOUT, **_options,
        )  # fmt: skip


@pytest.fixture(scope="module", params=sorted(WIDER))
def wider_results(request, tmp_path_factory) -> tuple[int, GroupResults]:
    return request.param, WIDER[request.param].run(tmp_path_factory.mktemp(f"wider_{request.param}"))


@pytest.mark.parametrize("label", WIDER_LABELS)
def test_one_rank_of_several_skipping_a_unit_trains_as_ddp(wider_results, label):
    from lightning_helpers import max_abs_diff

    world_size, results = wider_results
    runs = list(zip(results["middle_skip_ddp"], results[f"middle_skip_{label}"]))
    assert len(runs) == world_size
    # past 2 ranks the sums are not bitwise DDP's, skips or not: gloo adds an element's N terms in an
    # order that depends on where it falls in the buffer (ours and DDP's bucket it differently), and at
    # 3 ranks each share is scaled by 1/3 (inexact) before the sum, DDP's after it
    tolerance = 1e-5
    for ddp, zero in runs:
        assert max_abs_diff({"losses": zero["losses"]}, {"losses": ddp["losses"]}) <= tolerance
        assert max_abs_diff(zero["weights"], ddp["weights"]) <= tolerance


# ---- reduce-scatters launched at readiness, whatever the host's lead ----------------------------------
LAG_HOOKS = 6
"""How many gradient hooks a collective reports no completion after it was issued: a host running
that far ahead of its device (on a GPU nothing syncs in backward, so the lead is the queued work)."""

ENGINE_CASES = CaseGroup(world_size=2, init_process_group=True)
"""Cases at the engine level, with a gloo group of their own (the cases above build Trainers)."""


class HostAhead:
    """NCCL as the host sees it from ahead of its GPU, on gloo: every collective's completion
    (``PendingCollective.done``, a query of its CUDA event on NCCL) stays False until ``LAG_HOOKS``
    gradient hooks have run since it was issued, and waits are NCCL's (``waits_block_host`` is False:
    a wait orders a stream, it does not poll). gloo's waits still block here, which with every rank
    launching every bucket in the same order only waits for a peer that is launching too."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.hooks = model, 0
        self._handles: list = []
        self._saved: dict = {}

    def __enter__(self) -> "HostAhead":
        from lightning_zero.engine.comm import collectives

        lead, real_init, real_done = self, collectives.PendingCollective.__init__, collectives.PendingCollective.done

        def init(pending, work=None) -> None:
            real_init(pending, work)
            pending._issued_at_hook = lead.hooks

        def done(pending) -> bool:
            return lead.hooks - getattr(pending, "_issued_at_hook", -LAG_HOOKS) >= LAG_HOOKS and real_done(pending)

        self._saved = {"__init__": real_init, "done": real_done}
        collectives.PendingCollective.__init__, collectives.PendingCollective.done = init, done
        self._saved["waits_block_host"] = collectives.waits_block_host
        collectives.waits_block_host = lambda group, device: False
        return self

    def count_hooks(self, after_each: Callable[[], None]) -> None:
        """Count every gradient hook (registered after the engine's, so each runs after the engine's)
        and call ``after_each`` after it."""

        def hook(_: Tensor) -> None:
            self.hooks += 1
            after_each()

        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in self.model.parameters()]

    def __exit__(self, *exc: object) -> None:
        from lightning_zero.engine.comm import collectives

        collectives.waits_block_host = self._saved.pop("waits_block_host")
        for name, fn in self._saved.items():
            setattr(collectives.PendingCollective, name, fn)
        for handle in self._handles:
            handle.remove()


def _loss(model: torch.nn.Module, tokens: Tensor, detach_after: Optional[int]) -> Tensor:
    """The GPT's loss; with ``detach_after``, the residual stream is detached after that block, so
    this rank's backward reaches neither it, nor the blocks before it, nor the embeddings."""
    if detach_after is None:
        return model(tokens[:, :-1], tokens[:, 1:])[1]
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    x = model.drop(model.wte(idx) + model.wpe(torch.arange(idx.shape[1])))
    for i, block in enumerate(model.blocks):
        x = block(x)
        if i == detach_after:
            x = x.detach()
    logits = model.lm_head(model.ln_f(x))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def host_lead_run(ctx: RankContext, stage: int, lagging: bool, skipping_rank: Optional[int] = None, **options: Any) -> dict:
    """3 steps of a 3-block GPT through the engine (buckets of about one parameter, so many more are
    ready than may be in flight), with the host ``lagging`` behind completions or not: at each
    gradient hook of the last step, how many reduce-scatters were launched and how many buckets
    were ready in bucket order; the last backward's ``waiting_gradients``; the weights."""
    import contextlib

    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS
    from lightning_zero.models.gpt import GPT, GPTConfig

    if options.pop("hybrid", False):
        from lightning_zero.engine.comm import collectives

        group, replicate = ctx.once("hybrid_groups", lambda: collectives.hybrid_groups(1))
    else:
        group, replicate = None, None
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(ctx.rank))
    seen: list[tuple[int, int]] = []

    def launched_and_ready() -> None:
        ready = 0
        while ready < len(engine.buckets) and engine.buckets[ready].ready:
            ready += 1
        # hybrid with one-rank shard groups: a bucket's reduction is its all-reduce across the replicas
        seen.append((COLLECTIVE_STATS.calls["all_reduce" if replicate is not None else "reduce_scatter"], ready))

    lead = HostAhead(model) if lagging else contextlib.nullcontext()
    with lead:  # from the engine's construction on: the backend's waits are NCCL's
        config = ZeroConfig(stage=stage, bucket_size_mb=2e-3, **options)
        engine = ZeroEngine(model, [optimizer], config, group=group, replicate_group=replicate)
        if lagging:
            lead.count_hooks(launched_and_ready)
        for _ in range(3):
            seen.clear()
            COLLECTIVE_STATS.reset()
            engine.begin_step()
            _loss(model, tokens, 1 if ctx.rank == skipping_rank else None).backward()
            if lagging:
                launched_and_ready()  # as backward returns, before the flush
            engine.finish_backward()
            engine.end_step()
            optimizer.step()
            engine.after_optimizer_step(optimizer)
            optimizer.zero_grad()
    report = engine.memory_report()
    out = {
        "seen": list(seen), "waiting": report.waiting_gradients, "buckets": len(engine.buckets),
        "largest_bucket": max(b.param_bytes for b in engine.buckets), "allocations": engine.residency.pool.allocations,
        "weights": engine.full_state_dict(model),
    }  # fmt: skip
    engine.close()
    return out


HOST_LEAD_RUNS = {"zero2": {"stage": 2}, "zero3": {"stage": 3}, "zero2_hybrid": {"stage": 2, "hybrid": True}}
SKIPPING_RUNS = {"zero2_rank1_skips": {"stage": 2, "skipping_rank": 1}}
"""Rank 1's backward reaches neither the first two blocks nor the embeddings (gloo's waits block the
host, so only stage 2 runs here: at stage 3 the skipping rank's host would block in its backward
while its peer's backward waits for the all-gathers it issues after its own)."""
for _label, _options in {**HOST_LEAD_RUNS, **SKIPPING_RUNS}.items():
    for _lagging in (False, True):
        ENGINE_CASES.case(host_lead_run, name=f"{_label}_{'lagging' if _lagging else 'prompt'}", lagging=_lagging, **_options)


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory) -> GroupResults:
    return ENGINE_CASES.run(tmp_path_factory.mktemp("engine_cases"))


@pytest.mark.parametrize("label", HOST_LEAD_RUNS)
def test_reduce_scatters_launch_at_readiness_while_the_host_runs_ahead_of_completions(engine_results, label):
    """Every bucket ready (with every bucket before it) is launched by the gradient hook that made it
    ready, although no collective reports completion for ``LAG_HOOKS`` hooks; so no full gradients
    wait beyond the buckets that became ready before an earlier one, and the run trains as without
    the lag, bitwise, with the same communication buffers. At stage 3, once the unit ends are
    trusted, the last bucket waits for the backward's end (autograd's final callback, see [Note:
    readiness per unit]): launched by the time ``backward()`` returns (the last sample)."""
    from lightning_helpers import max_abs_diff

    for prompt, lagging in zip(engine_results[f"{label}_prompt"], engine_results[f"{label}_lagging"]):
        assert lagging["buckets"] > 2 and lagging["seen"]  # more ready than may be in flight (2)
        buckets = lagging["buckets"]
        held_last = label.startswith("zero3")  # the last bucket, until the backward's end
        late = [
            (hook, launched, ready)
            for hook, (launched, ready) in enumerate(lagging["seen"])
            if launched != ready and not (held_last and launched == ready - 1 == buckets - 1)
        ]
        assert not late, f"(hook, reduce-scatters launched, buckets ready in order) where a ready bucket waited: {late}"
        assert lagging["seen"][-1][0] == buckets, f"not every bucket launched as backward returned: {lagging['seen'][-1]}"
        assert lagging["waiting"] <= 2 * lagging["largest_bucket"], (lagging["waiting"], lagging["largest_bucket"])
        assert max_abs_diff(lagging["weights"], prompt["weights"]) == 0.0
        assert lagging["allocations"] == prompt["allocations"]


# ---- the ownership path: which parameters take part is decided alike on every rank --------------------
@pytest.mark.parametrize("label", SKIPPING_RUNS)
def test_a_rank_whose_backward_skips_buckets_launches_every_bucket_during_its_backward(engine_results, label):
    """The parameters rank 1's backward cannot reach are marked ready at its first gradient hook
    (see [Note: unreached parameters]), so by the end of its backward (the last sample, as
    ``backward()`` returns) every bucket is launched, in order, as on its peer, instead of by the
    flush after backward (an NCCL kernel left spinning on the peer until then); training is the
    same, bitwise, as without the host's lead."""
    from lightning_helpers import max_abs_diff

    for rank, (prompt, lagging) in enumerate(zip(engine_results[f"{label}_prompt"], engine_results[f"{label}_lagging"])):
        launched_by_backwards_end, _ = lagging["seen"][-1]
        assert launched_by_backwards_end == lagging["buckets"], (rank, lagging["seen"])
        assert max_abs_diff(lagging["weights"], prompt["weights"]) == 0.0


def dropped_gradient_on_the_ownership_path(ctx: RankContext, stage: int, dropping_ranks: tuple[int, ...]) -> dict:
    """Two steps of a whole-tensor optimizer (Adafactor: each parameter stepped whole by its owner)
    through the engine; after the second backward ``param.grad = None`` on ``dropping_ranks`` for
    one matrix. Returns the error the step raised (None if it stepped), and whether that matrix and
    another changed in the second step."""
    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))
    optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, bucket_size_mb=2e-3))
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(ctx.rank))
    dropped = model.blocks[0].attn.qkv.weight
    error, before = None, {}
    for step in range(2):
        engine.begin_step()
        model(tokens[:, :-1], tokens[:, 1:])[1].backward()
        engine.finish_backward()
        engine.end_step()
        if step == 1:
            before = {name: engine.full_state_dict(model)[name] for name in ("blocks.0.attn.qkv.weight", "blocks.1.mlp.fc.weight")}
            if ctx.rank in dropping_ranks:
                dropped.grad = None
        try:
            optimizer.step()
        except RuntimeError as err:
            error = str(err)
            break
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()
    after = engine.full_state_dict(model) if error is None else {}
    engine.close()
    return {"error": error, "changed": {name: not torch.equal(after[name], value) for name, value in before.items()} if after else {}}


for _stage in (2, 3):
    for _dropping in ((1,), (0, 1)):
        ENGINE_CASES.case(
            dropped_gradient_on_the_ownership_path, name=f"dropped_grad_stage{_stage}_ranks{''.join(map(str, _dropping))}",
            stage=_stage, dropping_ranks=_dropping,
        )  # fmt: skip


@pytest.mark.parametrize("stage", (2, 3))
def test_a_gradient_dropped_on_one_rank_only_on_the_ownership_path_fails_alike_on_every_rank(engine_results, stage):
    """Not all-to-alls with splits that differ between ranks (a hang on NCCL): the same clear error on
    every rank, before any rank steps."""
    errors = [r["error"] for r in engine_results[f"dropped_grad_stage{stage}_ranks1"]]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "'blocks.0.attn.qkv.weight' on 1 of 2 ranks" in errors[0] and "on every rank or on none" in errors[0]


@pytest.mark.parametrize("stage", (2, 3))
def test_a_gradient_dropped_on_every_rank_on_the_ownership_path_sits_the_step_out(engine_results, stage):
    for r in engine_results[f"dropped_grad_stage{stage}_ranks01"]:
        assert r["error"] is None
        assert r["changed"] == {"blocks.0.attn.qkv.weight": False, "blocks.1.mlp.fc.weight": True}


# ---- collectives kept at world size 1 ------------------------------------------------------------------
ONE_RANK = CaseGroup(world_size=1, init_process_group=True)
"""A group of one rank: its collectives return early unless ``COLLECTIVES_AT_ONE_RANK`` is set."""


class _CountingDist:
    """``torch.distributed`` as ``collectives`` sees it, counting the collectives it issues."""

    ISSUING = ("all_reduce", "all_to_all_single", "broadcast", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_gather_into_tensor", "all_gather_single")  # fmt: skip

    def __init__(self, dist) -> None:
        self._dist, self.issued = dist, 0

    def counting(self, fn):
        def issue(*args, **kwargs):
            self.issued += 1
            return fn(*args, **kwargs)

        return issue

    def __getattr__(self, name: str):
        value = getattr(self._dist, name)
        return self.counting(value) if name in self.ISSUING else value


def one_rank_run(ctx: RankContext, strategy: str, issuing: bool) -> dict:
    """3 steps of a 2-block GPT through the engine in a group of one rank, with the collectives
    issued anyway (``issuing``) or skipped: the weights, and how many collectives reached torch."""
    import os

    import torch.distributed as dist

    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.comm import collectives
    from lightning_zero.engine.config import STRATEGY_NAMES
    from lightning_zero.models.gpt import GPT, GPTConfig

    counting = _CountingDist(dist)
    # torch's functions, and the process group's own calls (see [Note: collectives issued on the group])
    names = ("_all_gather_flat", "_reduce_scatter_flat", "_group_all_gather", "_group_reduce_scatter", "_group_all_reduce")
    saved = collectives.dist, *(getattr(collectives, name) for name in names)
    collectives.dist = counting
    for name, function in zip(names, saved[1:]):
        setattr(collectives, name, counting.counting(function))
    os.environ[collectives.COLLECTIVES_AT_ONE_RANK] = "1" if issuing else "0"
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = ZeroEngine(model, [optimizer], ZeroConfig(**STRATEGY_NAMES[strategy], bucket_size_mb=2e-3))
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            engine.begin_step()
            model(tokens[:, :-1], tokens[:, 1:])[1].backward()
            engine.finish_backward()
            engine.end_step()
            optimizer.step()
            engine.after_optimizer_step(optimizer)
            optimizer.zero_grad()
        weights = engine.full_state_dict(model)
        engine.close()
    finally:
        collectives.dist = saved[0]
        for name, function in zip(names, saved[1:]):
            setattr(collectives, name, function)
        del os.environ[collectives.COLLECTIVES_AT_ONE_RANK]
    return {"weights": weights, "issued": counting.issued}


ONE_RANK_STRATEGIES = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
for _strategy_name in ONE_RANK_STRATEGIES:
    for _issuing in (False, True):
        ONE_RANK.case(one_rank_run, name=f"{_strategy_name}_{'issuing' if _issuing else 'skipping'}", strategy=_strategy_name, issuing=_issuing)


@pytest.fixture(scope="module")
def one_rank_results(tmp_path_factory) -> GroupResults:
    return ONE_RANK.run(tmp_path_factory.mktemp("one_rank"))


@pytest.mark.parametrize("strategy", ONE_RANK_STRATEGIES)
def test_collectives_kept_at_world_size_one_reach_the_backend_and_train_the_same(one_rank_results, strategy):
    """With ``LIGHTNING_ZERO_COLLECTIVES_AT_ONE_RANK=1`` a one-rank group issues its reduce-scatters
    (and stage 3 its all-gathers) through torch, as a one-rank NCCL group on a GPU then runs NCCL's
    kernels; the weights are the shortcut's, bit for bit."""
    from lightning_helpers import max_abs_diff

    (skipping,), (issuing,) = one_rank_results[f"{strategy}_skipping"], one_rank_results[f"{strategy}_issuing"]
    assert skipping["issued"] == 0
    assert issuing["issued"] > 0
    assert max_abs_diff(issuing["weights"], skipping["weights"]) == 0.0


# ---- the loss scaler with gradients on the host -----------------------------------------------------
STALE = 1.0
"""What an unlanded copy's destination reads as: the 1.0 a previous step left in the buffer."""


class LateCopies(TorchFunctionMode):
    """CUDA's ``non_blocking`` copies, where host and device are one CPU: the copy's destination
    reads ``STALE`` until the next kernel has run, and then the copy lands (overwriting what that
    kernel wrote there). Both forms, ``.to(..., non_blocking=True)`` and
    ``dst.copy_(src, non_blocking=True)``, in either direction (to pinned host memory, or from it to
    the device)."""

    def __init__(self) -> None:
        super().__init__()
        self._unlanded: list[tuple[Tensor, Tensor]] = []
        self.copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        copied = func is Tensor.to and kwargs.get("non_blocking") and result is not args[0]
        copied = copied or (func is Tensor.copy_ and (kwargs.get("non_blocking") or (len(args) > 2 and args[2])))
        if copied:
            for destination, value in self._unlanded:  # an earlier copy lands first (this one ran a kernel)
                destination.copy_(value)
            self._unlanded = [(result, result.clone())]
            result.fill_(STALE)
            self.copies += 1
        elif getattr(func, "__name__", "") not in ("__get__", "__set__"):  # attribute access runs no kernel
            for destination, value in self._unlanded:
                destination.copy_(value)
            self._unlanded.clear()
        return result


def _scaler_step(fused: bool, overflow: bool) -> dict[str, Any]:
    """One ``ZeroGradScaler`` step of SGD (whose update, unlike Adam's, shows a wrong unscaling) over host parameters whose (scaled) gradients overflow or
    not, with every non-blocking copy landing late."""
    from lightning_zero.engine.device_roles import mark_host, tracking_host_tensors
    from lightning_zero.engine.gradients.grad_scaler import ZeroGradScaler

    with tracking_host_tensors("cpu"):
        params = [mark_host(torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6))), mark_host(torch.nn.Parameter(torch.ones(3)))]
        optimizer = torch.optim.SGD(params, lr=0.1, fused=fused)
        given_scales: list[Any] = []
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: given_scales.append(getattr(opt, "grad_scale", None)))
        scaler = ZeroGradScaler("cpu", init_scale=1024.0, backoff_factor=0.5)
        scale = scaler.scale(torch.ones(())).item()
        unscaled = [torch.linspace(0.5, 1.5, 6), torch.tensor([0.25, float("inf") if overflow else 2.0, -1.0])]
        for p, g in zip(params, unscaled):
            p.grad = mark_host(g * scale)
        before = [p.detach().clone() for p in params]
        with LateCopies() as late:
            scaler.step(optimizer)
        scaler.update()
    return {"params": [p.detach() for p in params], "before": before, "unscaled": unscaled, "scale": scaler.get_scale(),
            "given_scales": given_scales, "late_copies": late.copies}  # fmt: skip


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_an_overflow_with_host_gradients_skips_the_step_and_backs_off_when_copies_to_the_host_land_late(fused):
    out = _scaler_step(fused, overflow=True)
    for after, before in zip(out["params"], out["before"]):
        assert torch.equal(after, before)  # the step was skipped: no inf/NaN reached the weights
    assert out["scale"] == 512.0  # backed off
    assert all(s is None for s in out["given_scales"])  # the host optimizer never takes a device scale


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_finite_step_with_host_gradients_unscales_them_when_copies_to_the_host_land_late(fused):
    out = _scaler_step(fused, overflow=False)
    params = [torch.nn.Parameter(b.clone()) for b in out["before"]]
    for p, g in zip(params, out["unscaled"]):
        p.grad = g.clone()
    torch.optim.SGD(params, lr=0.1).step()
    for after, expected in zip(out["params"], params):
        assert torch.allclose(after, expected.detach(), atol=1e-6)
    assert out["scale"] == 1024.0
    assert out["given_scales"] == [None]


def test_the_late_copies_emulation_delays_both_forms_of_non_blocking_copy():
    """What the tests above rely on: a ``non_blocking`` copy, as ``.to`` or as ``copy_`` (either
    direction: one memory here), reads stale until the next kernel, then holds its values."""
    source, stale, stale_double = torch.arange(3.0), torch.full((3,), STALE), torch.full((3,), STALE, dtype=torch.float64)
    with LateCopies() as late:
        into = torch.zeros(3)
        into.copy_(source, non_blocking=True)
        stale_after_copy = torch.equal(into, stale)  # the next kernel still sees it stale
        landed_after_copy = torch.equal(into, source)
        moved = source.to(torch.float64, non_blocking=True)
        stale_after_to = torch.equal(moved, stale_double)
        landed_after_to = torch.equal(moved, source.double())
        blocking = torch.zeros(3).copy_(source)  # not delayed
    assert stale_after_copy and landed_after_copy and stale_after_to and landed_after_to
    assert torch.equal(blocking, source) and late.copies == 2


@pytest.mark.parametrize(
    "backend, device, blocking, expected",
    [("gloo", "cpu", None, True), ("nccl", "cuda", None, False), ("nccl", "cuda", "1", True),
     ("cpu:gloo,cuda:nccl", "cuda", None, False), ("cpu:gloo,cuda:nccl", "cpu", None, True)],
)  # fmt: skip
def test_whether_a_wait_blocks_the_host_follows_the_backend_that_serves_the_device(monkeypatch, backend, device, blocking, expected):
    """What decides between launching at once and finishing only what completed (see [Note: no
    waiting in backward]): NCCL's waits order streams unless ``TORCH_NCCL_BLOCKING_WAIT=1``; a group
    made with several backends (torch's default ``"cpu:gloo,cuda:nccl"``) serves CUDA tensors with NCCL."""
    from lightning_zero.engine.comm import collectives

    monkeypatch.setattr(collectives, "skips_collectives", lambda group: False)  # as in a group of several ranks
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group: backend)
    monkeypatch.delenv("NCCL_BLOCKING_WAIT", raising=False)
    if blocking is None:
        monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", blocking)
    assert collectives.waits_block_host(None, torch.device(device)) is expected
