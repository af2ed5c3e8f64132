"""Every variant against DDP in the same run: step time (wall and host CPU), aten ops, Python calls,
and the host time beyond DDP's per unit.

[Note: ratios to DDP]
- Timed alone (each variant in processes of its own, one after the other), the step-time ratio is
  the variant's median step time over DDP's, and the time beyond DDP the difference of the medians.
- Paired (`paired.py`, both the variant and DDP stepped round-robin in the same processes), round
  i's ratio is the variant's step of round i over DDP's step of round i, each the slowest rank's;
  the ratio reported is the median over rounds, with the quartiles as its spread, and the time
  beyond DDP is the median of the per-round differences. A load that comes and goes on shared cores
  slows both steps of a round alike, so it cancels in the ratio instead of landing on whichever
  variant ran while it lasted. Its 95% confidence interval is distribution-free (`median_interval`):
  what says whether a 3% difference is resolved, where the quartiles say how much rounds vary.
- The same for the **host CPU time** of a step (`rank.StepTimer`: the rank process's CPU time until
  the step returns). Where the step is host work it is that work without the time spent waiting for
  a core, so on a loaded machine its ratios spread far less than the wall time's (measured at a load
  of 10 on 2 cores: zero3 / DDP rounds' quartiles 1.53–1.75 in CPU time, 1.19–2.26 in wall time,
  both medians 1.63).
- **ms beyond DDP per unit** divides the host CPU ms beyond DDP's by the variant's units, where it gathers
  and releases parameters by unit: ours at stage 3 and both FSDP2 variants (one per `Block` and the
  root). That is the host work a stage-3 design pays per unit and step (on the launch-bound shape
  the whole step is host time). Stages 1-2, DDP, torch's ZeRO-1 and DeepSpeed have no units (their
  per-step work grows with parameters or buckets, and this model fits one bucket), so it is blank.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_zero.bench.results import OK, VariantResult, round_times
from lightning_zero.bench.variants import BASELINE


def against_ddp(results: Sequence[VariantResult]) -> tuple[VariantResult, ...]:
    """`results` with every ratio to DDP and the time beyond DDP's filled in (see [Note: ratios to DDP]);
    unchanged where DDP or the variant did not run."""
    ddp = next((r for r in results if r.name == BASELINE and r.status == OK), None)
    return tuple(_against(r, ddp) if ddp is not None and r.status == OK else r for r in results)


@dataclass(frozen=True)
class _Versus:
    """One series (wall or host CPU time per step) of a variant against DDP's."""

    ratio: float
    """The median ratio (see [Note: ratios to DDP])."""
    quartiles: Optional[tuple[float, float]]
    """Paired: the rounds' first and third quartiles."""
    interval: Optional[tuple[float, float]]
    """Paired: the median's 95% interval."""
    beyond_s: float
    """Seconds beyond DDP's (paired: the median of the per-round differences)."""


def _versus(result: VariantResult, ddp: VariantResult, cpu: bool) -> _Versus:
    if not (result.paired and ddp.paired):
        mine, theirs = (result.host_cpu_s, ddp.host_cpu_s) if cpu else (result.step_time_s, ddp.step_time_s)
        return _Versus(mine / theirs, None, None, mine - theirs)
    rounds = list(zip(round_times(result.ranks, cpu), round_times(ddp.ranks, cpu)))
    ratios = [mine / theirs for mine, theirs in rounds]
    quartiles = interval = None
    if len(ratios) >= 2 and result is not ddp:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        quartiles, interval = (q1, q3), median_interval(ratios)
    beyond_s = statistics.median(mine - theirs for mine, theirs in rounds)
    return _Versus(statistics.median(ratios), quartiles, interval, beyond_s)


def _against(result: VariantResult, ddp: VariantResult) -> VariantResult:
    wall, cpu = _versus(result, ddp, cpu=False), _versus(result, ddp, cpu=True)
    beyond_ms = cpu.beyond_s * 1e3
    return dataclasses.replace(
        result,
        step_time_ratio_to_ddp=wall.ratio,
        step_time_ratio_quartiles=wall.quartiles,
        step_time_ratio_ci95=wall.interval,
        host_cpu_ratio_to_ddp=cpu.ratio,
        host_cpu_ratio_ci95=cpu.interval,
        aten_ops_ratio_to_ddp=_ratio(result.aten_ops_per_step, ddp.aten_ops_per_step),
        python_calls_ratio_to_ddp=_ratio(result.python_calls_per_step, ddp.python_calls_per_step),
        ms_beyond_ddp=beyond_ms,
        ms_beyond_ddp_per_unit=beyond_ms / result.units if result.units else None,
    )


def median_interval(values: Sequence[float], confidence: float = 0.95) -> Optional[tuple[float, float]]:
    """A `confidence` interval of the median of `values`, assuming only that they are independent
    draws: the order statistics (k, n + 1 - k) with the largest k whose binomial tail
    P(Binomial(n, 1/2) < k) is at most (1 - confidence) / 2. None where even the smallest and
    largest value would not cover it (fewer than 6 values at 95%)."""
    n, tail = len(values), (1 - confidence) / 2
    k, below = 0, 0.0  # below = P(Binomial(n, 1/2) <= k - 1)
    while k < n and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def _ratio(mine: Optional[int], theirs: Optional[int]) -> Optional[float]:
    return mine / theirs if mine is not None and theirs else None
