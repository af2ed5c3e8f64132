"""What the user chooses: the ZeRO stage and its knobs, validated once, at construction."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, fields
from typing import Any, Literal, Mapping, Optional, Sequence, Union

from lightning_zero.engine.zero_plus_plus import (
    GradientQuantization,
    SecondaryShardSize,
    WeightQuantization,
    check_zero_plus_plus_options,
    gradient_format,
    weight_format,
)


class ZeroStage(enum.IntEnum):
    """ZeRO stages, named by what each one shards across the data-parallel ranks; each also shards
    what the stages below it shard."""

    NOTHING = 0
    """DDP: every rank holds everything. Not an engine stage; the estimator and bench price it."""
    OPTIMIZER_STATE = 1
    """Optimizer state and fp32 master weights are sharded; gradients are reduced after backward."""
    GRADIENTS = 2
    """Also gradients: reduce-scattered bucket by bucket during backward, full gradients freed."""
    PARAMETERS = 3
    """Also parameters: each rank keeps its chunk at rest and gathers a unit just before use."""

    @property
    def shards_optimizer_state(self) -> bool:
        return self >= ZeroStage.OPTIMIZER_STATE

    @property
    def shards_gradients(self) -> bool:
        return self >= ZeroStage.GRADIENTS

    @property
    def shards_parameters(self) -> bool:
        return self >= ZeroStage.PARAMETERS


STRATEGY_NAMES: dict[str, dict[str, Any]] = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_offload": {"stage": 2, "offload_optimizer": True},
    "zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_params": True},
    "zero3_offload_nvme": {"stage": 3, "offload_optimizer": "nvme", "offload_params": True},
    "zero3_offload_nvme_params": {"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme"},
    "zero3pp": {"stage": 3, "secondary_shard_size": "node", "quantize_weights": "int8", "quantize_gradients": "int8"},
}
"""The names ``import lightning_zero`` registers in the Trainer's and Fabric's strategy registries,
and the options each one stands for."""

ENGINE_STAGES = (ZeroStage.OPTIMIZER_STATE, ZeroStage.GRADIENTS, ZeroStage.PARAMETERS)
STAGE_3_OPTIONS = ("unit_classes", "min_unit_params", "prefetch_units", "check_units_every_gather", "keep_frozen_units_mb")
"""Options of how stage 3 gathers parameters; at stages 1-2 they would do nothing."""


def check_shard_group_size(shard_group_size: int, world_size: int) -> None:
    """Raise a ``ValueError`` unless ``shard_group_size`` ranks can form the shard groups of hybrid
    sharding over ``world_size`` ranks (it must divide it)."""
    if shard_group_size > world_size or world_size % shard_group_size:
        raise ValueError(
            f"`shard_group_size={shard_group_size}` does not divide the {world_size} ranks into equal shard"
            f" groups: it must divide the world size ({', '.join(str(k) for k in range(1, world_size + 1) if world_size % k == 0)}"
            " here), or be 'node' (the devices per node)."
        )


NVME_PATH_VARIABLE = "LIGHTNING_ZERO_NVME_PATH"
"""Where ``offload_optimizer="nvme"`` keeps its files when ``nvme_path`` is not given (the registered
name ``zero3_offload_nvme`` takes no options)."""

OffloadTier = Union[bool, Literal["cpu", "nvme"]]
"""Where offloaded state lives: False (on the device), True or "cpu" (host memory), "nvme" (files on
a local disk, in host memory only around their uses)."""

ShardGroupSize = Optional[Union[int, Literal["node"]]]
"""How many ranks shard the states: None (all of them), an int, or "node" (the ranks of one node)."""


def check_shard_group_option(shard_group_size: ShardGroupSize) -> None:
    """At construction: the option's type and range, before the world size is known."""
    if shard_group_size is None or shard_group_size == "node":
        return
    if not isinstance(shard_group_size, int) or isinstance(shard_group_size, bool) or shard_group_size < 1:
        raise ValueError(f"`shard_group_size` must be None, a positive int or 'node', got {shard_group_size!r}.")


def resolve_shard_group_size(shard_group_size: ShardGroupSize, world_size: int, ranks_per_node: int) -> Optional[int]:
    """At setup, on every rank alike: the shard groups' size for hybrid sharding, or None when
    every rank shards (the option is None, or covers all ranks). Raises if it does not divide the
    ranks into equal groups."""
    check_shard_group_option(shard_group_size)
    if shard_group_size is None:
        return None
    size = ranks_per_node if shard_group_size == "node" else int(shard_group_size)
    check_shard_group_size(size, world_size)
    return None if size == world_size else size


def check_kept_budget(keep_frozen_units_mb: float) -> None:
    """``ZeroConfig.keep_frozen_units_mb``: a number of MiB, 0 or more (``math.inf`` allowed)."""
    value = keep_frozen_units_mb
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"`keep_frozen_units_mb` must be a number of MiB (0: free frozen units after each use; math.inf:"
            f" keep every all-frozen unit until the optimizer step), got {value!r}."
        )
    if not value >= 0:  # also NaN
        raise ValueError(
            f"`keep_frozen_units_mb` must be 0 or more MiB per rank (0 frees frozen units after each use, as"
            f" without it; math.inf keeps every all-frozen unit until the optimizer step), got {value!r}."
        )


def check_offload(stage: ZeroStage, offload_optimizer: "OffloadTier", offload_params: "OffloadTier") -> None:
    """Raise a ``ValueError`` for an offload choice ``stage`` cannot make (the engine's config and the
    estimator's layouts share this check)."""
    if offload_optimizer and stage is ZeroStage.NOTHING:
        raise ValueError("offloading the optimizer needs a ZeRO stage (1, 2 or 3); DDP has no offload.")
    if offload_params and stage is not ZeroStage.PARAMETERS:
        raise ValueError(
            f"`offload_params={offload_params!r}` needs stage 3 (got stage {int(stage)}): only stage 3 keeps parameter"
            " chunks, at stages 1-2 every rank holds the full parameters on its device. Use"
            " `offload_optimizer=True` to move the optimizer state to the host at any stage."
        )
    if offload_params and not offload_optimizer:
        # the optimizer updates the weight chunk in place: weights on the host but the optimizer on
        # the device would move the chunk across PCIe twice per step for nothing
        raise ValueError(
            "`offload_params=True` keeps the parameter chunks in host memory, and those chunks are"
            " what the optimizer steps, so it needs `offload_optimizer=True` as well."
        )


@dataclass(frozen=True)
class ZeroConfig:
    """Every option of the engine, checked in ``__post_init__`` so a bad value fails on every rank
    before any process group or collective exists."""

    stage: int = 2
    """1, 2 or 3 (see :class:`ZeroStage`)."""

    bucket_size_mb: float = 25.0
    """Target size, in MiB of parameter bytes, of one bucket: the parameters whose gradients are
    reduce-scattered (and whose updated shards are all-gathered) in one collective. Collectives per
    step scale with model bytes / bucket size. A parameter larger than a bucket gets its own."""

    unit_classes: Optional[Sequence[str]] = None
    """Stage 3: names of the module classes whose instances are units (e.g. ``["Block"]``): their
    parameters are gathered together just before their forward and freed after. None: every
    element of an ``nn.ModuleList``/``nn.ModuleDict``/``nn.Sequential``. The top module is always
    a unit too (the root unit, gathered for the whole step)."""

    min_unit_params: int = 0
    """Stage 3: a candidate unit with fewer parameters than this stays in its parent's unit, so
    tiny modules do not cost a collective each."""

    prefetch_units: int = 1
    """Stage 3: how many units ahead to gather while the current one computes (0 disables). At most
    the root unit + 1 + ``prefetch_units`` units are gathered at once."""

    check_units_every_gather: Optional[bool] = None
    """Stage 3: read every all-gather's unit tags as soon as it lands instead of once per backward
    (see [Note: unit tags] in ``unit.py``). It turns ranks whose forwards run a different number of
    units from a hang into an error at the first unit where they disagree; on an accelerator it
    costs a host sync per gather. None (default): on where parameters live in host memory (CPU
    training, where reading the tags waits for nothing), off on accelerators."""

    keep_frozen_units_mb: float = 0.0
    """Stage 3: MiB per rank of gathered weights of all-frozen units (no parameter of theirs requires
    a gradient) kept gathered from their first gather in a training step until the optimizer step,
    instead of gathered again for every forward and backward: with gradient accumulation over K
    micro-batches such a unit costs 1 all-gather per optimizer step instead of up to 2K. Units are
    kept in order of first use while their gathered bytes fit; the others behave as with 0. 0 (the
    default): every unit is freed after each use. ``math.inf``: every all-frozen unit is kept.
    See [Note: kept frozen units] in ``engine/parameters/kept_units.py``."""

    offload_optimizer: OffloadTier = False
    """True (or "cpu"): keep the optimizer state and fp32 master chunks in host memory (pinned on
    CUDA) and step the optimizer there; gradient chunks are copied to the host as each bucket's
    reduce-scatter finishes, updated chunks copied back for the all-gather. "nvme": as True, and
    the optimizer's own state (Adam's moments) lives in files under ``nvme_path`` instead, stepped
    one bucket at a time through ``nvme_buffer_count`` host buffers (see ``state_on_disk.py``)."""

    offload_params: OffloadTier = False
    """Stage 3: True (or "cpu"): also keep the parameter chunks at rest in host memory, copied to the
    device only for their unit's all-gather. Needs ``offload_optimizer`` (the optimizer steps those
    chunks). "nvme": the chunks live in files under ``nvme_path`` and are read into host memory
    ahead of each gather and of the optimizer step, and written back after the step (see
    ``masters_on_disk.py``). Needs ``offload_optimizer="nvme"``."""

    nvme_path: Optional[str] = None
    """With ``offload_optimizer="nvme"``: an existing directory on a fast local disk (an NVMe SSD).
    Each rank makes its own scratch directory in it, removed when the engine closes; checkpoints
    are saved elsewhere as usual. None: the ``LIGHTNING_ZERO_NVME_PATH`` environment variable."""

    nvme_buffer_count: int = 4
    """With ``offload_optimizer="nvme"``: host buffers the state streams through, each the size of
    the largest bucket's state: one steps while the others read ahead and write behind. At least 2."""

    fused_host_step: bool = False
    """With ``offload_optimizer``: step Adam, AdamW, SGD and Adagrad with torch's fused CPU kernel
    (one multithreaded pass per group: 2.4-3.9x faster on the host than the per-tensor kernel a plain
    ``AdamW()`` runs there), at the price of DDP's bits: its rounding differs, and training carries
    the difference on (see [Note: the exact host step] in ``host_step.py``). False (the default):
    keep the kernel the optimizer was configured with, DDP's arithmetic."""

    overlap_host_step: bool = True
    """With ``offload_optimizer`` (True, or "nvme" where the parameter chunks stay in memory): step each
    bucket's chunks on a host thread as soon as its reduced gradients are in host memory (with "nvme",
    its state read from disk as they land), while backward computes the earlier layers, instead of
    all buckets after backward. The result is bitwise the one stepping after backward gives: a step
    the gradients, the hyperparameters or a verdict (clipping, loss scaling) turn out to change is
    rolled back and taken again (see [Note: the host step during backward] in ``step_ahead.py``).
    False: the whole host step after backward."""

    host_threads: Optional[int] = None
    """With ``offload_optimizer``: the threads each rank's host step uses (``torch.set_num_threads``).
    None: the cores this process may run on, divided by the ranks of its node (what a rank owns when
    the ranks of a node share its cores), or ``OMP_NUM_THREADS`` where it is set."""

    elementwise_optimizers: Sequence[str] = ()
    """Optimizer classes the engine does not know, declared element-wise (their update of each element
    reads only that element and scalars), by class name (``"MyAdam"``) or qualified name
    (``"mylib.optim.MyAdam"``): they step flat chunks instead of whole tensors on owner ranks, which
    is faster. Declaring one that is not element-wise (per-tensor norms, matrix shapes) trains a
    different model. See ``engine/optimizer/optimizer_kinds.py``."""

    secondary_shard_size: SecondaryShardSize = None
    """Stage 3, ZeRO++'s hpZ: after a unit's forward each rank keeps 1/K of its gathered weights, and
    backward's all-gather runs among K consecutive ranks (one node: "node") instead of all of them:
    bitwise the same training, backward's weight traffic kept off the inter-node link, for 2Ψ/K more
    bytes per rank in half precision. K must divide the world size and be smaller than it. None (the
    default): backward gathers from every rank. See [Note: ZeRO++] in ``zero_plus_plus.py``."""

    quantize_weights: WeightQuantization = False
    """Stage 3, ZeRO++'s qwZ: all-gather weights as blocks of int8 (True or "int8") or fp8 ("fp8")
    with one fp32 scale each, dequantized into the unit's storage: half the bytes of bf16 weights.
    Forward and backward compute with the dequantized weights (evaluation steps too); the shards the
    optimizer steps are never quantized, and what reads the true weights (``summon_full_params``,
    state dicts, reads at rest) is gathered unquantized. Not bitwise DDP: the loss follows DDP's
    within the quantization's error."""

    quantize_gradients: GradientQuantization = False
    """Stage 3, ZeRO++'s qgZ: reduce each bucket's gradients by an all-to-all within the node then one
    across nodes, sending int8 (True or "int8") or int4 ("int4") blocks with one fp32 scale each and
    summing in fp32 (``quantized_reduction.py``). Not bitwise DDP; no error feedback (see the note there)."""

    def __post_init__(self) -> None:
        if type(self.stage) is not int or self.stage not in {int(s) for s in ENGINE_STAGES}:  # not 3.0, not True
            raise ValueError(
                f"ZeRO `stage` must be one of 1, 2 or 3 (1 shards optimizer state, 2 also gradients,"
                f" 3 also parameters), got {self.stage!r}."
            )
        if isinstance(self.bucket_size_mb, bool) or not isinstance(self.bucket_size_mb, (int, float)):
            raise TypeError(f"`bucket_size_mb` must be a positive number of MiB, got {self.bucket_size_mb!r}.")
        if not self.bucket_size_mb > 0 or self.bucket_size_mb == float("inf"):
            raise ValueError(f"`bucket_size_mb` must be a positive, finite number of MiB, got {self.bucket_size_mb!r}.")

        if self.unit_classes is not None:
            if isinstance(self.unit_classes, str) or not all(isinstance(c, str) and c for c in self.unit_classes):
                raise TypeError(
                    f"`unit_classes` must be a list of module class names such as ['Block'], got {self.unit_classes!r}."
                )
            object.__setattr__(self, "unit_classes", tuple(self.unit_classes))
        if not (self.check_units_every_gather is None or isinstance(self.check_units_every_gather, bool)):
            raise TypeError(f"`check_units_every_gather` must be True, False or None (automatic), got {self.check_units_every_gather!r}.")
        if isinstance(self.elementwise_optimizers, str) or not all(isinstance(c, str) and c for c in self.elementwise_optimizers):
            raise TypeError(
                "`elementwise_optimizers` must be a list of optimizer class names such as ['MyAdam'] or"
                f" ['mylib.optim.MyAdam'], got {self.elementwise_optimizers!r}."
            )
        object.__setattr__(self, "elementwise_optimizers", tuple(self.elementwise_optimizers))
        self._check_offload_tiers()
        if not isinstance(self.fused_host_step, bool):
            raise TypeError(f"`fused_host_step` must be True or False, got {self.fused_host_step!r}.")
        if not isinstance(self.overlap_host_step, bool):
            raise TypeError(f"`overlap_host_step` must be True or False, got {self.overlap_host_step!r}.")
        if self.host_threads is not None and (isinstance(self.host_threads, bool) or not isinstance(self.host_threads, int) or self.host_threads < 1):
            raise ValueError(f"`host_threads` must be a positive number of threads, or None (the rank's share of its node's cores), got {self.host_threads!r}.")
        check_offload(self.zero_stage, self.offload_optimizer, self.offload_params)
        if self.params_on_disk and not self.optimizer_state_on_disk:
            # the NVMe stream of the optimizer step is what reads and writes the chunks it steps
            raise ValueError(
                "`offload_params='nvme'` keeps the parameter chunks in files, and the optimizer steps"
                " them one bucket at a time as it streams its own state from the same disk, so it needs"
                f" `offload_optimizer='nvme'` (got `offload_optimizer={self.offload_optimizer!r}`)."
                " `strategy='zero3_offload_nvme_params'` sets both."
            )
        check_kept_budget(self.keep_frozen_units_mb)
        check_zero_plus_plus_options(
            self.stage, self.secondary_shard_size, self.quantize_weights, self.quantize_gradients, self.offload_params
        )
        for name in ("min_unit_params", "prefetch_units"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
        self._check_options_apply()

    def _check_offload_tiers(self) -> None:
        if self.offload_optimizer == "cpu":
            object.__setattr__(self, "offload_optimizer", True)
        if not (isinstance(self.offload_optimizer, bool) or self.offload_optimizer == "nvme"):
            raise ValueError(
                f"`offload_optimizer` must be False, True (or 'cpu': host memory) or 'nvme' (files under"
                f" `nvme_path`), got {self.offload_optimizer!r}."
            )
        if self.offload_params == "cpu":
            object.__setattr__(self, "offload_params", True)
        if not (isinstance(self.offload_params, bool) or self.offload_params == "nvme"):
            raise ValueError(
                f"`offload_params` must be False, True (or 'cpu': host memory) or 'nvme' (files under"
                f" `nvme_path`), got {self.offload_params!r}."
            )
        if self.optimizer_state_on_disk:
            if self.nvme_path is None:
                object.__setattr__(self, "nvme_path", os.environ.get(NVME_PATH_VARIABLE) or None)
            if not isinstance(self.nvme_path, str) or not self.nvme_path:
                raise ValueError(
                    "`offload_optimizer='nvme'` needs `nvme_path`: an existing directory on a fast local disk"
                    f" where each rank keeps its optimizer state, got nvme_path={self.nvme_path!r}. Pass it"
                    f" (`ZeroStrategy(..., nvme_path='/local_nvme/scratch')`), or set {NVME_PATH_VARIABLE}"
                    " (what `strategy='zero3_offload_nvme'` reads)."
                )
            count = self.nvme_buffer_count
            if isinstance(count, bool) or not isinstance(count, int) or count < 2:
                raise ValueError(f"`nvme_buffer_count` must be an integer of at least 2, got {count!r}.")
        elif self.nvme_path is not None or self.nvme_buffer_count != 4:
            given = "`nvme_path`" if self.nvme_path is not None else "`nvme_buffer_count`"
            raise ValueError(
                f"{given} only applies with `offload_optimizer='nvme'` (optimizer state in files), but"
                f" `offload_optimizer={self.offload_optimizer!r}`. Remove it, or set `offload_optimizer='nvme'`."
            )

    @property
    def optimizer_state_on_disk(self) -> bool:
        """``offload_optimizer="nvme"``: the optimizer's state lives in files (``state_on_disk.py``)."""
        return self.offload_optimizer == "nvme"

    @property
    def params_on_disk(self) -> bool:
        """``offload_params="nvme"``: the stage-3 chunks live in files (``masters_on_disk.py``)."""
        return self.offload_params == "nvme"

    def _check_options_apply(self) -> None:
        """An option that does nothing with the chosen stage raises rather than being ignored: a
        user who sets ``unit_classes`` at stage 2 believes something is sharded that is not. (A
        LightningCLI config switched from zero3 to zero2 with the stage-3 options left in gets
        this message too, naming the options to delete; a warning would scroll by unread.)"""
        defaults = {f.name: f.default for f in fields(self)}
        given = [name for name in STAGE_3_OPTIONS if getattr(self, name) != defaults[name]]
        if given and not self.zero_stage.shards_parameters:
            raise ValueError(
                f"{', '.join(f'`{n}`' for n in given)} only {'applies' if len(given) == 1 else 'apply'} at"
                f" stage 3 (how parameters are gathered), but `stage={self.stage}` keeps full parameters"
                " on every rank. Remove them, or use `stage=3`."
            )
        if self.fused_host_step is not defaults["fused_host_step"] and not self.offload_optimizer:
            raise ValueError(
                "`fused_host_step` only applies with `offload_optimizer=True` (it picks the kernel of the"
                " optimizer step on the host); without offload the optimizer keeps its own settings."
                " Remove it, or set `offload_optimizer=True`."
            )

        for name in ("overlap_host_step", "host_threads"):
            if getattr(self, name) != defaults[name] and not self.offload_optimizer:
                raise ValueError(
                    f"`{name}` only applies with `offload_optimizer` (it shapes the optimizer step on the"
                    " host); without offload the optimizer steps on the device. Remove it, or set"
                    " `offload_optimizer=True`."
                )

    @property
    def zero_stage(self) -> ZeroStage:
        return ZeroStage(self.stage)

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_size_mb * 2**20))

    @property
    def weight_quantization(self) -> Optional[str]:
        """qwZ's block format ("int8", "fp8"), or None."""
        return weight_format(self.quantize_weights)

    @property
    def gradient_quantization(self) -> Optional[str]:
        """qgZ's block format ("int8", "int4"), or None."""
        return gradient_format(self.quantize_gradients)

    @property
    def kept_frozen_bytes(self) -> float:
        """``keep_frozen_units_mb`` in bytes (``math.inf`` stays infinite)."""
        return self.keep_frozen_units_mb * 2**20


def config_from_options(options: Mapping[str, Any]) -> ZeroConfig:
    """The ``ZeroConfig`` of a strategy's constructor arguments (``options``: its ``locals()``, which
    hold every ``ZeroConfig`` field under the same name, and more): both adapters take the same options."""
    return ZeroConfig(**{f.name: options[f.name] for f in fields(ZeroConfig)})
