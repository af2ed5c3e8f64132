"""How a sharded checkpoint is read (issue 41, load speed): the tensors exactly as DCP's own reader
reads them, each distinct pickle of DCP's tensor items unpickled once by torch's weights-only
unpickler (a poisoned one still refused, nothing run), and DCP's .metadata unpickled once per load
whatever the number of optimizers. Counts, not times: a regression to per-tensor unpickling or to
per-read metadata fails here."""

from __future__ import annotations

import inspect
import io
import os
import pickle
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from multiprocess import run_on_ranks

from lightning_zero.compat.dcp_reads import load_in_this_process


@contextmanager
def _counting(owner: object, attribute: str, counts: dict[str, int], name: str) -> Iterator[None]:
    original = getattr(owner, attribute)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(owner, attribute, counted)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


@contextmanager
def _unpickler_calls() -> Iterator[dict[str, int]]:
    """Calls of torch's weights-only unpickler and of lightning-zero's .metadata unpickler inside."""
    from torch import _weights_only_unpickler

    from lightning_zero.checkpoint.pickles import DcpMetadataUnpickler

    counts: dict[str, int] = {"weights_only": 0, "dcp_metadata": 0}
    with _counting(_weights_only_unpickler.Unpickler, "load", counts, "weights_only"):
        with _counting(DcpMetadataUnpickler, "load", counts, "dcp_metadata"):
            yield counts


def _tensors(blocks: int) -> dict[str, torch.Tensor]:
    """``blocks`` alike blocks of mixed shapes and dtypes (each tensor its own values), and odd ones."""
    torch.manual_seed(blocks)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(blocks):
        tensors[f"model/block{i}/weight"] = torch.randn(6, 4)
        tensors[f"model/block{i}/bias"] = torch.randn(6)
        tensors[f"optim/block{i}/exp_avg"] = torch.randn(24).to(torch.bfloat16)
        tensors[f"optim/block{i}/step"] = torch.tensor(float(i))
    tensors["buffer/counts"] = torch.arange(5, dtype=torch.int64)
    tensors["buffer/empty"] = torch.empty(0, 3)
    return tensors


def _save(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """DCP's save in this process alone (torch 2.6's takes no ``no_dist`` and decides so itself: no
    process group here)."""
    alone = {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(directory)), **alone)


def _read_like_dcp(directory: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DCP's own reader (``torch.load`` per item): the reference."""
    targets = {key: torch.full_like(t, 7) for key, t in like.items()}
    load_in_this_process(targets, dcp.FileSystemReader(str(directory)))
    return targets


def test_tensors_are_read_as_dcps_own_reader_reads_them(tmp_path):
    from lightning_zero.checkpoint.storage import read_tensors

    saved = _tensors(blocks=5)
    _save(saved, tmp_path)
    targets = {key: torch.full_like(t, 7) for key, t in saved.items()}
    read_tensors(targets, tmp_path, None)
    reference = _read_like_dcp(tmp_path, saved)
    for key, t in saved.items():
        assert targets[key].dtype == t.dtype and torch.equal(targets[key], t) and torch.equal(reference[key], t), key


@pytest.mark.parametrize("blocks", [2, 12])
def test_each_distinct_item_pickle_is_unpickled_once_per_read(tmp_path, blocks):
    """5 distinct pickles (4 per block, every block alike, and the int64 buffer; the empty tensor has
    no bytes to read): the weights-only unpickler runs 5 times however many blocks; DCP's own reader
    runs it once per tensor it reads."""
    from lightning_zero.checkpoint.storage import read_tensors

    saved = _tensors(blocks)
    _save(saved, tmp_path)
    targets = {key: torch.empty_like(t) for key, t in saved.items()}
    with _unpickler_calls() as counts:
        read_tensors(targets, tmp_path, None)
    assert counts == {"weights_only": 5, "dcp_metadata": 1}
    with _unpickler_calls() as counts:
        _read_like_dcp(tmp_path, saved)
    assert counts["weights_only"] == len(saved) - 1 == 4 * blocks + 1  # (the empty tensor has no bytes to read)


class _RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_an_item_pickle_the_unpickler_refuses_is_refused_after_a_trusted_one(tmp_path):
    """A poisoned item after a trusted one of the same shape: its pickle differs, so it goes to the
    weights-only unpickler, which refuses it as DCP's read would; the command never runs."""
    from lightning_zero.checkpoint.pickles import DcpTensorItems

    def archive(obj: object) -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        return buffer

    items = DcpTensorItems()
    trusted = torch.randn(4)
    assert torch.equal(items.load(archive(trusted)), trusted)
    assert torch.equal(items.load(archive(trusted + 1)), trusted + 1)  # the same pickle: rebuilt, not unpickled
    marker = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        items.load(archive({"tensor": trusted, "payload": _RunsACommand(marker)}))
    assert not marker.exists()
    # a pickle of another structure (a view with an offset) is unpickled on its own, and read right
    view = torch.arange(10.0)[3:]
    loaded = items.load(archive(view))
    assert torch.equal(loaded, view) and loaded.storage_offset() == 3


# ---- a whole load, 2 ranks --------------------------------------------------------------------------------
def _save_and_load(rank: int, world_size: int, directory: str, blocks: int, optimizers: int) -> dict[str, int]:
    """An engine over ``blocks`` alike layers and ``optimizers`` AdamW, one step, saved as a sharded
    directory and loaded back: the unpickler calls of the load on this rank."""
    from torch import nn

    from lightning_zero.checkpoint.checkpointing import ZeroCheckpointing
    from lightning_zero.engine import ZeroConfig, ZeroEngine

    class Ranks:
        is_global_zero = rank == 0
        world_size = 2

        def broadcast(self, obj, src=0):
            box = [obj]
            torch.distributed.broadcast_object_list(box, src)
            return box[0]

        def barrier(self, name=None):
            torch.distributed.barrier()

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(blocks)])
    layers = list(model)
    per_optimizer = [layers[i::optimizers] for i in range(optimizers)]
    opts = [torch.optim.AdamW([p for layer in group for p in layer.parameters()], lr=0.1) for group in per_optimizer]
    engine = ZeroEngine(model, opts, ZeroConfig(stage=2))
    model(torch.randn(3, 8)).sum().backward()
    engine.finish_backward()
    engine.end_step()
    for opt in opts:
        opt.step()
        engine.after_optimizer_step(opt)
    checkpointing = ZeroCheckpointing("sharded")
    checkpoint = {
        "state_dict": checkpointing.module_shards(model, engine),
        "optimizer_states": [checkpointing.optimizer_shards(engine, opts, opt) for opt in opts],
        "global_step": 1,
    }
    path = os.path.join(directory, f"blocks{blocks}-optimizers{optimizers}")
    checkpointing.save(Ranks(), checkpoint, path, model, engine, write_file=lambda c, p: None)
    saved = {name: p.detach().clone() for name, p in engine.weight_chunks().items()}
    with _unpickler_calls() as counts:
        rest = ZeroCheckpointing("sharded").load(path, model, engine, opts, True, read_file=lambda p: {}, weights_only=True)
    assert rest["global_step"] == 1
    assert all(torch.equal(saved[name], chunk) for name, chunk in engine.weight_chunks().items())
    engine.close()
    return counts


def test_a_load_unpickles_metadata_once_and_each_distinct_pickle_once(tmp_path):
    """DCP's .metadata once per load (it was read twice per DCP read: 4 times with one optimizer, 6
    with two); the weights-only unpickler for meta.pt and each distinct item pickle, as many calls
    for 2 layers as for 8."""
    results = {
        (blocks, optimizers): run_on_ranks(_save_and_load, str(tmp_path), blocks, optimizers)
        for blocks, optimizers in ((2, 1), (8, 1), (8, 2))
    }
    for (blocks, optimizers), per_rank in results.items():
        for counts in per_rank:
            assert counts["dcp_metadata"] == 1, (blocks, optimizers, counts)
    for rank in range(2):
        assert results[(2, 1)][rank]["weights_only"] == results[(8, 1)][rank]["weights_only"], results
        assert results[(8, 1)][rank]["weights_only"] < 8 * 2 * 4  # DCP's reader: one per tensor item (8 layers x 2 x 4)
