"""One task of a SLURM job with auto-requeue, started as ``srun`` starts it (the ``SLURM_*``
variables, no Lightning launcher), for the late-signal test of ``test_preemption.py``.

    python late_signal_worker.py OUT PHASE-DELAY [PHASE-DELAY ...]

One zero3 ``fit`` for each ``PHASE-DELAY``, in the folder ``OUT/PHASE-DELAY``: rank 0 sends itself
SIGUSR1 before the first backward, so the ranks agree to stop at step 1 and save ``hpc_ckpt_1.ckpt``
there. Then, in ``PHASE``, each rank sends itself SIGUSR1 and SIGTERM, not before ``DELAY`` seconds
after rank 0's first signal (the scheduler reaching rank 1 late; a second one for rank 0):

- ``save``: from inside the preemption save (a callback's ``on_save_checkpoint``);
- ``teardown``: from inside the Trainer's teardown (the cluster environment's ``teardown``, which
  the strategy's runs, after the engine ended and before the Trainer puts its signal handlers back).

The fits run one after the other in this process, so each after the first starts where an earlier
preempted run left its handlers. After the last, the same two signals reach the process while the
interpreter exits, after Python gave up its handlers (``SignalsAtExit``): the process must still
exit 0. After each fit, this rank's views of the fits so far are written to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import types
from typing import Any, Optional

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning_helpers import GPTModule, token_data

from lightning_zero import ZeroStrategy

LATE_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class LateSignals(Callback):
    """Rank 0's first signal, and each rank's late ones in ``phase``, ``delay`` s after it at the earliest."""

    def __init__(self, phase: str, delay: float) -> None:
        self.phase, self.delay = phase, delay
        self.start: Optional[float] = None
        self.sent_after: Optional[float] = None
        """Seconds from rank 0's first signal to this rank's late ones (each rank's own clock: the
        ranks start the first step together, within a collective's latency)."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.start = time.monotonic()
            if trainer.global_rank == 0:
                os.kill(os.getpid(), signal.SIGUSR1)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: dict) -> None:
        if self.phase == "save":
            self.send()

    def send(self) -> None:
        if self.start is None or self.sent_after is not None:
            return
        time.sleep(max(0.0, self.start + self.delay - time.monotonic()))
        self.sent_after = time.monotonic() - self.start
        for signum in LATE_SIGNALS:
            os.kill(os.getpid(), signum)  # handled before `kill` returns to the next bytecode


class SignalsInTeardown(SLURMEnvironment):
    """SLURM with auto-requeue, whose teardown (run by the strategy's) sends the late signals."""

    def __init__(self, late: LateSignals) -> None:
        super().__init__(auto_requeue=True)
        self.late = late

    def teardown(self) -> None:
        super().teardown()
        if self.late.phase == "teardown":
            self.late.send()


class PreemptionLog(logging.Handler):
    """The lines ``lightning_zero.lightning.preemption`` logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class SignalsAtExit:
    """Sends the late signals while the interpreter exits, after Python put the default handlers
    back: from a finalizer, run when the interpreter drops the modules (see ``install``)."""

    MARK = b"late signals sent at exit\n"
    """Written to the output first, so the test knows the signals were sent."""

    def __init__(self) -> None:
        self.kill, self.write, self.pid, self.signals = os.kill, os.write, os.getpid(), LATE_SIGNALS  # globals may be gone then

    def __del__(self) -> None:
        self.write(1, self.MARK)
        for signum in self.signals:
            self.kill(self.pid, signum)

    @classmethod
    def install(cls) -> None:
        """Held by a module of its own, which nothing else refers to: it goes when the interpreter
        drops ``sys.modules`` (``__main__`` may be kept alive longer, by what refers to its functions)."""
        holder = types.ModuleType("late_signals_at_exit")
        holder.sender = cls()  # type: ignore[attr-defined]
        sys.modules[holder.__name__] = holder


def fit(root: str, phase: str, delay: float, log: PreemptionLog) -> dict:
    os.makedirs(root, exist_ok=True)
    os.environ["SCONTROL_CALLS"] = os.path.join(root, "scontrol_calls")  # the stub `scontrol` appends there
    late = LateSignals(phase, delay)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3), max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[late], default_root_dir=root, plugins=[SignalsInTeardown(late)],
    )  # fmt: skip
    del log.lines[:]
    exit_code: Any = "did not exit"
    try:
        trainer.fit(GPTModule(), token_data())
    except SystemExit as exit:
        exit_code = exit.code
    return {
        "exit_code": exit_code,
        "stopped_at": trainer.global_step,
        "sent_after": late.sent_after,
        "log": list(log.lines),
    }


def main(out: str, fits: list[str]) -> None:
    rank = int(os.environ["SLURM_PROCID"])
    log = PreemptionLog()
    logger = logging.getLogger("lightning_zero.lightning.preemption")
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    views = {}
    for name in fits:
        phase, delay = name.split("-")
        views[name] = fit(os.path.join(out, name), phase, float(delay), log)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
            json.dump(views, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    SignalsAtExit.install()
