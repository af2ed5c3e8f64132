"""Bytes per link: our collectives' bytes split into intra-node and inter-node (issue 63, ZeRO++).

[Note: bytes per link]
A node is `ranks_per_node` consecutive ranks (`--nodes M` splits N ranks into M of them; on the CPU
the nodes are simulated, every rank on one machine). The engine counts every collective it issues in
`COLLECTIVE_STATS.bytes_by_group[(kind, ranks)]`, with the global ranks of its process group. A
collective's bytes are

* **intra-node** where its group lies within one node (hpZ's backward gathers among K ≤ a node's
  ranks, qgZ's first all-to-all), and
* **inter-node** where its group spans nodes (stage 3's gathers and reduce-scatters over all ranks,
  qgZ's second all-to-all among one rank per node).

The bytes are *full-buffer bytes* per rank and step, as the engine counts them: an all-gather's
output, a reduce-scatter's input, an all-to-all's input, an all-reduce's tensor, in the bytes of the
dtype that is sent (a quantized collective's uint8 rows, scales and padding included). What crosses
a link is the ring's share of it, (G-1)/G for a group of G ranks, and a group that spans nodes also
moves part of its buffer between ranks of one node: the split is by group, ZeRO++'s accounting
(Wang et al., 2023, section 3), not a model of the wire.

All-gathers are split by the phase of the step they were issued in (`wrappers.PHASES`): the forward's
and backward's, which hpZ and qwZ treat differently, and any after backward (the parameter refresh
of stages 1-2).
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

INTRA, INTER = "intra", "inter"
LINKS = (INTRA, INTER)
CATEGORIES = (
    "all_gather forward", "all_gather backward", "all_gather after backward", "reduce_scatter", "all_to_all", "all_reduce",
)  # fmt: skip
"""The rows of a variant's bytes by link, in the report's order; a kind the engine counts and these
do not name is reported under its own name, after them."""

GroupBytes = Mapping[tuple[str, tuple[int, ...]], int]
"""`COLLECTIVE_STATS.bytes_by_group`: full-buffer bytes by (kind, global ranks of the group)."""
LinkBytes = dict[str, dict[str, int]]
"""Full-buffer bytes by category (`CATEGORIES`), then by link (`LINKS`)."""


def link_of(ranks: Sequence[int], ranks_per_node: int) -> str:
    """`INTRA` where the group of `ranks` lies within one node of `ranks_per_node` consecutive
    ranks (a group of one rank, or none, moves nothing off the node), `INTER` where it spans nodes."""
    return INTRA if len({rank // ranks_per_node for rank in ranks}) <= 1 else INTER


def category(kind: str, phase: str) -> str:
    """The row a collective of `kind` issued in `phase` of the step is counted in."""
    if kind != "all_gather":
        return kind
    return f"all_gather {phase}" if phase in ("forward", "backward") else "all_gather after backward"


def phase_deltas(snapshots: Sequence[tuple[str, GroupBytes]]) -> dict[str, Counter]:
    """Each phase's own bytes from cumulative snapshots taken at the end of each phase, in order
    (the count was reset at the start of the step)."""
    out: dict[str, Counter] = {}
    previous: Counter = Counter()
    for phase, snapshot in snapshots:
        current = Counter(snapshot)
        delta = current - previous
        out[phase] = out.get(phase, Counter()) + delta
        previous = current
    return out


def bytes_by_link(by_phase: Mapping[str, GroupBytes], ranks_per_node: int) -> LinkBytes:
    """Full-buffer bytes by category and link (see [Note: bytes per link]) from each phase's
    `bytes_by_group`; only categories that moved bytes appear."""
    out: LinkBytes = {}
    for phase, groups in by_phase.items():
        for (kind, ranks), nbytes in groups.items():
            if not nbytes:
                continue
            row = out.setdefault(category(kind, phase), {INTRA: 0, INTER: 0})
            row[link_of(ranks, ranks_per_node)] += nbytes
    order = {name: index for index, name in enumerate(CATEGORIES)}
    return dict(sorted(out.items(), key=lambda item: (order.get(item[0], len(order)), item[0])))


def link_totals(link_bytes: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Intra-node and inter-node bytes over every category."""
    return {link: sum(row.get(link, 0) for row in link_bytes.values()) for link in LINKS}
