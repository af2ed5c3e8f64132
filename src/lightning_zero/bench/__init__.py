"""`lightning-zero bench`: our ZeRO stages side by side with DDP, torch's ZeRO-1, FSDP2 and DeepSpeed
on one model, one data stream and one machine, each next to the ZeRO paper's floors.

    from lightning_zero.bench import BenchOptions, run_bench
    result = run_bench(BenchOptions(devices=2, steps=5, variants=("ddp", "zero2")))

Modules: `options` (what to run, the named `--shape`s), `variants` (the table), `wrappers` (how each
variant is built and stepped), `worker` (one process group per variant) and `rank` (what each of its
ranks runs), `paired` (`--paired`: the variants round-robin in one process group), `memory`, `comm`,
`overhead` and `host_counts` with `python_calls` (what is measured and how), `disk` (NVMe offload's
directory, its raw figures and the engine's I/O), `io_floor` (the NVMe optimizer step against its I/O
floor, at the rates of the engine's own I/O path), `links` (`--nodes`: our collectives' bytes
intra-node and inter-node, ZeRO++'s accounting), `theory` (the floors, and the bytes per link),
`ratios` (each variant against DDP), `targets` (issue 8's targets and the notes), `results` (the
figures), `report` (markdown, JSON; its side tables `report_sections`, host work `host_report`,
building blocks `markdown`) and `chart` (PNG). `--capacity`: `capacity`
(the search for the largest model or batch under a memory budget), `budget` (how the budget is
enforced, per rank), `footprint` (the prediction beside each row), `capacity_results` (its figures),
`capacity_report` (its table and chart). `--offload-overlap`: `offload_overlap` (how much of the
offloaded host step a slow backward hides, issue 53's CPU stand-in), `offload_overlap_results` (its
figures), `offload_overlap_report` (its tables and chart), `host_bandwidth` (the memory probe and
AdamW's bytes). The console subcommand is `lightning_zero.cli.bench`.
"""

from lightning_zero.bench.options import BenchOptions
from lightning_zero.bench.results import BenchResult, VariantResult
from lightning_zero.bench.run import run_bench

__all__ = ["BenchOptions", "BenchResult", "VariantResult", "run_bench"]
