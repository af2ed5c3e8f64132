"""Training time lost per sharded checkpoint, synchronous against ``async_save=True`` (2 gloo ranks, CPU,
the example GPT, zero2, AdamW, to local disk). Three fits of the same steps: no saves, a save every
``every`` steps, the same saves asynchronous. Per save it reports

- blocked: the time ``trainer.save_checkpoint`` held the training step (median over saves, rank 0);
- lost: (fit time with saves - fit time without) / saves — what the saves cost the run in all,
  including the background writes competing with training for the CPU and the wait at fit's end;
  one fit each, so on a shared machine this one is only as steady as the machine.

    PYTHONPATH=src python scripts/async_save_bench.py [n_embd=768] [steps=24] [every=6] [folder]

768 gives the 29.4M-parameter GPT (4 layers); 384 the bench's default shape (7.3M).
"""

import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def rank_main(rank, world, port, n_embd, steps, every, folder, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")  # fmt: skip
    torch.set_num_threads(1)
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_zero import ZeroStrategy
    from lightning_zero.models.gpt import GPT, GPTConfig

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPT(GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=n_embd, dropout=0.0, bias=True))

        def training_step(self, batch, _):
            return self.model(batch[:, :-1], batch[:, 1:])[1]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Saves(Callback):
        def __init__(self, path):
            self.path, self.blocked = path, []

        def on_train_batch_end(self, trainer, *args):
            if self.path and trainer.global_step % every == 0:
                start = time.perf_counter()
                trainer.save_checkpoint(os.path.join(self.path, f"step{trainer.global_step}.ckpt"))
                self.blocked.append(time.perf_counter() - start)

    data = torch.randint(0, 256, (steps * world * 4, 129), generator=torch.Generator().manual_seed(0))
    results = {}
    for mode in ("warm-up", "none", "sync", "async"):  # the first fit of a process pays for imports and first calls
        saves = Saves(os.path.join(folder, mode) if mode in ("sync", "async") else "")
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=ZeroStrategy(stage=2, async_save=mode == "async"),
            max_steps=2 if mode == "warm-up" else steps,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[saves],
        )  # fmt: skip
        L.seed_everything(0, verbose=False)
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        start = time.perf_counter()
        trainer.fit(Module(), loader)
        results[mode] = (time.perf_counter() - start, saves.blocked)
    if rank == 0:
        out.put(results)


if __name__ == "__main__":
    n_embd = int(sys.argv[1]) if len(sys.argv) > 1 else 768
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    every = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    folder = sys.argv[4] if len(sys.argv) > 4 else tempfile.mkdtemp(dir="/tmp")
    made_here = len(sys.argv) <= 4
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    processes = [ctx.Process(target=rank_main, args=(r, 2, port, n_embd, steps, every, folder, queue)) for r in range(2)]
    [p.start() for p in processes]
    results = queue.get()
    [p.join() for p in processes]
    if made_here:
        shutil.rmtree(folder)  # 8 checkpoints of ~350 MB at the default size
    base = results["none"][0]
    params = 4 * 12 * n_embd**2 + 256 * n_embd + 128 * n_embd  # blocks + token and position embeddings, about
    print(f"GPT n_layer=4 n_embd={n_embd} (~{params / 1e6:.1f}M parameters), zero2, 2 CPU ranks, {steps} steps, a save every {every}")
    print(f"fit without saves: {base:.2f} s")
    for mode in ("sync", "async"):
        total, blocked = results[mode]
        saves = len(blocked)
        print(f"{mode:5s}: fit {total:.2f} s, {saves} saves; blocked per save: median {statistics.median(blocked):.3f} s"
              f" (all {[round(b, 3) for b in blocked]}); lost per save: {(total - base) / saves:.3f} s")  # fmt: skip
