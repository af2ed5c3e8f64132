"""Frozen parameters left out of a sharded checkpoint (``save_frozen=False``), and their fingerprint.

A fine-tuning run (LoRA, adapters) trains millions of parameters on top of a frozen base of
billions, which the user's code loads anyway (``from_pretrained`` in ``__init__`` or
``configure_model``). Such a checkpoint holds the trainable parameters, the buffers, the optimizer
state and the rest of Lightning's checkpoint; in place of the frozen weights its manifest holds
their fingerprint (``Manifest.frozen``): each one's name, full shape, dtype and checksum. A resume
loads on top of the model as built, keeping its frozen weights, once they match the fingerprint.

[Note: a fingerprint of the frozen weights]
The checksum of a tensor of ``n`` elements is ``sum((i + 1) * bits(x_i)) mod P`` over its flat
view, ``bits`` the element's bit pattern as an integer (an int view of its itemsize) and
``P = 2**31 - 1``: integer arithmetic, so exact, and a change of any one element (a bit, a sign,
``-0.0`` for ``0.0``) or a swap of two changes it. It is a sum over positions, so any split of the
flat view adds up to the same value: each rank sums the elements it holds — its chunk where the
engine shards the parameter (stage 3), its ``torch.chunk`` share of the flat tensor where every rank
holds it whole (stages 1-2) — and one gather of Python integers adds the ranks' parts. No rank ever
holds more than it trains with, and the value depends neither on the world size nor on the stage,
as a checkpoint that loads at another world size or stage needs. (With hybrid sharding the shard
groups hold the same chunks: only the first one counts them.) A chunk is summed in the parameter's
dtype: a frozen parameter's chunk is kept in it (see [Note: frozen chunks] in
``engine/shards/sharded_param.py``), and a chunk in another dtype (an fp32 master, were one kept)
is cast back first: it was made from the parameter and a frozen one is never stepped, so the cast
is exact.

It is a fingerprint, not a cryptographic hash: it catches a different or edited base, not an
adversary.

A pass costs ~15 ns per element on one thread (seconds per save for a base of billions over a few
ranks), and frozen weights do not change between saves: each rank keeps its parts
(``_PartsCache``) and sums again only a tensor whose storage or version counter moved since (a load,
an in-place edit through the parameter). An edit through ``.data`` or a NumPy view moves no version
counter and is not seen after the run's first save.
"""

from __future__ import annotations

import json
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn

from lightning_zero.checkpoint.group import CheckpointGroup
from lightning_zero.engine import ZeroEngine
from lightning_zero.engine.shards.partition import ChunkLayout

MODULUS = 2**31 - 1
"""A prime below 2**31: a product of two residues fits an int64, a sum of 2**31 of them too."""
_SPAN = 1 << 20
"""Elements summed per pass, so that the int64 temporaries stay a few MiB for any parameter."""
_INT_OF_ITEMSIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

FrozenRecord = dict[str, dict[str, Any]]
"""Per frozen parameter name: ``{"shape": [...], "dtype": "torch.bfloat16", "checksum": int}``,
the manifest's ``frozen`` field (JSON)."""


class FrozenWeightsMismatchError(ValueError):
    """The model's frozen weights are not those a checkpoint saved without them was trained on."""


def frozen_names(module: nn.Module) -> list[str]:
    """The parameters that do not require gradients (their first name where tied)."""
    return [name for name, p in module.named_parameters() if not p.requires_grad]


def partial_checksum(values: Tensor, start: int) -> int:
    """The part of the checksum of a flat tensor that ``values`` (its elements from ``start`` on)
    contributes (see [Note: a fingerprint of the frozen weights])."""
    flat = values.detach().reshape(-1)
    if flat.numel() == 0:
        return 0
    bits = flat.view(_INT_OF_ITEMSIZE[flat.element_size()])
    wide = flat.element_size() == 8  # below 8 bytes |bits| < 2**31: a product with a weight fits an int64
    weights = torch.empty(min(_SPAN, flat.numel()), dtype=torch.int64, device=flat.device)
    total = 0
    for offset in range(0, flat.numel(), _SPAN):
        piece = bits[offset : offset + _SPAN].to(torch.int64, copy=True)  # worked on in place: never the weights
        if wide:
            piece.remainder_(MODULUS)
        first = start + offset + 1
        position = torch.arange(first, first + piece.numel(), out=weights[: piece.numel()])
        if first + piece.numel() > MODULUS:
            position.remainder_(MODULUS)
        total += int(piece.mul_(position).remainder_(MODULUS).sum())
    return total % MODULUS


def checksum(tensor: Tensor) -> int:
    """The checksum of a whole tensor (a base's weight, in one process)."""
    return partial_checksum(tensor, 0)


def record_of(tensor: Tensor) -> dict[str, Any]:
    """A whole tensor's fingerprint entry."""
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype), "checksum": checksum(tensor)}


class _PartsCache:
    """This rank's checksum parts, by the object that owns the summed elements (a parameter, or its
    ``ShardedParam`` at stage 3), valid while the elements' storage, version counter and range are
    those they were summed at (see [Note: a fingerprint of the frozen weights])."""

    def __init__(self) -> None:
        # by id: a tensor's ``==`` is element-wise, so tensors cannot be keys of a WeakKeyDictionary
        self._parts: dict[int, tuple["weakref.ref[Any]", tuple[int, int, int, int], int]] = {}

    def part(self, owner: object, values: Tensor, start: int, dtype: torch.dtype) -> int:
        """``partial_checksum`` of ``values`` as ``dtype`` (a master chunk is cast back to the
        parameter's dtype: exact, see the Note)."""
        key = (values.data_ptr(), values._version, start, values.numel())
        cached = self._parts.get(id(owner))
        if cached is not None and cached[0]() is owner and cached[1] == key:
            return cached[2]
        part = partial_checksum(values.to(dtype), start)
        self._parts[id(owner)] = (weakref.ref(owner, lambda _, i=id(owner): self._parts.pop(i, None)), key, part)
        return part


_PARTS = _PartsCache()


def fingerprint(module: nn.Module, engine: Optional[ZeroEngine], group: Optional[CheckpointGroup], names: Iterable[str]) -> FrozenRecord:
    """The fingerprint of ``module``'s parameters ``names`` (those it has), from what each rank holds
    (see [Note: a fingerprint of the frozen weights]). A collective over ``group`` (every rank calls
    it); ``group=None``: this process alone, which holds every parameter whole."""
    wanted = set(names)
    sharded = {id(sp.param): sp for sp in engine.params} if engine is not None else {}
    params = [(name, p) for name, p in module.named_parameters() if name in wanted]
    chunked = [sharded[id(p)] for _, p in params if id(p) in sharded and not sharded[id(p)].keeps_full]
    chunks = engine.weight_chunks() if chunked and engine is not None else {}
    rank, size = (group.rank, group.size) if group is not None else (0, 1)
    first_replica = engine is None or engine.shard_group_size is None or rank < engine.shard_group_size
    records: FrozenRecord = {}
    parts: dict[str, int] = {}
    for name, p in params:
        sp = sharded.get(id(p))
        if sp is not None and not sp.keeps_full:  # stage 3: this rank's chunk, the parameter a placeholder
            start, _ = sp.layout.owned_range(sp.rank)
            parts[name] = _PARTS.part(sp, chunks[id(sp)], start, p.dtype) if first_replica else 0
            shape = sp.shape
        else:  # whole on every rank: each sums its share
            start, end = ChunkLayout(p.numel(), size).owned_range(rank)
            parts[name] = _PARTS.part(p, p.detach().reshape(-1)[start:end], start, p.dtype)
            shape = p.shape
        records[name] = {"shape": list(shape), "dtype": str(p.dtype), "checksum": 0}
    gathered = group.all_gather(parts) if group is not None else [parts]
    for name in records:
        records[name]["checksum"] = sum(part[name] for part in gathered) % MODULUS
    return records


def digest(record: FrozenRecord) -> str:
    """Eight hex digits that stand for the whole fingerprint, for people to compare."""
    return f"{zlib.crc32(json.dumps(record, sort_keys=True).encode()):08x}"


@dataclass(frozen=True)
class Difference:
    """How one frozen parameter differs from the fingerprint."""

    name: str
    how: str


def differences(recorded: FrozenRecord, current: FrozenRecord, strict: bool = True) -> list[Difference]:
    """Every recorded parameter that ``current`` (the model's or a base's fingerprint) holds
    differently — shape first, then dtype, then content — or lacks (when ``strict``)."""
    found = []
    for name, saved in recorded.items():
        now = current.get(name)
        if now is None:
            if strict:
                found.append(Difference(name, "missing"))
        elif now["shape"] != saved["shape"]:
            found.append(Difference(name, f"shape {now['shape']}, saved with {saved['shape']}"))
        elif now["dtype"] != saved["dtype"]:
            found.append(Difference(name, f"dtype {now['dtype']}, saved with {saved['dtype']}"))
        elif now["checksum"] != saved["checksum"]:
            found.append(Difference(name, "content differs (checksum)"))
    return found


def refuse_differences(found: list[Difference], checkpoint: str, what: str, hint: str) -> None:
    """Raise ``FrozenWeightsMismatchError`` naming each difference (the first ten) when there are any.
    ``checkpoint``: the checkpoint, in words ("Checkpoint '<path>'")."""
    if not found:
        return
    listed = "; ".join(f"{d.name}: {d.how}" for d in found[:10]) + (f"; and {len(found) - 10} more" if len(found) > 10 else "")
    raise FrozenWeightsMismatchError(
        f"{checkpoint} was saved without its frozen weights (save_frozen=False), and {what}"
        f" differ from the ones it was trained on: {listed}. HINT: {hint}"
    )


def check_model_frozen(
    recorded: FrozenRecord, module: nn.Module, engine: Optional[ZeroEngine], group: Optional[CheckpointGroup], checkpoint: str, strict: bool
) -> None:
    """Before a load changes anything: the model's frozen weights against the checkpoint's
    fingerprint. A collective; every rank computes the same fingerprint, so every rank raises alike."""
    current = fingerprint(module, engine, group, recorded)
    refuse_differences(
        differences(recorded, current, strict),
        f"Checkpoint {checkpoint!r}",
        "the model's frozen weights",
        "load the same base weights in your module (e.g. the same `from_pretrained` checkpoint and dtype) before"
        " resuming; `lightning-zero verify` shows the checkpoint's fingerprint.",
    )
