"""Preemption: a signal that reaches each rank at its own moment ends ``fit`` at one step on every
rank, with one consistent checkpoint.

Lightning's signal connector acts where a signal lands. With ``SLURMEnvironment(auto_requeue=True)``
its handler for SLURM's requeue signal (SIGUSR1) saves a checkpoint right there — a collective that
each rank enters at a different point of its step — and its SIGTERM handler broadcasts from the
handler. Ranks signalled apart then pair different collectives and hang (under DDP as well).

Under ``ZeroStrategy`` instead (see [Note: stop votes] in ``engine/comm/stop_vote.py``):

1. ``PreemptionSignals``, the Trainer's signal connector from the strategy's setup on, only records
   the request in the engine's stop vote (SIGTERM: exit; the requeue signal: requeue);
2. the next gradient reduce-scatter carries every rank's votes, so all ranks learn of it in the
   same backward, with no collective or host sync of their own;
3. ``StopAtAgreedStep``, the Trainer's last callback, acts at the end of the first training batch
   after that which ends an optimizer step (not in the middle of gradient accumulation): under
   SLURM with auto-requeue every rank saves ``hpc_ckpt_<N>.ckpt`` in ``default_root_dir`` — where
   Lightning resumes from when the job starts again — and rank 0 runs ``scontrol requeue`` if the
   requeue signal was among the requests; then every rank leaves ``fit`` the way Lightning's SIGTERM
   handling does (``SIGTERMException``: exit code 0; ``OnExceptionCheckpoint`` saves there too).

Outside ``fit`` (validate, test, predict) there is no training state to keep: SIGTERM stops each
rank's loop at its next batch as Lightning's does, and the requeue signal only requeues.

[Note: late signals]
A scheduler signals the tasks of a job one by one, so after the ranks agreed to stop each rank's
own signal may still be on its way (or a second one: SIGTERM after the requeue signal). From the
moment the ranks agreed (the stop vote decided) until the process exits, such a signal is logged
and dropped on every rank — acting on it would requeue the job again or ask for a stop already
agreed, and the default action kills the rank (exit code -10 or -15) while it saves, exits cleanly
or writes its last logs:

- until ``fit`` is torn down, ``PreemptionSignals``' own handlers drop it;
- at teardown, the handlers that drop it replace those from before ``fit`` (usually the default)
  before Lightning puts the others back, so there is no moment without them; a new run in this
  process gets the handlers from before back first (``register_signal_handlers``);
- at the interpreter's exit, Python puts the default action back for every signal it handles
  (after the ``atexit`` functions, before it frees the modules — with torch loaded that can take
  a second): so the ``atexit`` function of this module ignores them from there on (``SIG_IGN``,
  which Python leaves alone), unlogged, as Python can no longer run a handler.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import subprocess
from types import FrameType
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_zero.engine.comm.stop_vote import StopReason

log = logging.getLogger(__name__)

__all__ = ["PreemptedExit", "PreemptionSignals", "StopAtAgreedStep", "handle_preemption", "requeue_slurm_job"]


class PreemptedExit(SIGTERMException):
    """Every rank leaves ``fit`` at the same step after a preemption signal (exit code 0). The
    strategy tears down as after a finished run: no rank is inside a collective."""


class PreemptionSignals(_SignalConnector):
    """Lightning's signal connector whose handlers only record a request in the engine's stop vote
    while fitting (see the module docstring); the other handlers it composes are kept."""

    @override
    def _slurm_sigusr_handler_fn(self, signum: Any, _: Optional[FrameType]) -> None:
        self._request(StopReason.REQUEUE, signum)

    @override
    def _sigterm_notifier_fn(self, signum: Any, _: Optional[FrameType]) -> None:
        launcher = self.trainer.strategy.launcher
        if launcher is not None:  # the ranks this process started get it too (Lightning's popen launch)
            launcher.kill(signum)
        self._request(StopReason.EXIT, signum)

    stopped_for_preemption = False
    """Set by ``StopAtAgreedStep`` when this run stops for a preemption signal (see [Note: late signals])."""

    @override
    def register_signal_handlers(self) -> None:
        # a new run in this process: the handlers an earlier preempted run left (see `teardown`) go,
        # else Lightning would take them for the user's and not register its own
        self.stopped_for_preemption = False
        for signum, before in list(_REPLACED_BY_LATE_SIGNAL_DROP.items()):
            if signal.getsignal(signum) is _drop_late_signal:
                self._register_signal(signum, signal.SIG_DFL if before is None else before)
        _REPLACED_BY_LATE_SIGNAL_DROP.clear()
        super().register_signal_handlers()

    @override
    def teardown(self) -> None:
        if self.stopped_for_preemption:
            # in place of the handlers from before `fit`, which Lightning must not put back first
            for signum in self._preemption_signals():
                before = self._original_handlers.pop(signum, signal.getsignal(signum))
                _REPLACED_BY_LATE_SIGNAL_DROP.setdefault(signum, before)
                self._register_signal(signum, _drop_late_signal)
            atexit.unregister(_ignore_late_signals_at_exit)  # once, however many runs were preempted
            atexit.register(_ignore_late_signals_at_exit)
        super().teardown()  # the other handlers from before `fit`

    def _preemption_signals(self) -> list[int]:
        """SIGTERM, and the requeue signal where this run handles it (SLURM with auto-requeue)."""
        environment = self.trainer._accelerator_connector.cluster_environment
        slurm = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        return [signal.SIGTERM] + ([environment.requeue_signal] if slurm and environment.requeue_signal is not None else [])

    def _agreed_to_stop(self) -> bool:
        """From the stop vote's decision until the next run (see [Note: late signals])."""
        if self.stopped_for_preemption:
            return True
        engine = getattr(self.trainer.strategy, "engine", None)
        return engine is not None and bool(engine.stop_vote.agreed)

    def _request(self, reason: StopReason, signum: Any) -> None:
        if self._agreed_to_stop():
            _drop_late_signal(signum, None)
            return
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None and self.trainer.state.fn == TrainerFn.FITTING:
            log.info(f"Received signal {signum}: the ranks stop at the next step boundary ({reason.name.lower()}).")
            engine.stop_vote.request(reason)
        elif reason is StopReason.EXIT:
            self.received_sigterm = True  # Lightning's evaluation loops stop after their current batch
        elif self.trainer.is_global_zero:
            requeue_slurm_job()


class StopAtAgreedStep(Callback):
    """Ends ``fit`` on every rank at the first step boundary after the ranks agreed to stop (see
    the module docstring). The Trainer's last callback, so that the others' ``on_train_batch_end``
    (weight averages, checkpoints) have run for this step when it saves."""

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any, **kwargs: Any) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None or not engine.stop_vote.agreed or engine.holds_unstepped_gradients:
            return
        reasons = engine.stop_vote.agreed
        environment = trainer.strategy.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)  # rank 0's is used
            rank_zero_info(f"Preempted: saving {path} at step {trainer.global_step} on every rank.")
            trainer.save_checkpoint(path)
            trainer.strategy.wait_for_checkpoint()  # with `async_save`: complete before the process may exit
            if StopReason.REQUEUE in reasons and trainer.is_global_zero:
                requeue_slurm_job()
        trainer._signal_connector.received_sigterm = True
        if isinstance(trainer._signal_connector, PreemptionSignals):
            trainer._signal_connector.stopped_for_preemption = True
        raise PreemptedExit()


_REPLACED_BY_LATE_SIGNAL_DROP: dict[int, Any] = {}
"""The handlers ``_drop_late_signal`` replaced after a preempted run, put back when a new run starts."""


def _drop_late_signal(signum: int, _: Optional[FrameType]) -> None:
    log.info(f"Received signal {signum} after the ranks agreed to stop for preemption: nothing left to do, ignored.")


def _ignore_late_signals_at_exit() -> None:
    """From the interpreter's exit on, Python runs no handler: a late signal is ignored (see [Note: late signals])."""
    for signum in _REPLACED_BY_LATE_SIGNAL_DROP:
        if signal.getsignal(signum) is _drop_late_signal:
            signal.signal(signum, signal.SIG_IGN)


def handle_preemption(trainer: "pl.Trainer") -> None:
    """Give ``trainer`` the signal connector and the last callback of this module (idempotent: the
    strategy's setup runs again for each ``fit``/``validate``/...). Before Lightning registers its
    signal handlers, which it does after the strategy's setup."""
    if not isinstance(trainer._signal_connector, PreemptionSignals):
        trainer._signal_connector = PreemptionSignals(trainer)
    trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, StopAtAgreedStep)] + [StopAtAgreedStep()]


def requeue_slurm_job() -> None:
    """``scontrol requeue`` this SLURM job (an array job's task: ``<array id>_<task id>``), as
    Lightning's own handler does; a failure is logged, not raised: the checkpoint is saved already."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job_id):
        rank_zero_warn(f"Not requeuing: {job_id!r} is not a SLURM job id (from SLURM_JOB_ID / SLURM_ARRAY_*).")
        return
    try:
        result = subprocess.call(["scontrol", "requeue", job_id])
    except OSError as err:
        rank_zero_warn(f"Requeuing SLURM job {job_id} failed: {err}. HINT: `scontrol` must be on the PATH of the job's tasks.")
        return
    if result == 0:
        rank_zero_info(f"Requeued SLURM job {job_id}.")
    else:
        rank_zero_warn(f"Requeuing SLURM job {job_id} failed: `scontrol requeue` exited with {result}.")
