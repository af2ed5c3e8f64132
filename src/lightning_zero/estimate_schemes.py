"""The choices a memory estimate compares: what one parameter costs, in bytes, under each precision
(`PrecisionScheme`, `SCHEMES`), and where model states live, what is sharded and what is moved to
host memory or NVMe (`Layout`, every one of them in order of preference in `LAYOUTS`).

The arithmetic that turns them into bytes per device, host and disk is `lightning_zero.estimate`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Union

from lightning_zero.engine.config import ZeroStage, check_offload

FP32_BYTES = 4
"""The engine's optimizer steps half-precision weights through an fp32 master chunk."""


@dataclass(frozen=True)
class PrecisionScheme:
    """What one parameter costs, in bytes, split by who holds the bytes.

    The split matters because each stage shards a different term: stage 1 the optimizer term, stage 2
    also the gradient term, stage 3 also the weight term.
    """

    name: str
    """The name the command line and `precision_scheme` take."""
    weight_bytes: int
    """The weights the forward and backward pass read."""
    gradient_bytes: int
    """The gradients the backward pass writes (same dtype as the weights)."""
    optimizer_bytes: int
    """Everything the optimizer keeps per parameter: an fp32 master copy if any, Adam's two moments."""
    description: str
    """One line saying where the numbers come from."""
    master_bytes: int = 0
    """The part of `optimizer_bytes` that is an fp32 master copy of the weights (0 where there is none)."""

    def __post_init__(self) -> None:
        for field in ("weight_bytes", "gradient_bytes", "optimizer_bytes"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if not 0 <= self.master_bytes < self.optimizer_bytes:
            raise ValueError(f"master_bytes must be at least 0 and less than optimizer_bytes, got {self.master_bytes}")

    @property
    def total_bytes(self) -> int:
        """Bytes per parameter with nothing sharded (DDP)."""
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def moment_bytes(self) -> int:
        """What the optimizer allocates itself (Adam's moments): `optimizer_bytes` less the master copy."""
        return self.optimizer_bytes - self.master_bytes

    @property
    def offload_chunk_bytes(self) -> int:
        """Bytes per element of the master and gradient chunks offload keeps on the host: the engine's
        master dtype, fp32 for half-precision weights, else the weights' own (`ShardedParam.master_dtype`)."""
        return max(self.weight_bytes, FP32_BYTES)


SCHEMES: Mapping[str, PrecisionScheme] = {
    scheme.name: scheme
    for scheme in (
        PrecisionScheme(
            "mixed",
            weight_bytes=2,
            gradient_bytes=2,
            # fp32 master weights (4) + Adam's fp32 momentum (4) and variance (4): the paper's K = 12.
            optimizer_bytes=12,
            master_bytes=4,
            description="fp16/bf16 weights and gradients; fp32 master copy + Adam moments (ZeRO's K=12)",
        ),
        PrecisionScheme(
            "fp32",
            weight_bytes=4,
            gradient_bytes=4,
            # Adam's two fp32 moments; the weights already are fp32, so no master copy.
            optimizer_bytes=8,
            description="fp32 weights, gradients and Adam moments, no separate master copy "
            "(also Lightning's bf16-mixed, whose parameters stay fp32 under autocast)",
        ),
        PrecisionScheme(
            "half",
            weight_bytes=2,
            gradient_bytes=2,
            # Adam's two moments kept in fp32 (torch's AdamW on bf16 parameters keeps them in bf16,
            # 4 B instead of 8: for `bf16-true` this is an upper bound).
            optimizer_bytes=8,
            description="fp16/bf16 weights and gradients with no fp32 master copy; fp32 Adam moments",
        ),
    )
}


def precision_scheme(name: str) -> PrecisionScheme:
    """The scheme called `name`, or a `ValueError` naming the ones that exist."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown precision scheme {name!r}; choose one of: {', '.join(SCHEMES)}") from None


@dataclass(frozen=True)
class Layout:
    """Where model states live: what is sharded (the stage) and what is moved to host memory."""

    stage: ZeroStage
    """What is sharded across the data-parallel ranks (`ZeroStage.NOTHING` is DDP)."""
    offload_optimizer: Union[bool, Literal["nvme"]] = False
    """True: the optimizer term (master copy and moments) lives in host memory; the step runs on the
    CPU. "nvme": as True, but the moments live in files on a local disk ([Note: optimizer state on
    NVMe] in `estimate.py`). The engine's option of the same name (its "cpu" is True here)."""
    offload_params: Union[bool, Literal["nvme"]] = False
    """Stage 3 only: True: the weight shard also lives in host memory and is copied in to be
    gathered. "nvme" (with the moments on NVMe): the master chunk lives in files too, and the host
    keeps only the few buckets of it read in at a time."""

    def __post_init__(self) -> None:
        for name in ("offload_optimizer", "offload_params"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or value == "nvme"):
                raise ValueError(f"{name} must be False, True or 'nvme', got {value!r}")
        check_offload(self.stage, self.offload_optimizer, self.offload_params)
        if self.params_on_disk and not self.state_on_disk:
            raise ValueError("offload_params='nvme' needs offload_optimizer='nvme' (the engine's rule)")

    @property
    def state_on_disk(self) -> bool:
        """The optimizer's moments live on NVMe."""
        return self.offload_optimizer == "nvme"

    @property
    def params_on_disk(self) -> bool:
        """The master chunk (the weight shard) lives on NVMe too."""
        return self.offload_params == "nvme"

    @property
    def label(self) -> str:
        """A short name: the strategy name, plus what is offloaded (e.g. `zero3 + offload optimizer`,
        `zero3 + offload optimizer (nvme), params`)."""
        name = "ddp" if self.stage is ZeroStage.NOTHING else f"zero{int(self.stage)}"
        optimizer = "offload optimizer (nvme)" if self.state_on_disk else "offload optimizer"
        if self.offload_params:
            return f"{name} + {optimizer}, params{' (nvme)' if self.params_on_disk else ''}"
        if self.offload_optimizer:
            return f"{name} + {optimizer}"
        return name


LAYOUTS: tuple[Layout, ...] = (
    Layout(ZeroStage.NOTHING),
    Layout(ZeroStage.OPTIMIZER_STATE),
    Layout(ZeroStage.GRADIENTS),
    Layout(ZeroStage.PARAMETERS),
    Layout(ZeroStage.OPTIMIZER_STATE, offload_optimizer=True),
    Layout(ZeroStage.GRADIENTS, offload_optimizer=True),
    Layout(ZeroStage.PARAMETERS, offload_optimizer=True),
    Layout(ZeroStage.PARAMETERS, offload_optimizer=True, offload_params=True),
    Layout(ZeroStage.OPTIMIZER_STATE, offload_optimizer="nvme"),
    Layout(ZeroStage.GRADIENTS, offload_optimizer="nvme"),
    Layout(ZeroStage.PARAMETERS, offload_optimizer="nvme"),
    Layout(ZeroStage.PARAMETERS, offload_optimizer="nvme", offload_params=True),
    Layout(ZeroStage.PARAMETERS, offload_optimizer="nvme", offload_params="nvme"),
)
"""Every layout, in order of preference: on the device before offloading (the host step and PCIe
copies cost more than sharding), lower stages first (fewer collectives, stage 3 moves 1.5x the bytes),
NVMe last (every step reads and writes the whole optimizer state from disk)."""
