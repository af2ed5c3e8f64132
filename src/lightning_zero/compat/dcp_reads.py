"""Reading a DCP checkpoint in this process alone, while a process group may exist.

torch 2.6's ``dcp.load`` has no ``no_dist`` flag (newer releases do) and decides by itself
(``no_dist`` = no process group initialized), so a rank of a running job that reads a checkpoint by
itself (Fabric loading a Trainer's checkpoint, ``convert`` inside a job) would be made to
coordinate with its peers; there the function ``load`` calls takes the flag.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import StorageReader

LOAD_TAKES_NO_DIST = "no_dist" in inspect.signature(dcp.load).parameters


def load_in_this_process(targets: dict[str, Any], reader: StorageReader) -> None:
    """Fill ``targets`` from ``reader`` without any collective."""
    if LOAD_TAKES_NO_DIST:
        dcp.load(targets, storage_reader=reader, no_dist=True)
    else:  # torch 2.6: what its `load` runs, given the flag
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        _load_state_dict(targets, storage_reader=reader, no_dist=True)
