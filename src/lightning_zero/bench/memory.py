"""Memory a rank holds: model-state bytes by kind and location, and peak process memory.

[Note: counting model-state bytes]
Every variant says which tensors it holds as parameters, gradients and optimizer state
(`StateTensors`); each is counted by the *storage* under it, once, at the storage's full size. So
views are not counted twice (our stage-1/2 shards are views into the parameters, DDP's gradients
are views into its buckets with `gradient_as_bucket_view=True`), padding inside a storage is
counted, and a freed stage-3 parameter (storage resized to 0 bytes) counts 0. When two kinds share a
storage it is counted under the first of parameters, gradients, optimizer state. DTensors (FSDP2)
are counted by their local shard. Location is the tensor's device type ("cpu", "cuda").

This is the same rule for every variant, so the figures compare; it sees only tensors reachable
from the module and the optimizer (plus the extra ones a wrapper names), not communication buffers
or activations — those show in the peak memory instead.

[Note: peak memory]
On CUDA: `torch.cuda.max_memory_allocated`, reset after setup. On CPU: the peak resident set size
(`VmHWM` in /proc/self/status), reset after setup by writing "5" to /proc/self/clear_refs (Linux
4.0+; where that fails, the peak since the process started, and the result says so). glibc keeps
freed heap memory mapped, which hides sharding in RSS; the benchmark therefore starts its processes
with `MALLOC_MMAP_THRESHOLD_=131072` (see `worker.py`), so buffers of 128 KiB and more are mmap'ed
and returned to the system when freed; each rank also sets the same threshold with `mallopt`
(`small_mmap_threshold`), which holds even where the variable did not reach the process.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.engine.gradients.sharded_grad import ShardedGradient

KINDS = ("parameters", "gradients", "optimizer_state")
"""The three model-state terms of the ZeRO paper, in the order a shared storage is attributed."""


@dataclass(frozen=True)
class StateTensors:
    """The tensors a variant holds as model state, by kind (duplicates and views are fine)."""

    parameters: tuple[Tensor, ...] = ()
    """Weights: the module's, and the shards or copies stepped in their place."""
    gradients: tuple[Tensor, ...] = ()
    """Gradients, full or sharded."""
    optimizer_state: tuple[Tensor, ...] = ()
    """Optimizer state tensors and master copies."""


@dataclass(frozen=True)
class HeldBytes:
    """Model-state bytes held by one rank at one moment; see [Note: counting model-state bytes]."""

    parameters: int
    """Bytes of weights (full, gathered or sharded, whatever is held now)."""
    gradients: int
    """Bytes of gradients."""
    optimizer_state: int
    """Bytes of optimizer state (moments, step counters, master copies)."""
    total: int
    """The sum of the three."""
    by_location: dict[str, int] = field(default_factory=dict)
    """Total bytes by device type, e.g. {"cpu": ..., "cuda": ...}."""


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard, any other tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, Tensor) else t


def held_bytes(tensors: StateTensors) -> HeldBytes:
    """Sum the storages under `tensors`, each once (see [Note: counting model-state bytes])."""
    seen: set[tuple[str, int]] = set()
    by_kind = dict.fromkeys(KINDS, 0)
    by_location: dict[str, int] = {}
    for kind in KINDS:
        for tensor in getattr(tensors, kind):
            t = _local(tensor)
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            key = (str(t.device), storage.data_ptr())
            if nbytes == 0 or t.is_meta or key in seen:
                continue
            seen.add(key)
            by_kind[kind] += nbytes
            by_location[t.device.type] = by_location.get(t.device.type, 0) + nbytes
    return HeldBytes(**by_kind, total=sum(by_kind.values()), by_location=by_location)


def module_and_optimizer_tensors(
    module: nn.Module, optimizers: Sequence[Optimizer], extra_gradients: Iterable[Tensor] = ()
) -> StateTensors:
    """What a module and its optimizers hold: the module's parameters, every `.grad`, the
    optimizers' state tensors, and the tensors the optimizers step in place of the module's
    parameters (our shards, FSDP2's DTensors, DeepSpeed's flat partitions).

    Such a stepped tensor counts as a parameter when it has the module's parameter dtype (it *is*
    this rank's copy of the weights, e.g. a stage-3 shard) and as optimizer state otherwise (an fp32
    master copy of half-precision weights, the paper's K term)."""
    module_params = list(module.parameters())
    weight_dtype = module_params[0].dtype if module_params else torch.float32
    stepped = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    state = [
        v for opt in optimizers for per_param in opt.state.values() for v in per_param.values() if isinstance(v, Tensor)
    ]
    return StateTensors(
        parameters=tuple(module_params) + tuple(p for p in stepped if p.dtype == weight_dtype),
        # our `ShardedGradient` views hold no memory: the chunks they show are the stepped tensors' `.grad`
        gradients=tuple(g for g in (p.grad for p in (*module_params, *stepped)) if g is not None and not isinstance(g, ShardedGradient))
        + tuple(extra_gradients),
        optimizer_state=tuple(state) + tuple(p for p in stepped if p.dtype != weight_dtype),
    )


# --- peak memory ---------------------------------------------------------------------------------

MMAP_THRESHOLD_BYTES = 131072
"""128 KiB, glibc's default starting threshold, made fixed: glibc otherwise raises it (up to 32 MiB)
after the first large free, and from then on keeps freed tensors resident."""
_M_MMAP_THRESHOLD = -3  # the mallopt parameter number, from glibc's <malloc.h>


def small_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at `MMAP_THRESHOLD_BYTES` for this process (what the
    `MALLOC_MMAP_THRESHOLD_` variable does at start-up); False where libc is not glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def _status_kib(field_name: str) -> Optional[int]:
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])  # "VmHWM:   123456 kB"
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class PeakMemory:
    """How peak memory is read on this device; see [Note: peak memory]."""

    device: torch.device
    """The rank's device: CUDA figures for a GPU, the process's RSS for the CPU."""

    def reset(self) -> str:
        """Start a new peak now; returns what the peak will mean, for the report."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return "torch.cuda.max_memory_allocated since setup"
        try:
            with open(_CLEAR_REFS, "w") as clear_refs:
                clear_refs.write("5")  # 5 = reset the peak RSS to the current RSS (proc(5))
            return "peak RSS (VmHWM) since setup"
        except OSError:
            return "peak RSS (VmHWM) since the process started (could not reset it)"

    def current(self) -> int:
        """Bytes in use now: allocated CUDA memory, or the resident set size."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return 1024 * (_status_kib("VmRSS") or 0)

    def peak(self) -> int:
        """Peak bytes since `reset`."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return 1024 * (_status_kib("VmHWM") or 0)
