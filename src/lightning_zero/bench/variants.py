"""The table of what the benchmark compares: each variant's name, family, and the ZeRO stage whose
floor it is measured against. How each is built and stepped is `wrappers.py`."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence, Union

from lightning_zero.engine.config import STRATEGY_NAMES


class Family(str, enum.Enum):
    """Who implements a variant; variants of one family share a wrapper."""

    DDP = "torch DDP"
    TORCH_ZERO = "torch ZeroRedundancyOptimizer"
    FSDP2 = "torch FSDP2"
    OURS = "lightning-zero"
    DEEPSPEED = "DeepSpeed"


@dataclass(frozen=True)
class ZeroPlusPlus:
    """ZeRO++'s options of a variant (`ZeroConfig` fields of the same names; [Note: ZeRO++] in
    `engine/zero_plus_plus.py`)."""

    secondary_shard_size: Optional[Union[int, Literal["node"]]] = None
    """hpZ's K ("node": the ranks of one node, `--nodes`); None: no hpZ."""
    quantize_weights: Union[bool, str] = False
    """qwZ: the forward's (and without hpZ backward's) all-gathers in "int8" or "fp8" blocks."""
    quantize_gradients: Union[bool, str] = False
    """qgZ: gradients reduced by two quantized all-to-alls, within the node then across nodes."""

    def config(self) -> dict[str, Any]:
        """The `ZeroConfig` fields these options set (none of them where they are off)."""
        fields = {
            "secondary_shard_size": self.secondary_shard_size,
            "quantize_weights": self.quantize_weights,
            "quantize_gradients": self.quantize_gradients,
        }
        return {name: value for name, value in fields.items() if value not in (None, False)}

    @classmethod
    def of_strategy(cls, name: str) -> "ZeroPlusPlus":
        """The options of a registered strategy name (`engine/config.py`'s `STRATEGY_NAMES`)."""
        options = {k: v for k, v in STRATEGY_NAMES[name].items() if k != "stage"}
        return cls(**options)


@dataclass(frozen=True)
class VariantSpec:
    """One way of training the same model with data parallelism."""

    name: str
    """What `--variants` takes and the report shows."""
    family: Family
    """Who implements it; picks the wrapper."""
    stage: int
    """0 (DDP) to 3: the ZeRO stage it corresponds to, whose memory and communication floors it is
    compared with. For FSDP2 `reshard_after_forward=False` is ≈ stage 2 and `True` ≈ stage 3."""
    description: str
    """One line for the report."""
    offload_optimizer: Union[bool, Literal["nvme"]] = False
    """Ours: optimizer state (and its step) in host memory; "nvme": its moments in files under the
    run's `--nvme-path`, stepped through a few host buffers."""
    offload_params: Union[bool, Literal["nvme"]] = False
    """Ours, stage 3: parameter shards in host memory too; "nvme": in NVMe files too."""
    whole_tensor: bool = False
    """Ours: the optimizer takes the ownership path of whole-tensor optimizers (each parameter
    stepped whole on one owner rank, docs/optimizers.md) with AdamW's arithmetic (`OwnedAdamW`),
    so the row differs from the same stage's chunk path by that path's cost alone. Not in
    `DEFAULT_VARIANTS`."""
    zero_plus_plus: Optional[ZeroPlusPlus] = None
    """Ours, stage 3: ZeRO++'s options. Such a variant needs `--nodes` of 2 or more (hpZ's K is a node,
    qgZ reduces within then across nodes), so it is not in `DEFAULT_VARIANTS`: `NODE_VARIANTS`."""

    @property
    def is_ours(self) -> bool:
        return self.family is Family.OURS

    @property
    def state_on_disk(self) -> bool:
        """Ours with `offload_optimizer="nvme"`: needs a directory for its files."""
        return self.offload_optimizer == "nvme"


VARIANTS: tuple[VariantSpec, ...] = (
    VariantSpec("ddp", Family.DDP, 0, "DistributedDataParallel, gradient_as_bucket_view=True"),
    VariantSpec("torch_zero1", Family.TORCH_ZERO, 1, "DDP + ZeroRedundancyOptimizer, parameters_as_bucket_view=True"),
    VariantSpec("fsdp2_z2", Family.FSDP2, 2, "fully_shard per Block and root, reshard_after_forward=False"),
    VariantSpec("fsdp2_z3", Family.FSDP2, 3, "fully_shard per Block and root, reshard_after_forward=True"),
    VariantSpec("zero1", Family.OURS, 1, "ZeroEngine stage 1"),
    VariantSpec("zero2", Family.OURS, 2, "ZeroEngine stage 2"),
    VariantSpec("zero3", Family.OURS, 3, "ZeroEngine stage 3, one unit per Block"),
    VariantSpec(
        "zero2_whole", Family.OURS, 2, "ZeroEngine stage 2, AdamW stepped whole on owner ranks (OwnedAdamW)", whole_tensor=True
    ),
    VariantSpec(
        "zero3_whole", Family.OURS, 3, "ZeroEngine stage 3, AdamW stepped whole on owner ranks (OwnedAdamW)", whole_tensor=True
    ),
    VariantSpec("zero2_offload", Family.OURS, 2, "ZeroEngine stage 2, optimizer on the CPU", offload_optimizer=True),
    VariantSpec(
        "zero3_offload",
        Family.OURS,
        3,
        "ZeroEngine stage 3, optimizer and parameter shards on the CPU",
        offload_optimizer=True,
        offload_params=True,
    ),
    VariantSpec(
        "zero3_offload_nvme",
        Family.OURS,
        3,
        "ZeroEngine stage 3, as zero3_offload with Adam's moments in NVMe files (--nvme-path)",
        offload_optimizer="nvme",
        offload_params=True,
    ),
    VariantSpec(
        "zero3_offload_nvme_params",
        Family.OURS,
        3,
        "ZeroEngine stage 3, as zero3_offload_nvme with the parameter shards in NVMe files too",
        offload_optimizer="nvme",
        offload_params="nvme",
    ),
    VariantSpec(
        "zero3_hpz", Family.OURS, 3, "ZeroEngine stage 3, hpZ: backward gathers within a node (secondary_shard_size='node')",
        zero_plus_plus=ZeroPlusPlus(secondary_shard_size="node"),
    ),
    VariantSpec(
        "zero3_qwz", Family.OURS, 3, "ZeroEngine stage 3, qwZ: weight all-gathers in int8 blocks (quantize_weights='int8')",
        zero_plus_plus=ZeroPlusPlus(quantize_weights="int8"),
    ),
    VariantSpec(
        "zero3_qgz", Family.OURS, 3,
        "ZeroEngine stage 3, qgZ: gradients reduced by int8 all-to-alls, within then across nodes (quantize_gradients='int8')",
        zero_plus_plus=ZeroPlusPlus(quantize_gradients="int8"),
    ),
    VariantSpec(
        "zero3pp", Family.OURS, 3, "ZeroEngine stage 3, hpZ + qwZ + qgZ as strategy='zero3pp'",
        zero_plus_plus=ZeroPlusPlus.of_strategy("zero3pp"),
    ),
    VariantSpec("ds_zero1", Family.DEEPSPEED, 1, "DeepSpeed ZeRO stage 1, gradient_clipping=0"),
    VariantSpec("ds_zero2", Family.DEEPSPEED, 2, "DeepSpeed ZeRO stage 2, gradient_clipping=0"),
    VariantSpec("ds_zero3", Family.DEEPSPEED, 3, "DeepSpeed ZeRO stage 3, gradient_clipping=0"),
)

BY_NAME: dict[str, VariantSpec] = {v.name: v for v in VARIANTS}
DEFAULT_VARIANTS: tuple[str, ...] = tuple(v.name for v in VARIANTS if not v.whole_tensor and v.zero_plus_plus is None)
"""What a run compares unless `--variants` says otherwise: every implementation of the chunk path.
The ownership path's rows are asked for by name: they measure what a whole-tensor optimizer costs
over the chunk path, not an implementation to rank. ZeRO++'s rows need `--nodes`: `NODE_VARIANTS`."""
NODE_VARIANTS: tuple[str, ...] = ("zero3", *(v.name for v in VARIANTS if v.zero_plus_plus is not None))
"""What a run with `--nodes` of 2 or more compares unless `--variants` says otherwise: zero3 and
ZeRO++'s options, one at a time and together, whose bytes per link are measured against zero3's."""
BASELINE = "ddp"
"""The variant step times are divided by."""


def select(names: Sequence[str]) -> tuple[VariantSpec, ...]:
    """The named variants in the table's order (DDP first, so its time is there to compare with);
    unknown names raise a `ValueError` listing the known ones."""
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; choose from: {', '.join(BY_NAME)}")
    wanted = set(names)
    return tuple(v for v in VARIANTS if v.name in wanted)


def peers(spec: VariantSpec, among: Sequence[VariantSpec]) -> tuple[VariantSpec, ...]:
    """The other implementations of the same stage (without offload) that ours should beat."""
    return tuple(v for v in among if not v.is_ours and v.stage == spec.stage and v.family is not Family.DDP)
