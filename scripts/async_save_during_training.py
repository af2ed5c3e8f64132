"""How much an asynchronous save's writer thread slows the training thread (issue 59, L3).

One process (a gloo group of one rank), the engine stepping a GPT with AdamW; rounds alternate a
window of training (``--window`` seconds) with an ``async_save`` always in flight (the next one
started between two steps as soon as the last committed; each into the arena the warm-up save
arranged, to local disk) and a window as long with none. Per round it records

- steps/s of the training thread with a save in flight and without (the time a save held the step,
  its staging, is left out of the windows: it is reported on its own);
- the training thread's time per step in both windows, split by Linux's schedstat into time on a
  CPU, time runnable but waiting for a core, and the rest, which is time waiting for the GIL;
- the save: the time it held the step (staging), its wall time from start to commit while training
  ran, and the writer thread's CPU seconds;
- the same save written with no training beside it (its wall time alone).

``--train example`` trains and saves the same GPT (``--n-embd``, ``--layers``): on a CPU its step is
kernel time, which releases the GIL. ``--train launch-bound`` trains the launch-bound shape (12
layers of width 64, batch 1: a step of host Python and small kernels, as a fast GPU's host thread)
while the GPT of ``--n-embd``/``--layers`` is saved: the GIL case.

    PYTHONPATH=src python scripts/async_save_during_training.py --train launch-bound --rounds 3 --window 6
    PYTHONPATH=src python scripts/async_save_during_training.py --train example --rounds 3 --window 10

768/4 layers is the GPT of the async-save benchmark (docs/benchmarks.md); each save writes ~344 MB
(fp32 weights and AdamW's two moments).

Where the writer holds the GIL: record a run with py-spy (``pip install py-spy``; ``--gil`` keeps
only samples of threads holding the GIL), then summarize it with the number of saves the run printed:

    PYTHONPATH=src py-spy record --gil --threads -r 200 -f raw -o gil.txt -- \
        python scripts/async_save_during_training.py --train launch-bound --rounds 3 --window 6
    python scripts/async_save_during_training.py --gil-samples gil.txt --gil-saves N
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

LAUNCH_BOUND = {"n_layer": 12, "n_embd": 64, "n_head": 4, "block_size": 32, "batch": 1}


class Trained:
    """A GPT under the engine (zero2, AdamW), stepped on fixed random tokens."""

    def __init__(self, n_layer: int, n_embd: int, n_head: int, block_size: int, batch: int) -> None:
        from lightning_zero.engine import ZeroConfig, ZeroEngine
        from lightning_zero.models.gpt import GPT, GPTConfig

        torch.manual_seed(0)
        self.model = GPT(GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=block_size, dropout=0.0))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.engine = ZeroEngine(self.model, [self.optimizer], ZeroConfig(stage=2))
        self.tokens = torch.randint(0, 256, (batch, block_size + 1))

    def step(self) -> None:
        self.engine.begin_step()
        self.model(self.tokens[:, :-1], self.tokens[:, 1:])[1].backward()
        self.engine.finish_backward()
        self.engine.end_step()
        self.optimizer.step()
        self.engine.after_optimizer_step(self.optimizer)
        self.optimizer.zero_grad()


class OneRank:
    """What ``ZeroCheckpointing.save`` needs of a strategy, at world size 1."""

    is_global_zero, world_size = True, 1

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self, name: Any = None) -> None:
        pass


class Saver:
    """Asynchronous saves of ``saved``'s state, each timed: held (staging), committed (from start,
    on the writer thread), the writer thread's CPU seconds."""

    def __init__(self, saved: Trained, folder: str) -> None:
        from lightning_zero.checkpoint.checkpointing import ZeroCheckpointing

        self.saved, self.folder = saved, folder
        self.checkpointing = ZeroCheckpointing("sharded", async_save=True)
        self.count = 0
        self.record: dict[str, float] = {}
        saves = self.checkpointing.saves
        start_save = saves.start_save

        def timed_start(path: Any, write: Callable) -> Any:
            def timed_write(*args: Any) -> None:
                cpu = time.thread_time()
                write(*args)
                self.record["writer_cpu"] = time.thread_time() - cpu
                self.record["committed"] = time.perf_counter() - self.record["start"]

            return start_save(path, timed_write)

        saves.start_save = timed_start

    def start(self) -> None:
        s = self.saved
        self.count += 1
        self.record = {"start": time.perf_counter()}
        checkpoint = {
            "state_dict": self.checkpointing.module_shards(s.model, s.engine),
            "optimizer_states": [self.checkpointing.optimizer_shards(s.engine, [s.optimizer], s.optimizer)],
        }
        path = os.path.join(self.folder, f"save{self.count % 2}")  # each overwrites the one before the last
        self.checkpointing.save(OneRank(), checkpoint, path, s.model, s.engine, write_file=lambda c, p: None)
        self.record["held"] = time.perf_counter() - self.record["start"]

    @property
    def in_flight(self) -> bool:
        save = self.checkpointing.saves._in_flight
        return save is not None and save.thread is not None and save.thread.is_alive()

    def finish(self) -> dict[str, float]:
        self.checkpointing.wait()
        return dict(self.record)


def schedstat() -> tuple[float, float]:
    """This thread's (seconds on a CPU, seconds runnable but waiting for one) from Linux's schedstat."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


class Window:
    """Training steps and what they took: wall seconds, and this thread's seconds on a CPU and
    runnable waiting for a core; the rest of the wall time the thread slept, which in this loop is
    waiting for the GIL (nothing else blocks it: one rank, no I/O)."""

    def __init__(self) -> None:
        self.steps, self.wall, self.cpu, self.queued = 0, 0.0, 0.0, 0.0

    def step(self, trained: Trained) -> None:
        wall, (cpu, queued) = time.perf_counter(), schedstat()
        trained.step()
        cpu_end, queued_end = schedstat()
        self.wall += time.perf_counter() - wall
        self.cpu += cpu_end - cpu
        self.queued += queued_end - queued
        self.steps += 1

    def per_step_ms(self) -> dict[str, float]:
        slept = max(self.wall - self.cpu - self.queued, 0.0)
        return {k: 1000 * v / max(self.steps, 1) for k, v in (("wall", self.wall), ("cpu", self.cpu), ("queued", self.queued), ("slept", slept))}


def train_without_saves(trained: Trained, seconds: float) -> Window:
    window, deadline = Window(), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        window.step(trained)
    return window


def train_while_saving(trained: Trained, saver: "Saver", seconds: float) -> tuple[Window, list[dict]]:
    """Steps for ``seconds`` with a save always in flight: the next starts (between two steps, not
    counted in the window) as soon as the last one committed. The saves that committed."""
    window, saves, deadline = Window(), [], time.perf_counter() + seconds
    saver.start()
    while time.perf_counter() < deadline:
        if not saver.in_flight:
            saves.append(saver.finish())
            saver.start()
        window.step(trained)
    saver.finish()  # the last one ran past the window
    return window, saves


GIL_PHASES = [  # (phase, a frame that marks it): a sample goes to the first phase one of its frames marks
    ("torch.save of an item: writing a record (CRC-32 and copy)", "torch/serialization.py:1312"),  # torch 2.13's line
    ("torch.save of an item: end of the archive", "__exit__"),
    ("torch.save of an item: the rest (pickler, its class made per call, checks)", "torch/serialization.py"),
    ("DCP: per-item Python of the write loop (resolving each DTensor's chunk)", "_write_files_from_queue"),
    ("DCP: pickling and unpickling objects for its collectives", "_object_to_tensor"),
    ("DCP: pickling and unpickling objects for its collectives", "_tensor_to_object"),
    ("DCP: planning", "create_local_plan"),
    ("DCP: planning", "create_global_plan"),
    ("DCP: planning", "finish_plan"),
    ("DCP: .metadata", "finish"),
    ("lightning-zero: checksums", "checksum_files"),
    ("lightning-zero: meta.pt and manifest", "_write_meta_and_manifest"),
    ("lightning-zero: commit", "_commit"),
    ("DCP: the rest", "torch/distributed/checkpoint/"),
]


def _marks(mark: str, frame: str) -> bool:
    """py-spy names a frame ``[Class.]function (file:line)``: a mark with a "/" or ":" is looked for
    in the file part, any other is the function's name."""
    name, _, where = frame.partition(" (")
    return mark in where if ("/" in mark or ":" in mark) else name.rsplit(".", 1)[-1] == mark


def summarize_gil(raw: str, rate: float, saves: int) -> None:
    """Where the writer threads held the GIL, from ``py-spy record --gil --threads -f raw`` of a run
    of this script (samples taken only while a thread holds the GIL), per save."""
    held: dict[str, int] = {}
    for line in open(raw):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        if "lightning-zero save" not in frames[0]:  # the writer threads are named after their save
            continue
        phase = next((p for p, mark in GIL_PHASES if any(_marks(mark, f) for f in frames[1:])), "other")
        held[phase] = held.get(phase, 0) + int(count)
    total = sum(held.values())
    print(f"writer threads held the GIL {total / rate:.2f} s in all, {total / rate / saves:.3f} s per save ({saves} saves):")
    for phase, samples in sorted(held.items(), key=lambda kv: -kv[1]):
        print(f"  {100 * samples / total:5.1f}%  {samples / rate / saves:.3f} s/save  {phase}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", choices=("example", "launch-bound"), default="example")
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--window", type=float, default=8.0, help="seconds of training per window")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads of the process (1: a core left to the writer on 2)")
    parser.add_argument("--folder", default=None, help="where the checkpoints go (default: a new folder in /tmp, removed after)")
    parser.add_argument("--gil-samples", default=None, help="summarize this py-spy raw output instead of running (see docs/benchmarks.md)")
    parser.add_argument("--gil-rate", type=float, default=200.0, help="py-spy's sampling rate of --gil-samples")
    parser.add_argument("--gil-saves", type=int, default=1, help="saves written by the run py-spy recorded (it prints them)")
    args = parser.parse_args()
    if args.gil_samples:
        summarize_gil(args.gil_samples, args.gil_rate, args.gil_saves)
        return

    torch.set_num_threads(args.threads)
    folder = args.folder or tempfile.mkdtemp(dir="/tmp", prefix="async_save_during_training_")
    os.makedirs(folder, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1)
    saved_shape = {"n_layer": args.layers, "n_embd": args.n_embd, "n_head": 4, "block_size": 128, "batch": 4}
    trained = Trained(**(saved_shape if args.train == "example" else LAUNCH_BOUND))
    saved = trained if args.train == "example" else Trained(**saved_shape)
    saved.step()  # optimizer state to save
    for _ in range(3):
        trained.step()
    saver = Saver(saved, os.path.join(folder, "checkpoints"))
    saver.start()  # the first save arranges the arena (allocates)
    saver.finish()

    alone, saves, during, without = [], [], [], []
    for _ in range(args.rounds):
        saver.start()
        alone.append(saver.finish())
        window, committed = train_while_saving(trained, saver, args.window)
        during.append(window)
        saves.extend(committed)
        without.append(train_without_saves(trained, args.window))
    dist.destroy_process_group()
    if args.folder is None:
        shutil.rmtree(folder)

    def median(rows: list, key: Callable[[Any], float]) -> float:
        return statistics.median(key(r) for r in rows)

    rate = lambda w: w.steps / w.wall  # noqa: E731
    params = sum(p.numel() for p in saved.model.parameters())
    trained_params = sum(p.numel() for p in trained.model.parameters())
    print(f"train: {args.train} ({trained_params / 1e6:.2f}M parameters); saved: GPT {args.layers}x{args.n_embd} ({params / 1e6:.1f}M,"
          f" ~{params * 12 / 1e6:.0f} MB), zero2, AdamW, 1 rank, torch threads {args.threads}; {args.rounds} rounds of"
          f" {args.window:.0f} s windows (medians)")  # fmt: skip
    base, busy = median(without, rate), median(during, rate)
    print(f"steps/s without a save:         {base:.2f}   (all {[round(rate(w), 2) for w in without]})")
    print(f"steps/s with a save in flight:  {busy:.2f}   (all {[round(rate(w), 2) for w in during]}) -> {busy / base:.2f}x")
    for name, windows in (("without a save", without), ("with a save in flight", during)):
        ms = {k: median(windows, lambda w: w.per_step_ms()[k]) for k in ("wall", "cpu", "queued", "slept")}
        print(f"training thread ms/step, {name}: {ms['wall']:.1f} wall = {ms['cpu']:.1f} on a CPU"
              f" + {ms['queued']:.1f} waiting for a core + {ms['slept']:.1f} waiting for the GIL")  # fmt: skip
    print(f"saves committed during the windows: {len(saves)}; saves written in all: {saver.count}")
    print(f"save held the step:             {median(saves, lambda r: r['held']):.3f} s")
    print(f"save, start to commit:          {median(saves, lambda r: r['committed']):.3f} s while training, "
          f"{median(alone, lambda r: r['committed']):.3f} s alone")  # fmt: skip
    print(f"writer thread CPU per save:     {median(saves, lambda r: r['writer_cpu']):.3f} s while training, "
          f"{median(alone, lambda r: r['writer_cpu']):.3f} s alone")  # fmt: skip

if __name__ == "__main__":
    main()
