"""Sharded checkpoint directory → one plain Lightning checkpoint file, in one CPU process.

The output has the full fp32 weights under ``state_dict`` (tied weights under each of their keys;
with a weight-averaging callback the average there and the training weights under
``current_model_state``, as in DDP's file) and the rest of the Lightning checkpoint
(hyperparameters, loops, callbacks — SWA's average whole, as in DDP's file — ...), so
``torch.load`` and ``LightningModule.load_from_checkpoint`` read it with no process group. With
``include_optimizer=True`` it also holds the optimizer state in the unsharded format DDP writes, so
training can resume from it under any strategy.

A checkpoint saved without its frozen weights (``save_frozen=False``) becomes a full one with
``base``, the weights it was fine-tuned from, merged in once they match its fingerprint
(``frozen_merge.py``); without one it is refused, unless ``trainable_only`` asks for the
trainable weights alone (the file then says what it lacks under ``FROZEN_KEY``).

Memory: every tensor of the output is read once, straight from the shard files into the tensor
that is saved (DCP reads each rank's slices into place), and ``torch.save`` streams tensors to the
file, so the peak is close to the output's size — where DeepSpeed's ``zero_to_fp32`` needs ~2x.
"""

from __future__ import annotations

import io
import uuid
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_zero.checkpoint import remote
from lightning_zero.checkpoint.atomic import commit, temporary_sibling
from lightning_zero.checkpoint.directory import AVERAGED_KEY, CURRENT_MODEL_STATE, OPTIMIZERS_KEY, read_callback_shards
from lightning_zero.checkpoint.errors import CheckpointWriteError, describe
from lightning_zero.checkpoint.folders import Folder, LocalFolder, RemoteFolder, as_folder
from lightning_zero.checkpoint.frozen import digest
from lightning_zero.checkpoint.frozen_merge import FROZEN_KEY, left_out_entry, merge_base, read_base
from lightning_zero.checkpoint.integrity import check_directory
from lightning_zero.checkpoint.locations import RemoteLocation, checkpoint_location
from lightning_zero.checkpoint.manifest import Manifest, PathLike
from lightning_zero.checkpoint.pickles import save_torch_file
from lightning_zero.checkpoint.sharded import CURRENT_PREFIX, SHARDED, TENSOR, read_full_state
from lightning_zero.checkpoint.storage import read_dcp_metadata, read_meta, read_tensors, tensor_metadata


def convert_checkpoint(
    src: PathLike,
    dst: PathLike,
    include_optimizer: bool = False,
    weights_only: Optional[bool] = None,
    base: Optional[PathLike] = None,
    base_prefix: str = "",
    trainable_only: bool = False,
) -> Union[Path, RemoteLocation]:
    """Write the single-file form of the sharded checkpoint ``src`` to ``dst``; returns ``dst``.
    ``weights_only``: how ``src``'s meta.pt is unpickled, as ``torch.load`` reads a file (None:
    torch's default; see [Note: untrusted checkpoints] in ``pickles.py``). ``base``,
    ``base_prefix``, ``trainable_only``: for a checkpoint saved without its frozen weights (see
    above; ``read_base`` for the formats of ``base``).

    Refuses to overwrite ``src`` itself, or to convert a damaged one (every file is checked against
    the checksum in its manifest first); an existing ``dst`` file is replaced only once the new one
    is complete. Either may be a URL: the sharded checkpoint is read in place, and the file is
    streamed into one upload, published once complete.
    """
    source, dst = checkpoint_location(src), checkpoint_location(dst)
    same = str(dst) == str(source) if isinstance(dst, RemoteLocation) or isinstance(source, RemoteLocation) else dst.resolve() == source.resolve()
    if same:
        raise ValueError(f"convert_checkpoint would overwrite its source {str(source)!r}; choose another destination.")
    if isinstance(dst, RemoteLocation):
        if RemoteFolder(dst).has_manifest():
            raise IsADirectoryError(f"Destination {dst.url!r} is a sharded checkpoint; give the URL of the file to write.")
        checkpoint = _converted(source, include_optimizer, weights_only, base, base_prefix, trainable_only)
        try:
            remote.write_file(dst, lambda stream: save_torch_file(checkpoint, stream))
        except Exception as err:  # noqa: BLE001 - re-raised with the file named
            raise CheckpointWriteError(f"{dst.url!r} could not be written: {describe(err, with_filename=False)}.") from err
        return dst
    if dst.is_dir():
        raise IsADirectoryError(f"Destination {str(dst)!r} is a directory; give the path of the file to write.")
    checkpoint = _converted(source, include_optimizer, weights_only, base, base_prefix, trainable_only)
    dst.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_sibling(dst, uuid.uuid4().hex[:8])
    try:
        with open(temporary, "wb") as f:  # an open file, so that a full disk is reported in the OS's words
            save_torch_file(checkpoint, f)
    except Exception as err:  # noqa: BLE001 - re-raised with the file named
        temporary.unlink(missing_ok=True)
        raise CheckpointWriteError(f"{str(dst)!r} could not be written: {describe(err, with_filename=False)}.") from err
    commit(temporary, dst)
    return dst


def _converted(
    source: Any, include_optimizer: bool, weights_only: Optional[bool], base: Optional[PathLike], base_prefix: str, trainable_only: bool
) -> dict[str, Any]:
    """``full_checkpoint`` with a frozen-less checkpoint's base merged in, or refused without one."""
    checkpoint = full_checkpoint(source, include_optimizer, weights_only)
    left_out = checkpoint.get(FROZEN_KEY)
    if left_out is None:
        if base is not None:
            raise ValueError(f"Checkpoint {str(source)!r} holds every weight; `--base` is for checkpoints saved with `save_frozen=False`.")
        return checkpoint
    if base is not None:
        merge_base(checkpoint, read_base(base, base_prefix), str(source), str(base))
    elif not trainable_only:
        raise ValueError(
            f"Checkpoint {str(source)!r} was saved without its frozen weights (save_frozen=False;"
            f" {len(left_out['fingerprint'])} tensors, fingerprint {digest(left_out['fingerprint'])}). HINT: give the"
            " base they come from with `--base PATH` (`convert_checkpoint(..., base=PATH)`: a torch.save state dict,"
            " or safetensors files), checked"
            " against the checkpoint's fingerprint; or write the trainable weights alone with `--trainable-only`."
        )
    return checkpoint


def checkpoint_file(path: PathLike, weights_only: Optional[bool] = None) -> Union[Path, str, io.BytesIO]:
    """What code that reads one checkpoint *file* can take: ``path`` itself when it is a file, the
    single-file form of a sharded directory (weights and the rest, no optimizer state) in memory
    when it is one, its meta.pt unpickled under ``weights_only`` (as the reader will unpickle the
    form handed to it). For Lightning's file-only readers::

        model = MyModel.load_from_checkpoint(checkpoint_file(trainer.checkpoint_callback.best_model_path))

    At a URL: a file's URL as given (Lightning's readers open URLs), a sharded checkpoint's single-file form.
    """
    location = checkpoint_location(path)
    if isinstance(location, RemoteLocation):
        folder: Folder = RemoteFolder(location)
        if not folder.has_manifest():
            return location.url
    elif not location.is_dir():
        return location
    else:
        folder = LocalFolder(location)
    buffer = io.BytesIO()
    save_torch_file(full_checkpoint(folder, weights_only=weights_only), buffer)
    buffer.seek(0)
    return buffer


def full_checkpoint(src: PathLike, include_optimizer: bool = False, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """The sharded checkpoint ``src`` as the one dict a plain Lightning checkpoint file holds
    (checked against its checksums first); see the module's docstring. ``weights_only``: see
    ``convert_checkpoint``."""
    src = as_folder(src)  # one folder for every read below (at a URL: the version its manifest names)
    manifest = check_directory(src)  # every file against its checksum: never convert damaged bytes
    meta = read_meta(src, weights_only)
    checkpoint: dict[str, Any] = {k: v for k, v in meta.items() if k not in (OPTIMIZERS_KEY, AVERAGED_KEY)}
    dcp_metadata = read_dcp_metadata(src)  # once for every read below
    checkpoint["state_dict"] = read_full_state(src, manifest, dcp_metadata=dcp_metadata)
    if manifest.frozen:  # what the weights lack, for a load or a merge to put back (frozen_merge.py)
        checkpoint[FROZEN_KEY] = left_out_entry(manifest)
    if meta.get(AVERAGED_KEY):  # a weight-averaging callback's average above; the training weights here
        checkpoint[CURRENT_MODEL_STATE] = read_full_state(src, manifest, CURRENT_PREFIX, dcp_metadata)
    read_callback_shards(checkpoint.get("callbacks", {}), lambda prefix: read_full_state(src, manifest, prefix, dcp_metadata))
    if include_optimizer:
        checkpoint["optimizer_states"] = [
            _full_optimizer_state(src, manifest, meta, dcp_metadata, i) for i in range(len(manifest.optimizers))
        ]
    return checkpoint


def _full_optimizer_state(src: Folder, manifest: Manifest, meta: dict, dcp_metadata: Any, index: int) -> dict[str, Any]:
    """One optimizer's state as ``torch.optim.Optimizer.state_dict()`` of an unsharded run."""
    metadata = tensor_metadata(src, dcp_metadata)
    saved = meta[OPTIMIZERS_KEY][index]
    names = [name for group in saved["param_groups"] for name in group["params"]]
    layout = manifest.optimizers[index]
    targets: dict[str, torch.Tensor] = {}
    for name in names:
        for key, kind in layout.get(name, {}).items():
            entry = f"optim/{index}/{name}/{key}"
            if kind in (SHARDED, TENSOR):
                targets[entry] = torch.empty(metadata[entry].size, dtype=metadata[entry].properties.dtype)
    read_tensors(targets, src, None, dcp_metadata)
    state: dict[int, dict[str, Any]] = {}
    for position, name in enumerate(names):
        entries = {}
        for key, kind in layout.get(name, {}).items():
            entry = f"optim/{index}/{name}/{key}"
            if kind == SHARDED:
                entries[key] = targets[entry].view(manifest.params[name])
            elif kind == TENSOR:
                entries[key] = targets[entry]
            else:
                entries[key] = saved["values"][name][key]
        if entries:
            state[position] = entries
    groups, start = [], 0
    for group in saved["param_groups"]:
        count = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + count))})
        start += count
    return {"state": state, "param_groups": groups}
