"""The pickles of a checkpoint, read without running what they name unless the user trusts them.

[Note: untrusted checkpoints]
Unpickling calls whatever the pickle names: a checkpoint from elsewhere can run any command as it
loads. torch's answer is ``torch.load(weights_only=True)``, its default since 2.6: an unpickler that
builds tensors, containers, primitive values and the globals on an allow list (torch's own, and those
a user adds with ``torch.serialization.add_safe_globals``), and refuses any other global before
calling it. A sharded directory holds two pickles (besides its tensor items, below), and no reader
of it unpickles either differently:

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

Each tensor item in DCP's ``.distcp`` files is a ``torch.save`` archive with a pickle of its own,
which DCP's reader loads with ``torch.load(weights_only=True)``; lightning-zero's reader does the
same, once per distinct pickle (see [Note: one unpickling per distinct pickle] below).
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import pickle
import re
import sys
import types
from dataclasses import dataclass
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


# ---- DCP's tensor items ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Rebuild:
    """How torch's weights-only unpickler built the tensor of one pickle: from the storage in
    record ``record``, ``nbytes`` long, a plain CPU tensor of ``dtype`` at this offset, size and stride."""

    record: str
    nbytes: int
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def fills(self, target: torch.Tensor) -> bool:
        """Whether the tensor is the record's bytes as ``target`` holds them (all of them, in order)."""
        return (
            target.dtype == self.dtype
            and tuple(target.size()) == self.size
            and target.is_contiguous()
            and self.offset == 0
            and self.stride == torch.empty(self.size, device="meta").stride()
            and self.nbytes == target.numel() * target.element_size()
        )


class DcpTensorItems:
    """Loads DCP's tensor items as DCP's reader does (each is a ``torch.save`` archive of one tensor,
    read with ``torch.load(weights_only=True)``), unpickling each distinct pickle only once.

    [Note: one unpickling per distinct pickle]
    A checkpoint's items are a few shapes repeated (every block of a model alike, each Adam moment
    shaped like its parameter's chunk), and torch's weights-only unpickler costs ~0.3-0.5 ms a call:
    loading a 239M GPT with AdamW made 1,168 calls, now 17 (docs/benchmarks.md, "Checkpoint load"). An item's ``data.pkl`` says everything the tensor is made of
    but its bytes (dtype, size, stride, offset, which storage record, how many bytes of it), and
    unpickling is a function of the pickle's bytes: so an item whose ``data.pkl`` and byte order are
    those of an item already loaded here gets the same tensor built around its own storage record,
    without unpickling it again. The first item of each pickle goes through ``torch.load`` itself,
    so every pickle that anything is built from was checked by the weights-only unpickler, and one
    it refuses (or any archive that is not the plain case) raises or loads exactly as before.
    Only a plain result is reused (a ``torch.Tensor``, strided, on the CPU, no autograd state, no
    attributes, built from the archive's one storage record, in this machine's byte order). Where
    the tensor is all of its record and the reader wants all of it, ``read_into`` reads the record
    straight into the target, sparing the tensor in between and a copy of every byte read."""

    def __init__(self) -> None:
        self._rebuilds: dict[tuple[bytes, bytes], Optional[_Rebuild]] = {}

    def load(self, stream: IO[bytes]) -> torch.Tensor:
        """The tensor of the item ``stream`` holds (from its start), as ``torch.load(stream,
        map_location="cpu", weights_only=True)`` returns it."""
        try:
            archive = torch._C.PyTorchFileReader(stream)
            key = (archive.get_record("data.pkl"), archive.get_record("byteorder"))
            rebuild = self._rebuilds.get(key)
            if rebuild is not None:
                storage = archive.get_storage_from_record(rebuild.record, rebuild.nbytes, torch.UntypedStorage)
                return torch.empty(0, dtype=rebuild.dtype).set_(storage.untyped_storage(), rebuild.offset, rebuild.size, rebuild.stride)
        except Exception:  # noqa: BLE001 - not a plain archive: torch.load says what it makes of it
            archive, key = None, None
        stream.seek(0)
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
        if archive is not None and key not in self._rebuilds:
            self._rebuilds[key] = _plain_rebuild(tensor, archive, key[1])
        return tensor

    def read_into(self, stream: IO[bytes], target: torch.Tensor) -> bool:
        """``target.copy_(self.load(stream))`` without the tensor in between, where that is a copy of
        bytes: the item's pickle is one unpickled here already, its tensor all of its storage record,
        contiguous, of ``target``'s dtype and size, and ``target`` contiguous. The record's bytes are
        read straight into ``target``. False where not (``target`` may then be partly written: load
        the item with ``load``)."""
        try:
            archive = torch._C.PyTorchFileReader(stream)
            rebuild = self._rebuilds.get((archive.get_record("data.pkl"), archive.get_record("byteorder")))
            if rebuild is None or not rebuild.fills(target):
                return False
            stream.seek(archive.get_record_offset(rebuild.record))
            into = memoryview(target.view(-1).view(torch.uint8).numpy())
            done = 0
            while done < rebuild.nbytes:
                read = stream.readinto(into[done:])
                if not read:
                    return False
                done += read
            return True
        except Exception:  # noqa: BLE001 - not the plain case: `load` says what it makes of it
            return False


def _plain_rebuild(tensor: Any, archive: Any, byteorder: bytes) -> Optional[_Rebuild]:
    """How to rebuild ``tensor`` around another archive's storage, if it is the plain case."""
    records = [name for name in archive.get_all_records() if name.startswith("data/")]
    plain = (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and tensor.device.type == "cpu"
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.__dict__
        and len(records) == 1
        and byteorder == sys.byteorder.encode()
    )
    if not plain:
        return None
    return _Rebuild(
        records[0], tensor.untyped_storage().nbytes(), tensor.dtype, tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride())
    )
