"""`lightning-zero estimate`: the model-state table of `lightning_zero.estimate` for a parameter
count or a model spec (`--model`, counted on the meta device by `model_spec`), with the host memory
offload needs (and how much of it is pinned) and, for NVMe offload, the disk; given the device
memory (and the host's), a recommendation and the largest model that fits. With
`--whole-tensor-optimizer`, the optimizer state of an optimizer that steps whole tensors on owner
ranks ([Note: whole-tensor optimizer state] in `lightning_zero.estimate`). CPU offload's rows also
give the rollback copies the host step during backward may keep, a column of their own that the
host-memory check counts unless `--no-rollback` ([Note: offloaded state] there)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Optional, Union

from lightning_zero import estimate as est
from lightning_zero import sizing
from lightning_zero.cli import model_spec
from lightning_zero.cli.arguments import Subcommand, parse_count, parse_memory, positive_float, positive_int
from lightning_zero.engine.config import resolve_shard_group_size
from lightning_zero.engine.zero_plus_plus import NodeLayout, resolve_secondary_shard_size
from lightning_zero.estimate_schemes import SCHEMES, PrecisionScheme, precision_scheme


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=parse_count, metavar="N", help="number of parameters, e.g. 7.5e9 or 7.5B")
    model.add_argument(
        "--model",
        metavar="SPEC",
        help="count the parameters of package.module:Class or path/to/file.py:Class, built on the meta device",
    )
    parser.add_argument(
        "--init-args",
        metavar="JSON",
        help="keyword arguments for --model's constructor as a JSON object, e.g. '{\"n_layer\": 12}'",
    )
    parser.add_argument(
        "--frozen-params",
        type=parse_count,
        default=0,
        metavar="N",
        help="of the parameters, how many are frozen (e.g. 7B under LoRA adapters): they cost their weights"
        " only, no gradients and no optimizer state; whole on every device at stages 0-2, 1/N at stage 3"
        " (default: 0)",
    )
    parser.add_argument(
        "--keep-frozen-units-mb",
        type=_kept_budget,
        default=0.0,
        metavar="MiB",
        help="stage 3's keep_frozen_units_mb: MiB per device of frozen units' full weights kept gathered from"
        " their first forward until the optimizer step ('inf': all of them); priced as min(it, the frozen"
        " weights) in the '+ kept frozen' column, which 'fits' counts (needs --frozen-params; default: 0)",
    )
    parser.add_argument(
        "--secondary-shard-size",
        type=_shard_group_size,
        metavar="K",
        help="stage 3's hpZ (ZeRO++ secondary_shard_size): each rank keeps 1/K of every unit's weights from its"
        " forward to its backward ('node': --devices), priced as weight bytes x parameters / K in the"
        " '+ secondary' column, which 'fits' counts (rows with offload_params price none: hpZ refuses it)",
    )
    parser.add_argument("--devices", type=positive_int, required=True, metavar="N", help="devices (ranks) per node")
    parser.add_argument("--nodes", type=positive_int, default=1, metavar="N", help="number of nodes (default: 1)")
    parser.add_argument(
        "--shard-group-size",
        type=_shard_group_size,
        metavar="K",
        help="hybrid sharding: shard within groups of K ranks ('node': --devices) and replicate across"
        " them (default: shard over all ranks)",
    )
    parser.add_argument(
        "--precision",
        choices=list(SCHEMES),
        default="mixed",
        help="bytes per parameter: "
        + "; ".join(f"{s.name} = {s.weight_bytes}+{s.gradient_bytes}+{s.optimizer_bytes}" for s in SCHEMES.values())
        + " (weights+gradients+optimizer; default: mixed)",
    )
    parser.add_argument(
        "--gpu-memory",
        type=parse_memory,
        metavar="SIZE",
        help="memory per device, e.g. 80GB or 80 (GB); recommends the cheapest layout that fits and "
        "prints the largest model that fits",
    )
    parser.add_argument(
        "--host-memory",
        type=parse_memory,
        metavar="SIZE",
        help="memory per node for offloaded states, e.g. 1TB; only used with --gpu-memory (without it, "
        "offload layouts are not limited by the host and the largest model is searched without offload)",
    )
    parser.add_argument(
        "--whole-tensor-optimizer",
        action="store_true",
        help="the optimizer steps whole tensors (Muon, Adafactor, LAMB, SOAP, a class lightning-zero does not"
        " know): each parameter's state lives whole on one owner rank, as the engine plans it from --model's"
        " parameter sizes, and the owner holds the full weights and gradients of its parameters while it steps"
        " (the last column); bytes per element stay --precision's (Adam's moments: an upper bound for Muon or"
        " Adafactor). Needs --model; no NVMe rows (NVMe offload refuses such optimizers)",
    )
    parser.add_argument(
        "--no-rollback",
        action="store_true",
        help="count no rollback copies for CPU offload's host step during backward (the '+ rollback' column):"
        " right with overlap_host_step=False, or in the Lightning Trainer with no gradient clipping and no hook"
        " between backward and the optimizer step. Default: count them (12 B per parameter / N with AdamW), as"
        " a plain loop, Fabric or the Trainer with clipping keeps them",
    )
    defaults = est.NvmeStaging()
    nvme = parser.add_argument_group(
        "NVMe offload (the 'nvme' rows): the host keeps the master and gradient chunks plus a few"
        " buckets' optimizer state, the disk the rest of it"
    )
    nvme.add_argument(
        "--bucket-size-mb",
        type=positive_float,
        default=defaults.bucket_bytes / 2**20,
        metavar="MiB",
        help="parameter MiB of the largest bucket: the strategy's bucket_size_mb at stages 1-2; at stage 3 a"
        " bucket is a unit, so the largest unit's parameters (default: %(default)g, the engine's bucket size)",
    )
    nvme.add_argument(
        "--nvme-buffer-count",
        type=positive_int,
        default=defaults.buffer_count,
        metavar="K",
        help="host buffers the optimizer state streams through, each one bucket's state (default: %(default)d)",
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.init_args is not None and args.model is None:
        parser.error("--init-args needs --model")
    if args.host_memory is not None and args.gpu_memory is None:
        parser.error("--host-memory needs --gpu-memory")
    if args.whole_tensor_optimizer and args.model is None:
        parser.error("--whole-tensor-optimizer needs --model: the owner of each parameter depends on its size")
    owned = None
    if args.model is None:
        num_params = args.params
    else:
        numels = _parameter_numels(args.model, args.init_args, parser)
        num_params = sum(numels)
        owned = est.OwnedParameters(numels) if args.whole_tensor_optimizer else None
    if args.frozen_params > num_params:
        parser.error(f"--frozen-params: {args.frozen_params:,} is more than the model's {num_params:,} parameters")
    if args.keep_frozen_units_mb and not args.frozen_params:
        parser.error("--keep-frozen-units-mb needs --frozen-params: only frozen units are kept")
    if args.frozen_params and owned is not None:
        parser.error("--frozen-params with --whole-tensor-optimizer: which parameters are frozen is unknown; leave one out")
    scheme = precision_scheme(args.precision)
    try:
        shard_group_size = resolve_shard_group_size(args.shard_group_size, args.devices * args.nodes, args.devices)
    except ValueError as error:
        parser.error(f"--shard-group-size: {error}")
    topology = est.Topology(devices=args.devices, nodes=args.nodes, shard_group_size=shard_group_size)
    secondary_shard_size = None
    if args.secondary_shard_size is not None:
        if shard_group_size is not None:
            parser.error("--secondary-shard-size cannot be combined with --shard-group-size (the engine refuses hybrid sharding with hpZ)")
        try:
            secondary_shard_size = resolve_secondary_shard_size(args.secondary_shard_size, NodeLayout(args.devices * args.nodes, args.devices))
        except ValueError as error:
            parser.error(f"--secondary-shard-size: {error}")
    try:
        nvme = est.NvmeStaging(bucket_bytes=max(1, int(args.bucket_size_mb * 2**20)), buffer_count=args.nvme_buffer_count)
    except ValueError as error:
        parser.error(f"--nvme-buffer-count: {error}")
    rollback_copies = not args.no_rollback
    estimates = est.estimate_all(
        num_params, scheme, topology, nvme, owned, rollback_copies, args.frozen_params, args.keep_frozen_units_mb,
        secondary_shard_size,
    )
    recommendation = largest = None
    if args.gpu_memory is not None:
        recommendation = sizing.recommend(estimates, args.gpu_memory, args.host_memory)
        if owned is None:  # a larger model's parameter sizes, and so its owners, are unknown
            largest = sizing.largest_model(
                scheme, topology, args.gpu_memory, args.host_memory, nvme=nvme, rollback_copies=rollback_copies
            )
    report = _EstimateReport(num_params, scheme, topology, estimates, recommendation, largest, owned, rollback_copies, args.frozen_params)
    if sys.stdout.isatty():
        _print_rich(report)
    else:
        _print_plain(report)
    return 0


def _kept_budget(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"a number of MiB, 0 or more, or 'inf', got {text!r}")
    return value


def _shard_group_size(text: str) -> Union[int, str]:
    return "node" if text == "node" else positive_int(text)


def _parameter_numels(spec: str, init_args: Optional[str], parser: argparse.ArgumentParser) -> list[int]:
    # A console script runs with its own directory on sys.path, not the working directory as
    # `python -m` does; add it so `--model mypackage.model:Net` finds a package next to the user.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return model_spec.parameter_numels(spec, init_args)
    except model_spec.ModelSpecError as error:
        parser.error(f"--model: {error}")
        raise  # parser.error exits; this line only tells type checkers so


@dataclass(frozen=True)
class _EstimateReport:
    num_params: int
    scheme: PrecisionScheme
    topology: est.Topology
    estimates: tuple[est.MemoryEstimate, ...]
    recommendation: Optional[sizing.Recommendation]
    largest: Optional[sizing.LargestModel]
    owned: Optional[est.OwnedParameters] = None
    rollback_copies: bool = True
    frozen_params: int = 0

    @property
    def title(self) -> str:
        s, t = self.scheme, self.topology
        return (
            f"Model states of {self.num_params:,} parameters"
            + (f" ({self.frozen_params:,} frozen: weights only)" if self.frozen_params else "")
            + f", precision {s.name} "
            f"({s.weight_bytes} B weights + {s.gradient_bytes} B gradients + {s.optimizer_bytes} B optimizer "
            f"per parameter), {t.devices} device(s) x {t.nodes} node(s) = {t.world_size} data-parallel ranks"
            + (
                f", sharded within groups of {t.shard_group_size} and replicated across {t.world_size // t.shard_group_size}"
                if t.shard_group_size
                else ""
            )
            + (f"; {self._owners_phrase}" if self.owned else "")
        )

    @property
    def _owners_phrase(self) -> str:
        """The owner plan in words: how many elements the busiest rank steps whole, against Ψ'/N."""
        owned, ranks = self.owned, self.topology.sharding_ranks
        assert owned is not None
        return (
            f"whole-tensor optimizer: {len(owned.numels)} parameters each stepped on one owner rank, the busiest"
            f" owning {owned.busiest(ranks):,} elements (Ψ/N = {owned.total / ranks:,.0f}, largest parameter"
            f" {owned.largest:,})"
        )

    @property
    def keeps_frozen_units(self) -> bool:
        """Stage 3's rows price frozen units kept gathered (``--keep-frozen-units-mb``)."""
        return any(e.kept_frozen_units_per_rank for e in self.estimates)

    @property
    def keeps_secondary_shards(self) -> bool:
        """Stage 3's rows price hpZ's secondary shards (``--secondary-shard-size``)."""
        return any(e.secondary_shards_per_rank for e in self.estimates)

    @property
    def unit(self) -> tuple[str, int]:
        """One unit for the whole table, so its columns compare at a glance."""
        return sizing.decimal_unit(max(e.device.total for e in self.estimates))

    @property
    def headers(self) -> list[str]:
        unit = self.unit[0]
        headers = [
            "layout",
            f"per device ({unit})",
            "weights",
            "gradients",
            "optimizer",
            f"devices per node ({unit})",
            f"host per node ({unit})",
            "of which pinned",
            f"+ rollback per node ({unit})",
            f"nvme per node ({unit})",
        ]
        if self.owned:
            headers.append(f"+ owner's step ({unit})")
        if self.keeps_frozen_units:
            headers.append(f"+ kept frozen ({unit})")
        if self.keeps_secondary_shards:
            headers.append(f"+ secondary ({unit})")
        return headers + (["fits"] if self.recommendation else [])

    @property
    def rows(self) -> list[list[str]]:
        size = self.unit[1]

        def number(nbytes: int) -> str:
            return f"{nbytes / size:,.3f}"

        rows = []
        for e in self.estimates:
            row = [
                e.layout.label,
                number(e.device.total),
                number(e.device.parameters),
                number(e.device.gradients),
                number(e.device.optimizer_state),
                number(e.device.total * e.devices_per_node),
                number(e.host.total),
                number(e.pinned),
                number(e.host_step_rollback) if e.host_step_rollback else "-",
                number(e.disk) if e.layout.state_on_disk else "-",
            ]
            if self.owned:
                row.append(number(e.step_transient_per_rank) if e.step_transient_per_rank else "-")
            if self.keeps_frozen_units:
                row.append(number(e.kept_frozen_units_per_rank) if e.kept_frozen_units_per_rank else "-")
            if self.keeps_secondary_shards:
                row.append(number(e.secondary_shards_per_rank) if e.secondary_shards_per_rank else "-")
            if self.recommendation:
                r = self.recommendation
                row.append("yes" if sizing.fits(e, r.gpu_memory, r.host_memory) else "no")
            rows.append(row)
        return rows

    @property
    def footer(self) -> str:
        lines = [WHOLE_TENSOR_NOTE] if self.owned else []
        if any(e.layout.offload_optimizer is True for e in self.estimates) and not self.owned:
            lines.append(ROLLBACK_NOTE if self.rollback_copies else NO_ROLLBACK_NOTE)
        if self.recommendation is None:
            lines.append(est.LEFT_OUT)
        else:
            lines.append(self.recommendation.message)
            lines.append(self.largest.message if self.largest else LARGEST_NOT_SEARCHED)
        return "\n".join(lines)


WHOLE_TENSOR_NOTE = (
    "Whole-tensor optimizer: each rank keeps the full optimizer state of the parameters it owns (the optimizer"
    " column, for the busiest owner) and, while it steps them, their full weights and gradients (+ owner's step,"
    " per device, or per rank on the host with offload; counted by 'fits'). NVMe rows are left out."
)
ROLLBACK_NOTE = (
    "+ rollback: copies of the master chunks and optimizer state that CPU offload's host step during backward"
    " keeps, in ordinary (not pinned) memory, to undo a step that clipping or a hook between backward and the"
    " step changes; not in 'host per node', counted by 'fits' as at most this. None with overlap_host_step=False,"
    " or in the Lightning Trainer with no gradient clipping and no such hook: --no-rollback."
)
NO_ROLLBACK_NOTE = (
    "Rollback copies for the host step during backward not counted (--no-rollback): right with"
    " overlap_host_step=False, or in the Lightning Trainer with no gradient clipping and no hook between"
    " backward and the step; otherwise CPU offload keeps up to 12 B per parameter / N more on the host."
)
LARGEST_NOT_SEARCHED = (
    "Largest model: not searched for a whole-tensor optimizer, whose owners depend on the sizes of a larger"
    " model's parameters; try --model with larger --init-args."
)


def _print_plain(report: _EstimateReport) -> None:
    """Aligned text for pipes and files: the layout column left-aligned, numbers right-aligned."""
    table = [report.headers, *report.rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(report.headers))]
    print(report.title)
    for row in table:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        print("  ".join(cells).rstrip())
    print(report.footer)


def _print_rich(report: _EstimateReport) -> None:
    # Imported here: only a terminal needs rich.
    from rich.console import Console
    from rich.table import Table

    table = Table(title=report.title, caption=report.footer, caption_justify="left")
    for i, header in enumerate(report.headers):
        table.add_column(header, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in report.rows:
        table.add_row(*row, style=None if row[-1] != "no" else "dim")
    Console().print(table)


ESTIMATE = Subcommand(
    name="estimate",
    help="Model-state memory per device and per node for DDP and ZeRO stages 1-3, with and without offload.",
    add_arguments=add_arguments,
    run=run,
)
