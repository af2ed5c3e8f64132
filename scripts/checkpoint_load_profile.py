"""Where the load of a sharded checkpoint spends its time (issue 41): one GPT with its AdamW state,
sharded over ``--devices`` CPU ranks (gloo), saved once, then loaded ``--repeats`` times through
``ZeroCheckpointing.load`` (what ``trainer.fit(ckpt_path=...)`` and ``fabric.load`` call), each
phase timed on rank 0 and the weights-only unpickler's calls counted.

    PYTHONPATH=src python scripts/checkpoint_load_profile.py [--layers 8] [--width 512] [--vocab 8192]
        [--stage 3] [--repeats 3] [--folder DIR] [--profile N]

The defaults are the 29.4M-parameter GPT of ``checkpoint_formats.py``; ``--layers 24 --width 896``
gives 227M (2.7 GB of checkpoint: mind the disk). ``--profile N`` also prints rank 0's cProfile of
the last load, its N most expensive functions by cumulative time. The checkpoint is deleted at the
end unless ``--keep``.

Phases are nested (indented in the output); times are rank 0's medians over the repeats, and
"calls" counts per load (of the last). A phase that ends in a collective (DCP's planning, the
checksums' agreement) includes the wait for the slower rank. On a shared machine compare the counts
and the ratios of one run. Linux only (page faults from ``resource``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import shutil
import socket
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_TIMES: dict[str, float] = defaultdict(float)
_CALLS: dict[str, int] = defaultdict(int)
_ORDER: list[str] = []


@contextmanager
def _phase(name: str) -> Iterator[None]:
    if name not in _ORDER:
        _ORDER.append(name)
    start = time.perf_counter()
    try:
        yield
    finally:
        _TIMES[name] += time.perf_counter() - start
        _CALLS[name] += 1


def _timed(owner: Any, attribute: str, name: str) -> None:
    """Replace ``owner.attribute`` (a function or method) by one that times itself as phase ``name``."""
    original = getattr(owner, attribute)

    def timed(*args: Any, **kwargs: Any) -> Any:
        with _phase(name):
            return original(*args, **kwargs)

    setattr(owner, attribute, timed)


def _instrument(engine: Any) -> None:
    """Time every phase of a load where lightning-zero and DCP call it."""
    import torch.distributed.checkpoint as dcp
    from torch import _weights_only_unpickler

    from lightning_zero.checkpoint import directory, integrity, sharded, storage

    _timed(directory, "verify_on_ranks", "verify checksums (manifest, CRC-32 of this rank's share, agreement)")
    _timed(integrity, "file_checksum", "  CRC-32 of one file")
    _timed(directory, "read_meta", "meta.pt unpickle")
    _timed(directory, "load_model", "load_model")
    _timed(directory, "load_optimizer", "load_optimizer")
    _timed(sharded, "read_tensors", "  read_tensors (DCP load)")
    _timed(storage, "_read_metadata", "    .metadata read + unpickle")
    _timed(storage, "_check_files_inside", "    .metadata paths check")
    _timed(storage._Reader, "read_data", "    DCP read_data (file reads, per-item deserialize, copy into targets)")
    _timed(torch, "load", "      torch.load (per item)")
    _timed(_weights_only_unpickler.Unpickler, "load", "        weights-only unpickler")
    _timed(storage, "load_torch_file", "  meta.pt torch.load")
    _timed(type(engine), "load_optimizer_chunked_state", "  engine.load_optimizer_chunked_state")
    _timed(dcp.state_dict_loader, "_load_state_dict", "    DCP _load_state_dict (plan + exchange + read_data)")


class _Ranks:
    """What ``ZeroCheckpointing.save`` needs of a strategy (``RankCoordination``)."""

    is_global_zero = property(lambda self: dist.get_rank() == 0)
    world_size = property(lambda self: dist.get_world_size())

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def barrier(self, name: Any = None) -> None:
        dist.barrier()


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, folder: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lightning_zero.checkpoint.checkpointing import ZeroCheckpointing
    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, block_size=32, n_layer=args.layers, n_head=args.heads, n_embd=args.width))
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=args.stage))
    tokens = torch.randint(0, args.vocab, (1, 33))
    engine.begin_step()
    loss = model(tokens[:, :-1], tokens[:, 1:])[1]
    loss.backward()
    engine.finish_backward()
    engine.end_step()
    optimizer.step()
    engine.after_optimizer_step(optimizer)
    optimizer.zero_grad()

    checkpointing = ZeroCheckpointing("sharded")
    path = os.path.join(folder, "checkpoint")
    checkpoint = {
        "state_dict": checkpointing.module_shards(model, engine),
        "optimizer_states": [checkpointing.optimizer_shards(engine, [optimizer], optimizer)],
        "global_step": 1,
        "epoch": 0,
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}},
        "lr_schedulers": [],
        "hyper_parameters": {"layers": args.layers, "width": args.width},
    }
    checkpointing.save(_Ranks(), checkpoint, path, model, engine, write_file=lambda c, p: None)
    del checkpoint
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))

    from lightning_zero.checkpoint.storage import tensor_metadata

    items = len(tensor_metadata(path))
    _instrument(engine)
    runs = []
    profiler = cProfile.Profile()
    for repeat in range(args.repeats):
        _TIMES.clear()
        _CALLS.clear()
        dist.barrier()
        if repeat == args.repeats - 1 and args.profile:
            profiler.enable()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with _phase("total load"):
            ZeroCheckpointing("sharded").load(path, model, engine, [optimizer], True, read_file=lambda p: {}, weights_only=True)
        profiler.disable()
        _CALLS["minor page faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        runs.append((dict(_TIMES), dict(_CALLS)))
    dist.barrier()
    out.put((rank, [(t["total load"], t.get("    DCP read_data (file reads, per-item deserialize, copy into targets)", 0.0)) for t, _ in runs]))
    if rank == 0:
        text = ""
        if args.profile:
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(args.profile)
            text = stream.getvalue()
        out.put({"runs": runs, "order": list(_ORDER), "params": n_params, "bytes": size, "items": items, "profile": text})
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where the checkpoint goes (default: a new folder in the temp dir)")
    parser.add_argument("--profile", type=int, default=0, help="print rank 0's cProfile of the last load, top N")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(dir=args.folder, prefix="load-profile-")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    processes = [ctx.Process(target=_rank_main, args=(r, args.devices, port, args, folder, queue)) for r in range(args.devices)]
    try:
        for p in processes:
            p.start()
        per_rank, result = {}, None
        for _ in range(args.devices + 1):
            got = queue.get()
            if isinstance(got, tuple):
                per_rank[got[0]] = got[1]
            else:
                result = got
        result["per_rank"] = per_rank
        for p in processes:
            p.join()
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    _report(args, result)


def _report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    runs: list[tuple[dict[str, float], dict[str, int]]] = result["runs"]
    print(
        f"GPT {result['params'] / 1e6:.1f}M parameters (layers {args.layers}, width {args.width}, vocab {args.vocab}), stage {args.stage},"
        f" {args.devices} CPU ranks; checkpoint {result['bytes'] / 1e6:.0f} MB, {result['items']} DCP keys; {args.repeats} loads"
    )
    total = statistics.median(t["total load"] for t, _ in runs)
    print(f"{'phase (rank 0)':<84} {'median s':>9} {'share':>6} {'calls/load':>10}")
    for name in result["order"]:
        seconds = statistics.median(t.get(name, 0.0) for t, _ in runs)
        calls = runs[-1][1].get(name, 0)
        print(f"{name:<84} {seconds:>9.3f} {seconds / total:>6.1%} {calls:>10}")
    for rank, times in sorted(result["per_rank"].items()):
        total, read = (statistics.median(t[i] for t in times) for i in (0, 1))
        print(f"rank {rank}: total load {total:.3f} s, of which DCP read_data {read:.3f} s (medians)")
    faults = [c["minor page faults"] for _, c in runs]
    print(f"minor page faults per load (rank 0; first touch of new memory): {faults}")
    if result["profile"]:
        print(result["profile"])


if __name__ == "__main__":
    main()
