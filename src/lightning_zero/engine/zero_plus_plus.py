"""ZeRO++'s three options, checked: hpZ (secondary shards), qwZ (quantized weight all-gathers) and
qgZ (quantized gradient reduction). See docs/zero-plus-plus.md.

[Note: ZeRO++]
Stage 3 moves every unit's weights across all ranks twice per step (the forward's all-gather and
backward's) and its gradients once (the reduce-scatter): 3Ψ. Past one node, all three cross the
slow link. ZeRO++ (Wang et al., 2023) cuts what crosses it three ways, each an option here:

* **hpZ**, ``secondary_shard_size=K``: after a unit's forward each rank keeps a 1/K share of the
  unit's gathered weights (its *secondary shard*: the rows of the K consecutive ranks' group that
  are its to keep, ``secondary_shards.py``), and backward's gather runs among those K ranks (one
  node) instead of all of them. The same values move, only over another link: bitwise zero3. It
  costs 2Ψ/K bytes per rank in half precision (the secondary shards of every unit, alive from its
  forward to its backward), reported by ``memory_report()`` and priced by the estimator.
* **qwZ**, ``quantize_weights``: the forward's all-gather sends each rank's chunk as int8 (or fp8)
  blocks with one fp32 scale each and dequantizes into the unit's storage. Forward and backward
  compute with the dequantized weights (backward gathers the same quantized bytes again, or with
  hpZ takes its secondary shard of the dequantized ones); the chunks the optimizer steps, and the
  fp32 masters, are never quantized.
* **qgZ**, ``quantize_gradients``: a bucket's gradients are reduced by two all-to-alls, within the
  node then across nodes, each sending int8 (or int4) blocks with scales and summing the received
  blocks in fp32 (``quantized_reduction.py``). No error feedback: see [Note: no error feedback]
  there.

``zero3pp`` in the registry is all three, with K the ranks of a node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch

WeightQuantization = Union[bool, Literal["int8", "fp8"]]
"""``quantize_weights``: False, True (= "int8") or "fp8" (e4m3 blocks, where torch has the dtype)."""

GradientQuantization = Union[bool, Literal["int8", "int4"]]
"""``quantize_gradients``: False, True (= "int8") or "int4" (two values a byte, as ZeRO++ sends them)."""

SecondaryShardSize = Optional[Union[int, Literal["node"]]]
"""``secondary_shard_size``: None (no hpZ), an int K, or "node" (the ranks of one node)."""

WEIGHT_FORMATS = ("int8", "fp8")
GRADIENT_FORMATS = ("int8", "int4")
QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Parameter dtypes the quantized collectives take: what blocks of int8/int4/fp8 with an fp32 scale
each can stand for. float64 asks for more exactness than a quantized collective keeps."""

ZERO_PLUS_PLUS_OPTIONS = ("secondary_shard_size", "quantize_weights", "quantize_gradients")


class NodeLayoutError(ValueError):
    """ZeRO++'s options against what the run turned out to be (the world size, the devices per node,
    the precision, hybrid sharding): raised when the ``Trainer`` or ``Fabric`` is built, and at setup.
    Its own class so that ``ZeroCLI`` can print it as the one-line strategy error it is."""


def weight_format(option: WeightQuantization) -> Optional[str]:
    """``quantize_weights`` checked and named: None (off), "int8" or "fp8"."""
    if option is False:
        return None
    if option is True:
        return "int8"
    if option == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"`quantize_weights='fp8'` needs torch's float8_e4m3fn dtype, which torch {torch.__version__} lacks; use 'int8'.")
    if option in WEIGHT_FORMATS:
        return str(option)
    raise ValueError(f"`quantize_weights` must be False, True (int8 blocks), 'int8' or 'fp8', got {option!r}.")


def gradient_format(option: GradientQuantization) -> Optional[str]:
    """``quantize_gradients`` checked and named: None (off), "int8" or "int4"."""
    if option is False:
        return None
    if option is True:
        return "int8"
    if option in GRADIENT_FORMATS:
        return str(option)
    raise ValueError(f"`quantize_gradients` must be False, True (int8 blocks), 'int8' or 'int4', got {option!r}.")


def check_secondary_option(option: SecondaryShardSize) -> None:
    """At construction: ``secondary_shard_size``'s type and range, before the world size is known."""
    if option is None or option == "node":
        return
    if not isinstance(option, int) or isinstance(option, bool) or option < 1:
        raise ValueError(
            f"`secondary_shard_size` must be None (no hpZ), a positive int K (each rank keeps 1/K of a unit"
            f" for backward's gather among K ranks) or 'node' (K = the ranks of one node), got {option!r}."
        )


def check_zero_plus_plus_options(
    stage: int, secondary_shard_size: SecondaryShardSize, quantize_weights: WeightQuantization,
    quantize_gradients: GradientQuantization, offload_params: object,
) -> None:
    """At construction (``ZeroConfig.__post_init__``): each option's value, and the combinations the
    engine refuses."""
    check_secondary_option(secondary_shard_size)
    weights, gradients = weight_format(quantize_weights), gradient_format(quantize_gradients)
    given = [name for name, on in zip(ZERO_PLUS_PLUS_OPTIONS, (secondary_shard_size is not None, weights, gradients)) if on]
    if given and stage != 3:
        raise ValueError(
            f"{', '.join(f'`{n}`' for n in given)} (ZeRO++) only {'applies' if len(given) == 1 else 'apply'} at stage 3,"
            f" where parameters are gathered for each use and gradients reduce-scattered into shards, but"
            f" `stage={stage}`. Remove {'it' if len(given) == 1 else 'them'}, or use `stage=3` (`strategy='zero3pp'`"
            " sets all three)."
        )
    if secondary_shard_size is not None and offload_params:
        raise ValueError(
            f"`secondary_shard_size` (hpZ) keeps a 1/K copy of every unit's weights on the device from its"
            f" forward to its backward, which `offload_params={offload_params!r}` exists to avoid. Use one or the"
            " other; `quantize_weights` and `quantize_gradients` work with parameter offload."
        )


@dataclass(frozen=True)
class NodeLayout:
    """Where a run's ranks sit: ``ranks_per_node`` consecutive ranks a node (Lightning's
    ``LOCAL_WORLD_SIZE``, the devices per node), ``world_size`` in all."""

    world_size: int
    ranks_per_node: int

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node


def resolve_secondary_shard_size(option: SecondaryShardSize, layout: NodeLayout) -> Optional[int]:
    """On every rank alike, as soon as the world is known (Trainer or Fabric construction, and again
    at setup): hpZ's K, or None. Raises for a K that does not split the ranks into equal groups, or
    that is the whole world (the secondary shard would be the whole unit)."""
    check_secondary_option(option)
    if option is None:
        return None
    k = layout.ranks_per_node if option == "node" else int(option)
    n = layout.world_size
    if k > n or n % k:
        raise NodeLayoutError(
            f"`secondary_shard_size={option!r}` (K = {k}) does not divide the {n} ranks into equal groups:"
            f" K must divide the world size ({', '.join(str(d) for d in range(1, n) if n % d == 0)} here), or be"
            " 'node' (the devices per node)."
        )
    if k == n:
        where = "one node holds every rank" if option == "node" else f"K = {k} is every rank"
        raise NodeLayoutError(
            f"`secondary_shard_size={option!r}`: {where}, so backward's gather already stays within the node"
            " and a secondary shard would be a whole second copy of each unit. hpZ (and `strategy='zero3pp'`)"
            f" is for runs of several nodes; on one node use `strategy='zero3'`{' (or a K below the world size)' if option != 'node' else ''}."
        )
    return k


def check_zero_plus_plus_layout(
    secondary_shard_size: SecondaryShardSize, quantize_gradients: GradientQuantization,
    shard_group_size: object, layout: NodeLayout,
) -> Optional[int]:
    """What the strategies check once the world is known; returns hpZ's K (or None)."""
    k = resolve_secondary_shard_size(secondary_shard_size, layout)
    on = [n for n, v in (("secondary_shard_size", secondary_shard_size is not None), ("quantize_gradients", bool(quantize_gradients))) if v]
    if on and shard_group_size is not None:
        raise NodeLayoutError(
            f"{' and '.join(f'`{n}`' for n in on)} cannot be combined with hybrid sharding (`shard_group_size="
            f"{shard_group_size!r}`): hybrid sharding already keeps parameter gathers within a shard group and"
            " reduces only 1/K of the gradients across groups. Use one or the other."
        )
    if layout.world_size % layout.ranks_per_node:
        raise NodeLayoutError(f"{layout.world_size} ranks do not split into nodes of {layout.ranks_per_node}.")
    return k


def check_quantizable(dtypes: "set[torch.dtype]", weights: Optional[str], gradients: Optional[str]) -> None:
    """At setup: every parameter dtype the quantized collectives would carry is one they take."""
    if not (weights or gradients):
        return
    bad = sorted(str(d) for d in dtypes if d not in QUANTIZABLE_DTYPES)
    if bad:
        options = " and ".join(n for n, on in (("`quantize_weights`", weights), ("`quantize_gradients`", gradients)) if on)
        raise NodeLayoutError(
            f"{options} quantize{'s' if ' and ' not in options else ''} blocks of float32, bfloat16 or float16 parameters,"
            f" but this model has {', '.join(bad)} parameters (e.g. `precision='64-true'`). Train in 32-true,"
            " bf16 or 16 precision, or turn quantization off."
        )
