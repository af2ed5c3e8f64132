"""ZeRO++'s process groups: which ranks share a node, and so which collectives stay off the slow link.

A node is ``ranks_per_node`` consecutive ranks (Lightning's devices per node, ``LOCAL_WORLD_SIZE``).
hpZ gathers backward's weights within a group of K consecutive ranks (``secondary``); qgZ reduces
gradients within the node (``within_node``), then across nodes among the ranks at the same position
in each (``across_nodes``). See [Note: ZeRO++] in ``engine/zero_plus_plus.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.zero_plus_plus import NodeLayout, check_quantizable, check_zero_plus_plus_layout

if TYPE_CHECKING:
    from lightning_zero.engine.config import ZeroConfig


@dataclass(frozen=True)
class NodeLinks:
    """The groups ZeRO++'s options communicate over, for this rank."""

    layout: NodeLayout
    secondary: collectives.ProcessGroup = None
    """hpZ: this rank's K consecutive ranks, among which backward gathers (None: no hpZ)."""
    within_node: collectives.ProcessGroup = None
    """qgZ's first all-to-all: the ranks of this rank's node (None: no qgZ)."""
    across_nodes: collectives.ProcessGroup = None
    """qgZ's second all-to-all: one rank per node, this rank's position in each (None: no qgZ, or one node)."""

    def destroy(self) -> None:
        """Free the groups (each process's own: a local call, once nothing is in flight on them)."""
        for group in (self.secondary, self.within_node, self.across_nodes):
            collectives.destroy_group(group)


def make_node_links(
    layout: NodeLayout, secondary_shard_size: Optional[int], quantizes_gradients: bool, timeout: Optional[timedelta] = None
) -> Optional[NodeLinks]:
    """The groups for hpZ's K (``secondary_shard_size``, already resolved; None: no hpZ) and qgZ, made on
    every rank in the same order; None where neither is on. hpZ's group is its own even where K is the
    node's size: gathers (in backward's order) and reductions (in bucket order) on one group would have
    to be issued in one order on every rank (see ``collectives.new_group_like``)."""
    if secondary_shard_size is None and not quantizes_gradients:
        return None
    within = across = secondary = None
    if quantizes_gradients:
        within = collectives.consecutive_groups(layout.ranks_per_node, timeout)
        if layout.nodes > 1:
            across = collectives.strided_groups(layout.ranks_per_node, timeout)
    if secondary_shard_size is not None:
        secondary = collectives.consecutive_groups(secondary_shard_size, timeout)
    return NodeLinks(layout, secondary, within, across)


def check_links(config: "ZeroConfig", links: Optional[NodeLinks], group: collectives.ProcessGroup, replicate_group: collectives.ProcessGroup) -> Optional[NodeLinks]:
    """At an engine's construction: the groups ``config``'s ZeRO++ options need were given (and none
    besides), over the same ranks as ``group``; returns ``links``."""
    needs = config.secondary_shard_size is not None or config.gradient_quantization is not None
    if needs and links is None:
        raise ValueError(
            "`secondary_shard_size` and `quantize_gradients` communicate over the node layout's process groups:"
            " build the engine with `links=make_node_links(layout, K, quantizes_gradients)` (the strategies do)."
        )
    if links is None:
        return None
    if replicate_group is not None:
        raise ValueError("ZeRO++'s node groups cannot be combined with hybrid sharding's replicate group.")
    if links.layout.world_size != collectives.world_size(group):
        raise ValueError(f"the node layout covers {links.layout.world_size} ranks, the engine's group {collectives.world_size(group)}.")
    if (config.secondary_shard_size is not None) != (links.secondary is not None) or (
        (config.gradient_quantization is not None) != (links.within_node is not None)
    ):
        raise ValueError("the node groups given do not match the config's ZeRO++ options (make them with `make_node_links`).")
    return links


def check_node_layout(
    config: "ZeroConfig", shard_group_size: object, world_size: int, ranks_per_node: int, precision: Optional[str] = None
) -> Optional[int]:
    """What a strategy checks of its ZeRO++ options once the world is known (``Trainer``/``Fabric``
    construction: every rank builds one, so every rank raises alike, before any process group
    exists; and again at setup); returns hpZ's K, or None. ``precision``: Lightning's name for the
    run's precision, whose parameter dtype the quantized collectives must take."""
    layout = NodeLayout(world_size, ranks_per_node)
    k = check_zero_plus_plus_layout(config.secondary_shard_size, config.quantize_gradients, shard_group_size, layout)
    if precision is not None and str(precision).startswith("64"):
        check_quantizable({torch.float64}, config.weight_quantization, config.gradient_quantization)
    return k


def links_for(
    config: "ZeroConfig", shard_group_size: object, world_size: int, ranks_per_node: int, timeout: Optional[timedelta]
) -> Optional[NodeLinks]:
    """A strategy's ZeRO++ groups (None without hpZ and qgZ), made on every rank at setup."""
    k = check_node_layout(config, shard_group_size, world_size, ranks_per_node)
    return make_node_links(NodeLayout(world_size, ranks_per_node), k, config.gradient_quantization is not None, timeout)


class LazyNodeLinks:
    """A strategy's ZeRO++ groups (``ZeroStrategy``, ``ZeroFabricStrategy``): made at its first setup,
    on every rank, and kept for the fits after it, as its hybrid-sharding groups are."""

    def __init__(self) -> None:
        self._made = False
        self._links: Optional[NodeLinks] = None

    def get(self, strategy: Any) -> Optional[NodeLinks]:
        """The groups of ``strategy``'s options (None without hpZ and qgZ): it has ``zero_config``,
        ``shard_group_size``, ``world_size``, ``num_processes`` (devices per node) and ``_timeout``."""
        if not self._made:
            self._links = links_for(
                strategy.zero_config, strategy.shard_group_size, strategy.world_size, strategy.num_processes, strategy._timeout
            )
            self._made = True
        return self._links
