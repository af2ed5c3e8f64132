"""A capacity run's figures (`--capacity`, `capacity.py`): each try, each variant's search, the run.
Written down like the benchmark's (`report.write_all`), as `bench.json` and `capacity_report.py`'s table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_zero.bench.results import RunReport


@dataclass(frozen=True)
class TryMeasurement:
    """What one rank measured in one capacity try (see `budget.py`, [Note: enforcing a memory budget])."""

    rank: int
    """The rank that measured."""
    baseline_bytes: int
    """Memory in use before the model was built: the process itself (RSS on CPU; 0 on CUDA)."""
    peak_bytes: int
    """Peak memory charged to the budget over setup and the steps."""
    uncharged_bytes: int
    """Host-side state of an offload variant on a CPU machine, left out of `peak_bytes` (0 otherwise)."""
    final_loss: float
    """The last step's loss: the try trained."""


@dataclass(frozen=True)
class CapacityTry:
    """One size tried for one variant."""

    size: int
    """The value of the knob grown (`n_layer` or `batch_size`)."""
    num_params: int
    """Ψ of the GPT tried."""
    status: str
    """`OK` (every rank stayed under the budget), `OVER_BUDGET`, `UNAVAILABLE` or `FAILED`."""
    reason: Optional[str]
    """Why it did not fit or failed; None when it fit."""
    peak_bytes: Optional[int]
    """Largest over ranks of the charged peak (None where the ranks were stopped before reporting)."""
    baseline_bytes: Optional[int]
    """Largest over ranks of the memory in use before the model was built."""


@dataclass(frozen=True)
class Capacity:
    """The figures of a capacity row that `bench.json` promises under `capacity`."""

    mode: str
    """"model" (`n_layer` grown at a fixed width) or "batch" (sequences per rank grown, model fixed)."""
    budget_bytes: int
    """Memory every rank had to stay under."""
    largest: int
    """The largest that trained: parameters (model) or samples per rank (batch); 0 when none did."""
    estimate: int
    """The same, predicted from `footprint.py` (the `estimate` arithmetic plus activations and baseline)."""


@dataclass(frozen=True)
class CapacityRow:
    """One variant's capacity search."""

    name: str
    """`variants.VariantSpec.name`."""
    stage: int
    """The ZeRO stage it corresponds to (0 = DDP)."""
    description: str
    """How it is configured, in one line."""
    status: str
    """`OK` when the search ended at the budget; `UNAVAILABLE` or `FAILED` when it ended otherwise."""
    reason: Optional[str]
    """Why the search ended: the first try that did not fit, or what broke."""
    capacity: Capacity
    """The figures (see `Capacity`)."""
    knob: str
    """What was grown: "n_layer" or "batch_size"."""
    largest_size: int
    """The knob's value at `capacity.largest` (0: none fit)."""
    estimate_size: int
    """The knob's value at `capacity.estimate`."""
    estimate_bytes: dict[str, int]
    """The predicted per-rank footprint at `estimate_size`, by term (see `footprint.Footprint`)."""
    tries: tuple[CapacityTry, ...]
    """Every try, in the order run."""
    notes: tuple[str, ...] = ()
    """Targets met or missed and anything else a reader must know."""


@dataclass(frozen=True)
class CapacityResult(RunReport[CapacityRow]):
    """A `--capacity` run: every variant's search (`capacity.py`)."""
