"""Whether torch's FSDP2 (``fully_shard``) runs on the CPU, which the benchmark compares against.

FSDP2 records events on the current stream of the parameters' device; ``torch.cpu.Stream`` has
``record_event`` (a no-op) from torch 2.7, so torch 2.6's FSDP2 fails inside its first forward there.
"""

from __future__ import annotations

import torch

FSDP2_RUNS_ON_CPU = hasattr(torch.cpu.Stream, "record_event")


def check_fsdp2_runs_on(device: torch.device) -> None:
    """Raise ``RuntimeError`` before ``fully_shard`` where FSDP2 cannot run on ``device``."""
    if device.type == "cpu" and not FSDP2_RUNS_ON_CPU:
        raise RuntimeError(
            f"FSDP2 cannot run on the CPU with torch {torch.__version__}: it records events on"
            " torch.cpu.Stream, which has record_event from torch 2.7. HINT: upgrade torch, run the"
            " fsdp2 variants on a GPU (`--device cuda`), or leave them out (`--variants`)."
        )
