"""ZeRO++'s gathers at stage 3 (hpZ's secondary shards, qwZ's quantized all-gathers) on 4 CPU ranks
laid out as 2 nodes × 2, engine-level (no Trainer), all in one group of ranks:

- hpZ (K = 2) trains bitwise as zero3 for 3 steps: plain, gradient accumulation, activation
  checkpointing inside a unit, prefetch 0 and 2, offload_optimizer, bf16 parameters;
- backward's gathers run on the 2-rank groups and the forward's on all 4, their bytes as the
  parameter sizes say;
- a secondary shard kept before an optimizer step is never gathered from after it;
- qwZ (int8, fp8): losses near zero3's, the forward computes with dequantize(quantize(chunks)),
  the chunks are never quantized, reads of the true weights are exact, evaluation gathers too;
  qwZ + hpZ trains bitwise as qwZ alone (backward's secondary shards hold the dequantized rows);
- memory_report counts the secondary shards as the estimator prices them.

One-process tests cover the quantized gather's padding and the secondary shard's guards.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import pytest
import torch
from torch import nn

from case_groups import CaseGroup, GroupResults, RankContext

WORLD_SIZE, RANKS_PER_NODE, K, STEPS = 4, 2, 2, 3
QUANTIZED_LOSS_TOLERANCE = {"int8": 3e-2, "fp8": 8e-2}
"""Relative, per format: int8 blocks of 256 keep each weight within 1/254 of its block's largest
magnitude, fp8 (e4m3, 3 mantissa bits) within 1/16 of the weight itself; this tiny 3-block MLP's loss
over 3 steps moves by up to ~1.3% with int8 and ~3% with fp8 (measured)."""
GROUP = CaseGroup(world_size=WORLD_SIZE, init_process_group=True, timeout=300)
D = 16  # widths divisible by the 4 ranks: no padding, so the byte formula is exact up to the tag column


class Block(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.checkpointed = checkpointed

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(h)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            from torch.utils.checkpoint import checkpoint

            return h + checkpoint(self._mlp, h, use_reentrant=False)
        return h + self._mlp(h)


class Net(nn.Module):
    """``checkpointed``: False; True (``checkpoint`` inside each block, a unit); "around" or
    "around_reentrant" (each block's call checkpointed, its recompute gathering the unit in backward)."""

    def __init__(self, checkpointed: Any = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.blocks = nn.ModuleList([Block(checkpointed is True) for _ in range(3)])
        self.head = nn.Linear(D, 4)
        self.around = checkpointed if isinstance(checkpointed, str) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.around == "around_reentrant") if self.around else block(h)
        return self.head(h).pow(2).mean()


def _batch(rank: int, step: int, micro: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank)).to(dtype)


def _engine(
    secondary: Optional[int] = None, quantize: Any = False, checkpointed: bool = False, dtype=torch.float32, frozen: bool = False,
    hybrid: bool = False, **config: Any,
):  # fmt: skip
    """``hybrid``: hybrid sharding, shard groups of ``RANKS_PER_NODE`` replicated across."""
    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.engine.comm import collectives
    from lightning_zero.engine.comm.node_links import make_node_links
    from lightning_zero.engine.zero_plus_plus import NodeLayout

    torch.manual_seed(0)
    model = Net(checkpointed).to(dtype)
    if frozen:  # an all-frozen unit (kept gathered with `keep_frozen_units_mb`)
        model.blocks[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    links = make_node_links(NodeLayout(WORLD_SIZE, RANKS_PER_NODE), secondary, False) if secondary else None
    cfg = ZeroConfig(stage=3, unit_classes=["Block"], secondary_shard_size=secondary, quantize_weights=quantize, **config)
    shard, replicate = collectives.hybrid_groups(RANKS_PER_NODE) if hybrid else (None, None)
    return model, opt, ZeroEngine(model, [opt], cfg, group=shard, replicate_group=replicate, links=links), links


def _close(engine: Any, links: Any) -> None:
    engine.close()
    if links is not None:
        links.destroy()


def _train(ctx: RankContext, secondary: Optional[int] = None, quantize: Any = False, checkpointed: bool = False,
           dtype=torch.float32, accumulate: int = 1, steps: int = STEPS, frozen: bool = False, hybrid: bool = False,
           **config: Any) -> dict[str, Any]:  # fmt: skip
    from lightning_zero.engine.comm.collectives import COLLECTIVE_STATS

    model, opt, engine, links = _engine(secondary, quantize, checkpointed, dtype, frozen, hybrid, **config)
    losses, traffic, held = [], {}, []
    for step in range(steps):
        COLLECTIVE_STATS.reset()
        for micro in range(accumulate):
            engine.sync_gradients = micro == accumulate - 1
            engine.begin_step()
            loss = model(_batch(ctx.rank, step, micro, dtype))
            held.append(engine.memory_report().secondary_shards)
            loss.backward()
            engine.finish_backward()
            engine.end_step()
            losses.append(loss.detach().float().item())
        if step == 1:
            traffic = {key: value for key, value in COLLECTIVE_STATS.bytes_by_group.items() if key[0] == "all_gather"}
        opt.step()
        engine.after_optimizer_step(opt)
        opt.zero_grad()
    units = engine.residency.units
    gather_bytes = {
        "root": sum(WORLD_SIZE * (b.shard_numel + 1) * b.dtype.itemsize for b in units[0].buckets),
        "blocks": sum(WORLD_SIZE * (b.shard_numel + 1) * b.dtype.itemsize for u in units[1:] for b in u.buckets),
        "block_params": sum(p.numel() * p.element_size() for p in model.blocks.parameters()),
    }
    weights = {k: v.float() for k, v in engine.full_state_dict(model).items()}
    _close(engine, links)
    return {"losses": losses, "weights": weights, "traffic": traffic, "gather_bytes": gather_bytes, "held": held}


HPZ_CASES = {
    "plain": {},
    "accumulate": {"accumulate": 2},
    "checkpointed": {"checkpointed": True},
    "checkpointed_around": {"checkpointed": "around"},
    "checkpointed_around_reentrant": {"checkpointed": "around_reentrant"},
    "prefetch0": {"prefetch_units": 0},
    "prefetch2": {"prefetch_units": 2},
    "offload": {"offload_optimizer": True},
    "bf16": {"dtype": torch.bfloat16},
    "frozen_kept": {"frozen": True, "keep_frozen_units_mb": math.inf},
}


def _hpz_against_zero3(ctx: RankContext, **options: Any) -> dict[str, Any]:
    return {"zero3": _train(ctx, **options), "hpz": _train(ctx, secondary=K, **options)}


for _name, _options in HPZ_CASES.items():
    GROUP.case(_hpz_against_zero3, name=f"hpz_{_name}", **_options)


def stale_secondary(ctx: RankContext, between: str) -> dict[str, Any]:
    """An optimizer step (or a write at rest) between a forward and its backward: zero3's backward
    gathers the chunks as changed, so hpZ's must not take the secondary shards kept by the forward
    before the change."""
    results = {}
    for name, secondary in (("zero3", None), ("hpz", K)):
        model, opt, engine, links = _engine(secondary)
        held = []
        for step in range(2):
            engine.begin_step()
            loss = model(_batch(ctx.rank, step))
            held.append(engine.memory_report().secondary_shards)
            if step == 1 and between == "step":  # steps with step 0's gradients, still held (no zero_grad)
                opt.step()
                engine.after_optimizer_step(opt)
            elif step == 1:
                with torch.no_grad():
                    model.blocks[1].fc1.weight.mul_(0.5)
            loss.backward()
            engine.finish_backward()
            engine.end_step()
            opt.step()
            engine.after_optimizer_step(opt)
        results[name] = {"weights": {k: v.clone() for k, v in engine.full_state_dict(model).items()}, "held": held}
        _close(engine, links)
    return results


GROUP.case(stale_secondary, name="stale_after_step", between="step")
GROUP.case(stale_secondary, name="stale_after_write", between="write")


@GROUP.case
def quantized(ctx: RankContext) -> dict[str, Any]:
    """qwZ int8: what the forward computes with, what the optimizer's chunks hold, exact reads."""
    from lightning_zero.engine.comm.quantization import FORMATS

    torch.manual_seed(0)
    reference = Net()  # the weights `_engine` starts from
    model, opt, engine, links = _engine(quantize="int8")
    exact_before = {k: v.clone() for k, v in engine.full_state_dict(model).items()}
    chunks_before = {k: v.clone() for k, v in engine.weight_chunks().items()}
    seen: list[list[torch.Tensor]] = []
    handle = model.blocks[1].register_forward_pre_hook(lambda m, a: seen.append([p.detach().clone() for p in m.parameters()]))
    engine.begin_step()
    loss = model(_batch(ctx.rank, 0))
    loss.backward()
    engine.finish_backward()
    engine.end_step()
    handle.remove()
    chunks_after = engine.weight_chunks()
    # the rows each rank sent for blocks[1] (one bucket: fc1.weight, fc1.bias, fc2.weight, fc2.bias,
    # no padding), quantized and dequantized as the gather does
    block = reference.blocks[1]
    rows = torch.cat([p.detach().reshape(WORLD_SIZE, -1) for p in block.parameters()], dim=1)  # (N, S)
    fmt = FORMATS["int8"]
    packed = torch.empty(WORLD_SIZE, fmt.packed_bytes(rows.shape[1]), dtype=torch.uint8)
    expected_rows = fmt.dequantize(fmt.quantize(rows, packed), rows.shape[1])
    widths = [p.numel() // WORLD_SIZE for p in block.parameters()]
    expected = [piece.reshape(p.shape) for piece, p in zip(torch.split(expected_rows, widths, dim=1), block.parameters())]
    with engine.gathered():
        summoned = [p.detach().clone() for p in model.blocks[1].parameters()]
    read_at_rest = model.blocks[1].fc1.weight.clone()
    # an evaluation step gathers (quantized) too
    with torch.no_grad():
        engine.begin_evaluation_step()
        eval_loss = model(_batch(ctx.rank, 9)).item()
        engine.end_step()
    engine.finish_evaluation()
    out = {
        "state_dict_exact": all(torch.equal(exact_before[k], v) for k, v in reference.state_dict().items()),
        "summoned_exact": all(torch.equal(a, b) for a, b in zip(summoned, reference.blocks[1].parameters())),
        "read_at_rest_exact": torch.equal(read_at_rest, reference.blocks[1].fc1.weight),
        "chunks_unchanged": all(torch.equal(chunks_before[k], v) for k, v in chunks_after.items()),
        "forward_saw_dequantized": all(torch.equal(a, b) for a, b in zip(seen[0], expected)),
        "dequantized_differs": any(not torch.equal(a, b) for a, b in zip(expected, block.parameters())),
        "eval_loss_finite": math.isfinite(eval_loss),
    }
    _close(engine, links)
    return out


for _format in ("int8", "fp8"):
    GROUP.case(_train, name=f"qwz_{_format}", quantize=_format)
GROUP.case(_train, name="qwz_hpz", quantize="int8", secondary=K)
GROUP.case(_train, name="qwz_hpz_checkpointed", quantize="int8", secondary=K, checkpointed=True)
GROUP.case(_train, name="qwz_checkpointed", quantize="int8", checkpointed=True)
GROUP.case(_train, name="qwz_offload_params", quantize="int8", offload_optimizer=True, offload_params=True)
GROUP.case(_train, name="qwz_hpz_frozen_kept", quantize="int8", secondary=K, frozen=True, keep_frozen_units_mb=math.inf)
GROUP.case(_train, name="qwz_frozen_kept", quantize="int8", frozen=True, keep_frozen_units_mb=math.inf)
GROUP.case(_train, name="hybrid_zero3", hybrid=True)
GROUP.case(_train, name="qwz_hybrid", quantize="int8", hybrid=True)


@GROUP.case
def secondary_memory(ctx: RankContext) -> dict[str, Any]:
    """memory_report's secondary shards between the forward and the backward, against the estimator."""
    from lightning_zero import estimate as est
    from lightning_zero.estimate_schemes import LAYOUTS, precision_scheme

    model, opt, engine, links = _engine(K)
    engine.begin_step()
    loss = model(_batch(ctx.rank, 0))
    report = engine.memory_report()
    loss.backward()
    engine.finish_backward()
    engine.end_step()
    after = engine.memory_report().secondary_shards
    zero3 = next(layout for layout in LAYOUTS if layout.label == "zero3")
    num_params = sum(p.numel() for p in model.parameters())
    predicted = est.estimate(num_params, zero3, precision_scheme("fp32"), est.Topology(devices=2, nodes=2), secondary_shard_size=K)
    _close(engine, links)
    return {
        "measured": report.secondary_shards,
        "in_parameters": report.device.parameters,
        "predicted": predicted.secondary_shards_per_rank,
        "after_backward": after,
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("zero_pp_gathers"))


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name", list(HPZ_CASES))
def test_hpz_trains_bitwise_as_zero3(results, name):
    for r in results[f"hpz_{name}"]:
        assert r["hpz"]["losses"] == r["zero3"]["losses"]
        _assert_bitwise(r["hpz"]["weights"], r["zero3"]["weights"])


def test_hpz_keeps_no_secondary_shard_of_a_unit_kept_gathered(results):
    for plain, frozen in zip(results["hpz_plain"], results["hpz_frozen_kept"]):
        assert plain["zero3"]["held"] == [0] * STEPS
        per_block = plain["hpz"]["held"][0] // 3
        assert plain["hpz"]["held"] == [3 * per_block] * STEPS
        assert frozen["hpz"]["held"] == [2 * per_block] * STEPS  # blocks[0] is all frozen, kept gathered


def test_hpz_backward_gathers_stay_within_the_secondary_group(results):
    for rank, r in enumerate(results["hpz_plain"]):
        pair = (0, 1) if rank < 2 else (2, 3)
        traffic, sizes = r["hpz"]["traffic"], r["hpz"]["gather_bytes"]
        everyone = ("all_gather", (0, 1, 2, 3))
        # the forward: the root unit and every block over all 4 ranks; backward: every block over the pair
        assert traffic[everyone] == sizes["root"] + sizes["blocks"]
        assert traffic[("all_gather", pair)] == sizes["blocks"]
        assert set(traffic) == {everyone, ("all_gather", pair)}
        assert sizes["blocks"] == pytest.approx(sizes["block_params"], rel=0.05)  # N·(S + 1) per bucket
        # zero3 gathers the blocks twice over all 4 ranks
        zero3 = r["zero3"]["traffic"]
        assert zero3 == {everyone: sizes["root"] + 2 * sizes["blocks"]}


@pytest.mark.parametrize("between", ["step", "write"])
def test_a_secondary_shard_kept_before_the_chunks_change_is_not_used_after(results, between):
    for r in results[f"stale_after_{between}"]:
        _assert_bitwise(r["hpz"]["weights"], r["zero3"]["weights"])
        assert all(h > 0 for h in r["hpz"]["held"]) and r["zero3"]["held"] == [0, 0]


def test_qwz_forward_computes_with_dequantized_chunks_and_never_quantizes_the_chunks(results):
    for r in results["quantized"]:
        assert r == {
            "state_dict_exact": True,
            "summoned_exact": True,
            "read_at_rest_exact": True,
            "chunks_unchanged": True,
            "forward_saw_dequantized": True,
            "dequantized_differs": True,
            "eval_loss_finite": True,
        }


@pytest.mark.parametrize("name, fmt", [("qwz_int8", "int8"), ("qwz_fp8", "fp8"), ("qwz_checkpointed", "int8")])
def test_qwz_losses_near_zero3(results, name, fmt):
    for q, z in zip(results[name], results["hpz_plain" if name != "qwz_checkpointed" else "hpz_checkpointed"]):
        assert q["losses"] != z["zero3"]["losses"]  # quantized
        assert q["losses"] == pytest.approx(z["zero3"]["losses"], rel=QUANTIZED_LOSS_TOLERANCE[fmt])


@pytest.mark.parametrize(
    "hpz, qwz",
    [("qwz_hpz", "qwz_int8"), ("qwz_hpz_checkpointed", "qwz_checkpointed"), ("qwz_hpz_frozen_kept", "qwz_frozen_kept")],
)
def test_qwz_with_hpz_trains_bitwise_as_qwz(results, hpz, qwz):
    for a, b in zip(results[hpz], results[qwz]):
        assert a["losses"] == b["losses"]
        _assert_bitwise(a["weights"], b["weights"])


def test_qwz_sends_chunks_offloaded_to_the_host_as_the_device_ones(results):
    for a, b in zip(results["qwz_offload_params"], results["qwz_int8"]):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)  # the host steps in another order
        assert a["losses"][0] == b["losses"][0]  # the first forward's gathers: the same bytes


def test_qwz_under_hybrid_sharding_gathers_within_the_shard_group(results):
    """qwZ with ``shard_group_size=2``: its quantized gathers are the shard group's (2 ranks), its
    losses near hybrid zero3's, which gathers the same units unquantized."""
    for rank, (q, z) in enumerate(zip(results["qwz_hybrid"], results["hybrid_zero3"])):
        assert q["losses"] != z["losses"]
        assert q["losses"] == pytest.approx(z["losses"], rel=QUANTIZED_LOSS_TOLERANCE["int8"])
        group = tuple(range(rank // RANKS_PER_NODE * RANKS_PER_NODE, (rank // RANKS_PER_NODE + 1) * RANKS_PER_NODE))
        assert {ranks for _, ranks in q["traffic"]} == {group} == {ranks for _, ranks in z["traffic"]}
        # int8 rows against fp32 ones: a quarter, plus each short row's whole last block of 256 codes
        assert sum(q["traffic"].values()) < 0.5 * sum(z["traffic"].values())


def test_memory_report_counts_the_secondary_shards_as_estimated(results):
    for r in results["secondary_memory"]:
        assert r["after_backward"] == 0
        assert r["measured"] > 0 and r["in_parameters"] > r["measured"]
        # the estimate prices every parameter; the root unit (embed, head: 5% here) keeps none
        assert r["measured"] == pytest.approx(r["predicted"], rel=0.10)
        assert r["measured"] <= r["predicted"]


# ---- one process ---------------------------------------------------------------------------


def test_quantized_gather_zeroes_the_padding_of_a_reused_buffer():
    """Garbage a pool buffer's earlier use left in the padding never enters a block's scale."""
    from lightning_zero.engine.buckets.quantized_gather import QuantizedGather
    from lightning_zero.engine.comm.buffers import BufferPool

    pool = BufferPool(capacity_bytes=4096, slots=2)
    dirty = pool.take(100, torch.float32, torch.device("cpu"))
    dirty.fill_(float("nan"))
    pool.give_back(dirty)
    values = torch.linspace(-1, 1, 90)
    gather = QuantizedGather("int8", 100, 1, 0, None, torch.float32, torch.device("cpu"), pool)
    pending = gather.start(None, lambda row: row[:90].copy_(values), 7, None)  # 10 padding elements left unwritten
    pending.work.wait()
    rows, tags = gather.rows(pending.gathered)
    assert torch.isfinite(rows).all() and torch.equal(rows[0, 90:], torch.zeros(10))
    assert (rows[0, :90] - values).abs().max() <= 1 / 127 / 2 + 1e-7
    assert tags.tolist() == [7.0]


class _Param:
    def __init__(self, t: torch.Tensor) -> None:
        self.send_source = t


class _Bucket:
    world_size, shard_numel, dtype, device = 4, 3, torch.float32, torch.device("cpu")

    def __init__(self) -> None:
        self.params = [_Param(torch.zeros(2)), _Param(torch.zeros(1))]


def test_secondary_shard_keeps_its_rows_and_goes_with_a_new_generation():
    from lightning_zero.engine.parameters.secondary_shards import SecondaryShards

    owner = SecondaryShards(None)  # outside a process group: K = 1, position 0
    owner.size, owner.position = 2, 1  # as the second rank of a pair
    bucket = _Bucket()
    secondary = owner.of(bucket)
    rows = torch.arange(16, dtype=torch.float32).view(4, 4)  # (N, S + 1)
    secondary.keep(rows)
    assert torch.equal(secondary.rows[:, :3], rows[2:4, :3]) and secondary.holds
    assert owner.held_bytes == 2 * 4 * 4
    owner.chunks_changed()
    assert not secondary.holds and owner.held_bytes == 0


def test_a_chunk_written_in_place_behind_the_generation_raises():
    from lightning_zero.engine.parameters.secondary_shards import SecondaryShards

    owner = SecondaryShards(None)
    owner.size, owner.position = 2, 0
    bucket = _Bucket()
    secondary = owner.of(bucket)
    secondary.keep(torch.zeros(4, 4))
    bucket.params[0].send_source.add_(1)  # an in-place write no generation saw
    with pytest.raises(RuntimeError, match="written in place"):
        secondary.start_gather(None)


def test_the_estimator_prices_secondary_shards_at_stage_3_only():
    from lightning_zero import estimate as est
    from lightning_zero.estimate_schemes import LAYOUTS, precision_scheme

    topology, scheme = est.Topology(devices=8, nodes=2), precision_scheme("mixed")
    by_label = {e.layout.label: e for e in est.estimate_all(7 * 10**9, scheme, topology, secondary_shard_size=8)}
    plain = {e.layout.label: e for e in est.estimate_all(7 * 10**9, scheme, topology)}
    assert by_label["zero3"].secondary_shards_per_rank == 2 * 7 * 10**9 // 8  # 2Ψ/K in half precision
    assert by_label["zero3"].device_during_backward == plain["zero3"].device_during_backward + 2 * 7 * 10**9 // 8
    assert by_label["zero3"].device == plain["zero3"].device  # freed by the end of backward: in no total
    for layout in LAYOUTS:
        if layout.stage.value != 3 or layout.offload_params:
            assert by_label[layout.label].secondary_shards_per_rank == 0, layout.label
