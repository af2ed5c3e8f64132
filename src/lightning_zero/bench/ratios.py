"""Every variant against DDP in the same run: step time, aten ops, Python calls, and the time beyond
DDP's per unit.

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
- **ms beyond DDP per unit** divides the time beyond DDP by the variant's units, where it gathers
  and releases parameters by unit: ours at stage 3 and both FSDP2 variants (one per `Block` and the
  root). That is the host work a stage-3 design pays per unit and step (on the launch-bound shape
  the whole step is host time). Stages 1-2, DDP, torch's ZeRO-1 and DeepSpeed have no units (their
  per-step work grows with parameters or buckets, and this model fits one bucket), so it is blank.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Optional, Sequence

from lightning_zero.bench.results import OK, VariantResult, round_times
from lightning_zero.bench.variants import BASELINE


def against_ddp(results: Sequence[VariantResult]) -> tuple[VariantResult, ...]:
    """`results` with every ratio to DDP and the time beyond DDP's filled in (see [Note: ratios to DDP]);
    unchanged where DDP or the variant did not run."""
    ddp = next((r for r in results if r.name == BASELINE and r.status == OK), None)
    return tuple(_against(r, ddp) if ddp is not None and r.status == OK else r for r in results)


def _against(result: VariantResult, ddp: VariantResult) -> VariantResult:
    quartiles = interval = None
    if result.paired and ddp.paired:
        rounds = list(zip(round_times(result.ranks), round_times(ddp.ranks)))
        ratios = [mine / theirs for mine, theirs in rounds]
        ratio = statistics.median(ratios)
        if len(ratios) >= 2 and result is not ddp:
            q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
            quartiles = (q1, q3)
            interval = median_interval(ratios)
        beyond_s = statistics.median(mine - theirs for mine, theirs in rounds)
    else:
        ratio = result.step_time_s / ddp.step_time_s
        beyond_s = result.step_time_s - ddp.step_time_s
    beyond_ms = beyond_s * 1e3
    return dataclasses.replace(
        result,
        step_time_ratio_to_ddp=ratio,
        step_time_ratio_quartiles=quartiles,
        step_time_ratio_ci95=interval,
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
