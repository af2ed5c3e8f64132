"""The pickles of a checkpoint, read without running what they name unless the user trusts them.

[Note: untrusted checkpoints]
Unpickling calls whatever the pickle names: a checkpoint from elsewhere can run any command as it
loads. torch's answer is ``torch.load(weights_only=True)``, its default since 2.6: an unpickler that
builds tensors, containers, primitive values and the globals on an allow list (torch's own, and those
a user adds with ``torch.serialization.add_safe_globals``), and refuses any other global before
calling it. A sharded directory holds two pickles, and no reader of it unpickles either differently:

- ``meta.pt`` (``torch.save``): what Lightning checkpoints besides tensors (loops, callbacks, LR
  schedulers, hyperparameters). Read as Lightning reads a checkpoint file: ``weights_only`` as the
  caller passed it (None: torch's default), and under ``weights_only`` with ``CHECKPOINT_GLOBALS``
  allowed too, the plain containers that Lightning checkpoints hold hyperparameters in.
  ``weights_only=False`` unpickles anything, for a checkpoint the user trusts. torch's weights-only
  unpickler fills no dict subclass item by item, Lightning's ``AttributeDict`` included, but may call
  an allowed class: so what lightning-zero writes (meta.pt, a full file, a converted file) is pickled
  by ``save_torch_file``, which writes such a dict as a call of its class on a plain dict.
- DCP's ``.metadata`` (a plain pickle, which DCP's own reader loads with ``pickle.load``): read with
  ``DcpMetadataUnpickler``, which admits DCP's metadata dataclasses and the torch and pathlib values
  inside them, and nothing else, whatever ``weights_only`` says: DCP writes nothing else there, so a
  trusted checkpoint never needs more. Not even ``BytesStorageMetadata``: DCP reads a bytes item
  with ``torch.load(weights_only=False)``, and lightning-zero never writes one.

A refused global raises ``UntrustedCheckpointError`` naming the checkpoint, the file and the global;
nothing it names was called.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import pickle
import re
import types
from pathlib import Path
from typing import IO, Any, Iterator, Optional, Union

import torch

from lightning_zero.checkpoint.errors import UntrustedCheckpointError

CHECKPOINT_GLOBALS: list[Any] = [
    argparse.Namespace,  # hyperparameters of scripts built on argparse (Lightning's `hparams` of old)
    pathlib.PurePosixPath,
    pathlib.PureWindowsPath,
    pathlib.PosixPath,
    pathlib.WindowsPath,
]
"""Globals that a Lightning checkpoint legitimately holds beyond torch's weights-only allow list:
data, whose unpickling calls nothing but their own constructors. The Lightning adapter adds
Lightning's ``AttributeDict`` (``allow_in_checkpoints``); this package imports no Lightning."""


def allow_in_checkpoints(*objects: Any) -> None:
    """Add ``objects`` (classes that hold data only) to ``CHECKPOINT_GLOBALS``."""
    CHECKPOINT_GLOBALS.extend(o for o in objects if o not in CHECKPOINT_GLOBALS)


@contextlib.contextmanager
def checkpoint_globals() -> Iterator[None]:
    """Inside: torch's weights-only unpickler also admits ``CHECKPOINT_GLOBALS``. Only those not yet
    admitted are added (and taken away at the end): torch's scope removes what it added, which
    would undo an enclosing scope's or the user's own ``add_safe_globals``."""
    scoped = getattr(torch.serialization, "safe_globals", None)
    if scoped is None:  # torch 2.4: no scoped form; these are data classes, allowed for good
        torch.serialization.add_safe_globals(CHECKPOINT_GLOBALS)
        yield
        return
    admitted = torch.serialization.get_safe_globals()
    with scoped([g for g in CHECKPOINT_GLOBALS if g not in admitted]):
        yield


class _CheckpointPickler(pickle.Pickler):
    """Writes a dict subclass of ``CHECKPOINT_GLOBALS`` as a call of its class on a plain dict."""

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is not dict and isinstance(obj, dict) and cls in CHECKPOINT_GLOBALS:
            return cls, (dict(obj),)
        return NotImplemented


_CHECKPOINT_PICKLING = types.ModuleType("lightning_zero_checkpoint_pickling")
_CHECKPOINT_PICKLING.Pickler = _CheckpointPickler  # what `torch.save(pickle_module=...)` uses


def save_torch_file(obj: Any, f: Union[str, Path, IO[bytes]]) -> None:
    """``torch.save(obj, f)``, readable by a weights-only load that allows ``CHECKPOINT_GLOBALS``."""
    torch.save(obj, f, pickle_module=_CHECKPOINT_PICKLING)


_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_REFUSED_OTHERWISE = re.compile(r"WeightsUnpickler error:\s*(\S[^\n]*)")


def weights_only_refusal(err: BaseException) -> Optional[str]:
    """What torch's weights-only unpickler refused, in words ("refers to posix.system"), when
    ``err`` is its refusal; else None (a damaged file, or one read with ``weights_only=False``)."""
    message = str(err)
    if not isinstance(err, pickle.UnpicklingError) or "Weights only load failed" not in message:
        return None
    found = _REFUSED_GLOBAL.search(message)
    if found:
        return f"refers to {found[1]}"
    found = _REFUSED_OTHERWISE.search(message)
    return f"holds what torch's weights-only unpickler refuses ({found[1].strip() if found else 'see torch.load'})"


def untrusted(checkpoint: Any, file: str, refusal: str) -> UntrustedCheckpointError:
    """The error for a pickle of ``checkpoint`` that a weights-only load refuses (``refusal``: what
    ``weights_only_refusal`` says)."""
    return UntrustedCheckpointError(
        f"Checkpoint {str(checkpoint)!r} is not safe to load: {file} {refusal}, which a weights-only load"
        " does not allow (unpickling it could run code; nothing in the file was run)."
        " HINT: only for a checkpoint you trust, load it with `weights_only=False` (e.g."
        " `trainer.fit(..., ckpt_path=..., weights_only=False)`, `fabric.load(..., weights_only=False)`,"
        " `lightning-zero convert --no-weights-only`), or allow that one global with"
        " `torch.serialization.add_safe_globals([...])`."
    )


def load_torch_file(path: Path, weights_only: Optional[bool], checkpoint: Any, label: str, **kwargs: Any) -> Any:
    """``torch.load(path)`` on the CPU as a checkpoint file is read (see the note above); a refused
    global raises ``UntrustedCheckpointError`` naming ``checkpoint`` and the file as ``label``."""
    try:
        with checkpoint_globals():
            return torch.load(path, map_location="cpu", weights_only=weights_only, **kwargs)
    except pickle.UnpicklingError as err:
        refused = weights_only_refusal(err)
        if refused is None:
            raise
        raise untrusted(checkpoint, label, refused) from None


# ---- DCP's .metadata -----------------------------------------------------------------------------------
_DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PurePosixPath", "PureWindowsPath", "PosixPath", "WindowsPath"},  # StorageMeta.checkpoint_id
    "pathlib._local": {"PurePosixPath", "PureWindowsPath", "PosixPath", "WindowsPath"},  # Python 3.13+
}
"""What DCP's metadata is made of (torch 2.4 to 2.13), by module; also ``torch.<dtype>``,
``torch.<layout>`` and ``torch.<memory_format>`` values."""


class DcpMetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``_DCP_METADATA_GLOBALS`` (every global a pickle calls
    or builds goes through ``find_class``, so nothing else can be reached)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_METADATA_GLOBALS.get(module, ()) or (module == "torch" and _is_torch_value(name)):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def _is_torch_value(name: str) -> bool:
    return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def load_dcp_metadata(file: IO[bytes], checkpoint: Any, label: str = ".metadata") -> Any:
    """DCP's ``Metadata`` from ``file``, read with ``DcpMetadataUnpickler``; any other global raises
    ``UntrustedCheckpointError``, saying that ``weights_only=False`` does not lift this check."""
    try:
        return DcpMetadataUnpickler(file).load()
    except _Refused as refused:
        raise UntrustedCheckpointError(
            f"Checkpoint {str(checkpoint)!r} is not safe to load: its DCP metadata ({label}) refers to"
            f" {refused.name}, which is not one of DCP's metadata types (unpickling it could run code;"
            " nothing in the file was run). DCP writes nothing else there, so the file was replaced or"
            " altered after the save. HINT: restore the checkpoint from a copy you trust;"
            " `weights_only=False` does not lift this check, as no checkpoint needs it."
        ) from None
