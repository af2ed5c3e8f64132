"""The ZeRO engine: ``ZeroEngine`` shards a module's optimizer state, gradients and parameters.

Imports torch only, never Lightning, so it runs under any training loop (the adapters are
``lightning_zero.lightning`` and ``lightning_zero.fabric``).

A step's data, top to bottom, and the sub-package that owns each part (each may import only the
ones below it; ``parameters`` and ``gradients`` sit side by side and import neither the other):

- ``parameters``: where full parameters live — replicated (stages 1-2) or gathered per unit just
  before use and freed after (stage 3: units, their plan and materialization, the gather schedule,
  the engine's hooks in the user's modules and the module's link to its engine);
- ``gradients``: from backward to the optimizer — when buckets are reduce-scattered, what
  ``param.grad`` shows meanwhile, norms and clipping over shards, the loss scaler;
- ``buckets``: parameters that communicate together, one collective per direction;
- ``offload``: chunks and optimizer state in host memory and on NVMe;
- ``optimizer``: the user's optimizer stepping this rank's chunks, its fused host step, averages;
- ``comm``: moving bytes — collectives, buffers, host↔device copies — and the verdicts and votes
  that ride on them;
- ``shards``: what a rank holds of each parameter (the chunk layout, ``ShardedParam``), and the
  counts of the host work an aten-op count cannot see (``host_work``).

Beside them: ``config`` (what the user chooses; imported by all), ``device_roles`` (which tensors
are host memory, for the checks that stand in for NCCL's on a CPU) and ``zero_plus_plus`` (ZeRO++'s
options and the checks of them; these import nothing here but each other), and the facade that composes the parts — ``engine`` (``ZeroEngine``), ``optimizers``,
``full_weights`` and ``host_step_overlap`` (each drives parts of two side-by-side or layered
sub-packages, so it lives above them), ``memory`` — which nothing below imports.
``tests/test_import_layers.py`` holds the tree to this.
"""

from lightning_zero.engine.config import ZeroConfig, ZeroStage
from lightning_zero.engine.engine import ZeroEngine
from lightning_zero.engine.memory import MemoryReport, StateBytes
from lightning_zero.engine.optimizer.averaged_shards import AveragedShards, Buffers

__all__ = ["AveragedShards", "Buffers", "MemoryReport", "StateBytes", "ZeroConfig", "ZeroEngine", "ZeroStage"]
