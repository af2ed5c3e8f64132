"""How an offload-overlap run (`offload_overlap.py`) is written down: its markdown tables and its chart.
The files themselves (and `bench.json`) are written by `report.write_all`, as for the benchmark."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lightning_zero.bench.chart import pyplot
from lightning_zero.bench.markdown import format_mb, markdown_table
from lightning_zero.bench.offload_overlap_results import CLIPPING_WORDS, RATIO_TARGET, OverlapResult, OverlapRow
from lightning_zero.bench.results import OK

DEFINITIONS = f"""\
- **sleep**: block 0 sleeps in its backward (an identity autograd function around its output: after
  the later blocks' gradients, before its own), or in its forward (before backward: nothing can hide
  behind it). It stands for a GPU's backward, which leaves the host free; `time.sleep` frees the cores.
- **exposed**: per step, from `loss.backward()` returning to the end of `engine.after_optimizer_step`
  (finish_backward, end_step, the clipping, `optimizer.step()`, after_optimizer_step); the median of
  the timed steps, slowest rank. **backward / forward**: exposed with the sleep in backward over
  exposed with it in forward; issue 53's target with overlap_host_step: ≤ {RATIO_TARGET:g}. With it
  off the two are equal by construction (the baseline).
- **clipping**: `clip_grads_by_global_norm_` over the optimizer's parameters between backward and the
  step; "on, not firing" with a max_norm no norm reaches (coefficient 1), "on, firing" with one every
  norm exceeds. "a hook": no clipping, a callback-like edit point instead (user code between backward
  and the step, editing nothing), with the verdict's content check (as wherever user code runs there)
  or without it (as for a Trainer with no hook): the difference is what the content check costs.
- **verdict ms**: the verdict's comparisons at `optimizer.step()` (versions, hyperparameters, and the
  gradients' digests where the content check runs), with the sleep in backward.
- **optimizer.step**: its median time alone, with the sleep in backward / in forward.
- **host step**: `optimizer.step()` with overlap off, clipping off, the sleep in forward: the whole
  fused AdamW step on the host. **bytes**: 28 B per fp32 element of every rank's chunks (read the
  parameter, gradient, exp_avg, exp_avg_sq; write the parameter, exp_avg, exp_avg_sq). **memory**:
  `a += b` over two 256 MiB float32 tensors (3 x 256 MiB moved), best of 5, on every rank at once
  with its threads, before and after the steps (the better kept), summed over the ranks. **hideable**: the share of the host
  step's elements in buckets whose gradients are all complete before block 0's backward (blocks 1
  and later, the final norm); the rest (block 0, the embeddings and the head tied to them) can only
  step after the sleep, so 1 - hideable is about the least backward / forward can be with overlap."""


def _load(env: dict) -> str:
    load = env.get("load_average_1min")
    return "unknown" if load is None else f"{load:.2f} on {env['cpu_count']} cores"


def _ms(value: float) -> str:
    return f"{value:,.1f}"


def _overlap_rows(row: OverlapRow) -> list[list[str]]:
    return [
        [
            f"`{row.name}`",
            "on" if line.overlap_host_step else "off",
            CLIPPING_WORDS[line.clipping],
            _ms(line.exposed_backward_ms),
            _ms(line.exposed_forward_ms),
            f"{line.ratio:.2f}",
            f"{_ms(line.optimizer_step_backward_ms)} / {_ms(line.optimizer_step_forward_ms)}",
            f"{_ms(line.before_backward_end_ms)} / {_ms(line.host_step_ms)} ({line.overlap:.0%})" if line.host_step_ms else "—",
            f"{line.verdict_ms:,.2f}" if line.overlap_host_step else "—",
        ]
        for line in row.lines
    ]


def _host_row(row: OverlapRow) -> list[str]:
    host = row.host_step
    assert host is not None and row.sleep_ms is not None
    return [
        f"`{row.name}`",
        _ms(row.sleep_ms),
        _ms(host.ms),
        format_mb(host.bytes),
        f"{host.bytes_per_s / 1e9:,.1f}",
        f"{host.bandwidth_bytes_per_s / 1e9:,.1f}",
        f"{host.of_bandwidth:.0%}",
        f"{host.hideable:.0%}",
    ]


def markdown(result: OverlapResult) -> str:
    """The overlap report: setting, the exposed times, the host step against the memory, notes, definitions."""
    env, model, opts = result.environment, result.model, result.options
    config = model["config"]
    ran = [r for r in result.variants if r.status == OK]
    lines = [
        "# lightning-zero bench --offload-overlap",
        "",
        f"`{opts['command']}`",
        "",
        f"GPT {config['n_layer']} layers × {config['n_embd']} wide, {config['n_head']} heads (Ψ = {model['num_params']:,}),"
        f" {opts['batch_size']} × {opts['block_size']} tokens per rank; N = {env['world_size']} ranks on"
        f" {env['device']} ({env['cpu']}, {env['threads_per_rank']} threads per rank); {opts['precision']}; AdamW"
        f" (fused on the host: `fused_host_step=True`). {opts['warmup']} warm-up and {opts['steps']} timed rounds, each one step of every"
        f" sleep place and clipping setting. torch {env['torch']}; load average {_load(env)} before the run"
        " (the figures need an idle machine).",
        "",
        "## Exposed after backward",
        "",
    ]
    headers = [
        "variant", "overlap_host_step", "clipping", "exposed, sleep in backward ms", "exposed, sleep in forward ms",
        "backward / forward", "optimizer.step ms (bwd / fwd)", "host step before backward's end / total ms", "verdict ms",
    ]  # fmt: skip
    lines += markdown_table(headers, [line for r in ran for line in _overlap_rows(r)], "lllrrrrrr")
    lines += ["", "## The host step against the memory", ""]
    headers = [
        "variant", "sleep ms", "host step ms", "MB moved", "GB/s", "memory GB/s", "of the memory's", "hideable",
    ]  # fmt: skip
    lines += markdown_table(headers, [_host_row(r) for r in ran], "lrrrrrrr")
    lines += ["", "## Notes", ""]
    for r in result.variants:
        if r.status != OK:
            lines.append(f"- `{r.name}`: {r.status}: {r.reason}")
        lines += [f"- `{r.name}`: {note}" for note in r.notes]
    lines += [f"- {note}" for note in result.notes]
    lines += ["", "## Definitions", "", DEFINITIONS, ""]
    return "\n".join(lines)


def write_chart(result: OverlapResult, path: Path) -> Optional[str]:
    """Exposed time with the sleep in backward next to in forward, per variant, overlap setting and
    clipping. Returns None when written, otherwise why not."""
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    ran = [r for r in result.variants if r.status == OK]
    if not ran:
        return "no variant ran"
    labels, backward, forward = [], [], []
    for r in ran:
        for line in r.lines:
            labels.append(f"{r.name}\noverlap {'on' if line.overlap_host_step else 'off'}, clip {line.clipping}")
            backward.append(line.exposed_backward_ms)
            forward.append(line.exposed_forward_ms)
    x = list(range(len(labels)))
    width = 0.4
    figure, axes = plt.subplots(figsize=(max(8.0, 0.9 * len(labels) + 3), 5), constrained_layout=True)
    axes.bar([k - width / 2 for k in x], backward, width, label="sleep in backward")
    axes.bar([k + width / 2 for k in x], forward, width, label="sleep in forward")
    axes.set_ylabel("exposed after backward, ms (median, slowest rank)")
    axes.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    axes.set_title(f"N = {result.environment['world_size']} ranks; target with overlap: backward ≤ {RATIO_TARGET:g}x forward")
    axes.legend()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None
