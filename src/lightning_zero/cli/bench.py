"""`lightning-zero bench`: the options of `lightning_zero.bench.BenchOptions`, a run, and where the
report went; with `--capacity`, a capacity search (`lightning_zero.bench.capacity`) under a progress bar;
with `--offload-overlap`, how much of the offloaded host step backward hides (`lightning_zero.bench.offload_overlap`)."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Callable, Iterator

from lightning_zero.bench import variants
from lightning_zero.bench.capacity import CapacityProgress, run_capacity
from lightning_zero.bench.offload_overlap import run_offload_overlap
from lightning_zero.bench.options import (
    BUDGET_SCOPES, CAPACITY_MODES, CAPACITY_VARIANTS, DEVICES, OFFLOAD_OVERLAP_DEFAULTS, OVERLAP_VARIANTS, PRECISIONS,
    SHAPES, BenchOptions, shaped,
)  # fmt: skip
from lightning_zero.bench.run import run_bench
from lightning_zero.cli.arguments import (
    Subcommand, non_negative_float, non_negative_int, parse_count, parse_memory, positive_float, positive_int,
)  # fmt: skip

_DEFAULTS = BenchOptions()
_SHAPED = ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "devices", "warmup", "steps", "threads")
"""The options a `--shape` or `--offload-overlap` sets; given explicitly, they override it (their parser
default is None)."""


def _default(name: str) -> str:
    """An option's default, and each shape's (and `--offload-overlap`'s) where it sets one, for the help text."""
    value = getattr(_DEFAULTS, name)
    text = f"default: {'the cores divided among the ranks' if value is None else value}"
    for shape, preset in SHAPES.items():
        if name in preset:
            text += f"; --shape {shape}: {preset[name]}"
    if name in OFFLOAD_OVERLAP_DEFAULTS:
        text += f"; --offload-overlap: {OFFLOAD_OVERLAP_DEFAULTS[name]}"
    return text


def _variant_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    try:
        variants.select(names)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not names:
        raise argparse.ArgumentTypeError("name at least one variant")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `BenchOptions`, with its defaults."""
    d = _DEFAULTS
    model = parser.add_argument_group("model (a GPT; --params picks the width for the other shape options)")
    model.add_argument(
        "--shape", choices=tuple(SHAPES),
        help="a named shape, defaults for the shape and step options below (which still override it):"
        " launch-bound = 12 blocks × 64 wide, 4 heads, 1 × 32 tokens per rank, 5 warm-up + 100 timed steps,"
        " 1 thread per rank; compute is negligible, so the step is host time, what a fast GPU exposes",
    )  # fmt: skip
    width = model.add_mutually_exclusive_group()
    width.add_argument("--params", type=parse_count, metavar="N", help="target parameter count, e.g. 20M or 1.2e8")
    width.add_argument("--n-embd", type=positive_int, metavar="C", help=f"width ({_default('n_embd')})")
    model.add_argument("--n-layer", type=positive_int, metavar="L", help=f"blocks ({_default('n_layer')})")
    model.add_argument("--n-head", type=positive_int, metavar="H", help=f"heads ({_default('n_head')})")
    model.add_argument(
        "--block-size", type=positive_int, metavar="T", help=f"sequence length ({_default('block_size')})"
    )

    training = parser.add_argument_group("run")
    training.add_argument(
        "--batch-size", type=positive_int, metavar="B", help=f"sequences per rank and step ({_default('batch_size')})"
    )
    training.add_argument(
        "--devices", type=positive_int, metavar="N", help=f"ranks; 1 measures engine overhead alone ({_default('devices')})"
    )
    training.add_argument(
        "--threads", type=positive_int, metavar="K",
        help=f"CPU: intra-op threads per rank, torch.set_num_threads ({_default('threads')})",
    )  # fmt: skip
    training.add_argument(
        "--device", choices=DEVICES, default=d.device, help="cpu (gloo) or cuda (nccl, a GPU per rank); default: cpu"
    )
    training.add_argument(
        "--warmup", type=non_negative_int, metavar="K", help=f"untimed steps first ({_default('warmup')})"
    )
    training.add_argument(
        "--steps", type=positive_int, metavar="K", help=f"timed steps, median reported ({_default('steps')})"
    )
    training.add_argument(
        "--paired", action="store_true",
        help="step the variants round-robin in the same processes (one step of each in turn, each its own"
        " model, optimizer and data) and report each one's step time against DDP's as the median of per-round"
        " ratios, with its 95%% interval: resolves a few %% on shared cores, where variants timed minutes"
        " apart see different loads. DeepSpeed and NVMe offload cannot share a process and run alone (the"
        " report says so); peak memory is not measured for paired variants",
    )  # fmt: skip
    training.add_argument(
        "--variants",
        type=_variant_list,
        metavar="A,B,...",
        help="comma-separated, from: " + ", ".join(v.name for v in variants.VARIANTS)
        + " (default: all but the ownership path's "
        + ",".join(v.name for v in variants.VARIANTS if v.whole_tensor)
        + " and ZeRO++'s; with --nodes 2 or more: " + ",".join(variants.NODE_VARIANTS)
        + "; with --capacity: " + ",".join(CAPACITY_VARIANTS)
        + "; with --offload-overlap: " + ",".join(OVERLAP_VARIANTS) + ")",
    )
    training.add_argument("--precision", choices=PRECISIONS, default=d.precision, help="default: fp32")
    training.add_argument("--fused", action="store_true", help="fused AdamW in every variant")
    training.add_argument(
        "--activation-checkpointing", action="store_true",
        help="recompute every block's activations in backward (torch's checkpoint_wrapper), in every variant",
    )  # fmt: skip
    training.add_argument(
        "--shard-group-size", type=positive_int, default=d.shard_group_size, metavar="K",
        help="our variants: hybrid sharding within groups of K ranks, replicated across them; the report"
        " splits our traffic into within and across groups (default: shard over all ranks)",
    )  # fmt: skip
    training.add_argument(
        "--nodes", type=positive_int, default=d.nodes, metavar="M",
        help="split the ranks into M simulated nodes of N/M consecutive ranks (LOCAL_WORLD_SIZE; M must divide"
        " --devices): ZeRO++'s variants (" + ",".join(v for v in variants.NODE_VARIANTS if v != "zero3")
        + ") need M of 2 or more, and the report splits our collectives' bytes per step into intra-node and"
        " inter-node against ZeRO++'s accounting (default: one node)",
    )  # fmt: skip
    training.add_argument(
        "--bucket-size-mb", type=positive_float, default=d.bucket_size_mb, metavar="MB",
        help=f"bucket size of every variant that has buckets (default: {d.bucket_size_mb:g} MiB)",
    )  # fmt: skip
    training.add_argument(
        "--nvme-path", type=Path, default=d.nvme_path, metavar="DIR",
        help="zero3_offload_nvme: an existing directory on the disk to measure, where each rank keeps its"
        " optimizer state; its raw throughput is measured in the same run (default: a fresh directory"
        " under the current directory, removed afterwards)",
    )  # fmt: skip
    training.add_argument("--seed", type=int, default=d.seed, help=f"model and data seed (default: {d.seed})")
    training.add_argument(
        "--timeout", type=positive_float, default=d.timeout_s, metavar="S",
        help=f"seconds a variant (with --capacity: a try) may take before it is killed (default: {d.timeout_s:g})",
    )  # fmt: skip
    training.add_argument(
        "--out", type=Path, default=d.out, metavar="DIR", help=f"report directory (default: ./{d.out})"
    )

    capacity = parser.add_argument_group(
        "capacity: the largest model or batch each variant trains (3 steps, fresh ranks per try) with"
        " every rank under a memory budget, next to the estimate's prediction"
    )
    capacity.add_argument(
        "--capacity", choices=CAPACITY_MODES,
        help="model: grow --n-layer from 1 at the given width; batch: grow --batch-size from 1 for the given model",
    )  # fmt: skip
    capacity.add_argument(
        "--memory-budget", type=parse_memory, metavar="SIZE",
        help="per rank, e.g. 1.5GB or 141GB (a bare number is GB); CUDA: the caching allocator's cap; CPU:"
        " the process's resident memory, ~300 MB of Python and torch included (see docs/benchmarks.md)",
    )  # fmt: skip
    capacity.add_argument(
        "--budget-scope", choices=BUDGET_SCOPES, default=d.budget_scope,
        help="CPU only: device (default) charges what a GPU would hold, offload's host state left out; host"
        " charges the whole resident memory, offloaded state included (NVMe files and the page cache are not"
        " the process's memory): where zero3_offload_nvme shows what it gains",
    )  # fmt: skip

    overlap = parser.add_argument_group(
        "offload overlap: issue 53's CPU stand-in for a GPU's offloaded step, one rank by default: the step"
        " time exposed after backward with a sleep in block 0's backward (which a host step running during"
        " backward can hide behind) against the same sleep in its forward (which it cannot), with and without"
        " overlap_host_step and clipping; and the host step's bytes/s against the memory's, measured in the"
        " same run"
    )
    overlap.add_argument(
        "--offload-overlap", action="store_true",
        help="measure the overlap instead of the table; sets the defaults of the model and run options above"
        " (their --offload-overlap values)",
    )  # fmt: skip
    overlap.add_argument(
        "--sleep-ms", type=non_negative_float, metavar="MS",
        help="with --offload-overlap: the sleep in block 0's backward or forward (default: twice the host"
        " step the warm-up measures)",
    )  # fmt: skip


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Build `BenchOptions` (its checks fail as usage errors), run, print the table and the files."""
    if args.capacity is not None and args.memory_budget is None:
        parser.error("--capacity needs --memory-budget SIZE, e.g. --memory-budget 1.5GB")
    if args.memory_budget is not None and args.capacity is None:
        parser.error("--memory-budget is only used with --capacity (" + " or ".join(CAPACITY_MODES) + ")")
    if args.budget_scope != _DEFAULTS.budget_scope and args.capacity is None:
        parser.error("--budget-scope is only used with --capacity (" + " or ".join(CAPACITY_MODES) + ")")
    if args.sleep_ms is not None and not args.offload_overlap:
        parser.error("--sleep-ms is only used with --offload-overlap")
    explicit = {name: getattr(args, name) for name in _SHAPED if getattr(args, name) is not None}
    if args.variants:
        explicit["variants"] = args.variants
    elif args.nodes is not None and args.nodes >= 2 and not args.capacity and not args.offload_overlap:
        explicit["variants"] = variants.NODE_VARIANTS
    elif args.capacity:
        explicit["variants"] = CAPACITY_VARIANTS
    try:
        options = shaped(
            args.shape,
            **explicit,
            params=args.params,
            paired=args.paired,
            precision=args.precision,
            fused=args.fused,
            activation_checkpointing=args.activation_checkpointing,
            out=args.out,
            device=args.device,
            seed=args.seed,
            bucket_size_mb=args.bucket_size_mb,
            shard_group_size=args.shard_group_size,
            nodes=args.nodes,
            timeout_s=args.timeout,
            capacity=args.capacity,
            memory_budget=args.memory_budget,
            budget_scope=args.budget_scope,
            nvme_path=args.nvme_path,
            offload_overlap=args.offload_overlap,
            sleep_ms=args.sleep_ms,
        )
    except ValueError as error:
        parser.error(str(error))
        raise  # parser.error exits; this line only tells type checkers so
    if options.offload_overlap:
        result = run_offload_overlap(options, progress=lambda line: print(line, flush=True))
    elif options.capacity is None:
        result = run_bench(options, progress=lambda line: print(line, flush=True))
    else:
        with _progress_bar() as progress:
            result = run_capacity(options, progress)
    print()
    print(Path(result.files["markdown"]).read_text())
    for kind, where in result.files.items():
        print(f"{kind}: {where}")
    return 0


@contextlib.contextmanager
def _progress_bar() -> Iterator[Callable[[CapacityProgress], None]]:
    """A rich progress bar over the variants, showing the try running; a line per finished variant."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    ) as bar:
        task = bar.add_task("capacity", total=None)

        def update(progress: CapacityProgress) -> None:
            bar.update(task, description=progress.text, completed=progress.completed, total=progress.total)
            if progress.line is not None:
                bar.console.print(progress.line)

        yield update


BENCH = Subcommand(
    name="bench",
    help="Measure memory, communication and speed of our ZeRO stages against DDP, torch ZeRO-1, FSDP2 and DeepSpeed.",
    add_arguments=add_arguments,
    run=run_command,
)
