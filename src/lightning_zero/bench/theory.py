"""The floors a variant is measured against: the ZeRO paper's model-state and communication volumes.

Model states per rank (Rajbhandari et al., 2020, section 5 and figure 1), with Ψ parameters, N ranks
and w + g + o bytes per parameter for weights, gradients and optimizer state:

    DDP (stage 0)  (w+g+o)Ψ              mixed-precision Adam (2+2+12): 16Ψ      fp32 Adam (4+4+8): 16Ψ
    stage 1        (w+g)Ψ + oΨ/N                                        4Ψ+12Ψ/N                   8Ψ+8Ψ/N
    stage 2        wΨ + (g+o)Ψ/N                                        2Ψ+14Ψ/N                   4Ψ+12Ψ/N
    stage 3        (w+g+o)Ψ/N                                           16Ψ/N                      16Ψ/N

The arithmetic is `lightning_zero.estimate`'s (the `estimate` subcommand), so the benchmark and the
estimate cannot disagree. The benchmark trains in fp32 or Lightning-style bf16-mixed (autocast, with
fp32 weights, gradients and moments), so its floors use the fp32-Adam column; the paper's
mixed-precision column is reported beside it for reference.

Communication per step and rank, in bytes of the gradient dtype b (4 for both precisions here):
DDP and stages 1-2 move 2Ψ·b·(N-1)/N (a ring all-reduce = reduce-scatter + all-gather, each
(N-1)/N of the buffer); stage 3 moves 3Ψ·b·(N-1)/N (parameters are gathered twice, for forward and
for backward, plus the gradient reduce-scatter). The (N-1)/N factor is the share of a buffer a rank
receives in a ring collective; `comm.py` counts measured bytes the same way.

The ownership path (`zero2_whole`, `zero3_whole`: a whole-tensor optimizer, here AdamW's arithmetic
in `OwnedAdamW`) keeps each parameter's moments whole on its owner (`OwnedParameters`, the
estimator's [Note: whole-tensor optimizer state]) and adds, per step and dtype, two all-to-alls in
(every rank's gradient and weight chunks to the owners) and one out (the owners' updates to every
rank's chunk): `owner_exchange_bytes`, exact from the engine's owner plan and chunk layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional, Sequence

from torch import nn

from lightning_zero import estimate as est
from lightning_zero.bench.links import INTER, INTRA, link_of
from lightning_zero.bench.variants import VariantSpec, ZeroPlusPlus
from lightning_zero.engine import ZeroStage
from lightning_zero.engine.comm.quantization import FORMATS
from lightning_zero.engine.parameters.unit_plan import plan_units
from lightning_zero.engine.zero_plus_plus import NodeLayout, gradient_format, resolve_secondary_shard_size, weight_format
from lightning_zero.engine.optimizer.tensor_owners import plan_owners
from lightning_zero.engine.shards.partition import ChunkLayout
from lightning_zero.estimate_schemes import SCHEMES, Layout, PrecisionScheme

MODEL_STATE_RELATIVE_TOLERANCE = 0.05
"""Issue 8's target: measured model-state bytes within 5% of the floor, plus one unit (below)."""

COMM_RELATIVE_TOLERANCE = 0.01
"""Issue 8's target: measured communication bytes within 1% of the floor. What is left over is
per-parameter padding of shards (at most N-1 elements each) and small control tensors."""

BENCH_SCHEME = SCHEMES["fp32"]
"""Bytes per parameter of what the benchmark holds: fp32 weights and gradients and Adam's two fp32
moments, for `fp32` and for `bf16-mixed` alike (autocast casts activations, not model states)."""

PAPER_SCHEME = SCHEMES["mixed"]
"""The paper's mixed-precision Adam (2 + 2 + 12 bytes), reported for reference only."""


@dataclass(frozen=True)
class StateFloor:
    """The theoretical model-state bytes one rank holds, by kind and by where they live."""

    parameters: int
    """Weights (this rank's shard at stage 3)."""
    gradients: int
    """Gradients (this rank's shard from stage 2)."""
    optimizer_state: int
    """Adam's moments (and, in mixed precision, the fp32 master weights)."""
    offloaded: int
    """The part of the three terms above that lives in host memory with CPU offload (0 without)."""
    on_disk: int = 0
    """With NVMe offload: the optimizer state in files, in none of the terms above (the host's
    staging buffers are in `optimizer_state`)."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def model_state_floor(
    num_params: int,
    world_size: int,
    stage: int,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    scheme: PrecisionScheme = BENCH_SCHEME,
    nvme: est.NvmeStaging = est.NvmeStaging(),
    owned: Optional[est.OwnedParameters] = None,
) -> StateFloor:
    """Per-rank model-state floor of Ψ = `num_params` parameters sharded at `stage` (0 = DDP);
    `offload_optimizer` may be "nvme" (its host buffers sized by `nvme`), and so may `offload_params`:
    the estimator then prices the master chunks read in while the optimizer streams, but the bench
    measures between uses (after a phase of the step), where none is in memory, so they are left out.
    `owned`: the parameters a whole-tensor optimizer steps on owner ranks (the busiest rank's state)."""
    layout = Layout(ZeroStage(stage), offload_optimizer=offload_optimizer, offload_params=offload_params)
    topology = est.Topology(devices=world_size)
    estimate = est.estimate(num_params, layout, scheme, topology, nvme, owned)
    device, host = estimate.device, estimate.host_per_rank
    window = nvme.chunk_window_bytes(num_params, scheme, topology.sharding_ranks) if layout.params_on_disk else 0
    in_parameters = window if host.parameters else 0  # fp32: the master is the weight's only copy
    return StateFloor(
        parameters=device.parameters + host.parameters - in_parameters,
        gradients=device.gradients + host.gradients,
        optimizer_state=device.optimizer_state + host.optimizer_state - (window - in_parameters),
        offloaded=host.total - window,
        on_disk=estimate.disk_per_rank,
    )


def nvme_staging(stage: int, unit_bytes: int, scheme: PrecisionScheme = BENCH_SCHEME) -> est.NvmeStaging:
    """The engine's NVMe buffers for the benchmark's GPT: at stage 3 a bucket is a unit, so the
    largest one (`largest_unit_bytes`, fp32) sizes them, in `scheme`'s weight bytes; at stages 1-2
    the engine's default bucket."""
    if stage != 3:
        return est.NvmeStaging()
    return est.NvmeStaging(bucket_bytes=max(1, unit_bytes // BENCH_SCHEME.weight_bytes * scheme.weight_bytes))


def communication_volume(stage: int) -> int:
    """Floor of the bytes moved per step, in units of Ψ·b·(N-1)/N: 2 up to stage 2, 3 at stage 3."""
    return 3 if stage == 3 else 2


def communication_floor(num_params: int, world_size: int, stage: int, element_bytes: int = 4) -> float:
    """Bytes one rank receives per step at the floor: `communication_volume(stage)`·Ψ·b·(N-1)/N."""
    share = Fraction(world_size - 1, world_size)
    return float(communication_volume(stage) * num_params * element_bytes * share)


def owner_exchange_bytes(numels: Sequence[int], world_size: int, element_bytes: int = 4) -> list[int]:
    """Full-buffer bytes (what each all-to-all sends, its input, as `comm.py` counts it) of one step's
    owner exchange on each rank, for parameters of `numels` elements in the optimizer's order, all in
    one dtype of `element_bytes`: the gradient and the weight chunks in, C_r elements each (rank r's
    chunks of every parameter, `ChunkLayout`), and the updates out, L_r elements (the parameters r
    owns, whole, `plan_owners`): b·(2·C_r + L_r), about 3Ψ'b/N. Of them a rank keeps its own
    pieces, so what crosses the wire is the ring convention's (N-1)/N of it on average."""
    owned = plan_owners(numels, world_size).elements_per_rank(numels)
    chunks = [sum(ChunkLayout(n, world_size).owned_numel(rank) for n in numels) for rank in range(world_size)]
    return [element_bytes * (2 * chunks[rank] + owned[rank]) for rank in range(world_size)]


def traffic_by_group(num_params: int, stage: int, shard_group_size: int, element_bytes: int = 4) -> dict[str, float]:
    """Full-buffer bytes of one step's collectives per rank under hybrid sharding (what the engine
    counts: an all-gather's output, a reduce-scatter's input, an all-reduce's tensor). Within a shard
    group, the stage's usual volume, `communication_volume(stage)`·Ψ·b (stage 3 gathers its root unit
    once per step, so it measures a little less); across groups, only the all-reduce of each rank's
    reduced gradient chunk, Ψ·b/K."""
    return {
        "within": float(communication_volume(stage) * num_params * element_bytes),
        "across": num_params * element_bytes / shard_group_size,
    }


def unit_rows(model: nn.Module, unit_class: type[nn.Module], world_size: int) -> list[int]:
    """Each stage-3 unit's row S = Σ ceil(numel / N) over its parameters ([Note: chunk layout] in
    `engine/shards/partition.py`): the elements of one rank's row of the unit's (N, S) buffer, the
    root unit first (`plan_units`' order). The benchmark's units hold fp32 trainable parameters
    only, so each unit is one bucket; works on a meta model."""
    named = dict(model.named_parameters())
    plans = plan_units(model, unit_classes=(unit_class.__name__,))
    return [sum(ChunkLayout(named[name].numel(), world_size).padded_chunk_numel for name in plan.param_names) for plan in plans]


def link_bytes(
    rows: Sequence[int],
    world_size: int,
    ranks_per_node: int,
    options: Optional[ZeroPlusPlus] = None,
    element_bytes: int = 4,
) -> dict[str, dict[str, float]]:
    """Full-buffer bytes one rank's stage-3 step moves, by category and link ([Note: bytes per link]
    in `links.py`), for units of `rows` (`unit_rows`, the root first) on N = `world_size` ranks in
    nodes of P = `ranks_per_node`, with ZeRO++'s `options` (None: plain zero3), in the bytes a
    quantized row packs into (`FORMATS[...].packed_bytes(S)`: fp32 scales, codes, padding):

    * forward all-gather, every unit, all ranks: N·S·b, with qwZ N·packed(S);
    * backward all-gather, every unit but the root (gathered once per step, kept through backward):
      the same over all ranks (qwZ gathers its quantized rows again), or with hpZ N·S·b of the
      dequantized weights among K consecutive ranks, intra-node where K ≤ P;
    * gradients: a reduce-scatter over all ranks, N·S·b; with qgZ two all-to-alls of quantized rows,
      N·packed(S) within the node, then M·packed(S) (the node's reduced N/P = M rows) across nodes.

    b = `element_bytes`, the parameters' and gradients' (fp32 in the benchmark, in both precisions)."""
    options = options or ZeroPlusPlus()
    n, p = world_size, ranks_per_node
    layout = NodeLayout(n, p)
    world_link = link_of(range(n), p)
    weights, gradients = weight_format(options.quantize_weights), gradient_format(options.quantize_gradients)
    k = resolve_secondary_shard_size(options.secondary_shard_size, layout)

    def gathered(s: int) -> int:
        return n * FORMATS[weights].packed_bytes(s) if weights else n * s * element_bytes

    out: dict[str, dict[str, float]] = {}

    def add(category: str, link: str, nbytes: float) -> None:
        out.setdefault(category, {INTRA: 0.0, INTER: 0.0})[link] += nbytes

    for index, s in enumerate(rows):
        add("all_gather forward", world_link, gathered(s))
        if index > 0:  # the root unit stays gathered from its forward to its backward
            if k is not None:
                add("all_gather backward", link_of(range(k), p), n * s * element_bytes)
            else:
                add("all_gather backward", world_link, gathered(s))
        if gradients:
            packed = FORMATS[gradients].packed_bytes(s)
            add("all_to_all", INTRA, n * packed)
            if layout.nodes > 1:
                add("all_to_all", INTER, layout.nodes * packed)
        else:
            add("reduce_scatter", world_link, n * s * element_bytes)
    return out


def largest_unit_bytes(model: nn.Module, unit_class: type[nn.Module]) -> int:
    """Bytes of the largest unit's own parameters: the biggest `unit_class` instance, or what the
    root keeps outside all of them (embeddings, final norm). A stage-3 rank holds one or two such
    units gathered on top of its shards, which is the "plus one unit" of the tolerance below."""
    units = [m for m in model.modules() if isinstance(m, unit_class)]
    in_units = {id(p) for m in units for p in m.parameters()}
    sizes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in units]
    sizes.append(sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_units))
    return max(sizes)


def model_state_tolerance(floor_bytes: int, unit_bytes: int) -> int:
    """How far measured model-state bytes may be from `floor_bytes` and still meet issue 8's target:
    5% of the floor plus one unit (see `largest_unit_bytes`)."""
    return int(MODEL_STATE_RELATIVE_TOLERANCE * floor_bytes) + unit_bytes


@dataclass(frozen=True)
class VariantTheory:
    """Everything a variant's measurements are compared with."""

    model_state: StateFloor
    """Per-rank model-state floor at the variant's stage (fp32 Adam, see `BENCH_SCHEME`)."""
    model_state_tolerance_bytes: int
    """`model_state_tolerance`: how far the measurement may be from the floor."""
    paper_mixed_precision_bytes: int
    """The same floor for the paper's mixed-precision Adam (16Ψ at stage 0), for reference."""
    comm_volume_psi: int
    """2 or 3: the floor of bytes moved per step in units of Ψ·b·(N-1)/N."""
    comm_bytes_per_step: float
    """`communication_floor`: bytes one rank receives per step (with the ownership path, plus
    `owner_exchange_bytes_per_step`)."""
    owner_exchange_bytes_per_step: float = 0.0
    """The ownership path (`whole_tensor` variants): its all-to-alls' bytes on the busiest rank, in
    `comm.py`'s ring convention, (N-1)/N of `owner_exchange_bytes`; 0 on the chunk path."""
    optimizer_state_bound_bytes: int = 0
    """The ownership path: issue 42's bound on a rank's optimizer state, 1.1 × (the whole state / N
    + the largest parameter's state); 0 on the chunk path."""
    link_bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    """Ours at stage 3, with `--nodes`: `link_bytes`, the full-buffer bytes per step by category and
    link; empty otherwise."""


def variant_theory(
    spec: VariantSpec,
    num_params: int,
    world_size: int,
    unit_bytes: int,
    shard_group_size: Optional[int] = None,
    param_numels: Sequence[int] = (),
    rows: Sequence[int] = (),
    ranks_per_node: Optional[int] = None,
) -> VariantTheory:
    """The floors for `spec` on Ψ = `num_params` parameters and N = `world_size` ranks; `unit_bytes`
    is `largest_unit_bytes` of the model; `param_numels`, each parameter's size in the optimizer's
    order, prices the ownership path (`whole_tensor` variants need it). With hybrid sharding
    (`shard_group_size`, our variants only) states are sharded over K ranks, and the traffic is
    compared by group instead (`traffic_by_group`), so the flat communication floor is left out (0).
    With `ranks_per_node` (`--nodes`) and the units' `rows`, our stage-3 variants' bytes per link
    (`link_bytes`) are priced too."""
    hybrid = spec.is_ours and shard_group_size is not None and shard_group_size < world_size
    sharding_ranks = shard_group_size if hybrid else world_size
    owned = None
    if spec.whole_tensor:
        if sum(param_numels) != num_params:
            raise ValueError(f"{spec.name} needs each parameter's size (param_numels), summing to {num_params:,}")
        owned = est.OwnedParameters(param_numels)
    offload = (spec.offload_optimizer, spec.offload_params)
    floor = model_state_floor(num_params, sharding_ranks, spec.stage, *offload, nvme=nvme_staging(spec.stage, unit_bytes), owned=owned)
    paper = model_state_floor(
        num_params, sharding_ranks, spec.stage, *offload, PAPER_SCHEME, nvme_staging(spec.stage, unit_bytes, PAPER_SCHEME), owned
    )
    exchange = 0.0
    if owned is not None and not hybrid:
        share = Fraction(world_size - 1, world_size)
        exchange = float(share * max(owner_exchange_bytes(param_numels, world_size, BENCH_SCHEME.weight_bytes)))
    by_link: dict[str, dict[str, float]] = {}
    if spec.is_ours and spec.stage == 3 and rows and ranks_per_node is not None and not hybrid and not spec.whole_tensor:
        by_link = link_bytes(rows, world_size, ranks_per_node, spec.zero_plus_plus, BENCH_SCHEME.weight_bytes)
    comm = 0.0 if hybrid else communication_floor(num_params, world_size, spec.stage, BENCH_SCHEME.gradient_bytes) + exchange
    return VariantTheory(
        model_state=floor,
        model_state_tolerance_bytes=model_state_tolerance(floor.total, unit_bytes),
        paper_mixed_precision_bytes=paper.total,
        comm_volume_psi=communication_volume(spec.stage),
        comm_bytes_per_step=comm,
        owner_exchange_bytes_per_step=exchange,
        optimizer_state_bound_bytes=0 if owned is None else int(1.1 * optimizer_state_bound(owned, sharding_ranks)),
        link_bytes=by_link,
    )


def optimizer_state_bound(owned: est.OwnedParameters, world_size: int, scheme: PrecisionScheme = BENCH_SCHEME) -> float:
    """The whole optimizer state over N ranks plus the largest owned parameter's: what issue 42 holds a
    rank's optimizer state to (within 10%) on the ownership path."""
    return scheme.optimizer_bytes * owned.total / world_size + scheme.moment_bytes * owned.largest
