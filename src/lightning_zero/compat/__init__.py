"""What differs between the torch and Lightning releases lightning-zero supports, one module per concern.

- ``versions``: the supported range, checked when ``lightning_zero`` is imported;
- ``lightning_api``: Lightning 2.5 against 2.6 (Fabric's setup signature, ``weights_only`` on loads, autocast's weight cache);
- ``dcp_reads``: reading a DCP checkpoint in one process of a job (``dcp.load(no_dist=...)``, missing in torch 2.6);
- ``cuda_memory``: torch's report of its pinned host pool (``torch.cuda.host_memory_stats``, from torch 2.7);
- ``fsdp2_cpu``: whether the benchmark's FSDP2 runs on the CPU (``torch.cpu.Stream.record_event``, from torch 2.7).

The collectives' names (``all_gather_single`` from torch 2.13, the list ``reduce_scatter`` gloo has
only from torch 2.8) are picked in ``engine/comm/collectives.py``, the one module that calls
``torch.distributed``. DTensor needs no module: its public import path exists from torch 2.5, below
the supported range. Nor does DCP's save planner (``checkpoint/save_plan.py``): overriding
``DefaultSavePlanner.create_global_plan`` works alike from torch 2.6 to 2.14.

Each module decides once (at import, or for ``lightning_api`` at first use: importing Lightning
there would import the adapters, which import it) by asking the installed package what it offers (a parameter
in a signature, a function's presence) rather than comparing version numbers, so a backport or a
user's own ``CheckpointIO`` without the newer parameter takes the right path too.
"""
