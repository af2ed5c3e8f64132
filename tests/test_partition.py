"""Partition and bucket math, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.engine.buckets.assignment import assign_buckets
from lightning_zero.engine.shards.full_targets import FullTargets
from lightning_zero.engine.shards.partition import (
    ChunkLayout,
    copy_flat_into_rows,
    copy_rows_into_flat,
    interleaved_sizes,
    pack_rows,
    unpack_rows,
)
from lightning_zero.engine.shards.sharded_param import ShardedParam


@pytest.mark.parametrize("numel", [0, 1, 2, 3, 5, 7, 8, 91, 1000])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_chunks_match_torch_chunk_and_cover_every_element_once(numel, world_size):
    layout = ChunkLayout(numel, world_size)
    flat = torch.arange(numel)
    expected = list(torch.chunk(flat, world_size)) if numel else []
    owned = [flat[slice(*layout.owned_range(r))] for r in range(world_size)]
    nonempty = [o for o in owned if o.numel()]
    assert [o.tolist() for o in nonempty] == [e.tolist() for e in expected]
    assert sum(layout.owned_numel(r) for r in range(world_size)) == numel
    assert all(layout.owned_numel(r) <= layout.padded_chunk_numel for r in range(world_size))


@pytest.mark.parametrize("numel", [1, 5, 12, 13])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_row_copies_round_trip_with_zero_padding(numel, world_size):
    layout = ChunkLayout(numel, world_size)
    c = layout.padded_chunk_numel
    buffer = torch.full((world_size, c + 3), -1.0)  # a wider buffer: rows is a strided column slice
    rows = buffer[:, 1 : 1 + c]
    flat = torch.arange(1, numel + 1, dtype=torch.float32)
    copy_flat_into_rows(flat, rows)
    for r in range(world_size):
        start, end = layout.owned_range(r)
        assert rows[r, : end - start].tolist() == flat[start:end].tolist()
        assert rows[r, end - start :].eq(0).all()  # padding zeroed
    assert buffer[:, 0].eq(-1).all() and buffer[:, 1 + c :].eq(-1).all()  # neighbours untouched
    back = torch.empty(numel)
    copy_rows_into_flat(rows, back)
    assert back.tolist() == flat.tolist()


# sizes: odd, smaller than N, exactly divisible, one element; every world size incl. 1
BUCKET_SIZES = [[5, 1, 12, 7], [2, 3], [6, 6], [1], [13, 0, 4]]


def _reference_pack(flats, n, scale=None):
    widths = [-(-f.numel() // n) for f in flats]
    rows = torch.full((n, sum(widths)), -1.0, dtype=flats[0].dtype)
    offset = 0
    for flat, w in zip(flats, widths):
        copy_flat_into_rows(flat, rows[:, offset : offset + w], scale=scale)
        offset += w
    return rows, widths


@pytest.mark.parametrize("sizes", BUCKET_SIZES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_copies_equal_the_per_parameter_reference(sizes, world_size, dtype):
    g = torch.Generator().manual_seed(sum(sizes) + world_size)
    flats = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    expected, widths = _reference_pack(flats, world_size, scale=1.0 / world_size)
    packed = torch.full_like(expected, -1.0)
    pack_rows(flats, packed, scale=1.0 / world_size)
    assert torch.equal(packed, expected)  # bitwise, padding zeroed

    # copy-out: into targets of the same dtype (batched) and of another dtype (mixed in a bucket)
    rows = torch.cat([expected, torch.full((world_size, 1), 7.0, dtype=dtype)], dim=1)  # plus a tag column
    for target_dtype in (dtype, torch.float64):
        targets = [torch.empty(n, dtype=target_dtype) for n in sizes]
        unpack_rows(rows, targets, widths)
        for target, flat in zip(targets, flats):
            reference = torch.empty_like(target)
            copy_rows_into_flat(_reference_pack([flat], world_size, scale=1.0 / world_size)[0], reference)
            assert torch.equal(target, reference)


def test_interleaved_sizes_cut_a_row_into_chunks_and_padding():
    layouts = [ChunkLayout(n, 3) for n in (5, 1, 7)]
    rank = 2
    owned = [layout.owned_numel(rank) for layout in layouts]
    widths = [layout.padded_chunk_numel for layout in layouts]
    assert interleaved_sizes(owned, widths) == [1, 1, 0, 1, 1, 2]


def _sharded(params, world_size=2, rank=0):
    return [ShardedParam(f"p{i}", p, rank, world_size) for i, p in enumerate(params)]


def test_buckets_respect_size_dtype_and_optimizer():
    params = [nn.Parameter(torch.zeros(100)) for _ in range(6)] + [nn.Parameter(torch.zeros(100, dtype=torch.float64))]
    sharded = _sharded(params)
    owner = {id(sp): (0 if i < 4 else 1) for i, sp in enumerate(sharded)}
    buckets = assign_buckets(sharded, owner, bucket_bytes=2 * 400, group=None)
    membership = [[sp.name for sp in b.params] for b in buckets]
    assert membership == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"], ["p6"]]
    assert buckets[0].shard_numel == 100  # 2 params x ceil(100/2); world of 1 here: group=None


def test_parameter_larger_than_a_bucket_gets_its_own():
    sharded = _sharded([nn.Parameter(torch.zeros(10)), nn.Parameter(torch.zeros(1000)), nn.Parameter(torch.zeros(10))])
    buckets = assign_buckets(sharded, {id(sp): 0 for sp in sharded}, bucket_bytes=100, group=None)
    assert [[sp.name for sp in b.params] for b in buckets] == [["p0"], ["p1"], ["p2"]]


def test_half_precision_parameters_get_an_fp32_master_and_fp32_ones_alias():
    half = nn.Parameter(torch.randn(7, dtype=torch.bfloat16))
    full = nn.Parameter(torch.randn(7))
    sp_half, sp_full = _sharded([half, full], world_size=2, rank=1)
    assert sp_half.holds_master_copy and sp_half.shard.dtype == torch.float32
    assert sp_half.shard.tolist() == half.detach()[4:].float().tolist()
    assert not sp_full.holds_master_copy and sp_full.shard.data_ptr() == full.data_ptr() + 4 * 4


def test_assigned_data_becomes_the_storage_the_shard_aliases_as_under_ddp():
    p = nn.Parameter(torch.randn(6))
    (sp,) = _sharded([p])
    new = torch.arange(6.0)
    p.data = new
    assert sp.data_was_assigned()
    with pytest.raises(RuntimeError, match="between the backward and the optimizer step"):
        sp.check_data_not_assigned()
    sp.adopt_assigned_data()
    assert not sp.data_was_assigned() and p.data_ptr() == new.data_ptr()
    assert torch.equal(sp.shard.detach(), new[: sp.owned_numel])
    with torch.no_grad():
        sp.shard.add_(1.0)  # the optimizer's update reaches the parameter and whoever holds `new`
    assert torch.equal(new[: sp.owned_numel], torch.arange(1.0, 1.0 + sp.owned_numel))


def test_full_targets_answer_as_each_parameter_would_and_follow_an_adopted_storage():
    """A bucket's check and write-back targets (``FullTargets``, no Python call per parameter) agree
    with the per-parameter ones, before and after an assignment is adopted."""
    params = [nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(4, dtype=torch.bfloat16))]
    sharded = _sharded(params)
    targets = FullTargets(sharded)

    def places(tensors):
        return [None if t is None else (t.data_ptr(), tuple(t.shape)) for t in tensors]

    def per_parameter():  # the parameters fill whole rows where numel is even (2 ranks)
        flats = [sp.gather_target() for sp in sharded]
        return places(flats), places([f.view(2, -1) if f.numel() % 2 == 0 else None for f in flats])

    assert not targets.assigned()
    flats, rows = targets.targets()
    assert (places(flats), places(rows)) == per_parameter()
    targets.check_not_assigned()
    new = torch.arange(5.0)
    params[1].data = new
    assert targets.assigned() and sharded[1].data_was_assigned()
    with pytest.raises(RuntimeError, match="'p1' was assigned a new `.data` between the backward and the optimizer step"):
        targets.check_not_assigned()
    sharded[1].adopt_assigned_data()
    assert not targets.assigned()
    flats, rows = targets.targets()
    assert flats[1].data_ptr() == new.data_ptr() and (places(flats), places(rows)) == per_parameter()
    params[0].data = params[0].data.clone()  # the same shape, dtype and device: only the storage differs
    assert targets.assigned() and [sp.data_was_assigned() for sp in sharded] == [True, False, False]


def test_an_assignment_before_the_write_back_fails_naming_it_and_an_adopted_one_is_written_into():
    """Stages 1-2 at one rank (``group=None``), bf16 parameters (fp32 masters, copied back after a
    step): the per-bucket check finds the assignment and names the parameter; once adopted, the
    write-back's cached targets follow the new storage."""
    from lightning_zero.engine.config import ZeroConfig
    from lightning_zero.engine.parameters.replicated_parameters import ReplicatedParameters

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    residency = ReplicatedParameters(model, {id(p): 0 for p in model.parameters()}, ZeroConfig(stage=1), None)
    residency.after_optimizer_step(optimizer, residency.params)  # the cached targets are made
    assert not residency.holds_assigned_data()
    new = torch.zeros(2, 4, dtype=torch.bfloat16)
    model[1].weight.data = new
    assert residency.holds_assigned_data()
    with pytest.raises(RuntimeError, match="'1.weight' was assigned a new `.data` between the backward and the optimizer step"):
        residency.after_optimizer_step(optimizer, residency.params)
    residency.adopt_assigned_data()
    assert not residency.holds_assigned_data()
    (master,) = [p.shard for p in residency.params if p.name == "1.weight"]
    with torch.no_grad():
        master.fill_(0.5)  # as an optimizer step would update it
    residency.after_optimizer_step(optimizer, residency.params)
    assert model[1].weight.data_ptr() == new.data_ptr() and torch.equal(new, torch.full((2, 4), 0.5, dtype=torch.bfloat16))


@pytest.mark.parametrize("assigned", [torch.zeros(3), torch.zeros(6, dtype=torch.float64)])
def test_assigned_data_of_another_shape_or_dtype_is_refused_naming_both(assigned):
    p = nn.Parameter(torch.randn(6))
    (sp,) = _sharded([p])
    p.data = assigned
    with pytest.raises(RuntimeError, match=r"was assigned a tensor of shape \((3|6),\) \(torch.float(32|64)") as err:
        sp.adopt_assigned_data()
    assert "sharded it as shape (6,) (torch.float32" in str(err.value)

