"""The report's host-work section: per step, what the host does beyond compute — Python calls,
storage resizes, hook registrations, collectives — next to the step time against DDP's (paired: the
median of per-round ratios and its quartiles) and the milliseconds beyond DDP per unit.

On a fast GPU, and on the CPU with the launch-bound shape (`options.SHAPES`), the step is host time,
so these counts are what the time is made of; they are the figures issue 51's counting tests bound.
"""

from __future__ import annotations

from typing import Optional, Sequence

from lightning_zero.bench.markdown import markdown_table
from lightning_zero.bench.results import OK, VariantResult

HOST_DEFINITIONS = """\
- **host work per step** (one untimed step after the timed ones, with no other counter installed):
  **Python calls**, every call of a Python function in the step (`sys.setprofile` 'call' events:
  the model's forward, the implementation's hooks and bookkeeping, the optimizer; C functions and
  torch operators are not counted; on CUDA autograd's backward thread is not seen, so compare CPU
  counts); **storage resizes** and **hook registrations**, what lightning-zero's engine counts
  (`engine/shards/host_work.py`; the baselines show 0, not counted); **collectives**, as in calls/step.
- **timed**: *paired*, stepped round-robin with the other paired variants in the same processes,
  one step of each in turn, the order rotated every round (`--paired`); *alone*, in processes of its
  own (without `--paired`, or where a variant cannot share a process: the reason is listed).
  **× DDP** paired is the median over rounds of (this step / DDP's step of the same round), each the
  slowest rank's (a load that comes and goes slows both alike); **95% CI**, the median's confidence
  interval (order statistics, independent rounds assumed): a difference is resolved when it lies
  outside (the rounds' quartiles are in the JSON).
- **host CPU ms**: the rank process's CPU time per step (all its threads) until the step returns,
  before waiting for the device; median, the busiest rank's. Where the step is host work (the
  launch-bound shape, a fast GPU) it is that work, without the time spent waiting for a core, so its
  ratios hold on a loaded machine where wall-time ratios spread.
- **host ms beyond DDP**: host CPU ms per step minus DDP's (paired: median of the per-round
  differences); **per unit**: divided by the units the variant gathers and releases as one (ours at stage 3, FSDP2's
  `fully_shard` groups: a `Block` each and the root); blank for variants without units (stages
  1-2, DDP, DeepSpeed), whose host work grows with parameters, not units. Peak memory is not
  measured in paired mode (the processes hold every paired variant at once)."""


def _number(value: Optional[float], fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _span(span: Optional[tuple[float, float]]) -> str:
    return "—" if span is None else f"{span[0]:.2f}–{span[1]:.2f}"


def _row(r: VariantResult) -> list[str]:
    return [
        f"`{r.name}`",
        "paired" if r.paired else "alone",
        _number(None if r.step_time_s is None else r.step_time_s * 1e3, ",.1f"),
        _number(r.step_time_ratio_to_ddp, ".3f"),
        _span(r.step_time_ratio_ci95),
        _number(None if r.host_cpu_s is None else r.host_cpu_s * 1e3, ",.1f"),
        _number(r.host_cpu_ratio_to_ddp, ".3f"),
        _span(r.host_cpu_ratio_ci95),
        _number(r.python_calls_per_step, ",d"),
        _number(r.python_calls_ratio_to_ddp, ".2f"),
        _number(r.storage_resizes_per_step, ",d"),
        _number(r.hook_registrations_per_step, ",d"),
        _number(r.collective_calls_per_step, ",d"),
        _number(r.units, "d"),
        _number(r.ms_beyond_ddp, "+,.2f"),
        _number(r.ms_beyond_ddp_per_unit, "+.3f"),
    ]


def host_section(variants: Sequence[VariantResult], paired: bool) -> list[str]:
    """The host-work table of the variants that ran, and with `paired` which ran alone and why."""
    ran = [r for r in variants if r.status == OK]
    if not ran:
        return []
    rounds = len(ran[0].ranks[0].step_times_s) if ran[0].ranks else 0
    intro = "Host work per step (counted on one untimed step; see the definitions)"
    if paired:
        together = ", ".join(f"`{r.name}`" for r in ran if r.paired) or "none"
        intro += f"; paired over {rounds} rounds: {together}"
    headers = [
        "variant", "timed", "step ms", "× DDP", "95% CI", "host CPU ms", "× DDP", "95% CI", "Python calls/step",
        "× DDP", "storage resizes/step", "hook registrations/step", "collectives/step", "units",
        "host ms beyond DDP", "per unit",
    ]  # fmt: skip
    lines = ["", intro + ":", ""] + markdown_table(headers, [_row(r) for r in ran], "llrrrrrrrrrrrrrr")
    alone = [r for r in variants if r.not_paired_because]
    if paired and alone:
        lines += ["", "Timed alone although `--paired` was given:", ""]
        lines += [f"- `{r.name}`: {r.not_paired_because}" for r in alone]
    return lines
