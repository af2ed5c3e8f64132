"""How many bytes of model states DDP and ZeRO stages 1-3 keep per device and per host.

Choosing a stage is a trade: every stage shards more, stage 3 moves 1.5x the bytes of stages 1-2 per
step (3Ψ against 2Ψ), and CPU offload moves the optimizer step onto the host. So the first question
is which is the cheapest layout whose model states fit, and it can be answered with arithmetic alone:
this module is the ZeRO paper's accounting (Rajbhandari et al., 2020, section 3 and figure 1). The
number of parameters it starts from comes from the user or from `lightning_zero.cli.model_spec`,
which builds a model on the meta device, so nothing is allocated. Stages and the bytes of each kind
are the engine's own types (`ZeroStage`, `StateBytes`), so a measurement and its estimate compare
field by field. The precision schemes and layouts it is given are `lightning_zero.estimate_schemes`'.

[Note: what the estimate leaves out]
Model states only: weights, gradients and optimizer states. A real run also needs
- activations (often the largest term; they scale with batch size x sequence length and are what
  activation checkpointing trades for compute),
- stage 3's gathered units: each unit's full weights (and, in backward, full gradients) while it
  runs, plus the next unit's when prefetching,
- communication buckets (flat gather / reduce-scatter buffers, a few bucket sizes per rank),
- stage 3's reads of parameters at rest (``w.clone()`` between steps, ``torch.save(model)``): each
  holds that one parameter's full value while it runs, and whatever the code keeps of it after
  (see [Note: reads at rest] in ``engine/shards/at_rest.py``),
- the caching allocator's fragmentation and the CUDA context (roughly 0.5-1 GB per device),
- per-parameter padding of shards (at most N-1 elements per parameter, see `shard_numel`),
- frozen parameters not given as `frozen_params`, which are then counted as if trained (an upper
  bound: they have no gradients and no optimizer state),
- on the host, with offload: torch's caching host allocator rounds every pinned buffer (one per
  bucket or unit and kind) up to a power of two, up to twice the pinned figure; a second pinned
  gradient buffer per bucket while gradients accumulate over micro-batches (or when
  `zero_grad(set_to_none=False)` keeps them); Adam's step counters; and the process itself (Python,
  the CUDA context's host side, data loading).
Keep a margin between the estimate and the device's capacity for all of these.

[Note: offloaded state]
With `offload_optimizer`, each rank keeps in host memory, per parameter and for its chunk (Ψ/N):
- the master chunk the CPU optimizer steps, in the master dtype (fp32 for half-precision weights,
  else the weights' own dtype: 4 B in every scheme here), pinned;
- the gradient chunk, in the same dtype, pinned and kept between steps (each bucket's reduced
  gradients land there during backward);
- the optimizer's own state (Adam: two fp32 moments, 8 B), allocated by the optimizer and not
  pinned, since it never crosses the bus.
Pinned means page-locked: copies to and from the device run asynchronously at the bus's speed, and
the operating system can never swap or reclaim it. The pinned figure is for CUDA machines; on a
CPU-only one the same bytes are plain memory.
What stays on the device: the weights (full at stages 1-2; at stage 3 the chunk the all-gather
sends, in the weights' dtype) and, at stage 1, the full gradients. Stage 3 with `offload_params` and
trained half-precision weights still keeps the half chunk on the device (the cast happens there);
with fp32 weights, and for frozen weights in any dtype, the host's chunk is the only copy of the
weight (counted as parameters, as `memory_report()` does): fp32 weights leave no model state on the
device at all.
With `overlap_host_step` (the engine's default, CPU offload only) each bucket steps during backward,
before anything after backward (clipping by norm, a hook that edits gradients or the learning rate)
can change the step; to undo such a step bit for bit the engine keeps rollback copies of each
bucket's master chunk and optimizer state (see [Note: the host step during backward] in
``engine/offload/step_ahead.py``): (`offload_chunk_bytes` + `moment_bytes`)·S per rank, 12 B per
parameter / N with Adam, in ordinary memory (not pinned), allocated at the first step and kept
(`MemoryEstimate.host_step_rollback_per_rank`; `memory_report().host_step_rollback` measures the same
plus Adam's step counters). Whether they are kept depends on the training code, not on the layout:
a plain engine loop and Fabric keep them, the Lightning Trainer only with gradient clipping or a hook
between backward and the step, and nothing keeps them with `overlap_host_step=False`, NVMe offload,
several optimizers or a whole-tensor optimizer (those steps wait for backward). So they are a
figure of their own, in no total, which `sizing.fits` charges as an upper bound unless
`estimate(..., rollback_copies=False)`.

[Note: optimizer state on NVMe]
With `offload_optimizer="nvme"` the engine keeps the same master and gradient chunks in host memory
(the master chunk is what the step updates and, at stage 3, what the all-gather sends), and moves
only the optimizer's own per-element state (Adam's moments, `moment_bytes`) to files on a local disk.
That state is stepped one bucket at a time through `buffer_count` host buffers (not pinned), each the
size of the largest bucket's state. So, per rank, with S = Ψ/N (the shard):
- host: master chunk + gradient chunk (`offload_chunk_bytes`·S each, pinned, as with CPU offload)
  + staging = min(buffer_count, buckets) · `moment_bytes` · ⌈P/N⌉, where P = the largest bucket's
  parameters (its bytes / `weight_bytes`, at most Ψ) and buckets = ⌈Ψ/P⌉;
- NVMe: `STATE_SLOTS`·`moment_bytes`·S (16 B per parameter and rank for Adam's fp32 moments: each
  bucket's file holds the state of the last committed step and a slot the next step writes to, so
  a step taken during backward and undone leaves the committed one on disk; entries are padded to
  64 bytes in the files, ignored here).
P is `NvmeStaging.bucket_bytes`: the engine's `bucket_size_mb` (25 MiB) at stages 1-2, where a
parameter larger than that is a bucket of its own; at stage 3 a bucket is a unit's parameters (one
transformer block, or the root unit with the embeddings), so give the largest unit's size there.
With `offload_params="nvme"` too (stage 3, ZeRO-Infinity's layout) the master chunk moves to the
files as well (NVMe: + `offload_chunk_bytes`·S, so 12 B/parameter/N with Adam), and the host keeps of
it only the buckets read in at a time: min(buffer_count, buckets) · `offload_chunk_bytes` · ⌈P/N⌉
(the optimizer's stream; the gathers read `prefetch_units` + 1 units ahead). The gradient chunk stays
in host memory.

[Note: frozen parameters]
Of the Ψ parameters, `frozen_params` (Ψ_f) require no gradient (a fine-tuned model's frozen base):
no optimizer holds them, so they have no gradients and no optimizer state, and only their weights
cost memory: at stages 1-2 every rank holds them whole on its device (w·Ψ_f: they are in no
optimizer, so in no shard), at stage 3 one chunk each, w·Ψ_f/N in the weights' own dtype (a frozen
half-precision weight has no fp32 master: 2 B per element / N for a bf16 base, see [Note: frozen
chunks] in ``engine/shards/sharded_param.py``). With `offload_params` that chunk is on the host,
its only copy (the device keeps none; with `offload_params="nvme"` it is in the file between uses);
with only the optimizer offloaded it stays on the device, its only copy (no host step reads it).
Gradients and optimizer state are priced on the trainable Ψ - Ψ_f only. `memory_report()` counts the
same bytes (its `frozen_parameters`).
At stage 3, `keep_frozen_units_mb` keeps the full weights of all-frozen units gathered from their
first forward in a step until its optimizer step: at most min(budget, w·Ψ_f) more on each device
during forward and backward, freed before the optimizer step (`MemoryEstimate.kept_frozen_units_per_rank`,
in no total, charged by `sizing.fits`; `memory_report().kept_frozen_units` measures it mid-step).

[Note: secondary shards priced]
hpZ (`secondary_shard_size=K`, stage 3) keeps each rank's 1/K of every unit's gathered weights from
its training forward to its backward, in the weights' dtype: all units' at once between the
forward and the backward, w·Ψ/K per device (w·⌈Ψ/N⌉·N/K, the padded shard's rows), 2Ψ/K bytes in
half precision (`MemoryEstimate.secondary_shards_per_rank`). Freed by the end of backward, so in no
total, as the kept frozen units; charged by `sizing.fits` through `device_during_backward`.
`memory_report().secondary_shards` measures it between forward and backward. hpZ refuses
`offload_params` (it exists to keep those weights off the device), so those rows price none.

[Note: whole-tensor optimizer state]
An optimizer that looks across whole tensors (Muon, Adafactor, LAMB, SOAP, any class the engine does
not know; see docs/optimizers.md) steps each of its parameters whole on one owner rank
(`engine/optimizer/tensor_owners.py`), which keeps that parameter's optimizer state full-shaped.
The owners are balanced by size, largest parameter first, and every rank computes the same plan
from the parameters' sizes alone, so the estimate runs the engine's `plan_owners` on them
(`OwnedParameters`): per rank, the moments (`moment_bytes`) of the elements it owns, at most
Ψ'/N plus the largest parameter's (Ψ' the elements stepped this way), instead of its Ψ'/N chunk;
the busiest rank is priced. The master chunk, where there is one, stays a chunk
(`master_bytes`·S), as do weights and gradients. During the step the owner also holds the full
weight and gradient of every parameter it owns, in the master dtype (fp32 with a master copy, else
the weights'; the host's `offload_chunk_bytes` with offload), on the device, or on the host with
offload: `MemoryEstimate.step_transient_per_rank`, 2 · that dtype's bytes · its owned elements,
in no total (it is gone after the step, as activations are before it) but charged by `sizing.fits`
(the exchange's receive buffer adds one dtype's owned elements more for an instant). Stage 0 (DDP)
holds everything anyway, and NVMe offload refuses whole-tensor optimizers, so `estimate_all`
leaves those layouts out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

from lightning_zero.engine.config import ZeroConfig, ZeroStage, check_kept_budget, check_shard_group_size
from lightning_zero.engine.memory import StateBytes
from lightning_zero.engine.offload.disk_tier import STATE_SLOTS
from lightning_zero.engine.optimizer.tensor_owners import plan_owners
from lightning_zero.estimate_schemes import FP32_BYTES, LAYOUTS, Layout, PrecisionScheme

LEFT_OUT = (
    "Model states only (weights, gradients, optimizer states). Not included: activations, "
    "stage 3's gathered units (full weights of the running and the prefetched unit; those "
    "keep_frozen_units_mb keeps are the '+ kept frozen' column where given, hpZ's secondary shards "
    "the '+ secondary' column), "
    "communication buckets, allocator fragmentation and the CUDA context; with offload, pinned buffers "
    "are rounded up to a power of two; with NVMe, the page cache the files pass through. Leave a margin."
)
"""One-paragraph summary of [Note: what the estimate leaves out], for command-line output."""

_ENGINE_DEFAULTS = {f.name: f.default for f in fields(ZeroConfig)}


@dataclass(frozen=True)
class NvmeStaging:
    """What sizes the host buffers NVMe offload steps the optimizer state through (see [Note:
    optimizer state on NVMe]); the defaults are the engine's."""

    bucket_bytes: int = int(_ENGINE_DEFAULTS["bucket_size_mb"] * 2**20)
    """Parameter bytes of the largest bucket, in the weights' dtype: `bucket_size_mb` at stages 1-2
    (25 MiB); at stage 3 the largest unit's parameters."""
    buffer_count: int = _ENGINE_DEFAULTS["nvme_buffer_count"]
    """Host buffers, `nvme_buffer_count` (4)."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive number of bytes, got {self.bucket_bytes}")
        if self.buffer_count < 2:
            raise ValueError(f"buffer_count must be at least 2 (the engine's minimum), got {self.buffer_count}")

    def host_bytes(self, num_params: int, scheme: "PrecisionScheme", sharding_ranks: int) -> int:
        """Bytes of the staging buffers one rank keeps: min(buffer_count, buckets) · moment_bytes · ⌈P/N⌉."""
        bucket_params = min(num_params, max(1, self.bucket_bytes // scheme.weight_bytes))
        buckets = -(-num_params // bucket_params)
        return min(self.buffer_count, buckets) * scheme.moment_bytes * shard_numel(bucket_params, sharding_ranks)

    def chunk_window_bytes(self, num_params: int, scheme: "PrecisionScheme", sharding_ranks: int) -> int:
        """With the master chunks on NVMe too: the most of them one rank holds at once, the buckets
        the optimizer steps while reading ahead, min(buffer_count, buckets) · master bytes · ⌈P/N⌉
        (the gathers read fewer ahead: ``prefetch_units`` + 1 units)."""
        bucket_params = min(num_params, max(1, self.bucket_bytes // scheme.weight_bytes))
        buckets = -(-num_params // bucket_params)
        return min(self.buffer_count, buckets) * scheme.offload_chunk_bytes * shard_numel(bucket_params, sharding_ranks)


@dataclass(frozen=True)
class Topology:
    """The data-parallel world: `devices` ranks on each of `nodes` hosts."""

    devices: int
    """Devices (ranks) per node."""
    nodes: int = 1
    """Hosts; host memory is reported per node, summed over its ranks."""
    shard_group_size: Optional[int] = None
    """Hybrid sharding: the sharded terms are split over groups of this many ranks and replicated
    across the groups (None: over all ranks)."""

    def __post_init__(self) -> None:
        if self.devices < 1 or self.nodes < 1:
            raise ValueError(f"devices and nodes must be at least 1, got {self.devices} and {self.nodes}")
        if self.shard_group_size is not None:
            check_shard_group_size(self.shard_group_size, self.devices * self.nodes)

    @property
    def world_size(self) -> int:
        """All data-parallel ranks."""
        return self.devices * self.nodes

    @property
    def sharding_ranks(self) -> int:
        """N, the number of ranks that share the sharded terms: the shard group's size, or all."""
        return self.shard_group_size or self.world_size


@dataclass(frozen=True)
class OwnedParameters:
    """The parameters a whole-tensor optimizer steps, each whole on one owner rank (see [Note:
    whole-tensor optimizer state]): their sizes in elements, in the optimizer's order (its param
    groups', as `model.parameters()` lists them for an optimizer over the whole model)."""

    numels: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "numels", tuple(self.numels))
        if not self.numels or any(n < 1 for n in self.numels):
            raise ValueError(f"numels must be one positive size per parameter, got {self.numels!r}")

    @property
    def total(self) -> int:
        """Ψ': the elements stepped whole."""
        return sum(self.numels)

    @property
    def largest(self) -> int:
        """The largest parameter's elements: what an owner may hold beyond Ψ'/N."""
        return max(self.numels)

    def elements_per_rank(self, sharding_ranks: int) -> list[int]:
        """The elements each rank owns under the engine's owner plan (`plan_owners`)."""
        return plan_owners(self.numels, sharding_ranks).elements_per_rank(self.numels)

    def busiest(self, sharding_ranks: int) -> int:
        """The most elements one rank owns: at least ⌈Ψ'/N⌉, less than Ψ'/N + `largest`."""
        return max(self.elements_per_rank(sharding_ranks))


@dataclass(frozen=True)
class MemoryEstimate:
    """Model-state bytes for one layout: on each device and on each host."""

    layout: Layout
    device: StateBytes
    """On each device (they all hold the same amount, up to shard padding)."""
    host_per_rank: StateBytes
    """In host memory, for each rank: the terms it offloads."""
    devices_per_node: int
    pinned_per_rank: int = 0
    """The part of `host_per_rank` that is pinned (page-locked) on a CUDA machine: the master and
    gradient chunks the copies read and fill (see [Note: offloaded state])."""
    disk_per_rank: int = 0
    """Bytes in NVMe files for each rank (`offload_optimizer="nvme"`): not memory, and in no total."""
    step_transient_per_rank: int = 0
    """With a whole-tensor optimizer (`OwnedParameters`): the full weights and gradients the busiest
    owner holds while it steps, on the device, or on the host with offload; in no total (see [Note:
    whole-tensor optimizer state])."""
    kept_frozen_units_per_rank: int = 0
    """Stage 3 with `keep_frozen_units_mb`: the full weights of all-frozen units kept gathered through a
    step's micro-batches, min(budget, w·Ψ_f) on each device at most; freed before the optimizer step,
    so in no total (see [Note: frozen parameters])."""
    secondary_shards_per_rank: int = 0
    """Stage 3 with hpZ (`secondary_shard_size=K`): the secondary shards every unit keeps from its
    training forward to its backward, w·Ψ/K on each device; in no total (see [Note: secondary shards
    priced])."""
    host_step_rollback_per_rank: int = 0
    """With CPU offload (not NVMe) and `overlap_host_step`: the rollback copies of the master chunk and
    optimizer state the host step during backward keeps for each rank, in ordinary host memory; kept
    only where clipping or a hook between backward and the step may change the step, so in no total
    (see [Note: offloaded state]). 0 elsewhere, and with `rollback_copies=False`."""

    @property
    def device_during_backward(self) -> int:
        """Bytes on each device while forward and backward run: `device`, plus the frozen units kept
        gathered (`kept_frozen_units_per_rank`) and hpZ's secondary shards (`secondary_shards_per_rank`)."""
        return self.device.total + self.kept_frozen_units_per_rank + self.secondary_shards_per_rank

    @property
    def device_during_step(self) -> int:
        """Bytes on each device while the optimizer steps: `device`, plus the owner's full tensors
        where they are on the device."""
        return self.device.total + (0 if self.layout.offload_optimizer else self.step_transient_per_rank)

    @property
    def host_during_step(self) -> int:
        """Bytes on each node's host while the optimizer steps, at most: `host`, plus the owners' full
        tensors with offload, plus the host step's rollback copies (`host_step_rollback`)."""
        owners = self.step_transient_per_rank * self.devices_per_node if self.layout.offload_optimizer else 0
        return self.host.total + owners + self.host_step_rollback

    @property
    def host(self) -> StateBytes:
        """On each node: the offloaded terms of all the node's ranks together."""
        return self.host_per_rank.scaled(self.devices_per_node)

    @property
    def pinned(self) -> int:
        """On each node: the pinned part of `host`."""
        return self.pinned_per_rank * self.devices_per_node

    @property
    def host_step_rollback(self) -> int:
        """On each node: the rollback copies of all the node's ranks."""
        return self.host_step_rollback_per_rank * self.devices_per_node

    @property
    def disk(self) -> int:
        """On each node: NVMe bytes of all the node's ranks."""
        return self.disk_per_rank * self.devices_per_node


def shard_numel(num_params: int, world_size: int) -> int:
    """Elements of the largest rank's shard of `num_params`: the ceiling of Ψ/N, because the last rank's
    shard is padded to the others' size for the collectives. (Sharding each parameter separately pads
    each by up to N-1 elements; that is ignored here, see the module's note.)"""
    return -(-num_params // world_size)


def estimate(
    num_params: int,
    layout: Layout,
    scheme: PrecisionScheme,
    topology: Topology,
    nvme: NvmeStaging = NvmeStaging(),
    owned: Optional[OwnedParameters] = None,
    rollback_copies: bool = True,
    frozen_params: int = 0,
    keep_frozen_units_mb: float = 0,
    secondary_shard_size: Optional[int] = None,
) -> MemoryEstimate:
    """Model-state bytes of `num_params` (Ψ) parameters in `layout`, `frozen_params` of them frozen, with N = `topology.sharding_ranks`
    (all ranks, or with hybrid sharding the shard group's).

    Per device, with w, g, o the scheme's bytes per parameter:
    DDP (w+g+o)Ψ; stage 1 (w+g)Ψ + oΨ/N; stage 2 wΨ + (g+o)Ψ/N; stage 3 (w+g+o)Ψ/N.
    With offload the optimizer term leaves the device and the host keeps, per rank, the master and
    gradient chunks (pinned) and the optimizer's moments: see [Note: offloaded state]. With NVMe the
    moments go to disk and the host keeps `nvme`'s staging buffers instead: see [Note: optimizer
    state on NVMe]. With `owned` (some or all of the Ψ parameters, stepped by a whole-tensor
    optimizer) each rank keeps the moments of the parameters it owns instead of its chunk of
    theirs, and holds their full weights and gradients while it steps: see [Note: whole-tensor
    optimizer state]. Frozen parameters cost their weights only, and at stage 3 the ones
    `keep_frozen_units_mb` keeps gathered: see [Note: frozen parameters]. `secondary_shard_size`
    (hpZ's K, resolved): the secondary shards stage 3 keeps between forward and backward, see [Note:
    secondary shards priced].
    `rollback_copies`: whether the host step during backward keeps its rollback
    copies (CPU offload only): True, the engine's default in a plain loop or Fabric, an upper bound;
    False with `overlap_host_step=False`, or in the Lightning Trainer with no gradient clipping and no
    hook between backward and the step.
    """
    if num_params < 1:
        raise ValueError(f"the number of parameters must be at least 1, got {num_params}")
    if not 0 <= frozen_params <= num_params:
        raise ValueError(f"the frozen parameters must be between 0 and the model's {num_params:,} parameters, got {frozen_params:,}")
    trainable = num_params - frozen_params
    check_kept_budget(keep_frozen_units_mb)
    kept = 0
    if layout.stage is ZeroStage.PARAMETERS and keep_frozen_units_mb > 0:
        kept = scheme.weight_bytes * frozen_params
        kept = kept if math.isinf(keep_frozen_units_mb) else min(kept, int(keep_frozen_units_mb * 2**20))
    stage = layout.stage
    ranks = topology.sharding_ranks
    secondary = 0
    if secondary_shard_size is not None and stage is ZeroStage.PARAMETERS and not layout.offload_params:
        if ranks % secondary_shard_size:
            raise ValueError(f"hpZ's K = {secondary_shard_size} does not divide the {ranks} ranks")
        secondary = scheme.weight_bytes * shard_numel(num_params, ranks) * (ranks // secondary_shard_size)
    if owned is not None and stage is ZeroStage.NOTHING:
        owned = None  # DDP steps every parameter whole on every rank: nothing changes
    if owned is not None:
        if owned.total > trainable:
            not_frozen = " that are not frozen" if frozen_params else ""
            raise ValueError(f"the whole-tensor optimizer's {owned.total:,} elements exceed the model's {trainable:,} parameters{not_frozen}")
        if layout.state_on_disk:
            raise ValueError("offload_optimizer='nvme' does not stream a whole-tensor optimizer's state (the engine refuses it)")
    shard = shard_numel(num_params, ranks)  # of the weights: every parameter's
    trained_shard = shard_numel(trainable, ranks)  # of gradients and optimizer state: the trainable ones'
    # the elements whose moments a rank keeps: its shard, or its shard of the chunk path's
    # parameters plus the busiest owner's whole ones
    owned_elements = 0 if owned is None else owned.busiest(ranks)
    moment_elements = trained_shard if owned is None else shard_numel(trainable - owned.total, ranks) + owned_elements

    def held(sharded: bool, count: int = num_params) -> int:
        return shard_numel(count, ranks) if sharded else count

    if not layout.offload_optimizer:
        optimizer_state = scheme.optimizer_bytes * held(stage.shards_optimizer_state, trainable)
        if owned is not None:
            optimizer_state = scheme.master_bytes * trained_shard + scheme.moment_bytes * moment_elements
        device = StateBytes(
            parameters=scheme.weight_bytes * held(stage.shards_parameters),
            gradients=scheme.gradient_bytes * held(stage.shards_gradients, trainable),
            optimizer_state=optimizer_state,
        )
        step_dtype_bytes = FP32_BYTES if scheme.master_bytes else scheme.weight_bytes  # the master dtype
        return MemoryEstimate(
            layout=layout,
            device=device,
            host_per_rank=StateBytes(),
            devices_per_node=topology.devices,
            step_transient_per_rank=2 * step_dtype_bytes * owned_elements,
            kept_frozen_units_per_rank=kept,
            secondary_shards_per_rank=secondary,
        )

    chunk = scheme.offload_chunk_bytes * trained_shard  # the master chunk; the gradient chunk is as large
    # fp32 weights with offload_params: the host's chunk is the weight's only copy, frozen ones' too
    host_only_weights = layout.offload_params and scheme.weight_bytes == scheme.offload_chunk_bytes
    # with offload_params a frozen weight's chunk, in the weights' dtype, is on the host only (see
    # [Note: frozen parameters])
    frozen_shard = shard_numel(frozen_params, ranks) if layout.offload_params else 0
    weight_chunks = scheme.offload_chunk_bytes * (shard - frozen_shard) + scheme.weight_bytes * frozen_shard
    frozen_host = scheme.weight_bytes * frozen_shard if not (host_only_weights or layout.params_on_disk) else 0
    device = StateBytes(
        parameters=0 if host_only_weights else scheme.weight_bytes * (held(stage.shards_parameters) - frozen_shard),
        gradients=0 if stage.shards_gradients else scheme.gradient_bytes * trainable,
    )
    moments = scheme.moment_bytes * moment_elements
    in_host = nvme.host_bytes(trainable, scheme, topology.sharding_ranks) if layout.state_on_disk and trainable else moments
    # the master chunk: all of it in host memory, or with the parameters on NVMe the buckets read in
    window = nvme.chunk_window_bytes(num_params, scheme, topology.sharding_ranks) if layout.params_on_disk else 0
    master = window or chunk
    host_weights = (window or weight_chunks) if host_only_weights else frozen_host
    host = StateBytes(
        parameters=host_weights,
        gradients=chunk,
        optimizer_state=(0 if host_only_weights else master) + in_host,
    )
    # the host step during backward (one element-wise optimizer, the master chunks in host memory) copies
    # each bucket's master chunk, and in host memory its moments, before it steps: see [Note: offloaded
    # state]; moments on NVMe keep their last committed slot instead
    steps_during_backward = layout.offload_optimizer and not layout.params_on_disk and owned is None
    saved = scheme.offload_chunk_bytes + (0 if layout.state_on_disk else scheme.moment_bytes)
    rollback = saved * trained_shard if rollback_copies and steps_during_backward else 0
    return MemoryEstimate(
        layout=layout,
        device=device,
        host_per_rank=host,
        devices_per_node=topology.devices,
        pinned_per_rank=chunk + (host_weights if host_only_weights else master + frozen_host),
        disk_per_rank=(STATE_SLOTS * moments if layout.state_on_disk else 0) + (weight_chunks if layout.params_on_disk else 0),
        step_transient_per_rank=2 * scheme.offload_chunk_bytes * owned_elements,
        host_step_rollback_per_rank=rollback,
        kept_frozen_units_per_rank=kept,
        secondary_shards_per_rank=secondary,
    )


def estimate_all(
    num_params: int,
    scheme: PrecisionScheme,
    topology: Topology,
    nvme: NvmeStaging = NvmeStaging(),
    owned: Optional[OwnedParameters] = None,
    rollback_copies: bool = True,
    frozen_params: int = 0,
    keep_frozen_units_mb: float = 0,
    secondary_shard_size: Optional[int] = None,
) -> tuple[MemoryEstimate, ...]:
    """`estimate` for every layout in `LAYOUTS`, in their order of preference; with `owned` (a
    whole-tensor optimizer) without the NVMe layouts, which refuse it."""
    layouts = [layout for layout in LAYOUTS if owned is None or not layout.state_on_disk]
    return tuple(
        estimate(
            num_params, layout, scheme, topology, nvme, owned, rollback_copies, frozen_params, keep_frozen_units_mb,
            secondary_shard_size,
        )
        for layout in layouts
    )
