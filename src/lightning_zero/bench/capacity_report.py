"""How a capacity run (`capacity.py`) is written down: its markdown table and its chart. The files
themselves (and `bench.json`) are written by `report.write_all`, as for the benchmark."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lightning_zero.bench.chart import pyplot
from lightning_zero.bench.markdown import format_mb, markdown_table
from lightning_zero.bench.report_sections import raw_disk_line
from lightning_zero.bench.capacity_results import CapacityResult, CapacityRow
from lightning_zero.bench.results import OK

BUDGET_RULES = """\
- **budget**: per rank. CUDA: `torch.cuda.set_per_process_memory_fraction` caps the caching
  allocator, an out-of-memory error ends the try; the CUDA context and host memory are outside it.
  CPU: the whole process's resident set (VmRSS / VmHWM), the baseline of Python, torch and gloo
  included; the parent reads every rank's every 10 ms and kills the try when one is over, and a
  rank whose peak (VmHWM) went over fails it. Offload variants are not charged the state the
  engine keeps in host memory on purpose (on a GPU it is not in the device's budget), except under
  `--budget-scope host`, which charges the whole resident set to every variant: a host-memory
  budget, under which NVMe offload's files and the page cache (the kernel's) are not charged.
- **estimate**: the process baseline + the larger of the whole fp32 model every rank builds (4Ψ)
  and the `estimate` command's model states on the device (with `--budget-scope host`, on the
  device and the host; NVMe's host keeps a few buckets' moments) + activations counted with fake
  tensors; it leaves out stage 3's gathered units, communication buffers, the optimizer's
  temporaries and allocator retention (`bench/footprint.py`). The process baseline is measured:
  the least any variant's first try (size 1) needed beyond its own predicted states and activations.
- **peak**: the charged peak of the worst rank at the largest size that fit."""


def _scope(opts: dict) -> str:
    if opts.get("budget_scope") != "host":
        return ""
    return " of host memory (the whole resident set, offloaded state included)"


def _size_and_amount(row: CapacityRow, size: int, amount: int) -> str:
    if size == 0:
        return "none"
    return f"{size}" if row.capacity.mode == "batch" else f"{size} ({amount / 1e6:,.1f}M)"


def _row(r: CapacityRow) -> list[str]:
    fit = next((t for t in reversed(r.tries) if t.status == OK and t.size == r.largest_size), None)
    ratio = f"{r.capacity.largest / r.capacity.estimate:.0%}" if r.capacity.estimate else "—"
    return [
        f"`{r.name}`",
        str(r.stage),
        _size_and_amount(r, r.largest_size, r.capacity.largest),
        _size_and_amount(r, r.estimate_size, r.capacity.estimate),
        ratio,
        format_mb(fit.peak_bytes if fit else None),
        str(len(r.tries)),
        r.reason or "—",
    ]


def markdown(result: CapacityResult) -> str:
    """The capacity report: setting, the table, notes, how the budget is enforced."""
    env, model, opts = result.environment, result.model, result.options
    config = model["config"]
    mode = opts["capacity"]
    grown = (
        f"n_layer grown from 1 at width {config['n_embd']}, "
        f"{opts['batch_size']} × {opts['block_size']} tokens per rank"
        if mode == "model"
        else f"{config['n_layer']} layers × {config['n_embd']} wide (Ψ = {model['num_params']:,}), sequences of "
        f"{opts['block_size']} tokens per rank grown from 1"
    )
    knob = "n_layer (Ψ)" if mode == "model" else "batch per rank"
    lines = [
        f"# lightning-zero bench --capacity {mode}",
        "",
        f"`{opts['command']}`",
        "",
        f"Largest {'model' if mode == 'model' else 'batch'} that trains 3 steps with every rank under "
        f"{format_mb(opts['memory_budget'])} MB{_scope(opts)}: GPT, {grown}; {config['n_head']} heads; N = "
        f"{env['world_size']} ranks on {env['device']} ({env['backend']}); {opts['precision']}; AdamW. "
        f"Process baseline under every estimate: {format_mb(model['baseline_bytes'])} MB per rank (measured; "
        f"{format_mb(model['before_model_bytes'])} MB before the model is built). torch {env['torch']}.",
        "",
    ]
    headers = [
        "variant", "stage", f"largest {knob}", f"estimate {knob}", "of estimate", "peak MB", "tries", "stopped by",
    ]  # fmt: skip
    lines += markdown_table(headers, [_row(r) for r in result.variants], "llrrrrrl")
    if env.get("nvme"):
        lines += ["", raw_disk_line(env["nvme"])]
    lines += ["", "## Notes", ""]
    lines += [f"- `{r.name}`: {note}" for r in result.variants for note in r.notes]
    lines += [f"- {note}" for note in result.notes]
    lines += ["", "## Definitions", "", BUDGET_RULES, ""]
    return "\n".join(lines)


def write_chart(result: CapacityResult, path: Path) -> Optional[str]:
    """Two panels: each variant's largest next to its estimate; its peak at the largest between the
    process baseline and the budget. Returns None when written, otherwise why not."""
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    rows = result.variants
    if not rows:
        return "no variant was searched"
    model_mode = result.options["capacity"] == "model"
    scale, unit = (1e6, "parameters, millions") if model_mode else (1, "samples per rank")
    x = list(range(len(rows)))
    figure, (sizes, peaks) = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * len(rows) + 3), 8), constrained_layout=True)
    width = 0.4
    largest = [r.capacity.largest / scale for r in rows]
    sizes.bar([k - width / 2 for k in x], largest, width, label="largest that trained")
    sizes.bar([k + width / 2 for k in x], [r.capacity.estimate / scale for r in rows], width, label="estimate")
    sizes.set_ylabel(f"largest {'model' if model_mode else 'batch'}, {unit}")
    sizes.legend()
    budget = result.options["memory_budget"]
    sizes.set_title(f"N = {result.environment['world_size']} ranks, {budget / 1e6:,.0f} MB per rank")
    fits = [next((t for t in r.tries if t.status == OK and t.size == r.largest_size), None) for r in rows]
    peaks.bar(x, [(t.peak_bytes or 0) / 1e6 if t else 0 for t in fits], color="tab:green", label="peak at the largest")
    peaks.axhline(result.model["baseline_bytes"] / 1e6, color="tab:gray", linestyle=":", label="process baseline")
    peaks.axhline(budget / 1e6, color="tab:red", linestyle="--", label="budget")
    peaks.set_ylabel("charged peak, MB per rank")
    peaks.legend()
    for axes in (sizes, peaks):
        axes.set_xticks(x, [r.name for r in rows], rotation=30, ha="right")
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None
