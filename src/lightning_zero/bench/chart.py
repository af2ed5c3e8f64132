"""The benchmark's chart (`bench.png`): model state next to its floor, peak memory, step time.

It needs matplotlib (the `bench` extra); without it the run writes the rest and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning_zero.bench.results import OK, BenchResult


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files only, or why it cannot be imported (a string)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"matplotlib is not importable ({error}); install the `bench` extra for the chart"
    return plt


def write_chart(result: BenchResult, path: Path) -> Optional[str]:
    """Three panels per variant that ran: model state next to its floor; peak memory, with the part
    already in use after setup shaded; median step time against DDP's. Returns None when written,
    otherwise why not."""
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    ran = [r for r in result.variants if r.status == OK]
    if not ran:
        return "no variant ran"
    names = [r.name for r in ran]
    x = list(range(len(ran)))
    figure, (state, peak, time) = plt.subplots(
        3, 1, figsize=(max(8.0, 0.9 * len(ran) + 3), 11), constrained_layout=True
    )
    width = 0.4
    state.bar([k - width / 2 for k in x], [r.model_state_bytes / 1e6 for r in ran], width, label="measured")
    floors = [r.theory.model_state.total / 1e6 for r in ran]
    state.bar([k + width / 2 for k in x], floors, width, label="floor (fp32 Adam)")
    state.set_ylabel("model state, MB per rank")
    state.legend()
    state.set_title(f"N = {result.environment['world_size']} ranks, Ψ = {result.model['num_params']:,} parameters")
    # paired mode measures no peak (one process holds every paired variant): those bars are left out
    peak.bar(x, [(r.peak_memory_bytes or 0) / 1e6 for r in ran], color="tab:green", label="peak")
    resting = [(r.resting_memory_bytes or 0) / 1e6 for r in ran]
    peak.bar(x, resting, color="tab:gray", alpha=0.5, label="in use after setup")
    peak.set_ylabel("peak memory, MB per rank" + (" (none where paired)" if any(r.paired for r in ran) else ""))
    peak.legend()
    time.bar(x, [r.step_time_s * 1e3 for r in ran], color="tab:purple")
    ddp = next((r for r in ran if r.name == "ddp"), None)
    if ddp is not None:
        time.axhline(ddp.step_time_s * 1e3, color="tab:red", linestyle="--", label="DDP")
        time.legend()
    time.set_ylabel("median step time, ms")
    for axes in (state, peak, time):
        axes.set_xticks(x, names, rotation=30, ha="right")
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None
