"""Writing one run down: a markdown report for people, a JSON file with every figure, a PNG chart.

The report is the setting, the main table, model states by kind, then the side tables
(`report_sections.py`), the host work per step (`host_report.py`), the notes and the definitions.
The chart is `chart.py`'s; the building blocks (MB figures, tables) are `markdown.py`'s. A capacity
run (`capacity.py`) is written the same way, with its own table and chart (`capacity_report.py`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from lightning_zero.bench.chart import write_chart
from lightning_zero.bench.host_report import HOST_DEFINITIONS, host_section
from lightning_zero.bench.markdown import format_mb, markdown_table, pct
from lightning_zero.bench.report_sections import (
    bytes_per_link_section, comm_by_kind_section, io_floor_section, nvme_section, ownership_section,
    traffic_by_group_section,
)  # fmt: skip
from lightning_zero.bench.results import OK, BenchResult, RunReport, VariantResult
from lightning_zero.bench.variants import BY_NAME

MARKDOWN_NAME, JSON_NAME, CHART_NAME, LOG_DIR_NAME = "bench.md", "bench.json", "bench.png", "logs"

_PRECISION_WORDS = {"fp32": "fp32", "bf16-mixed": "bf16-mixed (autocast; weights, gradients, moments fp32)"}

_TARGET_LABELS = {
    "model_state": "model state", "communication": "comm", "step_time": "time", "vs_peers": "vs peers",
    "overhead": "overhead", "io_floor": "I/O floor",
}  # fmt: skip

DEFINITIONS = """\
- **model state**: bytes of parameters, gradients and optimizer state one rank holds, counted by
  storage (views once, padding included), at the point of the step where the sum is largest; the
  worst rank. **floor**: the ZeRO paper's per-rank figure for the stage with fp32 Adam
  (4 + 4 + 8 bytes per parameter: 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N). Target: within 5% + one unit.
- **peak**: CUDA max allocated, or peak RSS (VmHWM, reset after setup; the processes run with
  MALLOC_MMAP_THRESHOLD_=131072 so freed buffers leave RSS); the worst rank. Includes activations,
  buffers and the process itself, so it is not comparable with the floor.
- **step**: median over timed steps of the slowest rank; **× DDP**: divided by DDP's in this run.
- **aten ops/step**: operators torch's dispatcher ran in one step (forward, backward, optimizer and
  everything around them); on a GPU roughly the kernel launches. **host syncs**: calls that make the
  host wait for the device (`.item()`, `.tolist()`, `bool(t)`, device-to-CPU copies; counted on CPU
  too), as all / made by lightning-zero / of those, in forward and backward. Targets (ours, issue
  11): ≤ 1.15× DDP's ops at stages 1-2, ≤ 1.35× at stage 3; syncs ≤ 1 per step, 0 in forward and
  backward.
- **calls, comm**: collectives of one step as seen by torch's dispatcher (`c10d::*` operators,
  DDP's C++ reducer included); comm = bytes a rank receives in a ring: (N-1)/N of the buffer per
  all-gather / reduce-scatter / broadcast, 2(N-1)/N per all-reduce. **floor**: 2Ψ·4 B·(N-1)/N up to
  stage 2, 3Ψ·4 B·(N-1)/N at stage 3. Target: within 1%.
- **ownership path** (`zero2_whole`, `zero3_whole`, asked for by name): AdamW's arithmetic in a class
  lightning-zero does not know (`OwnedAdamW`), so each parameter is stepped whole on one owner rank,
  as a whole-tensor optimizer's (Muon, Adafactor, LAMB, ...) is. Its floors hold the busiest owner's
  full-shape moments and add the all-to-alls (`theory.owner_exchange_bytes`); no speed target.
- **missed**: issue 8's targets this variant misses (see the notes); speed targets are ours only.
  Step time against DDP's (≤ 1.03× / 1.15×) is a GPU target: a CPU run of several ranks notes the
  ratio, unjudged (gloo); at one CPU rank the step is host work, the GPU's stand-in, and it is judged.
  `zero3_offload_nvme`'s step-time target is issue 28's: ≤ 1.5× `zero3_offload`'s in the same run.
- **NVMe** (`zero3_offload_nvme`): per step of the worst rank, over the timed steps. read/write GB/s
  are bytes over the seconds the engine's I/O threads spent in `preadv`/`pwritev`, summed over the
  threads (requests overlap, so the disk's aggregate can be higher); the engine does not fsync or
  bypass the page cache, so with free memory its reads mostly come from the page cache. **waits**:
  reads and writes the optimizer step had to block on. **optimizer step** (CPU runs): the median
  slowest-rank time from the reduced gradients to the refreshed parameters, the part of the step the
  disk is in. **raw**: dd-style, one 256 MB file in the
  same directory in the same run. Its optimizer state counts the host buffers it streams through;
  the files are "on disk", in no memory column.
- **I/O floor** (NVMe variants timed alone): max(host step, bytes read / read rate + bytes written /
  write rate) for one optimizer step of the worst rank (medians over the timed steps). Bytes: the
  engine's count to the end of the step from the end of forward where the step runs during
  backward, else from the end of backward (the gathers' reads are not the step's); rates: the engine's own I/O path (`ScratchDirectory`'s threads, one `preadv`/`pwritev`
  per bucket file, every rank at once, no fsync, through the page cache as the engine goes),
  measured on the same directory right after the variant, a rank's share of the aggregate; host
  step: the optimizer's update itself (`IOStats.update_seconds`). **step / floor**: the optimizer
  step's wall time over the floor; target ≤ 1.2× (issue 61); below 1 where the step ran during
  backward, or reads prefetched at the end of backward ran before the step began. **busy**: read
  and write seconds summed over the I/O threads (a sum, not a union: above 100% means requests
  overlapped), and the update's, over the step's span (from where its reads may start: with the
  step during backward, backward and the step). **floor at raw rates**: the same at the dd-style rates, the floor if the files
  outgrew the page cache."""


def _missed(result: VariantResult) -> str:
    if result.status != OK:
        return result.status
    judged = {k: v for k, v in result.targets.items() if v is not None}
    missed = [_TARGET_LABELS[k] for k, v in judged.items() if v is False]
    return ", ".join(missed) if missed else "none"


def _main_row(r: VariantResult) -> list[str]:
    def number(value: Optional[float], fmt: str) -> str:
        return "—" if value is None else format(value, fmt)

    return [
        f"`{r.name}`",
        str(r.stage),
        format_mb(r.model_state_bytes),
        format_mb(r.theory.model_state.total),
        pct(r.model_state_vs_theory),
        format_mb(r.peak_memory_bytes),
        number(None if r.step_time_s is None else r.step_time_s * 1e3, ",.0f"),
        number(r.step_time_ratio_to_ddp, ".2f"),
        number(r.tokens_per_s, ",.0f"),
        number(r.aten_ops_per_step, ",d"),
        number(r.aten_ops_ratio_to_ddp, ".2f"),
        _syncs(r),
        number(r.collective_calls_per_step, "d"),
        format_mb(r.comm_bytes_per_step),
        format_mb(r.theory.comm_bytes_per_step),
        pct(r.comm_vs_theory),
        number(r.final_loss, ".4f"),
        _missed(r),
    ]


def _syncs(r: VariantResult) -> str:
    """Host syncs per step: all / ours / ours in forward+backward."""
    if r.host_syncs_per_step is None:
        return "—"
    return f"{r.host_syncs_per_step} / {r.host_syncs_ours_per_step} / {r.host_syncs_ours_forward_backward}"


def _engine_kind(report: dict[str, Any], kind: str) -> int:
    """One kind's bytes from the engine's report (`MemoryReport` as a dict), device and host summed."""
    return report["device"][kind] + report["host"][kind]


def _state_row(r: VariantResult) -> list[str]:
    floor = r.theory.model_state
    kinds = r.model_state_by_kind or {}
    where = ", ".join(f"{k} {format_mb(v)}" for k, v in sorted((r.model_state_by_location or {}).items())) or "—"
    engine, comm_buffers = "—", "—"
    if r.ranks and r.model_state_phase in r.ranks[0].engine_reports:
        report = r.ranks[0].engine_reports[r.model_state_phase]
        engine = " / ".join(format_mb(_engine_kind(report, k)) for k in ("parameters", "gradients", "optimizer_state"))
        if report.get("waiting_gradients"):  # full gradients held past the floor in backward (issue 44)
            engine += f" (+{format_mb(report['waiting_gradients'])} waiting in backward)"
        comm_buffers = format_mb(report.get("comm_buffers"))
    return [
        f"`{r.name}`",
        r.model_state_phase or "—",
        f"{format_mb(kinds.get('parameters'))} / {format_mb(floor.parameters)}",
        f"{format_mb(kinds.get('gradients'))} / {format_mb(floor.gradients)}",
        f"{format_mb(kinds.get('optimizer_state'))} / {format_mb(floor.optimizer_state)}",
        where,
        format_mb(floor.offloaded) if floor.offloaded else "—",
        engine,
        comm_buffers,
    ]


def markdown(result: BenchResult) -> str:
    """The report: setting, the main table, model states by kind, notes, definitions."""
    env, model, opts = result.environment, result.model, result.options
    psi = model["num_params"]
    where = ", ".join(env["gpus"]) if env.get("gpus") else f"{env['cpu']}, {env['threads_per_rank']} thread(s) per rank"
    lines = [
        "# lightning-zero bench",
        "",
        f"`{result.options['command']}`",
        "",
        f"GPT {model['config']['n_layer']} layers × {model['config']['n_embd']} wide, "
        f"{model['config']['n_head']} heads, Ψ = {psi:,} parameters; {opts['batch_size']} × "
        f"{opts['block_size']} random byte tokens per rank; N = {env['world_size']} ranks on "
        f"{env['device']} ({env['backend']}; {where}); {_PRECISION_WORDS[opts['precision']]}; AdamW"
        f"{' (fused)' if opts['fused'] else ''}"
        f"{'; activation checkpointing on every block' if opts.get('activation_checkpointing') else ''}; "
        f"{opts['warmup']} warm-up + {opts['steps']} timed steps. "
        f"torch {env['torch']}, lightning {env['lightning']}"
        + (f", deepspeed {env['deepspeed']}" if env.get("deepspeed") else "")
        + ".",
        "",
    ]
    headers = [
        "variant", "stage", "model state MB", "floor MB", "Δ", "peak MB", "step ms", "× DDP", "tokens/s",
        "aten ops/step", "× DDP", "host syncs", "calls/step", "comm MB/step", "floor MB", "Δ", "loss", "missed",
    ]  # fmt: skip
    lines += markdown_table(headers, [_main_row(r) for r in result.variants], "llrrrrrrrrrrrrrrrl")
    lines += ["", "Model states per rank, measured / floor (MB), where the total was largest:", ""]
    state_headers = [
        "variant", "phase", "parameters", "gradients", "optimizer state", "by location", "floor offloaded",
        "engine's own report", "comm buffers kept",
    ]  # fmt: skip
    ran = [r for r in result.variants if r.status == OK]
    lines += markdown_table(state_headers, [_state_row(r) for r in ran], "llrrrlrrr")
    lines += comm_by_kind_section(ran)
    whole = [r for r in ran if BY_NAME[r.name].whole_tensor]
    if whole:
        lines += ownership_section(whole, ran)
    if opts.get("shard_group_size"):
        lines += traffic_by_group_section(result, ran, opts["shard_group_size"])
    if opts.get("nodes"):
        lines += bytes_per_link_section(result, ran)
    if env.get("nvme"):
        lines += nvme_section(env["nvme"], ran)
        lines += io_floor_section(ran)
    lines += host_section(result.variants, paired=bool(opts.get("paired")))
    lines += ["", "## Notes", ""]
    for r in result.variants:
        for note in r.notes:
            lines.append(f"- `{r.name}`: {note}")
    lines += [f"- {note}" for note in result.notes]
    if not any(r.notes for r in result.variants) and not result.notes:
        lines.append("- none")
    lines += ["", "## Definitions", "", DEFINITIONS, HOST_DEFINITIONS, ""]
    return "\n".join(lines)


# --- files ------------------------------------------------------------------------------------


def to_json(result: BenchResult) -> str:
    """Every figure of `result` (dataclasses as objects, paths as strings)."""
    return json.dumps(dataclasses.asdict(result), indent=2, default=str)


Report = TypeVar("Report", bound=RunReport)


def write_all(
    result: Report,
    out: Path,
    render: Callable[[Report], str] = markdown,
    chart: Callable[[Report, Path], Optional[str]] = write_chart,
) -> Report:
    """Write the chart, the markdown and the JSON into `out`; returns `result` with `files` set (and
    a note when there is no chart). `render` and `chart` draw a capacity run's instead."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"markdown": str(out / MARKDOWN_NAME), "json": str(out / JSON_NAME), "logs": str(out / LOG_DIR_NAME)}
    chart_problem = chart(result, out / CHART_NAME)
    notes = result.notes
    if chart_problem is None:
        files["png"] = str(out / CHART_NAME)
    else:
        files["png"] = f"not written: {chart_problem}"
        notes = notes + (f"No chart: {chart_problem}.",)
    result = dataclasses.replace(result, files=files, notes=notes)
    (out / MARKDOWN_NAME).write_text(render(result))
    (out / JSON_NAME).write_text(to_json(result) + "\n")
    return result
