"""The memory estimator's arithmetic against the ZeRO paper's figures, its recommendation, the meta-device
parameter counter and the `lightning-zero estimate` command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zero import estimate as est
from lightning_zero import sizing
from lightning_zero.cli import main, model_spec
from lightning_zero.cli.arguments import parse_count, parse_memory
from lightning_zero.engine import ZeroStage
from lightning_zero.estimate_schemes import LAYOUTS, Layout, PrecisionScheme, precision_scheme

REPO = Path(__file__).resolve().parents[1]
GPT_FILE = REPO / "src" / "lightning_zero" / "models" / "gpt.py"
GB = 10**9
MIXED, FP32, HALF = (precision_scheme(name) for name in ("mixed", "fp32", "half"))


def device_totals(num_params: int, scheme: PrecisionScheme, devices: int, nodes: int = 1) -> dict:
    estimates = est.estimate_all(num_params, scheme, est.Topology(devices, nodes))
    return {e.layout.label: e.device.total for e in estimates}


def test_zero_paper_figure_1_per_device():
    # ZeRO paper, figure 1: 7.5B parameters, K = 12, N = 8.
    totals = device_totals(7_500_000_000, MIXED, devices=8)
    assert totals["ddp"] == 120 * GB
    assert totals["zero1"] == pytest.approx(41.25 * GB, rel=1e-12)
    assert totals["zero2"] == pytest.approx(28.125 * GB, rel=1e-12)
    assert totals["zero3"] == 15 * GB


def test_fp32_and_half_schemes_under_ddp():
    assert device_totals(7_000_000_000, FP32, devices=8)["ddp"] == 112 * GB
    # Half precision with no fp32 master copy: 2 + 2 + 8 bytes per parameter.
    assert device_totals(7_240_000_000, HALF, devices=8)["ddp"] == pytest.approx(86.88 * GB, rel=1e-12)


def test_breakdown_by_term_for_each_stage():
    psi, n = 8_000, 4
    by_label = {e.layout.label: e for e in est.estimate_all(psi, MIXED, est.Topology(n))}
    assert by_label["ddp"].device == est.StateBytes(2 * psi, 2 * psi, 12 * psi)
    assert by_label["zero1"].device == est.StateBytes(2 * psi, 2 * psi, 12 * psi // n)
    assert by_label["zero2"].device == est.StateBytes(2 * psi, 2 * psi // n, 12 * psi // n)
    assert by_label["zero3"].device == est.StateBytes(2 * psi // n, 2 * psi // n, 12 * psi // n)
    assert all(e.host.total == 0 for label, e in by_label.items() if "offload" not in label)


def test_offload_moves_terms_to_the_host_of_each_node():
    # See [Note: offloaded state]: per rank the host keeps the master chunk (4 B) and the gradient
    # chunk (4 B), both pinned, and Adam's moments (8 B), not pinned.
    psi, devices, nodes = 16_000, 4, 2
    n = devices * nodes
    by_label = {e.layout.label: e for e in est.estimate_all(psi, MIXED, est.Topology(devices, nodes))}

    zero1 = by_label["zero1 + offload optimizer"]
    assert zero1.device == est.StateBytes(2 * psi, 2 * psi, 0)  # stage 1 keeps full gradients
    assert zero1.host_per_rank == est.StateBytes(gradients=4 * psi // n, optimizer_state=12 * psi // n)
    assert zero1.pinned_per_rank == 8 * psi // n

    zero2 = by_label["zero2 + offload optimizer"]
    assert zero2.device == est.StateBytes(2 * psi, 0, 0)
    # The host holds the chunks of the node's `devices` ranks, not of all n.
    assert zero2.host == est.StateBytes(gradients=devices * 4 * psi // n, optimizer_state=devices * 12 * psi // n)
    assert zero2.pinned == devices * 8 * psi // n

    # Half-precision weights: the device keeps the half chunk to gather from, with or without
    # offload_params; the host keeps the fp32 master, so offloading parameters moves nothing more.
    for label in ("zero3 + offload optimizer", "zero3 + offload optimizer, params"):
        zero3 = by_label[label]
        assert zero3.device == est.StateBytes(2 * psi // n, 0, 0), label
        assert zero3.host_per_rank == est.StateBytes(gradients=4 * psi // n, optimizer_state=12 * psi // n), label
        assert zero3.pinned_per_rank == 8 * psi // n, label


def test_offload_with_fp32_weights_leaves_nothing_on_the_device_at_stage_3():
    psi, n = 8_000, 4
    by_label = {e.layout.label: e for e in est.estimate_all(psi, FP32, est.Topology(n))}
    # Only the optimizer offloaded: the device keeps the fp32 chunk to gather from, the host a master copy.
    zero3 = by_label["zero3 + offload optimizer"]
    assert zero3.device == est.StateBytes(parameters=4 * psi // n)
    assert zero3.host_per_rank == est.StateBytes(gradients=4 * psi // n, optimizer_state=12 * psi // n)
    # With parameters offloaded the host chunk is the weight's only copy (a parameter, as memory_report() counts it).
    params = by_label["zero3 + offload optimizer, params"]
    assert params.device == est.StateBytes() and params.device.total == 0
    assert params.host_per_rank == est.StateBytes(parameters=4 * psi // n, gradients=4 * psi // n, optimizer_state=8 * psi // n)
    assert params.pinned_per_rank == 8 * psi // n == params.host_per_rank.total - 8 * psi // n  # the moments are not pinned
    # Stage 2: full fp32 weights on the device, the same 16 B per parameter and rank on the host.
    zero2 = by_label["zero2 + offload optimizer"]
    assert zero2.device == est.StateBytes(parameters=4 * psi)
    assert zero2.host_per_rank.total == 16 * psi // n and zero2.pinned_per_rank == 8 * psi // n
    # Without offload nothing is on the host, so nothing is pinned.
    assert all(e.pinned == 0 for label, e in by_label.items() if "offload" not in label)


def test_schemes_split_the_master_copy_from_the_moments():
    assert (MIXED.master_bytes, MIXED.moment_bytes, MIXED.offload_chunk_bytes) == (4, 8, 4)
    assert (FP32.master_bytes, FP32.moment_bytes, FP32.offload_chunk_bytes) == (0, 8, 4)
    # No master copy in the scheme, but the engine steps half weights through an fp32 chunk when offloading.
    assert (HALF.master_bytes, HALF.moment_bytes, HALF.offload_chunk_bytes) == (0, 8, 4)
    with pytest.raises(ValueError, match="master_bytes"):
        PrecisionScheme("bad", 2, 2, 4, "master as large as the optimizer term", master_bytes=4)


def test_uneven_shards_round_up():
    # 10 parameters on 4 ranks: chunks of 3, 3, 3, 1 padded to 3; the estimate is the largest rank's.
    assert est.shard_numel(10, 4) == 3
    zero3 = est.estimate(10, Layout(ZeroStage.PARAMETERS), FP32, est.Topology(4))
    assert zero3.device.total == 3 * FP32.total_bytes


@pytest.mark.parametrize(
    ("gpu_memory", "expected"),
    [
        (80 * GB, "zero1"),  # DDP needs 120 GB
        (30 * GB, "zero2"),  # 28.125 GB
        (20 * GB, "zero3"),  # 15 GB
        (10 * GB, "zero3 + offload optimizer"),  # 1.875 GB; zero1/zero2 with offload still need 30/15
        (2 * GB, "zero3 + offload optimizer"),  # offloading parameters saves nothing more: the half chunk stays
    ],
)
def test_recommend_prefers_lower_stages_then_offload(gpu_memory, expected):
    estimates = est.estimate_all(7_500_000_000, MIXED, est.Topology(8))
    recommendation = sizing.recommend(estimates, gpu_memory)
    assert recommendation.choice is not None
    assert recommendation.choice.layout.label == expected
    assert expected in recommendation.message
    assert "activations" in recommendation.message  # says what the estimate leaves out


def test_recommend_says_when_nothing_fits_and_respects_host_memory():
    estimates = est.estimate_all(7_500_000_000, MIXED, est.Topology(8))
    nothing = sizing.recommend(estimates, 1 * GB)
    assert nothing.choice is None
    assert "No layout fits" in nothing.message and "1.875 GB" in nothing.message

    # Offloading the optimizer needs 16 B per parameter of host memory on the node, 120 GB: with 100 GB
    # no host offload layout fits, and at 10 GB per device no on-device layout does either; NVMe,
    # the last resort, keeps 8 B per parameter (60 GB) and a few buckets on the host, the masters'
    # rollback copies (4 B, 30 GB: its host step runs during backward too) and 16 B per parameter on
    # disk (two slots of the moments: the committed step's and the next one's).
    on_disk = sizing.recommend(estimates, 10 * GB, host_memory=100 * GB)
    assert on_disk.choice.layout.label == "zero3 + offload optimizer (nvme)"
    assert (
        "60.419 GB of host memory per node (60 GB of it pinned), and up to 30 GB more for the host step's"
        " rollback copies, and 120 GB of NVMe per node"
    ) in on_disk.message
    # with 60 GB only the master chunks' move to NVMe as well fits: the host keeps the gradient
    # chunks (4 B per parameter, 30 GB) and a few buckets of masters and moments
    everything_on_disk = sizing.recommend(estimates, 10 * GB, host_memory=60 * GB)
    assert everything_on_disk.choice.layout.label == "zero3 + offload optimizer (nvme), params (nvme)"
    assert everything_on_disk.choice.disk == 150 * GB  # 20 B per parameter: two slots of the moments, the masters
    assert sizing.recommend(estimates, 10 * GB, host_memory=30 * GB).choice is None
    # CPU offload fits 128 GB only where the host step keeps no rollback copies (12 B per parameter
    # more, 90 GB: the Trainer without clipping or hooks, or overlap_host_step=False) ...
    no_copies = est.estimate_all(7_500_000_000, MIXED, est.Topology(8), rollback_copies=False)
    enough = sizing.recommend(no_copies, 10 * GB, host_memory=128 * GB)
    assert enough.choice.layout.label == "zero3 + offload optimizer"
    assert "120 GB of host memory per node (60 GB of it pinned)." in enough.message
    # ... where they may be kept, the host needs 210 GB for it, and 128 GB takes the moments to NVMe
    assert sizing.recommend(estimates, 10 * GB, host_memory=128 * GB).choice.layout.label == "zero3 + offload optimizer (nvme)"
    with_copies = sizing.recommend(estimates, 10 * GB, host_memory=210 * GB)
    assert with_copies.choice.layout.label == "zero3 + offload optimizer"
    assert "120 GB of host memory per node (60 GB of it pinned), and up to 90 GB more for the host step's rollback copies" in with_copies.message
    assert sizing.recommend(estimates, 10 * GB, host_memory=210 * GB - 1).choice.layout.state_on_disk


def test_recommend_offloads_fp32_parameters_when_the_device_holds_nothing_else():
    estimates = est.estimate_all(7_500_000_000, FP32, est.Topology(8), rollback_copies=False)
    recommendation = sizing.recommend(estimates, 1 * GB, host_memory=128 * GB)
    assert recommendation.choice.layout.label == "zero3 + offload optimizer, params"
    assert recommendation.choice.device.total == 0
    # with the host step's rollback copies (90 GB more) the host's 128 GB hold only NVMe's layout
    with_copies = sizing.recommend(est.estimate_all(7_500_000_000, FP32, est.Topology(8)), 1 * GB, host_memory=128 * GB)
    assert with_copies.choice.layout.label == "zero3 + offload optimizer (nvme), params"


def test_nvme_keeps_the_chunks_in_host_memory_and_the_moments_on_disk():
    # See [Note: optimizer state on NVMe]. 16,000 fp32 parameters on 4 ranks (shard 4,000); buckets of
    # 8,000 B of weights = 2,000 parameters, so 8 buckets, each 500 elements per rank: 3 buffers of
    # 500 x 8 B = 12,000 B on the host, and 8 B x 4,000 = 32,000 B on disk per rank.
    psi, n = 16_000, 4
    staging = est.NvmeStaging(bucket_bytes=8_000, buffer_count=3)
    by_label = {e.layout.label: e for e in est.estimate_all(psi, FP32, est.Topology(n), staging)}
    params = by_label["zero3 + offload optimizer (nvme), params"]
    assert params.device == est.StateBytes()
    assert params.host_per_rank == est.StateBytes(parameters=16_000, gradients=16_000, optimizer_state=12_000)
    assert (params.pinned_per_rank, params.disk_per_rank) == (32_000, 2 * 32_000)
    # The device side is CPU offload's; only the moments moved.
    for stage in ("zero1", "zero2", "zero3"):
        cpu, nvme = by_label[f"{stage} + offload optimizer"], by_label[f"{stage} + offload optimizer (nvme)"]
        assert nvme.device == cpu.device and nvme.pinned == cpu.pinned
        assert cpu.host_per_rank.optimizer_state - nvme.host_per_rank.optimizer_state == 32_000 - 12_000
        assert (cpu.disk, nvme.disk_per_rank, nvme.disk) == (0, 2 * 32_000, 4 * 2 * 32_000)  # two slots
    assert all(e.disk == 0 for e in by_label.values() if not e.layout.state_on_disk)
    # Mixed precision: the bucket holds 4,000 half-precision parameters (1,000 per rank); the host
    # also keeps the fp32 master chunk as optimizer state; 2 nodes of 2 devices: per node, 2 ranks.
    mixed = est.estimate(psi, LAYOUTS[-3], MIXED, est.Topology(2, 2), staging)
    assert mixed.layout.label == "zero3 + offload optimizer (nvme)"
    assert mixed.device == est.StateBytes(parameters=2 * 4_000)
    assert mixed.host_per_rank == est.StateBytes(gradients=16_000, optimizer_state=16_000 + 3 * 8 * 1_000)
    assert (mixed.disk_per_rank, mixed.disk) == (2 * 32_000, 2 * 64_000)


def test_nvme_parameters_move_the_master_chunks_to_disk_too():
    # 16,000 fp32 parameters on 4 ranks, buckets of 2,000 parameters (500 per rank), 3 buffers: the
    # host keeps the gradient chunk (4 x 4,000 B) and 3 buckets of masters (3 x 4 x 500 B) and of
    # moments (3 x 8 x 500 B); the disk two slots of the moments and the masters, 20 B x 4,000.
    staging = est.NvmeStaging(bucket_bytes=8_000, buffer_count=3)
    everything = est.estimate(16_000, LAYOUTS[-1], FP32, est.Topology(4), staging)
    assert everything.layout.label == "zero3 + offload optimizer (nvme), params (nvme)"
    assert everything.device == est.StateBytes()
    assert everything.host_per_rank == est.StateBytes(parameters=6_000, gradients=16_000, optimizer_state=12_000)
    assert (everything.pinned_per_rank, everything.disk_per_rank) == (16_000 + 6_000, 80_000)
    # Mixed precision: the device keeps the half chunk it gathers from, the fp32 masters go to disk.
    mixed = est.estimate(16_000, LAYOUTS[-1], MIXED, est.Topology(4), staging)
    assert mixed.device == est.StateBytes(parameters=2 * 4_000)
    assert mixed.host_per_rank == est.StateBytes(gradients=16_000, optimizer_state=3 * 4 * 1_000 + 3 * 8 * 1_000)
    assert mixed.disk_per_rank == 20 * 4_000
    with pytest.raises(ValueError, match="needs offload_optimizer='nvme'"):
        Layout(ZeroStage.PARAMETERS, offload_optimizer=True, offload_params="nvme")


def test_nvme_staging_never_exceeds_the_buckets_there_are():
    fp32_rank = est.Topology(1)
    # The engine's defaults: 25 MiB buckets (6,553,600 fp32 parameters), 4 buffers of their moments.
    assert est.NvmeStaging() == est.NvmeStaging(bucket_bytes=25 * 2**20, buffer_count=4)
    assert est.NvmeStaging().host_bytes(10**9, FP32, 1) == 4 * 8 * 6_553_600
    # A model smaller than a bucket is one bucket: one buffer, its whole state.
    assert est.NvmeStaging().host_bytes(1_000, FP32, 1) == 8 * 1_000
    # Two buckets: two buffers, each of the largest.
    assert est.NvmeStaging(bucket_bytes=4 * 600).host_bytes(1_000, FP32, 1) == 2 * 8 * 600
    # So a small model gains nothing from NVMe: one buffer holds what the optimizer held.
    small = est.estimate(1_000, LAYOUTS[-2], FP32, fp32_rank)
    assert small.host_per_rank.total == est.estimate(1_000, LAYOUTS[7], FP32, fp32_rank).host_per_rank.total
    with pytest.raises(ValueError, match="at least 2"):
        est.NvmeStaging(buffer_count=1)
    with pytest.raises(ValueError, match="'cpu'|False, True or 'nvme'"):
        Layout(ZeroStage.PARAMETERS, offload_optimizer="cpu")
    with pytest.raises(ValueError, match="DDP has no offload"):
        Layout(ZeroStage.NOTHING, offload_optimizer="nvme")


def test_invalid_configurations_are_refused():
    with pytest.raises(ValueError, match="DDP has no offload"):
        Layout(ZeroStage.NOTHING, offload_optimizer=True)
    with pytest.raises(ValueError, match="needs stage 3"):
        Layout(ZeroStage.GRADIENTS, offload_optimizer=True, offload_params=True)
    with pytest.raises(ValueError, match="offload_optimizer=True"):
        Layout(ZeroStage.PARAMETERS, offload_params=True)
    with pytest.raises(ValueError, match="mixed, fp32, half"):
        precision_scheme("fp16")
    with pytest.raises(ValueError, match="at least 1"):
        est.Topology(devices=0)


def test_format_bytes():
    assert sizing.format_bytes(28_125_000_000) == "28.125 GB"
    assert sizing.format_bytes(120 * GB) == "120 GB"
    assert sizing.format_bytes(16_000_000) == "16 MB"
    # small files (`lightning-zero convert`, `verify`) in the unit that shows them, not "0.0 MB"
    assert [sizing.format_bytes(n) for n in (0, 523, 40_960, 1_842_311)] == ["0 B", "523 B", "40.96 KB", "1.842 MB"]


def test_format_count():
    assert sizing.format_count(1_209_000_000) == "1.21B"
    assert sizing.format_count(125_000_000) == "125M"
    assert sizing.format_count(999_600_000) == "1B"
    assert sizing.format_count(950) == "950"


# --- the host step's rollback copies -----------------------------------------------------------------


def test_rollback_copies_are_a_figure_of_their_own_for_cpu_offload():
    # See [Note: offloaded state]: the master chunk (4 B) and Adam's moments (8 B) per parameter and
    # rank, beside the model states (no total holds them), never pinned, for the node's ranks.
    psi, devices, nodes = 16_000, 4, 2
    shard = psi // (devices * nodes)
    for scheme in (MIXED, FP32, HALF):
        counted = est.estimate_all(psi, scheme, est.Topology(devices, nodes))
        not_counted = est.estimate_all(psi, scheme, est.Topology(devices, nodes), rollback_copies=False)
        for e, bare in zip(counted, not_counted):
            label = f"{scheme.name}: {e.layout.label}"
            on_cpu = e.layout.offload_optimizer is True
            # NVMe state (masters in host memory) steps during backward too: its masters are copied,
            # its moments keep their committed slot on disk
            masters_only = e.layout.state_on_disk and not e.layout.params_on_disk
            assert e.host_step_rollback_per_rank == (12 * shard if on_cpu else 4 * shard if masters_only else 0), label
            assert e.host_step_rollback == devices * e.host_step_rollback_per_rank, label
            assert bare.host_step_rollback_per_rank == 0, label
            # nothing else moves: the model states, the pinned part and the disk are the same
            assert (e.device, e.host_per_rank, e.pinned_per_rank, e.disk_per_rank) == (
                bare.device,
                bare.host_per_rank,
                bare.pinned_per_rank,
                bare.disk_per_rank,
            ), label
            assert e.host_during_step == e.host.total + e.host_step_rollback, label
    # A whole-tensor optimizer steps after backward: no copies.
    owned = est.OwnedParameters([8_000, 8_000])
    whole = est.estimate(psi, Layout(ZeroStage.GRADIENTS, offload_optimizer=True), FP32, est.Topology(4), owned=owned)
    assert whole.host_step_rollback_per_rank == 0


def test_fits_counts_the_rollback_copies_at_most():
    zero2 = est.estimate(1_000, Layout(ZeroStage.GRADIENTS, offload_optimizer=True), FP32, est.Topology(1))
    assert (zero2.host.total, zero2.host_step_rollback) == (16_000, 12_000)
    assert sizing.fits(zero2, 10**6, host_memory=28_000)
    assert not sizing.fits(zero2, 10**6, host_memory=27_999)
    bare = est.estimate(1_000, zero2.layout, FP32, est.Topology(1), rollback_copies=False)
    assert sizing.fits(bare, 10**6, host_memory=16_000)


@pytest.fixture
def one_rank_path(tmp_path):
    """A gloo group of one rank whose engine takes the sharded path of N >= 2 ranks (buckets, host rows,
    the host step during backward), as tests/test_host_work.py sets it up."""
    import torch.distributed as dist

    from lightning_zero.engine.comm.collectives import COLLECTIVES_AT_ONE_RANK

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    os.environ[COLLECTIVES_AT_ONE_RANK] = "path"
    try:
        yield tmp_path
    finally:
        del os.environ[COLLECTIVES_AT_ONE_RANK]
        dist.destroy_process_group()


def _measured_rollback(stage: int, dtype: torch.dtype, directory: Path, **options) -> tuple[int, int, int]:
    """Two steps of a small model under the engine (a plain loop: it keeps rollback copies), and
    ``memory_report().host_step_rollback`` after them; with the model's Ψ and its parameter tensors."""
    from lightning_zero.engine import ZeroEngine
    from lightning_zero.engine.config import ZeroConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(33, 33), torch.nn.Tanh()) for _ in range(3))).to(dtype)
    psi, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))  # before stage 3 shards them
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    split = {"unit_classes": ["Linear"]} if stage == 3 else {"bucket_size_mb": 33 * 34 * 4 / 2**20}  # a bucket per block
    if options.get("offload_optimizer") == "nvme":
        options["nvme_path"] = str(directory)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, **split, **options), device=torch.device("cpu"))
    try:
        for _ in range(2):  # the first step has no optimizer state to copy yet
            engine.begin_step()
            model(torch.randn(4, 33, dtype=dtype)).float().pow(2).mean().backward()
            engine.finish_backward()
            engine.end_step()
            optimizer.step()
            engine.after_optimizer_step(optimizer)
            optimizer.zero_grad()
        measured = engine.memory_report().host_step_rollback
    finally:
        engine.close()
    return measured, psi, tensors


@pytest.mark.parametrize(
    ("stage", "dtype", "scheme", "offload_params"),
    [
        (1, torch.float32, FP32, False),
        (2, torch.float32, FP32, False),
        (3, torch.float32, FP32, False),
        (3, torch.float32, FP32, True),
        (2, torch.bfloat16, HALF, False),  # bf16 weights step through fp32 chunks and fp32 moments
        (3, torch.bfloat16, HALF, True),
    ],
    ids=["zero1", "zero2", "zero3", "zero3-params", "zero2-bf16", "zero3-params-bf16"],
)
def test_rollback_copies_match_the_engines_memory_report(one_rank_path, stage, dtype, scheme, offload_params):
    options = {"offload_optimizer": True, "offload_params": offload_params}
    measured, psi, tensors = _measured_rollback(stage, dtype, one_rank_path, **options)
    layout = Layout(ZeroStage(stage), offload_optimizer=True, offload_params=offload_params)
    predicted = est.estimate(psi, layout, scheme, est.Topology(1)).host_step_rollback_per_rank
    assert predicted == 12 * psi
    # the engine also copies Adam's step counters, one fp32 scalar per parameter tensor: left out of
    # the estimate, as the counters themselves are ([Note: what the estimate leaves out])
    assert measured == predicted + 4 * tensors
    # with overlap_host_step=False no copy is kept, and `rollback_copies=False` says so
    assert _measured_rollback(stage, dtype, one_rank_path, overlap_host_step=False, **options)[0] == 0
    assert est.estimate(psi, layout, scheme, est.Topology(1), rollback_copies=False).host_step_rollback_per_rank == 0


def test_nvme_rollback_copies_hold_the_masters_only(one_rank_path):
    """With the moments on NVMe the host step during backward copies the master chunks (4 B per
    parameter and rank) and Adam's step counters; the moments keep their committed slot on disk."""
    measured, psi, tensors = _measured_rollback(2, torch.float32, one_rank_path, offload_optimizer="nvme")
    predicted = est.estimate(psi, Layout(ZeroStage.GRADIENTS, offload_optimizer="nvme"), FP32, est.Topology(1)).host_step_rollback_per_rank
    assert predicted == 4 * psi
    assert measured == predicted + 4 * tensors


def test_no_rollback_copies_without_offload(one_rank_path):
    measured, psi, _ = _measured_rollback(2, torch.float32, one_rank_path, offload_optimizer=False)
    layout = Layout(ZeroStage.GRADIENTS, offload_optimizer=False)
    assert measured == 0 == est.estimate(psi, layout, FP32, est.Topology(1)).host_step_rollback_per_rank


# --- the largest model a budget holds ---------------------------------------------------------------


def test_largest_model_exact_on_small_numbers():
    one = est.Topology(1)
    # On the device, fp32 Adam costs 16 B per parameter: 10 parameters in 160 B (and in 175 B).
    assert sizing.largest_model(FP32, one, gpu_memory=175).num_params == 10
    on_device = sizing.largest_model(FP32, one, gpu_memory=160)
    assert (on_device.num_params, on_device.estimate.layout.label) == (10, "ddp")  # the first of equals
    assert "without offload" in on_device.message
    # With a host: zero3 offloading parameters puts nothing on the device and 16 B per parameter on
    # the host, 8 of them pinned: 62 parameters in 1000 B (992 B), 63 would need 1008 B (where the
    # host step keeps no rollback copies).
    offload = sizing.largest_model(FP32, one, gpu_memory=160, host_memory=1000, rollback_copies=False)
    assert offload.num_params == 62
    assert offload.estimate.layout.label == "zero3 + offload optimizer, params"
    assert (offload.estimate.device.total, offload.estimate.host.total, offload.estimate.pinned) == (0, 992, 496)
    # The rollback copies cost 12 B per parameter more: 35 parameters in 980 B ...
    copies = sizing.largest_model(FP32, one, gpu_memory=160, host_memory=1000, layouts=[offload.estimate.layout])
    assert (copies.num_params, copies.estimate.host_during_step, copies.estimate.host_step_rollback) == (35, 980, 420)
    assert "and up to 420 B more for the host step's rollback copies" in copies.message
    # ... so NVMe with the master chunks on disk, whose host step runs after backward and keeps none,
    # holds more: with one bucket (the default 25 MiB holds all of these) its buffers are the whole
    # state, 16 B per parameter, as CPU offload without copies.
    best = sizing.largest_model(FP32, one, gpu_memory=160, host_memory=1000)
    assert (best.num_params, best.estimate.layout.label) == (62, "zero3 + offload optimizer (nvme), params (nvme)")
    # Mixed precision keeps the 2 B half chunk on the device: the device bounds it at 80 B.
    assert sizing.largest_model(MIXED, one, gpu_memory=160, host_memory=1000, rollback_copies=False).num_params == 62
    assert sizing.largest_model(MIXED, one, gpu_memory=100, host_memory=10_000).num_params == 50
    # Two ranks share the sharded terms: each rank's shard is ceil(Ψ/2).
    two = sizing.largest_model(FP32, est.Topology(2), gpu_memory=160, host_memory=1000, rollback_copies=False)
    assert two.num_params == 62  # the host holds both ranks' chunks: 2 x 16 x 31 = 992 B
    assert sizing.largest_model(FP32, one, gpu_memory=15).num_params == 0
    assert sizing.largest_model(FP32, one, gpu_memory=15).estimate is None
    # NVMe, the last resort, wins only when it holds more: at 16 B per parameter, as much as CPU
    # offload without rollback copies, offload keeps it.
    assert sizing.largest_model(FP32, one, 160, 1000, rollback_copies=False).estimate.layout.label == "zero3 + offload optimizer, params"
    # Buckets of 10 parameters and 2 buffers: 8 B per parameter + 160 B on the host, the moments on disk
    # (two slots, 16 B per parameter) ...
    small_buckets = est.NvmeStaging(bucket_bytes=40, buffer_count=2)
    masters_in_host = [layout for layout in LAYOUTS if not layout.params_on_disk]
    bare = sizing.largest_model(FP32, one, 160, 1000, layouts=masters_in_host, nvme=small_buckets, rollback_copies=False)
    assert bare.num_params == 105  # 8 x 105 + 160 = 1000
    assert bare.estimate.layout.label == "zero3 + offload optimizer (nvme), params"
    assert (bare.estimate.host.total, bare.estimate.disk) == (1000, 16 * 105)
    assert "1.68 KB of NVMe per node" in bare.message
    # ... and where the host step during backward keeps the masters' rollback copies, 4 B per parameter
    # more: 12 x 70 + 160 = 1000
    on_disk = sizing.largest_model(FP32, one, gpu_memory=160, host_memory=1000, layouts=masters_in_host, nvme=small_buckets)
    assert (on_disk.num_params, on_disk.estimate.host_during_step, on_disk.estimate.host_step_rollback) == (70, 1000, 280)
    # The master chunks on disk too: 4 B per parameter (the gradient chunk) + 2 buffers of masters
    # (80 B) and of moments (160 B) on the host: 4 x 190 + 240 = 1000; 20 B per parameter on disk.
    everything = sizing.largest_model(FP32, one, gpu_memory=160, host_memory=1000, nvme=small_buckets)
    assert everything.num_params == 190
    assert everything.estimate.layout.label == "zero3 + offload optimizer (nvme), params (nvme)"
    assert (everything.estimate.host.total, everything.estimate.disk) == (1000, 20 * 190)


@pytest.mark.parametrize("scheme", [MIXED, FP32, HALF], ids=lambda s: s.name)
@pytest.mark.parametrize(
    ("devices", "gpu_memory", "host_memory"),
    [(1, 141 * GB, 128 * GB), (1, 80 * GB, None), (8, 80 * GB, 1024 * GB), (4, 24 * GB, 256 * GB), (1, 16 * GB, 2048 * GB)],
)
def test_largest_model_fits_and_one_more_parameter_does_not(scheme, devices, gpu_memory, host_memory):
    topology = est.Topology(devices)
    largest = sizing.largest_model(scheme, topology, gpu_memory, host_memory)
    assert largest.num_params > 10**8
    assert sizing.fits(largest.estimate, gpu_memory, host_memory)
    assert largest.estimate == est.estimate(largest.num_params, largest.estimate.layout, scheme, topology)
    for layout in LAYOUTS:
        if layout.offload_optimizer and host_memory is None:
            continue
        for more in (largest.num_params + 1, int(largest.num_params * 1.01)):
            assert not sizing.fits(est.estimate(more, layout, scheme, topology), gpu_memory, host_memory), layout.label


# --- whole-tensor optimizers --------------------------------------------------------------------------


def gpt_numels(**shape) -> list[int]:
    """Each parameter's size of a real (not meta) GPT, in the order an optimizer over it steps them."""
    from lightning_zero.models import gpt

    return [p.numel() for p in gpt.GPT(gpt.GPTConfig(**shape)).parameters()]


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_whole_tensor_optimizer_state_is_the_owner_plans(ranks):
    """See [Note: whole-tensor optimizer state]: each rank keeps its owned parameters' moments whole
    (the busiest rank under the engine's own plan is priced), and the master chunk stays a chunk."""
    from lightning_zero.engine.optimizer.tensor_owners import plan_owners

    numels = gpt_numels(block_size=64, n_layer=3, n_head=2, n_embd=48)
    psi, owned = sum(numels), est.OwnedParameters(numels)
    busiest = max(plan_owners(numels, ranks).elements_per_rank(numels))
    assert owned.busiest(ranks) == busiest
    shard = est.shard_numel(psi, ranks)
    for scheme in (MIXED, FP32, HALF):
        whole = {e.layout.label: e for e in est.estimate_all(psi, scheme, est.Topology(ranks), owned=owned)}
        chunks = {e.layout.label: e for e in est.estimate_all(psi, scheme, est.Topology(ranks))}
        assert not any("nvme" in label for label in whole)  # NVMe offload refuses whole-tensor optimizers
        assert whole["ddp"] == chunks["ddp"]  # DDP steps every parameter whole anyway
        for label, e in whole.items():
            if label == "ddp":
                continue
            chunk = chunks[label]
            optimizer_state = scheme.master_bytes * shard + scheme.moment_bytes * busiest
            held = e.host_per_rank if e.layout.offload_optimizer else e.device
            chunk_held = chunk.host_per_rank if e.layout.offload_optimizer else chunk.device
            assert held.optimizer_state - chunk_held.optimizer_state == scheme.moment_bytes * (busiest - shard), label
            if not e.layout.offload_optimizer:
                assert e.device.optimizer_state == optimizer_state, label
            # the rest is the chunk path's
            assert (held.parameters, held.gradients) == (chunk_held.parameters, chunk_held.gradients), label
            assert e.pinned_per_rank == chunk.pinned_per_rank, label
            # issue 42's bound: per-rank state ≤ 1.1 × (total / N, the chunk path's, + the largest parameter's)
            bound = chunk_held.optimizer_state + scheme.moment_bytes * max(numels)
            assert chunk_held.optimizer_state <= held.optimizer_state <= 1.1 * bound, label
            # while it steps, the owner holds its parameters' full weights and gradients in the master dtype
            step_bytes = scheme.offload_chunk_bytes if e.layout.offload_optimizer else (4 if scheme.master_bytes else scheme.weight_bytes)
            assert e.step_transient_per_rank == 2 * step_bytes * busiest, label
            assert chunk.step_transient_per_rank == 0
            if e.layout.offload_optimizer:
                # per node: every rank on it is an owner
                assert (e.device_during_step, e.host_during_step) == (e.device.total, e.host.total + ranks * e.step_transient_per_rank)
            else:
                assert (e.device_during_step, e.host_during_step) == (e.device.total + e.step_transient_per_rank, 0)


def test_whole_tensor_optimizer_over_some_parameters():
    """Muon's recipe: the matrices whole on their owners, the rest on the chunk path."""
    from lightning_zero.engine.optimizer.tensor_owners import plan_owners
    from lightning_zero.models import gpt

    model = gpt.GPT(gpt.GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32))
    psi = sum(p.numel() for p in model.parameters())
    matrices = [p.numel() for p in model.parameters() if p.ndim == 2]
    busiest = max(plan_owners(matrices, 4).elements_per_rank(matrices))
    e = est.estimate(psi, Layout(ZeroStage.GRADIENTS), FP32, est.Topology(4), owned=est.OwnedParameters(matrices))
    assert e.device.optimizer_state == 8 * (est.shard_numel(psi - sum(matrices), 4) + busiest)
    assert e.step_transient_per_rank == 2 * 4 * busiest


def test_whole_tensor_optimizer_misuse_is_refused():
    owned = est.OwnedParameters([10, 20])
    with pytest.raises(ValueError, match="exceed the model's 29 parameters"):
        est.estimate(29, Layout(ZeroStage.GRADIENTS), FP32, est.Topology(2), owned=owned)
    with pytest.raises(ValueError, match="nvme"):
        est.estimate(30, Layout(ZeroStage.GRADIENTS, offload_optimizer="nvme"), FP32, est.Topology(2), owned=owned)
    with pytest.raises(ValueError, match="one positive size per parameter"):
        est.OwnedParameters([])


def test_fits_charges_the_owners_step():
    numels = gpt_numels(block_size=64, n_layer=2, n_head=2, n_embd=32)
    owned = est.OwnedParameters(numels)
    zero2 = est.estimate(sum(numels), Layout(ZeroStage.GRADIENTS), FP32, est.Topology(2), owned=owned)
    assert zero2.step_transient_per_rank > 0
    assert sizing.fits(zero2, zero2.device_during_step)
    assert not sizing.fits(zero2, zero2.device_during_step - 1)  # the model states alone would fit


# --- counting parameters on the meta device ---------------------------------------------------------


def test_meta_count_of_example_gpt_matches_the_real_model():
    from lightning_zero.models import gpt

    shape = {"block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32}
    real = gpt.GPT(gpt.GPTConfig(**shape))
    real_count = sum(p.numel() for p in real.parameters())
    # The tied LM head shares the token embedding's tensor: counted once, not twice.
    every_reference = sum(p.numel() for _, p in real.named_parameters(remove_duplicate=False))
    assert every_reference - real_count == 256 * 32

    counted = model_spec.count_parameters(f"{GPT_FILE}:GPT", {"config": shape})
    assert counted == real_count == real.num_parameters()
    as_json = '{"config": {"block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32}}'
    assert model_spec.count_parameters("lightning_zero.models.gpt:GPT", as_json) == real_count


def test_meta_count_allocates_nothing():
    # 10^10 fp32 parameters would need 40 GB if they were real.
    assert model_spec.count_parameters("torch.nn:Linear", {"in_features": 100_000, "out_features": 100_000}) == 10**10 + 10**5
    assert torch.empty(0).device.type == "cpu"  # the meta device context does not leak



@pytest.mark.parametrize(
    ("spec", "init_args", "message"),
    [
        ("torch.nn.Linear", None, "not of the form package.module:Class"),
        ("torch.nn:", None, "not of the form"),
        ("no_such_module_xyz:Net", None, "cannot import module 'no_such_module_xyz'"),
        ("torch.nn:NoSuchLayer", None, "has no attribute 'NoSuchLayer'"),
        ("missing/file.py:Net", None, "does not exist"),
        ("torch.nn:Linear", '{"in_features": 3', "not valid JSON"),
        ("torch.nn:Linear", "[3, 4]", "must be a JSON object"),
        ("torch.nn:Linear", '{"in_features": 3, "out_feat": 4}', "unexpected keyword argument 'out_feat'"),
        ("torch:float32", None, "not a class"),
    ],
)
def test_bad_model_specs_say_what_is_wrong(spec, init_args, message):
    with pytest.raises(model_spec.ModelSpecError, match=message):
        model_spec.count_parameters(spec, init_args)


# --- the command line -------------------------------------------------------------------------------


def test_cli_plain_output_has_the_figures(capsys):
    assert main(["estimate", "--params", "7.5e9", "--devices", "8", "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # not a terminal: no rich styling
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()}
    assert rows["ddp"][1] == "120.000"
    assert rows["zero1"][1] == "41.250"
    assert rows["zero2"][1] == "28.125"
    assert rows["zero3"][1] == "15.000"
    assert "Recommended for 80 GB per device: zero1" in out
    # 16 B per parameter on 8 devices: 40B parameters in 80 GB each, as ddp would fit 5B.
    assert "Largest model for 80 GB per device without offload" in out
    assert "40,000,000,000 parameters (40B), as zero3: 80 GB per device" in out
    assert "activations and the terms left out reduce it" in out


def test_cli_states_host_and_pinned_memory(capsys):
    argv = ["estimate", "--params", "1.2e9", "--devices", "1", "--precision", "fp32"]
    assert main(argv + ["--gpu-memory", "141GB", "--host-memory", "128GB"]) == 0
    out = capsys.readouterr().out
    assert "host per node (GB)" in out and "of which pinned" in out
    assert "nvme per node (GB)" in out
    assert "+ rollback per node (GB)" in out and "to undo a step that clipping or a hook" in out
    rows = {line.split("  ")[0].strip(): line.split()[-10:] for line in out.splitlines()}
    # per device, weights, gradients, optimizer, devices per node, host per node, of which pinned,
    # + rollback, nvme, fits
    assert rows["zero3"] == ["19.200", "4.800", "4.800", "9.600", "19.200", "0.000", "0.000", "-", "-", "yes"]
    # 1.2B fp32 parameters offloaded: 4 B master + 4 B gradient (pinned) + 8 B moments on the host,
    # and the host step's rollback copies of the master and the moments, 12 B, beside them.
    offload = ["0.000", "0.000", "0.000", "0.000", "0.000", "19.200", "9.600", "14.400", "-", "yes"]
    assert rows["zero3 + offload optimizer, params"] == offload
    # NVMe: the chunks stay, the moments go to disk (two slots: 16 B per parameter), 4 buffers of
    # 6,553,600 x 8 B (0.21 GB) stay too, and the host step during backward copies the masters (4 B).
    on_disk = ["0.000", "0.000", "0.000", "0.000", "0.000", "9.810", "9.600", "4.800", "19.200", "yes"]
    assert rows["zero3 + offload optimizer (nvme), params"] == on_disk
    # The master chunks on disk too: the host keeps the gradient chunk (4 B) and 4 buckets of
    # masters (0.105 GB) and of moments (0.21 GB); 20 B per parameter on disk (the moments' two slots).
    everything = ["0.000", "0.000", "0.000", "0.000", "0.000", "5.115", "4.905", "-", "24.000", "yes"]
    assert rows["zero3 + offload optimizer (nvme), params (nvme)"] == everything
    # The host holds 16 B per parameter with CPU offload and the device 141 GB / 16 = 8.8B; with
    # the moments on NVMe 8 B per parameter, with the masters too 4 B (and 0.31 GB of buffers):
    # (128 GB - 0.31 GB) / 4, all of it on the host.
    assert "128 GB of host memory per node: 31,921,356,800 parameters (31.9B), as zero3 + offload optimizer (nvme), params (nvme):" in out
    assert "and 638.427 GB of NVMe per node" in out
    # Smaller buckets and fewer buffers: 2 x 8 B x 2,621,440 (10 MiB of fp32 weights) = 0.042 GB.
    assert main(argv + ["--gpu-memory", "141GB", "--host-memory", "128GB", "--bucket-size-mb", "10", "--nvme-buffer-count", "2"]) == 0
    rows = {line.split("  ")[0].strip(): line.split()[-10:] for line in capsys.readouterr().out.splitlines()}
    assert rows["zero3 + offload optimizer (nvme), params"][5] == "9.642"


def test_cli_prices_hybrid_sharding_per_device_and_per_node(capsys):
    # 8 nodes x 8 devices, sharded within a node: each term is divided by 8 (the node), not by 64
    argv = ["estimate", "--params", "64e9", "--devices", "8", "--nodes", "8", "--precision", "fp32"]
    assert main(argv + ["--shard-group-size", "node"]) == 0
    out = capsys.readouterr().out
    assert "sharded within groups of 8 and replicated across 8" in out
    rows = {line.split("  ")[0].strip(): line.split()[-9:] for line in out.splitlines()}
    # per device, weights, gradients, optimizer, devices per node, host per node, of which pinned,
    # + rollback, nvme
    assert rows["zero3"] == ["0.128", "0.032", "0.032", "0.064", "1.024", "0.000", "0.000", "-", "-"]  # TB
    # CPU offload's rollback copies: 12 B per parameter over the group of 8, for the node's 8 ranks
    assert rows["zero3 + offload optimizer"][-2] == "0.768"
    # NVMe: two slots of 8 B per parameter over the group of 8, for each of the node's 8 ranks: 64e9 x 16 B
    assert rows["zero3 + offload optimizer (nvme), params"][-1] == "1.024"
    assert main(argv + ["--shard-group-size", "16"]) == 0
    assert "groups of 16 and replicated across 4" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(argv + ["--shard-group-size", "3"])
    assert "must divide the world size" in capsys.readouterr().err


def test_cli_no_rollback_leaves_the_copies_out(capsys):
    # 7.5B mixed-precision parameters on 8 devices, 10 GB each: CPU offload needs 120 GB of host
    # memory, and its host step's rollback copies up to 90 GB more (12 B per parameter)
    argv = ["estimate", "--params", "7.5e9", "--devices", "8", "--gpu-memory", "10GB", "--host-memory", "128GB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()}
    # ..., host per node, of which pinned, + rollback, nvme, fits
    assert rows["zero3 + offload optimizer"][-5:] == ["120.000", "60.000", "90.000", "-", "no"]  # GB
    assert "Recommended for 10 GB per device and 128 GB of host memory per node: zero3 + offload optimizer (nvme)" in out
    assert main(argv + ["--no-rollback"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()}
    assert rows["zero3 + offload optimizer"][-5:] == ["120.000", "60.000", "-", "-", "yes"]
    assert "Recommended for 10 GB per device and 128 GB of host memory per node: zero3 + offload optimizer," in out
    assert "not counted (--no-rollback)" in out


def test_cli_counts_a_model(capsys):
    init_args = '{"config": {"n_layer": 1, "n_embd": 32, "n_head": 2}}'
    args = ["estimate", "--model", f"{GPT_FILE}:GPT", "--init-args", init_args]
    assert main(args + ["--devices", "2", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    expected = model_spec.count_parameters(f"{GPT_FILE}:GPT", {"config": {"n_layer": 1, "n_embd": 32, "n_head": 2}})
    assert f"Model states of {expected:,} parameters, precision fp32" in out


def test_cli_prices_a_whole_tensor_optimizer(capsys):
    from lightning_zero.engine.optimizer.tensor_owners import plan_owners

    shape = {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32}
    numels = gpt_numels(**shape)
    busiest = max(plan_owners(numels, 2).elements_per_rank(numels))
    args = ["estimate", "--model", f"{GPT_FILE}:GPT", "--init-args", json.dumps({"config": shape}), "--devices", "2"]
    assert main(args + ["--precision", "fp32", "--whole-tensor-optimizer", "--gpu-memory", "1GB"]) == 0
    out = capsys.readouterr().out
    assert f"the busiest owning {busiest:,} elements" in out and f"largest parameter {max(numels):,}" in out
    assert "+ owner's step (MB)" in out
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()}
    assert "zero3 + offload optimizer, params" in rows and not any("(nvme)" in label for label in rows)
    # per device, weights, gradients, optimizer, ..., + owner's step, fits
    assert float(rows["zero2"][4]) == pytest.approx(8 * busiest / 1e6, abs=5e-4)
    assert float(rows["zero2"][-2]) == pytest.approx(2 * 4 * busiest / 1e6, abs=5e-4)
    assert rows["ddp"][-2] == "-"
    assert "Largest model: not searched for a whole-tensor optimizer" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--params", "7e9", "--devices", "8", "--whole-tensor-optimizer"], "--whole-tensor-optimizer needs --model"),
        (["--params", "lots", "--devices", "8"], "expected a positive whole number such as"),
        (["--params", "1.5", "--devices", "8"], "not a whole number of parameters"),
        (["--params", "7e9", "--devices", "0"], "not a positive whole number"),
        (["--params", "7e9", "--devices", "8", "--gpu-memory", "80XB"], "units B, KB, MB, GB"),
        (["--params", "7e9", "--devices", "8", "--precision", "fp16"], "choose from 'mixed', 'fp32', 'half'"),
        (["--devices", "8"], "one of the arguments --params --model is required"),
        (["--params", "7e9", "--model", "a:B", "--devices", "8"], "not allowed with argument"),
        (["--params", "7e9", "--init-args", "{}", "--devices", "8"], "--init-args needs --model"),
        (["--model", "no_such_module_xyz:Net", "--devices", "8"], "cannot import module"),
        (["--model", "torch.nn:Linear", "--init-args", "{oops", "--devices", "8"], "not valid JSON"),
        (["--params", "7e9", "--devices", "8", "--nvme-buffer-count", "1"], "at least 2"),
        (["--params", "7e9", "--devices", "8", "--bucket-size-mb", "0"], "--bucket-size-mb"),
    ],
)
def test_cli_bad_input_exits_2_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: lightning-zero estimate" in err
    assert message in err


def test_argument_parsers():
    assert parse_count("7.24e9") == 7_240_000_000
    assert parse_count("7.5B") == parse_count("7_500_000_000") == 7_500_000_000
    assert parse_count("125M") == 125_000_000
    assert parse_memory("80") == parse_memory("80GB") == parse_memory("80 gb") == 80 * GB
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("512MB") == 512 * 10**6


def test_python_dash_m_piped_output():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "lightning_zero", "estimate", "--params", "7e9", "--devices", "8"]
        + ["--precision", "fp32"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "112.000" in result.stdout and "\x1b[" not in result.stdout
