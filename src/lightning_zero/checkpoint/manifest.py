"""The manifest of a sharded checkpoint directory: what it holds, written last.

A directory counts as a complete checkpoint only with a readable manifest whose files are all there
at their recorded sizes; saves also happen in a temporary directory switched into place once
complete (``atomic.py``), so an interrupted save is never found under the checkpoint's name.

Format 2 adds a CRC-32 of every file (``integrity.py``); format 1 directories (sizes only) still load.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_zero.checkpoint.errors import CorruptCheckpointError
from lightning_zero.checkpoint.folders import MANIFEST_NAME, as_folder
from lightning_zero.checkpoint.locations import PathLike

__all__ = ["MANIFEST_NAME", "META_NAME", "Manifest", "PathLike", "is_sharded_checkpoint"]

FORMAT = "lightning-zero/sharded/2"
REMOTE_FORMAT = "lightning-zero/sharded/3"
FROZEN_LEFT_OUT_FORMAT = "lightning-zero/sharded/4"
READABLE_FORMATS = ("lightning-zero/sharded/1", FORMAT, REMOTE_FORMAT, FROZEN_LEFT_OUT_FORMAT)
"""Format 2 only adds ``checksums``, format 3 (checkpoints at a URL, ``remote.py``) ``content``,
format 4 ``frozen`` (frozen weights left out, local or at a URL). The
version moves so that an older lightning-zero refuses a new checkpoint by naming its format, rather
than calling its manifest corrupted (unknown field)."""
META_NAME = "meta.pt"
"""Everything of the Lightning checkpoint that is not a tensor shard (loops, callbacks, LR
schedulers, precision state, hyperparameters, optimizer hyperparameters), written by rank 0."""



@dataclass
class Manifest:
    stage: int
    world_size: int
    params: dict[str, list[int]]
    """Each parameter's name and full shape; stored flat, chunked like ``torch.chunk``."""
    aliases: dict[str, str] = field(default_factory=dict)
    """``state_dict`` keys that are another parameter (tied weights) → that parameter's name."""
    buffers: list[str] = field(default_factory=list)
    optimizers: list[dict[str, dict[str, str]]] = field(default_factory=list)
    """Per optimizer: parameter name → {state key: "sharded" | "tensor" | "value"}."""
    optimizer_params: list[list[list[str]]] = field(default_factory=list)
    """Per optimizer, per param group: the parameter names, in order."""
    files: dict[str, int] = field(default_factory=dict)
    """Every other file of the directory and its size in bytes, checked on reading so that a
    truncated or missing shard is named instead of read as garbage."""
    checksums: dict[str, int] = field(default_factory=dict)
    """CRC-32 of every file of ``files`` (format 2; empty in format 1), checked before loading so that
    bytes changed in place are named instead of trained on."""
    format: str = FORMAT
    content: str = ""
    """Format 3: the version folder beside the manifest that holds ``files`` (``remote.py``); empty
    (and not written) where the files are beside the manifest."""
    frozen: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Format 4: the frozen parameters a ``save_frozen=False`` save left out, each one's fingerprint
    (full shape, dtype, checksum: ``frozen.py``); they are then not in ``params``. Empty (and not
    written) where every parameter was saved."""

    def write(self, directory: Any) -> None:
        data = asdict(self)
        if not self.content:
            del data["content"]  # a local directory's manifest stays format 2, byte for byte
        if self.frozen:
            data["format"] = FROZEN_LEFT_OUT_FORMAT  # older versions refuse it by its format
        else:
            del data["frozen"]
        folder = _folder(directory)
        folder.write_file(MANIFEST_NAME, json.dumps(data, indent=1).encode())

    @classmethod
    def read(cls, directory: Any) -> "Manifest":
        folder = _folder(directory)
        if not folder.exists():
            raise FileNotFoundError(f"Checkpoint {str(folder)!r} does not exist.")
        if not folder.has_manifest():
            raise ValueError(
                f"{str(folder)!r} is not a lightning-zero sharded checkpoint: it has no {MANIFEST_NAME}."
                " A sharded checkpoint gets it as the last step of a complete save; an interrupted save"
                " leaves a '*.tmp-*' directory (at a URL: a version folder no manifest names) instead."
                + _checkpoints_inside(folder)
            )
        path = f"{folder}/{MANIFEST_NAME}"
        try:
            with folder.open(MANIFEST_NAME) as f:
                data = json.loads(f.read().decode())
            manifest = cls(**data)
        except (ValueError, TypeError) as err:
            raise CorruptCheckpointError(f"The checkpoint manifest {path!r} is corrupted: {err}") from err
        directory = folder
        folder.use_content(manifest.content)
        if manifest.format not in READABLE_FORMATS:
            raise ValueError(
                f"{str(directory)!r} was written in format {manifest.format!r}; this version of"
                f" lightning-zero reads {' and '.join(map(repr, READABLE_FORMATS))}."
            )
        for name in manifest.files:
            problem = manifest.size_problem(directory, name)
            if problem is not None:
                raise CorruptCheckpointError(f"Checkpoint {str(directory)!r} is damaged: {problem}.")
        return manifest

    def size_problem(self, directory: Any, name: str) -> Optional[str]:
        """What is wrong with file ``name`` short of reading it (missing, other size), or None."""
        try:
            size = _folder(directory).size(name)
        except FileNotFoundError:
            return f"{name} is missing"
        if size != self.files[name]:
            return f"{name} is truncated or corrupted ({size} bytes, written as {self.files[name]})"
        return None

    def record_files(self, directory: Any, checksums: dict[str, int]) -> None:
        """Note the size and checksum of every file now in ``directory`` (all but the manifest)."""
        self.files = _folder(directory).sizes()
        unsummed = sorted(set(self.files) - set(checksums))
        if unsummed:
            raise RuntimeError(f"lightning-zero bug: no checksum was taken of {unsummed} in {str(directory)!r}.")
        self.checksums = {name: checksums[name] for name in self.files}


def _checkpoints_inside(folder: Any) -> str:
    """A hint where a local directory holds sharded checkpoints instead of being one (the Trainer's
    ``checkpoints/`` given for ``checkpoints/last.ckpt``): their paths, to give one of."""
    if not folder.is_local or not folder.path.is_dir():
        return ""
    inside = sorted(str(p) for p in folder.path.iterdir() if (p / MANIFEST_NAME).is_file())
    if not inside:
        return ""
    listed = ", ".join(repr(p) for p in inside[:5]) + (f" and {len(inside) - 5} more" if len(inside) > 5 else "")
    return f" HINT: it holds the sharded checkpoints {listed}; give the path of one."


def is_sharded_checkpoint(path: Any) -> bool:
    """A sharded checkpoint: a directory (or, at a URL, a location) with a manifest."""
    folder = _folder(path)
    if folder.is_local:
        return folder.path.is_dir() and folder.has_manifest()
    return folder.has_manifest()


def _folder(directory: Any) -> Any:
    return as_folder(directory)
