"""The ZeRO engine: a module and its optimizers, with the stages composed from shared parts.

    stage 1 = ReplicatedParameters + ReduceAfterBackward  + the sharded optimizer
    stage 2 = ReplicatedParameters + ReduceDuringBackward + the sharded optimizer
    stage 3 = ShardedParameters    + ReduceDuringBackward + the sharded optimizer

Nothing here imports Lightning: the strategy calls these methods from its hooks, and a Fabric
strategy or a plain training loop can call them the same way (one process per GPU, e.g. under
``torchrun``)::

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)  # first: else every rank's NCCL communicator and kernels land on cuda:0
    torch.distributed.init_process_group("nccl")
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3), device=device)
    for batch in data:
        engine.begin_step()
        loss = model(batch); loss.backward(); engine.finish_backward()
        engine.end_step()  # after the step's last backward, before the optimizer step
        optimizer.step(); engine.after_optimizer_step(optimizer); optimizer.zero_grad()
    with torch.no_grad():
        for batch in eval_data:  # ranks may run different numbers of evaluation steps
            engine.begin_evaluation_step(); model(batch); engine.end_step()
        engine.finish_evaluation()

``end_step`` has this one place: after the last backward of a step (with gradient accumulation,
after the last micro-batch's, or after every micro-batch's as the strategies call it, with
``sync_gradients`` False on those that only accumulate), before the optimizer step, and after each
evaluation step. Stage 3 then frees the root unit, so ``after_optimizer_step`` has nothing gathered
to refresh; the frozen units ``keep_frozen_units_mb`` keeps are freed at the step's last ``end_step``
(see [Note: kept frozen units] in ``parameters/kept_units.py``).
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine.parameters import module_link
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.host_reads import HostReads
from lightning_zero.engine.comm.stop_vote import StopReason, StopVote
from lightning_zero.engine.comm.node_links import NodeLinks, check_links
from lightning_zero.engine.config import ZeroConfig, ZeroStage
from lightning_zero.engine.full_weights import FullWeights
from lightning_zero.engine.gradients.grad_sync import GradientSync, ReduceAfterBackward
from lightning_zero.engine.gradients.reduce_during_backward import ReduceDuringBackward
from lightning_zero.engine.gradients.grad_window import GradientWindow
from lightning_zero.engine.gradients.norms import norms_by_name
from lightning_zero.engine.memory import MemoryReport, measure, working_memory
from lightning_zero.engine.offload.disk_tier import DiskTier
from lightning_zero.engine.offload.host_threads import apply_host_threads
from lightning_zero.engine.offload.masters_on_disk import master_bytes_needed
from lightning_zero.engine.host_step_overlap import HostStepOverlap, HostStepPlan, LossScale
from lightning_zero.engine.offload.host_step_report import HostStepReport
from lightning_zero.engine.optimizer.averaged_shards import AveragedShards, Buffers
from lightning_zero.engine.optimizer.sharded_optimizer import gather_full_state_dict, optimizer_index_of_params
from lightning_zero.engine.optimizer.whole_tensor_step import ChunkedState
from lightning_zero.engine.optimizers import ShardedOptimizers
from lightning_zero.engine.parameters.frozen_guard import FrozenAtSetup
from lightning_zero.engine.parameters.param_guard import ParameterReplacementGuard
from lightning_zero.engine.parameters.replicated_parameters import ReplicatedParameters
from lightning_zero.engine.parameters.residency import ParameterResidency
from lightning_zero.engine.parameters.sharded_parameters import ShardedParameters
from lightning_zero.engine.shards.sharded_param import ShardedParam


class ZeroEngine:
    """Shards ``optimizers``' state, gradients (stage ≥ 2) and parameters (stage 3) over ``group``.

    ``device``: where stage 3 materializes and keeps the parameter chunks (default: where the
    module's parameters are; meta-device parameters need it given). ``timeout``: how long the
    process group stage 3 creates for its all-gathers waits for peers (give the one ``group`` was
    created with; None: torch's default).

    Hybrid sharding (``collectives.hybrid_groups``): ``group`` is this rank's shard group, ``replicate_group``
    the ranks holding the same chunks in the other shard groups; states are sharded and parameters
    gathered within ``group``, and the reduced gradient chunks are all-reduced across
    ``replicate_group``. None (default): every rank is in ``group``.

    ZeRO++ (``config.secondary_shard_size``, ``quantize_gradients``; see [Note: ZeRO++] in
    ``zero_plus_plus.py``): ``links`` holds the groups of the node layout they need
    (``node_links.make_node_links``), made once by their owner (a strategy keeps them across fits).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        config: ZeroConfig,
        group: collectives.ProcessGroup = None,
        device: Optional[torch.device] = None,
        timeout: Optional[timedelta] = None,
        replicate_group: collectives.ProcessGroup = None,
        links: Optional[NodeLinks] = None,
    ) -> None:
        self.config = config
        apply_host_threads(config)  # with offload: this rank's share of its node's cores steps on the host
        group = collectives.resolved(group)  # the world as its own group: each collective asks less of torch
        self.group = group
        self.replicate_group = replicate_group
        self.links = check_links(config, links, group, replicate_group)
        self.module = module
        optimizer_of = optimizer_index_of_params(module, optimizers)
        self._host_reads = HostReads()
        self.disk: Optional[DiskTier] = None
        """``offload_optimizer="nvme"``: the scratch files of the optimizers' state, and with
        ``offload_params="nvme"`` of the parameter chunks (``disk_tier.py``)."""
        if config.optimizer_state_on_disk:
            self.disk = DiskTier(config)

        self.residency: ParameterResidency
        if config.zero_stage is ZeroStage.PARAMETERS:
            param_files = None
            if config.params_on_disk:
                assert self.disk is not None
                param_files = self.disk.reserve_for_params(master_bytes_needed(module, collectives.world_size(group)))
            self.residency = ShardedParameters(
                module, config, group, device or _device_of(module), self._host_reads, timeout, replicate_group, param_files,
                links,
            )
        else:
            self.residency = ReplicatedParameters(module, optimizer_of, config, group, replicate_group, timeout)
        self.params: list[ShardedParam] = self.residency.params
        self.buckets = self.residency.grad_buckets

        self._optimizers = ShardedOptimizers(
            self.params, config, lambda: self.gradients.take_assignments(), self.disk, self.buckets, group,
            self.residency.compute_device, lambda opt: self.residency.after_optimizer_step(opt, self.params_of(opt)),
            lambda: self.gradients.reduced,
            after_zero_grad=self._after_zero_grad,
        )  # fmt: skip
        for optimizer in optimizers:
            self._optimizers.add(optimizer)

        self.stop_vote = StopVote()
        """Requests to stop (a preemption signal), agreed on by the ranks at a gradient reduction
        (see [Note: stop votes] in ``stop_vote.py``)."""
        self._unstepped_gradients = False
        self.grad_sync: GradientSync
        if config.zero_stage is ZeroStage.OPTIMIZER_STATE:
            self.grad_sync = ReduceAfterBackward(self.buckets, votes=self.stop_vote)
        else:
            self.grad_sync = ReduceDuringBackward(self.buckets, listener=self.residency.gradient_listener, votes=self.stop_vote)
        self.sync_gradients = True
        """False while micro-batches only accumulate (Lightning's ``block_backward_sync``)."""
        self.gradients = GradientWindow(self.params, group)
        """What ``param.grad`` shows between backward and the optimizer step (see ``grad_window.py``)."""
        self._full_weights = FullWeights(self.residency, self.params, self.gradients, group, config.bucket_bytes)
        self._replacement_guard = ParameterReplacementGuard(module, self.params)
        self._frozen_at_setup = FrozenAtSetup(module)
        weakref.finalize(self, self._replacement_guard.close)  # an engine dropped without `close()` (Fabric never tears down)
        self.averages: weakref.WeakSet[AveragedShards] = weakref.WeakSet()
        """Weight averages kept beside the shards (``average_weights``), counted by ``memory_report``."""
        self._host_step = HostStepOverlap(
            config, lambda: self._optimizers.optimizers, self.params_of, self._optimizers.steps_whole_tensors,
            lambda: self.residency.buckets_with_host, self.gradients.take_assignments, self.grad_sync, self.disk,
            self.residency.copies_back,
        )  # fmt: skip
        """With CPU offload: the host step during backward (see [Note: the host step during backward]
        in ``offload/step_ahead.py``)."""
        if self.shards_parameters:
            module_link.link(module, self)  # the module's weights are this engine's chunks now
            self.residency.wait_for_host_step = self._host_step.wait  # reads at rest of host masters

    def add_optimizer(self, optimizer: Optimizer) -> None:
        """Shard ``optimizer`` too (stage 3 only: a module is sharded before the optimizers built
        from its parameters exist, as with Fabric's ``setup_module`` + ``setup_optimizers``). At
        stages 1-2 the buckets group parameters by optimizer, so all must be given at construction."""
        if not isinstance(self.residency, ShardedParameters):
            raise ValueError(
                f"At ZeRO stage {self.config.stage} an engine's optimizers are all given when it is built"
                " (its buckets group parameters by optimizer); this one was built without"
                f" {type(optimizer).__name__}."
            )
        if optimizer in self._optimizers:
            return
        optimizer_index_of_params(self.module, [optimizer])  # the checks made at construction
        self._optimizers.add(optimizer)
        self._host_step.bind()

    def use_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Stage 3, a module kept sharded after ``fit`` trains again: ``optimizers`` replace the
        finished run's (whose state is dropped), as a new engine would have been built with them."""
        self._host_step.close()
        self._optimizers.clear()
        for optimizer in optimizers:
            self.add_optimizer(optimizer)

    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizers this engine shards, in the order they were given."""
        return self._optimizers.optimizers

    def params_of(self, optimizer: Optimizer) -> list[ShardedParam]:
        """The sharded parameters `optimizer` steps, in its `state_dict` order."""
        return self._optimizers.params_of(optimizer)

    @property
    def shards_parameters(self) -> bool:
        """Stage 3: the module's parameters are chunks at rest, gathered around their use."""
        return isinstance(self.residency, ShardedParameters)

    @property
    def shard_group_size(self) -> Optional[int]:
        """Hybrid sharding: the ranks each state is sharded over (None: all of them)."""
        return collectives.world_size(self.group) if self.replicate_group is not None else None

    @property
    def unfrozen_since_setup(self) -> bool:
        """Whether a parameter frozen when this engine set the module up requires a gradient now
        (``parameters/frozen_guard.py``): the engine cannot train it."""
        return self._frozen_at_setup.unfrozen()

    # ---- the training step -----------------------------------------------------------------
    def begin_step(self) -> None:
        """Before each training/evaluation step (stage 3 gathers the root unit here). ``param.grad``
        keeps showing the last step's gradients until ``zero_grad`` or the next backward, as under DDP;
        gradients dropped or assigned since the step (``model.zero_grad()``) reach the chunks now, so
        a loop that calls no ``before_backward`` accumulates into what they left."""
        self._frozen_at_setup.check()
        self._host_step.arm(self.sync_gradients)
        self.gradients.take_assignments()
        self.residency.begin_step()

    def before_backward(self) -> None:
        """Before each backward (only needed when a step runs several): ``param.grad`` stops
        showing the previous backward's reduced gradients, so autograd accumulates as usual."""
        self._host_step.arm(self.sync_gradients)
        self.gradients.close(before_backward=True)

    # ---- the host step during backward (CPU offload) ------------------------------------------
    def plan_host_step(
        self,
        ahead: bool = True,
        keep_rollback: bool = True,
        reason: str = "",
        loss_scale: Optional[LossScale] = None,
        check_contents: bool = True,
    ) -> None:
        """How the adapter wants offloaded optimizer steps taken from the next step on: ``ahead`` during
        backward (where the engine can: see [Note: the host step during backward] in ``step_ahead.py``),
        else after it, for ``reason`` (counted in ``host_step_report``); ``keep_rollback``: keep copies
        to undo a step that something after backward changes (clipping, a hook's edit). Default: ahead,
        with rollback copies (a plain loop may clip or edit anything before ``optimizer.step()``).
        ``loss_scale``: with a ``ZeroGradScaler`` (``16-mixed``), its scale now (None before its first
        use; ``ScaleOf(scaler)``): gradients are unscaled as they arrive, and a step the scaler skips
        is undone. ``check_contents``: user code may run between backward and the step, so the
        verdict also compares the gradients' contents (edits through ``.data`` or a NumPy view move
        no version counter); False only where nothing but the engine touches them there. A plan
        other than the one in force starts afresh: steps taken after backward because recent ones
        were redone (backing off, see ``step_ahead.py``) are taken ahead again; planning the same
        again changes nothing."""
        plan = HostStepPlan(ahead, keep_rollback or loss_scale is not None, reason, loss_scale, check_contents)
        self._host_step.set_plan(plan)

    def host_step_report(self) -> Optional[HostStepReport]:
        """How the offloaded optimizer's steps ran (during or after backward, redone, and why; the last
        step's timing); None without CPU offload or where steps are never taken during backward."""
        return self._host_step.report()

    def wait_for_host_step(self) -> None:
        """Block until the host has stepped every bucket that reached it in this backward (all have
        by its end): what changes gradients or hyperparameters next then comes after those steps,
        and the verdict at ``optimizer.step()`` sees it. ``finish_backward`` waits for it already;
        nothing to wait for without the host step during backward."""
        self._host_step.wait()

    def _after_zero_grad(self) -> None:
        self._host_step.settle("`zero_grad()` before `optimizer.step()`")
        self.gradients.released()

    def begin_evaluation_step(self) -> None:
        """Before each evaluation (validation, test, predict) step, instead of ``begin_step``."""
        self.residency.announce_evaluation_step()
        self.residency.begin_step(evaluation=True)

    def finish_evaluation(self) -> None:
        """After this rank's last evaluation step of a loop (on every rank): ranks may run
        different numbers of evaluation steps (see ``evaluation_join.py``)."""
        self.residency.finish_evaluation()

    def finish_backward(self) -> None:
        """After every backward: the gradient shards are ready when this returns (unless
        ``sync_gradients`` is False at stage 1, where gradients keep accumulating unreduced), and the
        host step taken during backward is done: user code between backward and the optimizer step
        (a hook, a loop's own lines) reads and edits what that step read after it, never beside it
        (an edit is then seen by the verdict, see [Note: the host step during backward])."""
        self._host_step.backward_ended()
        self.residency.finish_backward_gathers()
        self.grad_sync.finish_backward(self.sync_gradients, self._host_reads)
        self._host_step.reductions_finished()
        self.residency.end_backward()  # before the read, so that ranks a verdict fails agree on what is gathered
        if self._host_step.ahead is not None and self.residency.holds_assigned_data():
            # `param.data = ...` in this step is kept as of before the step, as without overlap
            self._host_step.settle("weights assigned in the step")
        self.residency.adopt_assigned_data()  # `param.data = ...` in this step, before the optimizer steps
        self._unstepped_gradients = True
        self._read_from_device()  # the backward's one host sync: see [Note: deferred verdicts]
        if StopReason.LATE_GRADIENT in self.stop_vote.agreed:
            self.grad_sync.late_gradients_agreed()  # raises on every rank: see [Note: readiness per unit]
        if self.sync_gradients or self.config.zero_stage is not ZeroStage.OPTIMIZER_STATE:
            # stage 1 leaves a micro-batch that only accumulates in `param.grad`, as DDP does
            self.gradients.open(reduced=self.sync_gradients)
        self._host_step.wait()  # the verdict waits for it anyway; user code until then must not race it
        if self.sync_gradients and self.disk is not None:
            self.disk.prefetch()  # the optimizer step is next: its first reads start now

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        """Make the module see the shards ``optimizer`` just updated. ``param.grad`` still shows the
        gradients it stepped with, as under DDP, until ``optimizer.zero_grad()`` or the next backward
        (see ``grad_window.py``); a chunk the step freed (a whole-tensor optimizer's) shows None."""
        self.gradients.released()
        self.residency.after_optimizer_step(optimizer, self.params_of(optimizer))
        self._unstepped_gradients = False

    @property
    def holds_unstepped_gradients(self) -> bool:
        """A backward ran since the last optimizer step (gradient accumulation): its gradients wait
        for a step, and a checkpoint, which holds none, taken now would lose them. The same on every
        rank, so a stop agreed on (``stop_vote``) waits for the step boundary where this is False."""
        return self._unstepped_gradients

    def end_step(self) -> None:
        """After a step's last backward and before its optimizer step, or after an evaluation step
        (stage 3 frees the root unit; see the module docstring). A step whose backward ran with
        ``sync_gradients`` False only accumulated: stage 3 keeps what ``keep_frozen_units_mb`` keeps."""
        self.residency.end_step(before_optimizer_step=self.sync_gradients)
        self._read_from_device()  # an evaluation step's unit tags (nothing is left after a backward)

    def _read_from_device(self) -> None:
        """At most one host sync: the values queued in ``HostReads`` are read and, with offload, the
        host waits for the copies: the gradients copied to the host have landed, and no copy to the
        device still reads host chunks the optimizer (or a load) is about to write. Where both are
        due, the compute stream waits for the copies on the device and the read waits for both."""
        copies = self.residency.copies
        if copies is not None:
            if self._host_reads.pending:
                copies.join_compute_stream()
            else:
                copies.synchronize()
        self._host_reads.read()

    # ---- state -----------------------------------------------------------------------------
    def full_optimizer_state_dict(self, optimizer: Optimizer, keep: bool = True) -> dict[str, Any]:
        """``optimizer.state_dict()`` as if unsharded, on the CPU; a collective, call on every rank
        (``keep=False``: take part, return nothing)."""
        self._host_step.settle("the optimizer state was read before `optimizer.step()`")
        chunked = self._optimizers.chunked_state(optimizer)
        return gather_full_state_dict(chunked, self.params_of(optimizer), self.group, self.residency.compute_device, keep)

    def load_full_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        self._optimizers.load_full_state(optimizer, state_dict)

    def optimizer_chunked_state(self, optimizer: Optimizer) -> ChunkedState:
        """``optimizer``'s state in this rank's chunks, however it steps (a collective; what a sharded
        checkpoint saves: see ``optimizers.py``)."""
        self._host_step.settle("the optimizer state was read before `optimizer.step()`")
        return self._optimizers.chunked_state(optimizer)

    def load_optimizer_chunked_state(self, optimizer: Optimizer, state_dict: dict[str, Any], chunked: frozenset[tuple[int, str]]) -> None:
        """The inverse of ``optimizer_chunked_state`` (a collective)."""
        self._optimizers.load_chunked_state(optimizer, state_dict, chunked)

    def buckets_in_memory(self, writing: bool = False) -> Iterator[Sequence[ShardedParam]]:
        """Every sharded parameter, in groups whose ``ShardedParam.shard`` can be read (and with
        ``writing`` written) while the group is the current one: with ``offload_params="nvme"`` one
        bucket at a time, read in from disk (and written back after); otherwise one group, in memory
        anyway (see ``ParameterResidency.buckets_in_memory``)."""
        self._host_step.settle("the chunks were read before `optimizer.step()`")
        return self.residency.buckets_in_memory(writing)

    def weight_chunks(self) -> dict[int, torch.Tensor]:
        """This rank's chunk of every weight, by ``id`` of its ``ShardedParam`` (copies, one bucket at
        a time, where the chunks live on disk)."""
        self._host_step.settle("the chunks were read before `optimizer.step()`")
        return self.residency.weight_chunks()

    def sync_master_weights(self) -> None:
        """Refresh fp32 master shards after the module's full weights were loaded or edited
        (stages 1-2; at stage 3 the chunks are the only copy)."""
        if not isinstance(self.residency, ShardedParameters):
            for p in self.params:
                p.sync_master_from_param()

    def gathered(
        self, writeback: bool = False, rank0_only: bool = False, offload_to_cpu: bool = False, with_grads: bool = False
    ) -> AbstractContextManager[None]:
        """Inside, every parameter is its full tensor on every rank; edits are written back to the
        shards only with ``writeback=True``. A collective: enter it on every rank.

        Stage 3 takes FSDP's knobs: ``offload_to_cpu`` makes the full parameters copies in host
        memory (gathered one unit at a time, so the device holds one unit more than at rest);
        ``rank0_only`` gives them to global rank 0 alone, the other ranks' parameters staying at
        rest (no ``writeback`` then). At stages 1-2 the parameters are whole already and the knobs
        change nothing. ``with_grads``: each parameter's ``.grad`` is its full gradient too (a copy,
        where the parameters are, gathered a bucket at a time; edits to it are not kept), or None
        where it has none."""
        return self._full_weights.gathered(writeback, rank0_only, offload_to_cpu, with_grads)

    def full_state_dict(self, module: nn.Module, keep: bool = True, device: torch.device = torch.device("cpu")) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` with full parameters copied to ``device``, gathering one unit at a
        time (a collective). ``keep=False`` (e.g. on ranks that will not save) still takes part in
        the collectives but returns an empty dict, so no rank holds more than it needs."""
        return self._full_weights.state_dict(module, keep, device)

    def load_full_state_dict(self, module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load unsharded weights (a plain ``state_dict``, e.g. from a DDP checkpoint) into the
        shards and the module's buffers."""
        if not isinstance(self.residency, ShardedParameters):
            module.load_state_dict(state_dict, strict=strict)
            self.sync_master_weights()
            return
        self._full_weights.load_into_chunks(module, state_dict, strict)

    def release_parameters(self, device: torch.device) -> None:
        """Leave the module with plain full parameters on ``device`` and remove every hook (stage 3
        gathers one unit at a time; every rank then holds the whole model)."""
        self._host_step.close()
        self.gradients.close()
        self._optimizers.remove_step_hooks()
        self.grad_sync.close()
        self._optimizers.close_fused_host_steps()
        self._replacement_guard.close()
        self.residency.release_to(device)
        module_link.unlink(self.module, self)

    def end_training(self) -> None:
        """A run on the module ended normally. Stages 1-2: as ``release_parameters`` (the parameters
        are whole already). Stage 3: the module stays sharded at rest and its hooks go; gradients
        and communication buffers are freed, the optimizers' state is kept (see [Note: after fit]
        in ``module_link.py``). ``resume_training`` undoes it."""
        if not self.shards_parameters:
            self.release_parameters(self.residency.compute_device)
            return
        self._host_step.close()
        self.gradients.close()
        self.grad_sync.close()
        self.residency.end_training()
        for p in self.params:
            p.shard.grad = None

    def resume_training(self, optimizers: Optional[Sequence[Optimizer]] = None) -> None:
        """Stage 3: the module kept sharded by ``end_training`` is used again; ``optimizers`` (a new
        ``fit``) replace the finished run's."""
        self.grad_sync.open()
        self.residency.resume()
        self.stop_vote.reset()
        self._unstepped_gradients = False
        if optimizers is not None:
            self.use_optimizers(optimizers)

    def grad_norms(self, norm_type: float = 2.0) -> dict[str, torch.Tensor]:
        """The ``norm_type``-norm of every parameter's full (reduced) gradient, by parameter name, and
        of all of them (key ``"total"``), computed from the shards with one all-reduce. The numbers
        ``lightning.pytorch.utilities.grad_norm`` gives under DDP; call it on every rank, between
        backward and the optimizer step."""
        return norms_by_name(self.params, float(norm_type), self.group, self.residency.compute_device)

    def memory_report(self) -> MemoryReport:
        """Bytes of model state this rank holds now, and what it works with beside it (buffers kept for
        reuse, pinned blocks, copy rows, the last backward's gradients waiting: ``working_memory``)."""
        averages = [held for average in self.averages for held in average.held()]
        working = working_memory(self.residency, self.disk, self.grad_sync)
        working["host_step_rollback"] = self._host_step.rollback_bytes
        return measure(self.module, self.params, self._optimizers.with_params(), averages=averages, **working)

    @property
    def host_allocations(self) -> int:
        """Host buffers allocated for offloaded chunks so far: set up by the first step, then flat."""
        return self.residency.host_allocations

    def close(self) -> None:
        """Remove every hook (the optimizers step with their configured kernels again)."""
        self._host_step.close()
        self.gradients.close()
        self._optimizers.remove_step_hooks()
        self.grad_sync.close()
        self.residency.close()
        self._optimizers.close_fused_host_steps()
        if self.disk is not None:
            self.disk.close()
        self._replacement_guard.close()
        module_link.unlink(self.module, self)

    def average_weights(self, device: Optional[torch.device] = None, buffers: Buffers = Buffers.AVERAGED) -> AveragedShards:
        """A running average of the module's weights kept as this rank's chunks beside the
        optimizer's (EMA, SWA: see ``averaged_shards.py``), starting from the current weights;
        ``memory_report`` counts it while it lives."""
        average = AveragedShards(
            self.module, self.params, self.group, self.residency.compute_device, self.config.bucket_bytes,
            device=device, buffers=buffers, copies=self.residency.copies, buckets_in_memory=self.buckets_in_memory,
        )  # fmt: skip
        self.averages.add(average)
        return average


def _device_of(module: nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        if not t.is_meta:
            return t.device
    raise ValueError("The module lives on the meta device; pass `device=` to say where to materialize it.")


def linked_engine(module: nn.Module) -> Optional[ZeroEngine]:
    """The engine holding ``module``'s parameters sharded, if one does (see [Note: after fit] in
    ``module_link.py``)."""
    held = module_link.linked(module)
    return held if isinstance(held, ZeroEngine) else None
