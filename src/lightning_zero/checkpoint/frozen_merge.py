"""Frozen weights put back into the single-file form of a checkpoint saved without them
(``save_frozen=False``; see ``frozen.py``), each checked against the checkpoint's fingerprint first:

- from a base on disk (``lightning-zero convert --base``): a ``torch.save`` state dict (or a
  Lightning checkpoint file, its ``state_dict``), or safetensors files (one, or every one in a
  directory, as ``from_pretrained`` checkpoints are sharded);
- from the module itself (``load_from_checkpoint``: the user's ``__init__``/``configure_model``
  loaded them), so that Lightning's and torch's strict loading find every key.

The single-file form of such a checkpoint (``full_checkpoint``) says what it lacks under
``FROZEN_KEY``: the fingerprint and the ``state_dict`` keys tied to a frozen parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Union

import torch
from torch import Tensor, nn

from lightning_zero.checkpoint.frozen import FrozenRecord, differences, fingerprint, record_of, refuse_differences
from lightning_zero.checkpoint.manifest import Manifest

FROZEN_KEY = "lightning_zero_frozen_left_out"
"""In the single-file form of a checkpoint saved without its frozen weights:
``{"fingerprint": FrozenRecord, "aliases": {tied key: frozen parameter name}}``."""


def left_out_entry(manifest: Manifest) -> dict[str, Any]:
    """``FROZEN_KEY``'s value for a checkpoint whose manifest records frozen weights left out."""
    aliases = {alias: name for alias, name in manifest.aliases.items() if name in manifest.frozen}
    return {"fingerprint": manifest.frozen, "aliases": aliases}


def read_base(path: Union[str, Path], prefix: str = "") -> dict[str, Tensor]:
    """The tensors of the base at ``path`` by name, ``prefix`` put before each name (to map a base's
    names onto the checkpoint's, e.g. ``model.``). Memory-mapped where the format allows."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Base {str(path)!r} does not exist.")
    if path.is_dir() or path.suffix == ".safetensors":
        tensors = _read_safetensors(path)
    else:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        tensors = loaded.get("state_dict", loaded) if isinstance(loaded, Mapping) else None
        if not isinstance(tensors, Mapping):
            raise ValueError(f"Base {str(path)!r} holds no state dict (a dict of tensors, as `torch.save(model.state_dict())` writes).")
    return {prefix + name: t for name, t in tensors.items() if isinstance(t, Tensor)}


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"Base {str(path)!r} is a directory with no *.safetensors files.")
    try:
        from safetensors.torch import load_file
    except ImportError as err:
        raise ValueError(f"Reading the base {str(path)!r} needs the `safetensors` package: `pip install safetensors`.") from err
    tensors: dict[str, Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file), device="cpu"))
    return tensors


def check_base(recorded: FrozenRecord, base: Mapping[str, Tensor], source: str, base_name: str) -> None:
    """Every recorded frozen weight is in ``base`` (by the checkpoint's names) and matches its
    fingerprint; refuses naming each one that differs or is missing."""
    found = {name: record_of(base[name]) for name in recorded if name in base}
    refuse_differences(
        differences(recorded, found),
        f"Checkpoint {source!r}",
        f"the base {base_name!r}'s weights",
        "give the base the model was fine-tuned from (the same weights and dtype); where its names lack a"
        " prefix the checkpoint's have, add it with `--base-prefix` (e.g. `--base-prefix model.`).",
    )


def merge_base(checkpoint: dict[str, Any], base: Mapping[str, Tensor], source: str, base_name: str) -> None:
    """Put the frozen weights from ``base`` into ``checkpoint`` (a single-file form with ``FROZEN_KEY``)
    in place, once every one matches the fingerprint (``check_base``)."""
    left_out = checkpoint.pop(FROZEN_KEY)
    recorded: FrozenRecord = left_out["fingerprint"]
    check_base(recorded, base, source, base_name)
    _put_back(checkpoint["state_dict"], {name: base[name] for name in recorded}, left_out["aliases"])


def fill_from_module(state_dict: dict[str, Any], module: nn.Module, left_out: Mapping[str, Any], source: str) -> None:
    """Put ``module``'s own frozen weights into ``state_dict`` (the one a load is about to load), once
    they match the fingerprint, so that strict loading finds every key and keeps them as they are.
    ``source``: the checkpoint, in words."""
    recorded: FrozenRecord = left_out["fingerprint"]
    refuse_differences(
        differences(recorded, fingerprint(module, None, None, recorded)),
        source,
        "the model's frozen weights",
        "build the module with the base it was fine-tuned from (e.g. the same `from_pretrained` checkpoint and dtype).",
    )
    params = dict(module.named_parameters())
    _put_back(state_dict, {name: params[name].detach() for name in recorded}, left_out["aliases"])


def _put_back(state_dict: dict[str, Any], weights: Mapping[str, Tensor], aliases: Mapping[str, str]) -> None:
    state_dict.update(weights)
    for alias, name in aliases.items():
        state_dict[alias] = state_dict[name]
