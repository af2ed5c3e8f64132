"""Preemption under SLURM, simulated on 2 ranks: SIGUSR1 (auto-requeue) and SIGTERM reach each rank
at a different moment, and the ranks still stop at one step, save one checkpoint there, requeue the
job once (SIGUSR1) and exit 0; the job started again resumes from that checkpoint (Lightning finds
it by itself under SLURM) and ends with exactly the weights of a run never interrupted.

The signals are sent by each rank to itself (``os.kill``) from a callback at chosen batches — before
a backward (counted in that step's vote) or after it (counted in the next step's) — and in one case
from timers 0.4 s apart, landing wherever the ranks happen to be. ``scontrol`` is a stub on the
PATH that records its calls. The data of each step is keyed by the loop's batch counter, which a
checkpoint restores (Lightning restarts a plain DataLoader at the start of its epoch on resume).

Signals that arrive after the ranks agreed to stop are sent to tasks started as ``srun`` starts
them (``late_signal_worker.py``), whose processes exit as a job's do: from inside the preemption
save, the teardown, and the interpreter's exit (see [Note: late signals] in ``preemption.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Optional
from unittest import mock

import lightning as L
import pytest
import torch
from case_groups import CaseGroup, GroupResults, RankContext
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint
from lightning_helpers import GPTModule, WeightRecorder, make_trainer, token_data
from multiprocess import free_port, script_environment

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import verify_checkpoint

STEPS = 5
"""Optimizer steps of every run: the reference, and the preempted run with its resumed one."""
JOB_ID = "4242"

GROUP = CaseGroup(world_size=2, timeout=120)  # the cases take ~10 s; ranks stopping apart would hang


class StepKeyedGPT(GPTModule):
    """Each micro-batch's tokens chosen by the loop's batch counter and the rank, not by the loader."""

    TOKENS = torch.randint(0, 256, (64, 9), generator=torch.Generator().manual_seed(3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index = self.trainer.fit_loop.epoch_loop.total_batch_idx * self.trainer.world_size + self.global_rank
        tokens = self.TOKENS[index % len(self.TOKENS)].view(1, -1)
        return self(tokens[:, :-1], tokens[:, 1:])[1]


class SendSignals(Callback):
    """Rank r sends itself ``signum`` at training batch ``b`` for ``at[r] = (b, when)``: ``before``
    its backward (in ``on_train_batch_start``: counted in that step's vote), ``after`` it (in
    ``on_before_optimizer_step``, once the step's votes were read: counted in the next step's), or
    during the ``validation`` that follows that batch; ``delays[r]`` seconds later from a timer
    instead, when given, landing wherever the rank then is."""

    def __init__(self, signum: int, at: dict[int, tuple[int, str]], delays: Optional[dict[int, float]] = None) -> None:
        self.signum, self.at, self.delays = signum, at, delays or {}
        self.timers: list[threading.Timer] = []

    def _send(self, trainer: L.Trainer, when: str, batch_idx: int) -> None:
        rank = trainer.global_rank
        if self.at.get(rank) != (batch_idx, when):
            return
        if rank in self.delays:
            self.timers.append(threading.Timer(self.delays[rank], os.kill, (os.getpid(), self.signum)))
            self.timers[-1].start()
        else:
            os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._send(trainer, "before", batch_idx)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self._send(trainer, "after", trainer.fit_loop.epoch_loop.batch_idx)

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not trainer.sanity_checking:
            self._send(trainer, "validation", trainer.fit_loop.epoch_loop.batch_idx)

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        self._cancel()  # while the Trainer's handlers are still there for a timer that just fired

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._cancel()

    def _cancel(self) -> None:
        for timer in self.timers:
            timer.cancel()
            timer.join()


@contextlib.contextmanager
def _slurm_job(ctx: RankContext, folder: str) -> Iterator[str]:
    """This rank as task ``ctx.rank`` of a one-node SLURM job, with a stub ``scontrol`` on the PATH
    that appends its arguments to the returned file."""
    bin_dir = os.path.join(folder, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    calls = os.path.join(folder, "scontrol_calls")
    stub = os.path.join(bin_dir, "scontrol")
    with open(stub, "w") as file:
        file.write(f'#!/bin/sh\necho "$SLURM_PROCID $*" >> "{calls}"\n')
    os.chmod(stub, 0o755)
    variables = dict(
        SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="zero", SLURM_NTASKS=str(ctx.world_size),
        SLURM_NTASKS_PER_NODE=str(ctx.world_size), SLURM_NNODES="1", SLURM_NODELIST="localhost",
        SLURM_PROCID=str(ctx.rank), SLURM_LOCALID=str(ctx.rank), SLURM_NODEID="0",
        PATH=bin_dir + os.pathsep + os.environ["PATH"],
    )  # fmt: skip
    with mock.patch.dict(os.environ, variables):
        yield calls


class ManualStepKeyedGPT(StepKeyedGPT):
    """The same steps under manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()
        optimizer.zero_grad()


MODULES = {"automatic": StepKeyedGPT, "manual": ManualStepKeyedGPT}


@dataclass(frozen=True)
class Setup:
    """How a run trains; the reference run trains the same way, never interrupted."""

    stage: int
    module: str = "automatic"
    accumulate: int = 1
    validate: bool = False
    """Validate every 2 batches (changes no weight: the reference does not)."""
    async_save: bool = False
    """Sharded saves written in the background: the preemption save must still be complete at exit."""

    def trainer(self, callbacks: list, **trainer_kwargs: Any) -> L.Trainer:
        validation = dict(val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=0) if self.validate else {}
        return make_trainer(
            ZeroStrategy(stage=self.stage, async_save=self.async_save), STEPS, callbacks=callbacks,
            accumulate_grad_batches=self.accumulate, **validation, **trainer_kwargs,
        )  # fmt: skip

    def fit(self, trainer: L.Trainer, ckpt_path: Optional[str] = None) -> None:
        """Fit ``STEPS`` steps (raises ``SystemExit`` when preempted)."""
        trainer.fit(MODULES[self.module](), token_data(), token_data(8) if self.validate else None, ckpt_path=ckpt_path)

    def reference(self) -> dict[str, torch.Tensor]:
        """The weights at the end of an uninterrupted run."""
        L.seed_everything(0, verbose=False)
        recorder = WeightRecorder()
        self.fit(self.trainer([recorder]))
        return recorder.history[-1]


class StepAtStart(Callback):
    def __init__(self) -> None:
        self.step: Optional[int] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.step = trainer.global_step


def preempt_and_resume(ctx: RankContext, folder: str, setup: Setup, signals: SendSignals, slurm: bool = True) -> dict:
    """Fit until the signals stop the run, then start again and fit to the end: as SLURM tasks, the
    job resumes by itself; else from the checkpoint of an ``OnExceptionCheckpoint``."""
    uninterrupted = replace(setup, validate=False, module="automatic", async_save=False)  # the manual steps are the same steps
    final = ctx.once(uninterrupted, uninterrupted.reference)
    root = os.path.join(ctx.tmpdir, folder)
    os.makedirs(root, exist_ok=True)
    where = dict(default_root_dir=root, plugins=[SLURMEnvironment(auto_requeue=True)] if slurm else [])
    on_exception = [] if slurm else [OnExceptionCheckpoint(root)]
    with _slurm_job(ctx, root) if slurm else contextlib.nullcontext() as calls:
        L.seed_everything(0, verbose=False)
        preempted = setup.trainer([signals, *on_exception], enable_checkpointing=bool(on_exception), **where)
        exit_code: Any = "did not exit"
        try:
            setup.fit(preempted)
        except SystemExit as exit:
            exit_code = exit.code
        # this rank's own signal arriving after the stop (a scheduler signals tasks one by one)
        # must not kill it: it is logged and dropped
        os.kill(os.getpid(), signals.signum)
        saved = sorted(set(os.listdir(root)) - {"bin", "scontrol_calls"})
        L.seed_everything(1, verbose=False)  # the checkpoint decides the weights, not this seed
        recorder, start = WeightRecorder(), StepAtStart()
        resumed = setup.trainer([recorder, start], **where)
        # no ckpt_path under SLURM: Lightning finds the hpc checkpoint itself
        setup.fit(resumed, ckpt_path=None if slurm else on_exception[0].ckpt_path)
        requeues = open(calls).read().splitlines() if calls is not None and os.path.exists(calls) else []
    return {
        "exit_code": exit_code,
        "stopped_at": preempted.global_step,
        "received_sigterm": preempted.received_sigterm,
        "saved": saved,
        "requeues": requeues,
        "resumed_at": start.step,
        "resumed_to": resumed.global_step,
        "differ": sorted(k for k in final if not torch.equal(final[k], recorder.history[-1][k])),
    }


USR1, TERM = signal.SIGUSR1, signal.SIGTERM
CASES: dict[str, tuple[Optional[int], dict[str, Any]]] = {
    # (the step the ranks must stop at, None for any; the case's options)
    # rank 0 first, rank 1 two batches later (never: the run stopped at the end of rank 0's batch)
    "usr1_zero1": (2, dict(setup=Setup(1), signals=SendSignals(USR1, {0: (1, "before"), 1: (3, "before")}))),
    # rank 1 alone, after the backward of batch 2: counted in the next step's vote
    "usr1_zero2": (4, dict(setup=Setup(2), signals=SendSignals(USR1, {1: (2, "after")}))),
    # the same, the preemption checkpoint written in the background: complete before the ranks exit
    "usr1_zero2_async_save": (4, dict(setup=Setup(2, async_save=True), signals=SendSignals(USR1, {1: (2, "after")}))),
    # timers 0.4 s apart, started at batch 1: each lands wherever its rank then is
    "usr1_zero3_timers": (
        None,
        dict(setup=Setup(3), signals=SendSignals(USR1, {0: (1, "before"), 1: (1, "before")}, delays={0: 0.0, 1: 0.4})),
    ),
    # rank 1 after its first backward, rank 0 never
    "term_zero1_manual": (2, dict(setup=Setup(1, module="manual"), signals=SendSignals(TERM, {1: (0, "after")}))),
    # rank 0 in the validation after batch 1, rank 1 after the backward of batch 2 (too late)
    "term_zero2_validating": (
        3, dict(setup=Setup(2, validate=True), signals=SendSignals(TERM, {0: (1, "validation"), 1: (2, "after")})),
    ),
    # before the first of step 2's two micro-batches: counted there, acted on after its optimizer step
    "term_zero3_accumulating": (2, dict(setup=Setup(3, accumulate=2), signals=SendSignals(TERM, {0: (2, "before")}))),
    # no SLURM: nothing saved by the strategy, but every rank raises at the same step, where
    # Lightning's OnExceptionCheckpoint saves
    "term_zero3_on_exception_checkpoint": (
        3, dict(setup=Setup(3), signals=SendSignals(TERM, {1: (2, "before")}), slurm=False),
    ),
}  # fmt: skip
for _name, (_, _options) in CASES.items():
    GROUP.case(preempt_and_resume, name=_name, folder=_name, **_options)


@GROUP.case
def fit_again_after_preemption(ctx: RankContext) -> dict:
    """The Trainer of a preempted run fitted again in the same process (SLURM resumes it from the
    checkpoint): rank 0's signal in the new run is acted on, not dropped as a late one of the first."""
    root = os.path.join(ctx.tmpdir, "fit_again")
    os.makedirs(root, exist_ok=True)
    with _slurm_job(ctx, root) as calls:
        setup, signals = Setup(1), SendSignals(USR1, {0: (0, "before")})
        trainer = setup.trainer([signals], default_root_dir=root, plugins=[SLURMEnvironment(auto_requeue=True)])
        stopped_at = []
        for batch in (0, 2):
            signals.at = {0: (batch, "before")}
            with contextlib.suppress(SystemExit):
                setup.fit(trainer)
            stopped_at.append(trainer.global_step)
        requeues = open(calls).read().splitlines() if os.path.exists(calls) else []
    return {"stopped_at": stopped_at, "saved": sorted(set(os.listdir(root)) - {"bin", "scontrol_calls"}), "requeues": requeues}


def test_a_preempted_trainer_fitted_again_stops_for_its_new_signal(results) -> None:
    for r in results["fit_again_after_preemption"]:
        assert r["stopped_at"] == [1, 3]
        assert r["saved"] == ["hpc_ckpt_1.ckpt", "hpc_ckpt_2.ckpt"]
    assert results["fit_again_after_preemption"][0]["requeues"] == [f"0 requeue {JOB_ID}"] * 2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> GroupResults:
    return GROUP.run(tmp_path_factory.mktemp("preemption"))


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_signalled_apart_stop_at_one_step_save_once_and_resume_exactly(results, name: str) -> None:
    expected_step, options = CASES[name]
    slurm, requeue = options.get("slurm", True), name.startswith("usr1")
    ranks = results[name]
    stopped_at = {r["stopped_at"] for r in ranks}
    assert len(stopped_at) == 1, f"the ranks stopped at different steps: {[r['stopped_at'] for r in ranks]}"
    step = stopped_at.pop()
    if expected_step is not None:
        assert step == expected_step
    assert 0 < step < STEPS
    for rank, r in enumerate(ranks):
        assert r["exit_code"] is None, f"rank {rank}: {r['exit_code']}"  # SystemExit(): exit status 0
        assert r["received_sigterm"]
        # one checkpoint, nothing left over
        assert r["saved"] == ["hpc_ckpt_1.ckpt" if slurm else "on_exception.ckpt"], f"rank {rank}: {r['saved']}"
        assert (r["resumed_at"], r["resumed_to"]) == (step, STEPS)
        assert r["differ"] == [], f"rank {rank}: resumed weights differ from the uninterrupted run's in {r['differ']}"
    # rank 0 alone requeues the job, once, and only for SLURM's requeue signal
    assert ranks[0]["requeues"] == ([f"0 requeue {JOB_ID}"] if requeue else [])


# ---- late signals, to tasks started as srun starts them ---------------------------------------
PHASES = ("save", "teardown")
DELAYS = (0.2, 0.4, 1.0)
"""Seconds from rank 0's signal to the late ones (rank 1's first, rank 0's second)."""
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "late_signal_worker.py")


@pytest.fixture(scope="module")
def late_signals(tmp_path_factory) -> tuple[str, list[tuple[int, str]], list[dict[str, dict]]]:
    """``late_signal_worker.py`` run as the 2 tasks of a SLURM job, one fit for each phase and delay
    (``scontrol``: a stub that appends its arguments to the file in ``$SCONTROL_CALLS``): the folder,
    each task's exit code and output, and each rank's view of each fit by ``<phase>-<delay>``."""
    out = str(tmp_path_factory.mktemp("late_signals"))
    bin_dir = os.path.join(out, "bin")
    os.makedirs(bin_dir)
    with open(os.path.join(bin_dir, "scontrol"), "w") as file:
        file.write('#!/bin/sh\necho "$SLURM_PROCID $*" >> "$SCONTROL_CALLS"\n')
    os.chmod(os.path.join(bin_dir, "scontrol"), 0o755)
    port, tasks = free_port(), []
    fits = [f"{phase}-{delay}" for phase in PHASES for delay in DELAYS]
    for rank in (0, 1):
        env = script_environment()
        env.update(
            SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="zero", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2",
            SLURM_NNODES="1", SLURM_NODELIST="localhost", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
            SLURM_NODEID="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PATH=bin_dir + os.pathsep + env["PATH"],
        )  # fmt: skip
        command = [sys.executable, WORKER, out, *fits]
        tasks.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [task.communicate(timeout=120)[0] for task in tasks]
    finally:
        for task in tasks:
            task.kill()
    exits = [(task.returncode, output) for task, output in zip(tasks, outputs)]
    views = []
    for rank, (_, output) in enumerate(exits):
        path = os.path.join(out, f"rank{rank}.json")
        views.append(json.loads(Path(path).read_text()) if os.path.exists(path) else {})
        assert list(views[-1]) == fits, f"rank {rank} ran {list(views[-1])} of {fits}:\n{output[-4000:]}"
    return out, exits, views


def _kind(line: str) -> str:
    if "after the ranks agreed to stop for preemption" in line:
        return "dropped"
    return "request" if "the ranks stop at the next step boundary" in line else line


@pytest.mark.parametrize("phase", PHASES)
def test_late_signals_from_the_agreed_stop_on_are_logged_and_dropped(late_signals, phase: str) -> None:
    """Rank 0 is signalled (SIGUSR1) before the first backward, and the ranks agree to stop there;
    each rank then gets SIGUSR1 and SIGTERM in ``phase`` (rank 1's first, 0.2, 0.4 and 1.0 s after
    rank 0's at the earliest), one fit after the other in one process (see ``late_signal_worker.py``).
    Each is logged and dropped: no second requeue, no second request, one complete checkpoint."""
    out, exits, views = late_signals
    for delay in DELAYS:
        fit = f"{phase}-{delay}"
        for rank, view in enumerate(views):
            f, where = view[fit], f"rank {rank}, {fit}"
            # every fit, the later ones included, is stopped by rank 0's first signal: its handlers are back
            assert (f["exit_code"], f["stopped_at"]) == (None, 1), where
            assert f["sent_after"] is not None and f["sent_after"] >= delay, where  # sent in the phase
            assert [_kind(line) for line in f["log"]] == ["request"] * (rank == 0) + ["dropped", "dropped"], where
        root = os.path.join(out, fit)
        assert sorted(os.listdir(root)) == ["hpc_ckpt_1.ckpt", "scontrol_calls"], fit
        verify_checkpoint(os.path.join(root, "hpc_ckpt_1.ckpt"))
        assert Path(root, "scontrol_calls").read_text().splitlines() == [f"0 requeue {JOB_ID}"], fit


def test_late_signals_while_the_process_exits_do_not_kill_it(late_signals) -> None:
    """The same two signals while the interpreter exits, after Python gave its handlers up: both
    tasks still exit 0 (not -10 or -15: killed by the default action)."""
    _, exits, _ = late_signals
    for rank, (code, output) in enumerate(exits):
        assert "late signals sent at exit" in output, f"rank {rank}:\n{output[-2000:]}"
        assert code == 0, f"rank {rank} exited with {code}:\n{output[-2000:]}"


# ---- one process -------------------------------------------------------------------------------
@pytest.mark.parametrize("offload", [False, True])
def test_one_rank_counts_its_own_votes(offload: bool) -> None:
    """A world of one rank has no collective to carry the vote (or, offloaded, a packed row of its own)."""
    from lightning_zero.engine import ZeroEngine
    from lightning_zero.engine.comm.stop_vote import StopReason
    from lightning_zero.engine.config import ZeroConfig

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=2, offload_optimizer=offload))
    for requested in (False, True):
        if requested:
            engine.stop_vote.request(StopReason.REQUEUE)
        model(torch.randn(3, 4)).sum().backward()
        engine.finish_backward()
        engine.end_step()
        assert engine.holds_unstepped_gradients
        assert engine.stop_vote.agreed == ({StopReason.REQUEUE} if requested else set())
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        optimizer.zero_grad()
        assert not engine.holds_unstepped_gradients
    engine.close()


def test_leftovers_of_an_interrupted_preemption_save_do_not_hide_the_last_checkpoint(tmp_path) -> None:
    """A save killed halfway (the grace time ran out) leaves ``hpc_ckpt_2.ckpt.tmp-<token>``, whose
    token's digits Lightning reads as checkpoint 2<digits>; the launcher deletes it before Lightning
    looks for the checkpoint to resume from."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from lightning_zero.lightning.launchers import RecoveringLauncher

    (tmp_path / "hpc_ckpt_1.ckpt").mkdir()
    (tmp_path / "hpc_ckpt_2.ckpt.tmp-3fa9b2c1").mkdir()  # no manifest: incomplete
    (tmp_path / "hpc_ckpt_2.ckpt.tmp-3fa9b2c1" / "__0_0.distcp").write_bytes(b"partial")
    connector = _CheckpointConnector(SimpleNamespace(default_root_dir=str(tmp_path)))
    assert connector._hpc_resume_path == str(tmp_path / "hpc_ckpt_23921.ckpt")  # Lightning's reading of the leftover

    class Environment:  # as SLURM's: every task starts itself
        creates_processes_externally = True

        def validate_settings(self, num_devices: int, num_nodes: int) -> None:
            pass

    trainer = SimpleNamespace(default_root_dir=str(tmp_path), callbacks=[])
    RecoveringLauncher(Environment(), 1, 1).launch(lambda: None, trainer=trainer)
    assert sorted(os.listdir(tmp_path)) == ["hpc_ckpt_1.ckpt"]
    assert connector._hpc_resume_path == str(tmp_path / "hpc_ckpt_1.ckpt")
