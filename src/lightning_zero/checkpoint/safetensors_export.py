"""Sharded checkpoint directory → a Hugging Face model folder of safetensors files, in one CPU process.

The folder is what ``PreTrainedModel.save_pretrained`` writes: ``model.safetensors`` when the weights
fit in one file, else ``model-00001-of-0000N.safetensors``... and ``model.safetensors.index.json``
(``metadata.total_size``, ``metadata.total_parameters`` and ``weight_map``), split as Hugging Face
splits (``_split_into_files``), each file's header tagged ``{"format": "pt"}`` as ``from_pretrained``
requires. Names are the checkpoint's with ``strip_prefix`` removed: a LightningModule holding
``self.model = LlamaForCausalLM(...)`` saves ``model.model.layers.0...``; ``strip_prefix="model."``
gives Hugging Face's ``model.layers.0...``. Names outside the prefix (a loss module's buffers, a
metric) are left out and reported.

[Note: tied weights in an export]
safetensors refuses two names over one storage, and ``save_pretrained`` writes a tied pair once,
under the name ``_tied_weights_keys`` keeps (Llama: ``model.embed_tokens.weight``; ``lm_head.weight``
is tied back on loading, when the config says ``tie_word_embeddings``). A sharded checkpoint holds a
tied parameter once already, under its first name in ``named_parameters()`` order, the other names
listed as aliases in the manifest. In Hugging Face's models that first name is the one
``save_pretrained`` keeps (the input embedding is built before the head), so the export writes the
parameter under it and leaves the aliases out; they are reported in ``ExportedModel.tied``.

Memory: one output file at a time. Its tensors are read straight from the shard files into place
(DCP reads only the requested keys' slices, from every rank's file), into one buffer (see [Note: one
arena per file]), and safetensors writes them from that memory, with no copy. The peak is about one
output file (``max_shard_size``, or the largest tensor where that is larger) in the checkpoint's
dtype, plus one tensor, plus the file in the output dtype where ``dtype`` casts; however large the
model.
"""

from __future__ import annotations

import json
import math
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import Tensor

from lightning_zero.checkpoint.atomic import commit, temporary_sibling
from lightning_zero.checkpoint.errors import CheckpointWriteError, CorruptCheckpointError, describe
from lightning_zero.checkpoint.folders import Folder, as_folder
from lightning_zero.checkpoint.frozen_merge import check_base
from lightning_zero.checkpoint.integrity import check_directory
from lightning_zero.checkpoint.locations import PathLike, RemoteLocation, checkpoint_location
from lightning_zero.checkpoint.manifest import Manifest
from lightning_zero.checkpoint.storage import read_dcp_metadata, read_tensors, tensor_metadata

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
"""5 GB, the size most Hugging Face repositories are split at (``save_pretrained``'s default is 50 GB
since transformers 5): the export's peak memory is about one file (see the module's docstring)."""
EXPORT_TAG = {"format": "pt", "exported_by": "lightning-zero"}
"""Every file's safetensors header metadata: ``format`` for ``from_pretrained``; ``exported_by`` so
that a later export may replace this folder (``_check_destination``)."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The output dtypes ``dtype`` takes by name (floating-point tensors only are cast)."""
PIP_INSTALL = "pip install safetensors"


@dataclass(frozen=True)
class _Entry:
    """One tensor of the export: its name there, where it comes from, its shape and output dtype."""

    name: str
    """The name in the export (the checkpoint's, ``strip_prefix`` removed)."""
    key: Optional[str]
    """Its DCP key in the checkpoint; None where it comes from ``base``."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    """The dtype written (the checkpoint's unless ``dtype`` asks for another)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class ExportedModel:
    """What ``export_safetensors`` wrote."""

    out_dir: Path
    files: list[str]
    """The weight files, in order (and the index, where there is more than one)."""
    total_size: int
    """Bytes of tensor data, as the index's ``metadata.total_size`` counts them."""
    tied: dict[str, str] = field(default_factory=dict)
    """Names left out because their tensor is written under another: alias → written name."""
    outside_prefix: list[str] = field(default_factory=list)
    """Checkpoint names left out because they do not start with ``strip_prefix``."""


def export_safetensors(
    src: Union[PathLike, Folder],
    out_dir: PathLike,
    strip_prefix: str = "",
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    dtype: Union[None, str, torch.dtype] = None,
    config: Optional[PathLike] = None,
    base: Optional[Mapping[str, Tensor]] = None,
) -> ExportedModel:
    """Write the weights of the sharded checkpoint ``src`` (a directory or a URL, saved at any stage
    and world size) as a Hugging Face model folder ``out_dir``; see the module's docstring.

    ``strip_prefix``: removed from the start of every name; names without it are left out (one must
    have it). ``max_shard_size``: bytes per file, split as ``save_pretrained`` splits (a tensor
    larger than it gets a file of its own). ``dtype``: ``"bf16"``, ``"fp16"``, ``"fp32"`` or a
    torch dtype for the floating-point tensors; None keeps the checkpoint's. ``config``: a
    ``config.json`` copied into the folder, so that ``from_pretrained(out_dir)`` needs nothing else.
    ``base``: tensors by exported name, for weights the checkpoint holds no tensor for (read lazily,
    one file at a time; a safetensors ``safe_open`` wrapper keeps memory at one file). A checkpoint
    saved without its frozen weights (``save_frozen=False``) needs it, checked against the checkpoint's
    fingerprint of them first (``frozen_merge.check_base``).

    ``out_dir`` must be a local path that is missing, an empty directory or an earlier export (whose
    other files, e.g. a config or tokenizer, are kept); it is replaced only once the new folder is
    complete. ``src`` is checked against its checksums first."""
    save_file = _safetensors_save_file()
    out = _local_destination(out_dir)
    output_dtype = _output_dtype(dtype)
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size}.")
    config_path = Path(config) if config is not None else None
    if config_path is not None and not config_path.is_file():
        raise FileNotFoundError(f"The config {str(config_path)!r} to copy into the export is not a file.")
    folder = as_folder(src)
    _check_destination(out, folder)
    manifest = check_directory(folder)  # every file against its checksum: a missing shard is named here
    dcp_metadata = read_dcp_metadata(folder)
    if manifest.frozen and base is not None:  # the frozen weights left out come from `base`: the ones trained on?
        inside = {name: record for name, record in manifest.frozen.items() if name.startswith(strip_prefix)}
        by_checkpoint_name = {strip_prefix + name: t for name, t in base.items() if strip_prefix + name in inside}
        check_base(inside, by_checkpoint_name, str(folder), "base")
    selection = _select(folder, manifest, tensor_metadata(folder, dcp_metadata), strip_prefix, output_dtype, base)
    files = _split_into_files(selection.entries, max_shard_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_sibling(out, uuid.uuid4().hex[:8])
    temporary.mkdir()
    try:
        _write_files(folder, files, dcp_metadata, base, temporary, save_file)
        _carry_over(out, temporary)
        if config_path is not None:
            shutil.copyfile(config_path, temporary / CONFIG_NAME)
    except BaseException as err:
        shutil.rmtree(temporary, ignore_errors=True)  # what was at `out` stays as it was
        if isinstance(err, (CorruptCheckpointError, CheckpointWriteError)) or not isinstance(err, Exception):
            raise
        raise CheckpointWriteError(f"{str(out)!r} could not be written: {describe(err)}.") from err
    commit(temporary, out)
    written = list(files) + ([INDEX_NAME] if len(files) > 1 else [])
    return ExportedModel(out, written, sum(e.nbytes for e in selection.entries), selection.tied, selection.outside_prefix)


# ---- what is written ---------------------------------------------------------------------------
@dataclass
class _Selection:
    """What ``_select`` picked from the checkpoint (``tied`` and ``outside_prefix`` as in ``ExportedModel``)."""

    entries: list[_Entry]
    """Every tensor to write, in the checkpoint's order (parameters, then buffers)."""
    tied: dict[str, str]
    outside_prefix: list[str]


def _select(
    folder: Folder,
    manifest: Manifest,
    metadata: dict[str, Any],
    strip_prefix: str,
    dtype: Optional[torch.dtype],
    base: Optional[Mapping[str, Tensor]],
) -> _Selection:
    """The tensors to write, each tied parameter once (see [Note: tied weights in an export]), and
    what is left out. A tied parameter whose first name is outside ``strip_prefix`` is written under
    its first alias inside it."""
    names = [*manifest.params, *manifest.frozen, *manifest.buffers]  # frozen: left out by save_frozen=False, from `base`
    key_of = {name: f"model/{name}" for name in [*manifest.params, *manifest.frozen]} | {name: f"buffer/{name}" for name in manifest.buffers}
    kept = [name for name in names if name.startswith(strip_prefix)]
    if not kept:
        listed = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ValueError(
            f"strip_prefix {strip_prefix!r} maps no name of checkpoint {str(folder)!r}; its names are {listed}."
            " HINT: give the start they share up to the Hugging Face model's own names (e.g. 'model.' for a"
            " LightningModule's `self.model`), or '' to keep them whole."
        )
    written_as = {name: name for name in kept}  # checkpoint name of each tensor -> the name it is written under
    tied: dict[str, str] = {}
    for alias, name in manifest.aliases.items():
        if not alias.startswith(strip_prefix):
            continue
        if name in written_as:
            tied[alias[len(strip_prefix) :]] = written_as[name][len(strip_prefix) :]
        else:
            written_as[name] = alias
    entries = []
    for name, as_name in written_as.items():
        exported, key = as_name[len(strip_prefix) :], key_of[name]
        if key in metadata:
            shape = tuple(manifest.params[name]) if name in manifest.params else tuple(metadata[key].size)
            entries.append(_Entry(exported, key, shape, _cast(metadata[key].properties.dtype, dtype)))
        elif base is not None and exported in base:
            entries.append(_Entry(exported, None, tuple(base[exported].shape), _cast(base[exported].dtype, dtype)))
        else:
            if name in manifest.frozen and base is None:
                raise ValueError(
                    f"Checkpoint {str(folder)!r} was saved without its frozen weights (save_frozen=False; e.g. {name!r})."
                    " HINT: pass the weights it was fine-tuned from as `base` (`--base PATH`)."
                )
            hint = " nor is it in `base`" if base is not None else "; pass the weights it lacks as `base`"
            raise CorruptCheckpointError(f"Checkpoint {str(folder)!r} lists {name!r} in its manifest but holds no tensor for it{hint}.")
    return _Selection(entries, tied, [name for name in names if not name.startswith(strip_prefix)])


def _split_into_files(entries: list[_Entry], max_shard_size: int) -> dict[str, list[_Entry]]:
    """The entries by file, split as Hugging Face splits (``split_torch_state_dict_into_shards``): in
    order, a new file when the next tensor would take this one past ``max_shard_size``, a tensor
    larger than that in a file of its own; one file is ``model.safetensors``."""
    groups: list[list[_Entry]] = []
    current: list[_Entry] = []
    size = 0
    for entry in entries:
        if entry.nbytes > max_shard_size:
            groups.append([entry])
            continue
        if current and size + entry.nbytes > max_shard_size:
            groups.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    if current:
        groups.append(current)
    if len(groups) == 1:
        return {WEIGHTS_NAME: groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": group for i, group in enumerate(groups)}


def _read_file_tensors(folder: Folder, entries: list[_Entry], dcp_metadata: Any, base: Optional[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """One file's tensors, full and contiguous, read into place from every rank's shard files (see
    [Note: one arena per file])."""
    metadata = tensor_metadata(folder, dcp_metadata)
    read = [e for e in entries if e.key is not None]
    saved = _arena_views(read, [metadata[e.key].properties.dtype for e in read])
    read_tensors({e.key: view for e, view in zip(read, saved)}, folder, None, dcp_metadata)  # type: ignore[misc]
    if any(view.dtype != e.dtype for e, view in zip(read, saved)):
        written = _arena_views(read, [e.dtype for e in read])
        for source, target in zip(saved, written):
            target.copy_(source)
        saved = written  # the checkpoint's arena is freed on return
    tensors = {e.name: view.view(e.shape) for e, view in zip(read, saved)}
    for e in entries:
        if e.key is None:
            tensors[e.name] = base[e.name].reshape(e.shape).to(e.dtype).contiguous()  # type: ignore[index]
    return {e.name: tensors[e.name] for e in entries}  # in the index's order


# [Note: one arena per file]
# The tensors of one output file are flat views of one buffer, allocated once and freed as a whole
# once the file is written (safetensors accepts views of one storage that do not overlap). Tensors
# allocated one by one leave the heap fragmented (glibc serves allocations under 32 MB from it):
# exporting a 167M-parameter Llama (673 MB in fp32) in 100 MB files peaked 380 MB above the
# process's start that way, 276 MB with the arena. That is the largest file (131 MB: the embedding
# alone) and, once per tensor shape in each file, the DCP reader's first item of that shape, loaded
# whole before it is copied (see [Note: one unpickling per distinct pickle] in ``pickles.py``).
# Where ``dtype`` casts, the cast goes into a second arena in the output dtype.
ARENA_ALIGNMENT = 64
"""Bytes each view starts on a multiple of (any dtype's alignment; a cache line)."""


def _arena_views(entries: list[_Entry], dtypes: list[torch.dtype]) -> list[Tensor]:
    """One flat tensor per entry, of its element count in the given dtype, all views of one buffer."""
    offsets, end = [], 0
    for e, dtype in zip(entries, dtypes):
        offsets.append(end)
        end += -(-math.prod(e.shape) * dtype.itemsize // ARENA_ALIGNMENT) * ARENA_ALIGNMENT
    arena = torch.empty(end, dtype=torch.uint8)
    return [
        arena[offset : offset + math.prod(e.shape) * dtype.itemsize].view(dtype) for e, offset, dtype in zip(entries, offsets, dtypes)
    ]


def _write_files(
    folder: Folder, files: dict[str, list[_Entry]], dcp_metadata: Any, base: Optional[Mapping[str, Tensor]], into: Path, save_file: Any
) -> None:
    """Every weight file, one in memory at a time, and the index where there is more than one."""
    for filename, shard in files.items():
        tensors = _read_file_tensors(folder, shard, dcp_metadata, base)
        save_file(tensors, str(into / filename), metadata=dict(EXPORT_TAG))
        del tensors  # before the next file's are read
    if len(files) > 1:
        _write_index(into / INDEX_NAME, files)


def _write_index(path: Path, files: dict[str, list[_Entry]]) -> None:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it (keys sorted, 2-space indent)."""
    entries = [e for shard in files.values() for e in shard]
    parameters = [e for e in entries if e.key is None or e.key.startswith("model/")]  # buffers are not counted
    index = {
        "metadata": {"total_parameters": sum(math.prod(e.shape) for e in parameters), "total_size": sum(e.nbytes for e in entries)},
        "weight_map": {e.name: filename for filename, shard in files.items() for e in shard},
    }
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _cast(saved: torch.dtype, dtype: Optional[torch.dtype]) -> torch.dtype:
    return dtype if dtype is not None and saved.is_floating_point else saved


# ---- where it is written -------------------------------------------------------------------------
def _local_destination(out_dir: PathLike) -> Path:
    out = checkpoint_location(out_dir)
    if isinstance(out, RemoteLocation):
        raise ValueError(
            f"The export's folder must be a local path, got the URL {out.url!r}: `from_pretrained` reads a local"
            " folder or a Hub repository. Export locally, then upload the folder (e.g. `huggingface-cli upload`)."
        )
    return out


def _check_destination(out: Path, source: Folder) -> None:
    """``out`` missing, an empty directory or an earlier export, outside the checkpoint; anything
    else is refused, so that an export never replaces what it did not write."""
    if source.is_local and out.resolve().is_relative_to(source.path.resolve()):
        raise ValueError(f"The export's folder {str(out)!r} is inside the checkpoint {str(source)!r}; give a folder outside it.")
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"The export's folder {str(out)!r} is a file; give a missing or empty directory, or an earlier export.")
    if any(out.iterdir()) and not _is_export(out):
        raise FileExistsError(
            f"The export's folder {str(out)!r} exists and is not an earlier lightning-zero export; give a missing"
            " or empty directory, or an earlier export (which is replaced, its other files kept)."
        )


def _is_export(folder: Path) -> bool:
    """A folder whose weight files an earlier export wrote (tagged in their headers, ``EXPORT_TAG``)."""
    from safetensors import safe_open

    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        return False
    try:
        for path in weights:
            with safe_open(str(path), framework="pt") as f:
                if (f.metadata() or {}).get("exported_by") != EXPORT_TAG["exported_by"]:
                    return False
    except Exception:  # noqa: BLE001 - not a safetensors file we can read: not ours
        return False
    return True


def _carry_over(previous: Path, new: Path) -> None:
    """Files of an earlier export that are not its weights (a config, a tokenizer, a README) into the
    new folder: replacing an export replaces its weights only."""
    if not previous.is_dir():
        return
    for path in previous.iterdir():
        if path.suffix == ".safetensors" or path.name == INDEX_NAME:
            continue
        if path.is_dir():
            shutil.copytree(path, new / path.name, symlinks=True)
        else:
            shutil.copy2(path, new / path.name, follow_symlinks=False)


# ---- the safetensors package --------------------------------------------------------------------
def _safetensors_save_file() -> Any:
    """``safetensors.torch.save_file``, or an error naming the package and how to install it."""
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ImportError(
            f"Exporting to safetensors needs the `safetensors` package, which is not installed here: {PIP_INSTALL}"
        ) from err
    return save_file


def _output_dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(
        f"dtype {dtype!r} is not one the export writes; give one of {', '.join(map(repr, DTYPES))}, a floating-point"
        " torch dtype, or None to keep the checkpoint's."
    )
