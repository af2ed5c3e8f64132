"""Sharded checkpoint save and load time, a local directory against an S3-protocol server on this
machine (moto's standalone server on loopback, through s3fs), synchronous and ``async_save``, on 2
gloo CPU ranks (the example GPT at zero2 with its AdamW state, after one step).

For each destination, ``repeats`` rounds of: a synchronous save, an asynchronous save (the time the
step is held, and the time until it committed), a load (``strategy.load_checkpoint``: every file
checked against its checksum, then read into the shards). Each figure is the slowest rank's, the
median over rounds. Every save overwrites the same path (``last.ckpt``): at the URL each commits a new
version and deletes the previous one, as ``ModelCheckpoint(save_last=True)`` does.

    PYTHONPATH=src python scripts/remote_checkpoint_bench.py [--layers 4 --width 768] [--repeats 3]

4 x 768 is the 29.4M GPT; 8 x 1536 the 227M one. Needs ``moto[server]`` and ``s3fs`` (the test extra).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, args: argparse.Namespace, local: str, out: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")  # fmt: skip
    torch.set_num_threads(1)
    import lightning as L
    import torch.distributed as dist

    from lightning_zero import ZeroStrategy
    from lightning_zero.models.gpt import GPT, GPTConfig

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = GPTConfig(block_size=64, n_layer=args.layers, n_head=args.width // 64, n_embd=args.width, dropout=0.0, bias=True)
            self.model = GPT(config)

        def training_step(self, batch, _):
            return self.model(batch[:, :-1], batch[:, 1:])[1]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=2), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    L.seed_everything(0, verbose=False)
    module = Module()
    data = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    strategy, checkpointing = trainer.strategy, trainer.strategy._checkpointing

    def slowest(seconds: float) -> float:
        gathered = [None, None]
        dist.all_gather_object(gathered, seconds)
        return max(gathered)

    results: dict[str, dict[str, list[float]]] = {}
    for where, path in (("local", os.path.join(local, "last.ckpt")), ("s3", "s3://bench/run/last.ckpt")):
        times = results.setdefault(where, {"sync": [], "async_held": [], "async_total": [], "load": []})
        for _ in range(args.repeats):
            checkpointing.async_save = False
            dist.barrier()
            start = time.perf_counter()
            trainer.save_checkpoint(path)
            times["sync"].append(slowest(time.perf_counter() - start))
            checkpointing.async_save = True
            dist.barrier()
            start = time.perf_counter()
            trainer.save_checkpoint(path)
            held = time.perf_counter() - start
            strategy.wait_for_checkpoint()
            total = time.perf_counter() - start
            times["async_held"].append(slowest(held))
            times["async_total"].append(slowest(total))
            dist.barrier()
            start = time.perf_counter()
            strategy.load_checkpoint(path, weights_only=True)
            times["load"].append(slowest(time.perf_counter() - start))
    checkpointing.release()
    if rank == 0:
        params = sum(p.numel() for p in module.parameters())  # zero2: full parameters on every rank
        out.put((results, params))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")  # fmt: skip
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    local = tempfile.mkdtemp(dir="/tmp", prefix="remote-bench-")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    dist_port = _port()
    processes = [ctx.Process(target=rank_main, args=(r, dist_port, args, local, queue)) for r in range(2)]
    try:
        for p in processes:
            p.start()
        while True:  # a rank that failed prints its traceback and exits: do not wait for it forever
            try:
                results, params = queue.get(timeout=5)
                break
            except Exception:  # noqa: BLE001 - queue.Empty
                if any(p.exitcode not in (None, 0) for p in processes):
                    raise SystemExit(f"a rank failed (exit codes {[p.exitcode for p in processes]})") from None
        for p in processes:
            p.join()
    finally:
        shutil.rmtree(local, ignore_errors=True)
        server.stop()
    size = f"{params / 1e6:.1f}M parameters (n_layer={args.layers}, n_embd={args.width})"
    print(f"GPT {size}, zero2 + AdamW, 2 CPU ranks; slowest rank, median of {args.repeats} (seconds)")
    print("| destination | sync save | async: step held | async: until committed | load |")
    print("|---|--:|--:|--:|--:|")
    for where, times in results.items():
        cells = " | ".join(f"{statistics.median(times[k]):.2f}" for k in ("sync", "async_held", "async_total", "load"))
        print(f"| {where} | {cells} |")
    local_sync, s3_sync = (statistics.median(results[w]["sync"]) for w in ("local", "s3"))
    held = statistics.median(results["s3"]["async_held"])
    print(f"S3 / local sync save: {s3_sync / local_sync:.2f}x; S3 async step held / S3 sync save: {held / s3_sync:.0%}")


if __name__ == "__main__":
    main()
