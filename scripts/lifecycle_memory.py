"""Peak memory per rank in each phase of a run's lifecycle, at any size (the figures behind
``tests/test_after_fit.py``, which checks the same phases on a small model in CI).

    python scripts/lifecycle_memory.py [--stage 3] [--devices 2] [--layers 24] [--width 896] [--heads 14]

A GPT built in ``configure_model`` (on the meta device at stage 3) is fitted for 2 steps, then:
``trainer.save_checkpoint`` (a sharded directory), ``validate``, ``test``, ``predict``, a full-file
save (``strategy.state_dict_type = "full"``), and a fit resumed from the directory for one step with a
new module and Trainer in the same processes. Each phase's peak resident memory per rank is printed
(Linux: VmHWM, reset between phases; glibc's mmap threshold is lowered so freed tensors leave the
process, see ``bench/memory.py``), with the rise of rank 0's full save against the file's size.
``--stage 0`` runs DDP. The defaults are the 227M-parameter model of issue 24's table.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
from typing import Any, Callable

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401 - registers the strategy names
from lightning_zero import ZeroStrategy
from lightning_zero.bench.memory import PeakMemory, small_mmap_threshold
from lightning_zero.models.gpt import GPT, GPTConfig


class LifecycleModule(L.LightningModule):
    """A GPT built in ``configure_model`` (on the meta device at stage 3), trained, evaluated, predicted."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0][:, :-1], batch[0][:, 1:])[1]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.model(batch[0][:, :-1], batch[0][:, 1:])[1], sync_dist=True)

    test_step = validation_step

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0][:, :-1])[0][:, -1].argmax(-1)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _Phases:
    """Peak RSS per phase on this rank."""

    def __init__(self) -> None:
        small_mmap_threshold()
        self.memory = PeakMemory(torch.device("cpu"))
        self.peaks: dict[str, int] = {}
        self.before: dict[str, int] = {}
        self.current: str = ""

    def start(self, name: str) -> None:
        gc.collect()
        self.current = name
        self.before[name] = self.memory.current()
        self.memory.reset()

    def end(self) -> None:
        self.peaks[self.current] = self.memory.peak()


class _PhaseBoundaries(Callback):
    """Setup ends at ``on_fit_start``, training at ``on_train_end``. One per Trainer: Lightning points
    a callback's ``log`` at the module it last ran with, so a shared one would keep that module alive."""

    def __init__(self, phases: _Phases) -> None:
        self.phases = phases

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.phases.current == "setup":
            self.phases.end()
            self.phases.start("fit")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.phases.current == "fit":
            self.phases.end()
            self.phases.start("teardown")


def measure_lifecycle(
    strategy: Callable[[], Any], config: GPTConfig, data: DataLoader, out: str, **trainer_options: Any
) -> dict[str, Any]:
    """Run the phases on this process's ranks (a ``Trainer`` made with ``trainer_options`` and a new
    ``strategy()`` each time) and return this rank's ``peaks`` and ``before`` (bytes, by phase), the
    full file's size and the resumed run's last step."""
    directory, file = os.path.join(out, "sharded.ckpt"), os.path.join(out, "full.ckpt")
    phases = _Phases()

    def trainer(max_steps: int) -> L.Trainer:
        return L.Trainer(
            strategy=strategy(), max_steps=max_steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[_PhaseBoundaries(phases)], limit_val_batches=2,
            limit_test_batches=2, limit_predict_batches=2, num_sanity_val_steps=0, **trainer_options,
        )  # fmt: skip

    L.seed_everything(0, verbose=False)
    module, fitting = LifecycleModule(config), trainer(2)
    phases.start("setup")
    fitting.fit(module, data)  # no validation data: validation comes after fit
    phases.end()
    for name, run in (
        ("sharded save", lambda: fitting.save_checkpoint(directory)),
        ("validate after fit", lambda: fitting.validate(module, data, verbose=False)),
        ("test after fit", lambda: fitting.test(module, data, verbose=False)),
        ("predict after fit", lambda: fitting.predict(module, data)),
    ):
        phases.start(name)
        run()
        phases.end()
    if isinstance(fitting.strategy, ZeroStrategy):
        fitting.strategy.state_dict_type = "full"
    phases.start("full save")
    fitting.save_checkpoint(file)
    phases.end()
    del fitting, module  # the next run starts in these processes: the first one must be freed
    L.seed_everything(0, verbose=False)
    module, resumed = LifecycleModule(config), trainer(3)
    phases.start("resume")
    resumed.fit(module, data, ckpt_path=directory)
    phases.end()
    return {"peaks": phases.peaks, "before": phases.before, "file_bytes": os.path.getsize(file), "resumed_step": resumed.global_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3), help="0: DDP")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=896)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--out", default=None, help="where to write the checkpoints (default: a temporary directory)")
    args = parser.parse_args()

    config = GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    out = args.out or os.environ.setdefault("LIFECYCLE_MEMORY_DIR", tempfile.mkdtemp(prefix="lifecycle_"))
    data = DataLoader(TensorDataset(torch.randint(0, 256, (8 * args.devices, 65), generator=torch.Generator().manual_seed(0))), batch_size=2)
    strategy = (lambda: "ddp") if args.stage == 0 else (lambda: ZeroStrategy(stage=args.stage))
    result = measure_lifecycle(strategy, config, data, out, accelerator="cpu", devices=args.devices)

    phases = list(result["peaks"])
    full_rise = result["peaks"]["full save"] - result["before"]["full save"]
    mine = torch.tensor([[result["peaks"][p] for p in phases] + [full_rise]], dtype=torch.float64)
    if not torch.distributed.is_initialized():
        return
    gathered = [torch.zeros_like(mine) for _ in range(args.devices)]
    torch.distributed.all_gather(gathered, mine)
    if torch.distributed.get_rank() == 0:
        peaks = torch.cat(gathered) / 2**20
        numel = sum(p.numel() for p in GPT(config).parameters())
        name = "DDP" if args.stage == 0 else f"zero{args.stage}"
        print(f"GPT with {numel / 1e6:.1f}M parameters, {name}, {args.devices} CPU ranks, AdamW; peak RSS per rank (MB)")
        print(f"{'phase':28} " + " ".join(f"{'rank ' + str(r):>9}" for r in range(args.devices)))
        for index, phase in enumerate(phases):
            print(f"{phase:28} " + " ".join(f"{peaks[r, index]:9,.0f}" for r in range(args.devices)))
        size = result["file_bytes"] / 2**20
        print(f"rank 0's rise during the full save: {peaks[0, -1]:,.0f} MB for a {size:,.0f} MB file ({peaks[0, -1] / size:.2f}x)")


if __name__ == "__main__":
    main()
