"""``ZeroStrategy``: the thin Lightning adapter around the engine, and its options.

The Trainer keeps launching processes, running loops and calling precision plugins and callbacks;
this class only connects Lightning's hooks to the engine (``lightning_zero.engine``):

- ``setup``: broadcast rank 0's weights (as DDP does), build the optimizers, shard them (``sharded_setup.py``);
- each step: the hooks of its base class, ``ZeroStepHooks`` (``step_hooks.py``);
- checkpoints: sharded directories by default (``lightning_zero.checkpoint``), or one file in
  DDP's format with ``state_dict_type="full"``; both load at any stage and world size
  (``checkpoint_hooks.py``);
- preemption: a SIGTERM or SLURM's requeue signal ends ``fit`` at one step on every rank, however
  apart the ranks receive it (``preemption.py``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any, Generator, Mapping, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint.checkpointing import StateDictType, ZeroCheckpointing, check_save_frozen, check_state_dict_type
from lightning_zero.checkpoint.errors import CheckpointWriteError, UntrustedCheckpointError
from lightning_zero.checkpoint.locations import check_storage_options
from lightning_zero.checkpoint.manifest import PathLike
from lightning_zero.compat.lightning_api import load_passing_weights_only, trainer_takes_weights_only
from lightning_zero.engine import MemoryReport, ZeroEngine, ZeroStage
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.node_links import LazyNodeLinks, check_node_layout
from lightning_zero.engine.zero_plus_plus import GradientQuantization, SecondaryShardSize, WeightQuantization
from lightning_zero.engine.config import STRATEGY_NAMES, OffloadTier, ShardGroupSize, check_shard_group_option, config_from_options
from lightning_zero.fabric.checkpoint_io import file_writer
from lightning_zero.lightning import checkpoint_hooks
from lightning_zero.lightning.checkpointing import check_callbacks_can_save, check_checkpoint_locations
from lightning_zero.lightning.finetuning_callbacks import refuse_finetuning_callbacks
from lightning_zero.lightning.gathered_callbacks import gather_around_parameter_hooks
from lightning_zero.lightning.launchers import RecoveringLauncher, RecoveringMultiProcessingLauncher, StartMethod, check_start_method
from lightning_zero.lightning.precision import ZeroPrecision, check_precision_supported, to_zero_precision
from lightning_zero.lightning.preemption import PreemptedExit, handle_preemption
from lightning_zero.lightning.sharded_averaging import shard_weight_averaging
from lightning_zero.lightning.host_step_plan import plan_host_step
from lightning_zero.lightning.sharded_setup import check_optimizer_types, start_engine, teardown_keeping_shards
from lightning_zero.lightning.step_hooks import ZeroStepHooks, grad_norms


class ZeroStrategy(ZeroStepHooks):
    """ZeRO data parallelism: each of the N ranks keeps 1/N of the optimizer state (stage 1), of
    the gradients too (stage 2), of the parameters too (stage 3), and trains to the same weights
    as DDP.

    Args:
        stage: 1 shards optimizer state and fp32 master weights; 2 also shards gradients,
            reduce-scattering them in buckets during backward; 3 also shards parameters, gathering
            each unit just before its forward and backward and freeing it after.
        bucket_size_mb: stages 1-2: MiB of parameters whose gradients are reduce-scattered (and
            updated weights all-gathered) in one collective. Larger buckets mean fewer, bigger
            collectives and bigger temporary buffers. At stage 3 a unit is a bucket.
        unit_classes: stage 3: names of the module classes whose instances are units (e.g.
            ``["Block"]``). Default: every element of an ``nn.ModuleList``/``nn.Sequential``/
            ``nn.ModuleDict``. The LightningModule itself is the root unit, gathered for the whole step.
        min_unit_params: stage 3: candidate units with fewer parameters stay in their parent's unit.
        prefetch_units: stage 3: units gathered ahead of the one computing (0 disables); at most
            root + 1 + ``prefetch_units`` units are gathered at once.
        check_units_every_gather: stage 3: check that every rank gathered the same unit right after
            each all-gather rather than once per backward; turns a hang from ranks whose forwards
            run different numbers of units into an error naming them. Default (None): on for CPU
            training, where it is free; off on GPUs, where it is a host sync per gather.
        keep_frozen_units_mb: stage 3: MiB per rank of gathered weights of all-frozen units (a
            fine-tuned model's frozen base) kept from their first gather in a step until the
            optimizer step, so that with gradient accumulation each is gathered once per optimizer
            step instead of in every micro-batch's forward and backward; units are kept in order
            of first use while they fit. 0 (default): freed after each use. ``math.inf``: all.
        offload_optimizer: True (or "cpu"): keep optimizer state and fp32 master chunks in host
            memory and step the optimizer there (any stage). "nvme": as True, but the optimizer's
            own state (Adam's moments) lives in files under ``nvme_path``, stepped one bucket at a
            time through a few host buffers.
        offload_params: stage 3: True (or "cpu"): also keep the parameter chunks in host memory
            between uses (needs ``offload_optimizer``). "nvme": keep them in files under
            ``nvme_path``, read ahead of each gather and of the optimizer step (needs
            ``offload_optimizer="nvme"``).
        nvme_path: with ``offload_optimizer="nvme"``: an existing directory on a fast local disk;
            each rank keeps its scratch files in a directory of its own there, removed at the
            end. Default: the ``LIGHTNING_ZERO_NVME_PATH`` environment variable.
        nvme_buffer_count: with ``offload_optimizer="nvme"``: host buffers the state streams
            through (at least 2), each the size of the largest bucket's state.
        fused_host_step: with offload, step Adam/AdamW/SGD/Adagrad with torch's fused CPU kernel:
            2.4-3.9x faster on the host, but its rounding differs from DDP's and training carries it
            on (docs/offload.md#the-host-step). Default False: the optimizer's configured kernel,
            DDP's arithmetic.
        overlap_host_step: with ``offload_optimizer=True`` at stages 2-3, step each bucket on a host
            thread as soon as its reduced gradients reach host memory, during backward (default;
            bitwise the result of stepping after backward: see docs/offload.md). False: after backward.
        host_threads: with offload, the threads each rank's host step uses. Default: the cores this
            process may run on ÷ the ranks of its node (or ``OMP_NUM_THREADS`` where set).
        elementwise_optimizers: optimizer classes lightning-zero does not know, declared
            element-wise (each element's update reads only that element), by class name or
            qualified name (``["MyAdam"]``): they step flat chunks like Adam instead of whole tensors
            on one owner rank each, which is faster. An optimizer it does not know steps whole
            tensors (always right). See docs/optimizers.md.
        shard_group_size: hybrid sharding: states are sharded within groups of this many
            consecutive ranks and replicated across the groups ("node": the ranks of one node), so
            parameter all-gathers stay within a group and only the reduced gradient chunks (1/K
            of the gradients) are all-reduced across groups. Must divide the world size. Default
            (None): every rank shards.
        secondary_shard_size: stage 3, ZeRO++'s hpZ: each rank keeps 1/K of a unit's weights after its
            forward, so backward's all-gather runs among K consecutive ranks ("node": the devices of
            one node) instead of all: bitwise the same training, backward's weight traffic kept in the
            node, 2Ψ/K more bytes per rank (half precision). K divides the world size, below it.
        quantize_weights: stage 3, ZeRO++'s qwZ: all-gather weights as int8 (True, "int8") or fp8
            ("fp8") blocks with one scale each, half the bytes of bf16; forward and backward use the
            dequantized weights, the optimizer's shards are never quantized. Not bitwise DDP.
        quantize_gradients: stage 3, ZeRO++'s qgZ: reduce gradients by an all-to-all within the node
            then one across nodes, in int8 (True, "int8") or int4 ("int4") blocks summed in fp32.
            Not bitwise DDP. ``strategy="zero3pp"`` sets all three (K = the devices per node).
            See docs/zero-plus-plus.md.
        state_dict_type: "sharded" (default): ``trainer.save_checkpoint(path)`` writes a directory
            in which every rank writes its own chunks in parallel; it reloads at any world size and
            stage, and ``lightning-zero convert`` turns it into one file. "full": one file in
            Lightning's usual format (full weights and DDP-format optimizer state, gathered onto
            rank 0 one unit at a time), readable by ``torch.load`` / ``load_from_checkpoint``.
        async_save: sharded saves (``trainer.save_checkpoint``, ``ModelCheckpoint``) block training
            only while this rank's shards are copied into host staging buffers (kept between saves,
            pinned on CUDA; ``memory_report().checkpoint_staging``); the files and the commit are
            written in the background. One save is in flight at a time (the next waits for it); a
            failed one raises its ``CheckpointWriteError`` on every rank at the next save or load,
            at the end of ``fit`` or at teardown, and the previous checkpoint stays. ``fit``'s end,
            teardown, loads and a preemption stop wait for it; ``wait_for_checkpoint()`` does too.
            A ``state_dict_type="full"`` file is always written synchronously. See docs/checkpoints.md.
        save_frozen: False: sharded checkpoints leave out the parameters that do not require gradients
            (a fine-tuned model's frozen base: LoRA, adapters), holding only their fingerprint (names,
            shapes, dtypes, a checksum). A resume keeps the frozen weights the module loaded itself
            (``from_pretrained``) and refuses them, naming each, where they differ from the fingerprint;
            ``lightning-zero convert --base`` merges them back. Needs ``state_dict_type="sharded"``.
        start_method: how the Trainer starts the ranks, as for ``DDPStrategy``: "popen" (default)
            re-runs the script once per rank; "spawn", "fork" and "forkserver" start them from the
            calling process (``fork`` is what notebooks need), which gets back rank 0's final
            weights (full ones, at stage 3 too), its ``callback_metrics`` and the best checkpoint's path.
        accelerator: set by the Trainer from ``Trainer(accelerator=...)``.
        parallel_devices: set by the Trainer from ``Trainer(devices=...)``.
        cluster_environment: set by the Trainer; how ranks find each other.
        checkpoint_io: how checkpoint files are written (Lightning's ``CheckpointIO``).
        precision_plugin: set by the Trainer from ``Trainer(precision=...)``.
        process_group_backend: "nccl" on CUDA and "gloo" on CPU unless given.
        timeout: how long a collective may wait for the other ranks before failing.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        bucket_size_mb: float = 25.0,
        unit_classes: Optional[list[str]] = None,
        min_unit_params: int = 0,
        prefetch_units: int = 1,
        check_units_every_gather: Optional[bool] = None,
        keep_frozen_units_mb: float = 0.0,
        offload_optimizer: OffloadTier = False,
        offload_params: OffloadTier = False,
        nvme_path: Optional[str] = None,
        nvme_buffer_count: int = 4,
        fused_host_step: bool = False,
        overlap_host_step: bool = True,
        host_threads: Optional[int] = None,
        elementwise_optimizers: Optional[list[str]] = None,
        shard_group_size: ShardGroupSize = None,
        secondary_shard_size: SecondaryShardSize = None,
        quantize_weights: WeightQuantization = False,
        quantize_gradients: GradientQuantization = False,
        state_dict_type: StateDictType = "sharded",
        async_save: bool = False,
        save_frozen: bool = True,
        start_method: StartMethod = "popen",
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        elementwise_optimizers = elementwise_optimizers or ()
        self.zero_config = config_from_options(locals())  # validates before anything else happens
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            timeout=timeout, start_method=check_start_method(start_method),
        )  # fmt: skip
        check_shard_group_option(shard_group_size)
        self.shard_group_size = shard_group_size
        self._groups: Optional[tuple[collectives.ProcessGroup, collectives.ProcessGroup]] = None
        self._links = LazyNodeLinks()  # ZeRO++'s groups
        self._checkpointing = ZeroCheckpointing(state_dict_type, timeout, async_save, save_frozen)
        self._engine: Optional[ZeroEngine] = None
        # after `fit`: the finished run's engine, hooks removed, kept so that
        # `trainer.save_checkpoint` still finds the optimizer's shards
        self._finished: Optional[ZeroEngine] = None
        self._failed = False

    def __getstate__(self) -> dict[str, Any]:
        # a Trainer pickled after `fit` (by a hyperparameter search, a queue, a copy) carries the
        # options, not this process's engine, hooks and process groups
        state = super().__getstate__()  # Lightning's: without its optimizer wrappers
        state["_engine"] = state["_finished"] = state["_groups"] = None
        state["_links"] = LazyNodeLinks()
        return state

    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # Lightning picks its plugin from `Trainer(precision=...)`; ours clip sharded gradients
        self._precision_plugin = None if plugin is None else to_zero_precision(plugin)

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def state_dict_type(self) -> StateDictType:
        """The format ``trainer.save_checkpoint`` writes; settable, e.g. for one full file at the end."""
        return self._checkpointing.state_dict_type

    @state_dict_type.setter
    def state_dict_type(self, value: StateDictType) -> None:
        self._checkpointing.state_dict_type = check_state_dict_type(value)
        check_save_frozen(self._checkpointing.save_frozen, value)  # False needs sharded saves

    @property
    def engine(self) -> Optional[ZeroEngine]:
        """The engine sharding the current ``fit`` (None outside fitting)."""
        return self._engine

    # ---- setup / teardown --------------------------------------------------------------------
    @property
    def shards_parameters(self) -> bool:
        return self.zero_config.zero_stage is ZeroStage.PARAMETERS

    @override
    def setup_environment(self) -> None:
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if trainer is not None:  # before the callbacks' `setup`, where Lightning's would copy the whole module
            shard_weight_averaging(trainer)
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        collectives.let_workers_finish_at_exit()

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        check_precision_supported(self.precision_plugin)
        check_callbacks_can_save(trainer, self.state_dict_type)
        refuse_finetuning_callbacks(trainer)  # they unfreeze parameters mid-fit
        check_checkpoint_locations(trainer)  # a URL's fsspec package is installed (checkpoint/locations.py)
        gather_around_parameter_hooks(trainer, self)  # pruning reads and writes parameters between steps
        handle_preemption(trainer)  # signals only record a request; the ranks stop together
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._end_engine()
        if fitting:  # evaluation leaves the optimizers' state as the finished run left it
            self._finished = None
        self._engine = start_engine(
            self, self.zero_config, self.shard_group_size, trainer, fitting, self._data_parallel_groups(), self._links.get(self)
        )
        if fitting and self._engine is not None:
            plan_host_step(trainer, self._engine)  # offloaded steps during backward, where they can be
        self.setup_precision_plugin()  # after the engine: Lightning's optimizer wrappers copy its classes (weight_swaps.py)

    def _data_parallel_groups(self) -> tuple[collectives.ProcessGroup, collectives.ProcessGroup]:
        """(shard group, replicate group): (None, None) when every rank shards; with hybrid
        sharding created once, on every rank (see ``shard_group_size``)."""
        if self._groups is None:
            self._groups = collectives.data_parallel_groups(self.shard_group_size, self.world_size, self.num_processes, self._timeout)
        return self._groups

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        # the Trainer's construction, on every rank: ZeRO++'s options against the node layout
        check_node_layout(self.zero_config, self.shard_group_size, self.world_size, self.num_processes, self.precision_plugin.precision)

    @override
    def _configure_launcher(self) -> None:
        # Lightning's launchers, which first put back checkpoints a crash left mid-commit, before
        # `ckpt_path="last"` is resolved
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = RecoveringLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = RecoveringMultiProcessingLauncher(self, start_method=self._start_method)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # checkpoints load into the shards, which exist only after setup
        return True

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """At stage 3, ``configure_model`` and ``trainer.init_module()`` build on the meta device;
        setup then materializes one unit at a time (see ``engine/parameters/materialize.py``)."""
        if not self.shards_parameters or empty_init is False:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def summon_full_params(
        self, writeback: bool = False, rank0_only: bool = False, offload_to_cpu: bool = False, with_grads: bool = False
    ) -> Generator[None, None, None]:
        """Inside, every parameter is its full tensor on every rank (for inspection, generation or
        export), during ``fit`` and after it. Edits are written back to the shards only with
        ``writeback=True``. Enter it on every rank: gathering is a collective.

        At stage 3, as FSDP's: ``offload_to_cpu=True`` makes the full parameters copies in host
        memory, gathered one unit at a time (the accelerator holds one unit more than at rest);
        ``rank0_only=True`` gives them to rank 0 alone, the other ranks taking part in the gathers
        and keeping only their chunks (not with ``writeback``). Together: rank 0 alone holds the
        model, in host memory — what exporting a model that fits no device wants.

        ``with_grads=True`` (between backward and the optimizer step): each parameter's ``.grad``
        is its full gradient too, beside the full parameter, for logging and inspection (a copy:
        edits to it are not kept; edit ``param.grad`` outside this context instead)."""
        engine = self._state_engine
        if engine is None:
            yield
            return
        with engine.gathered(writeback, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu, with_grads=with_grads):
            yield

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        check_optimizer_types(self)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # the ranks may now disagree on which collective comes next: tear down without any (unless
        # they all stopped at the same step after a preemption signal)
        self._failed = not isinstance(exception, PreemptedExit)
        super().on_exception(exception)

    @override
    def on_train_end(self) -> None:
        # `fit` ends with its last save committed, or raises its error (after the callbacks' hooks,
        # which may have started that save)
        super().on_train_end()
        self.wait_for_checkpoint()

    @override
    def teardown(self) -> None:
        unsaved = self._wait_at_teardown()
        kept_sharded = False
        if self._engine is not None:
            if self._failed:
                self._engine.close()
            else:
                kept_sharded = self._engine.shards_parameters
                self._end_engine()
        self._failed = False
        if kept_sharded:
            teardown_keeping_shards(self)
        else:
            super().teardown()
        if unsaved is not None:
            raise unsaved

    def _wait_at_teardown(self) -> Optional[CheckpointWriteError]:
        """Wait for the save in flight and free the staging buffers; a failed save's error, raised
        once the rest of teardown is done — unless an exception is already ending the run, which it
        would mask (it is logged when it happens)."""
        try:
            self._checkpointing.release()
        except CheckpointWriteError as err:
            return None if self._failed else err
        return None

    def _end_engine(self) -> None:
        """The run's engine becomes the finished one: stage 3 keeps the module sharded at rest (see
        [Note: after fit] in ``engine/parameters/module_link.py``); stages 1-2 remove their hooks."""
        if self._engine is not None:
            self._engine.end_training()
            self._finished, self._engine = self._engine, None

    # ---- introspection -----------------------------------------------------------------------
    def grad_norm(self, norm_type: Union[float, int, str] = 2.0) -> dict[str, torch.Tensor]:
        """What ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` returns under DDP — the
        norm of each parameter's full gradient and their total, keyed the same way — computed from
        the gradient shards with one all-reduce (Lightning's helper gives the same numbers through
        ``param.grad``, with one all-reduce per parameter). Call it on every rank in
        ``on_before_optimizer_step``::

            self.log_dict(self.trainer.strategy.grad_norm(2))
        """
        if self._engine is None:
            raise RuntimeError("grad_norm() is available while `trainer.fit` runs (after setup).")
        return grad_norms(self._engine, float(norm_type))

    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank holds now (during ``fit``,
        or what the finished run kept), and the asynchronous saves' staging buffers."""
        engine = self._state_engine
        if engine is None:
            raise RuntimeError("memory_report() is available once `trainer.fit` has set up the strategy.")
        return replace(engine.memory_report(), checkpoint_staging=self._checkpointing.staging_bytes)

    # ---- checkpoints: see checkpoint_hooks.py ----------------------------------------------------
    @property
    def _state_engine(self) -> Optional[ZeroEngine]:
        """The engine holding the optimizer's shards: the running one, or the finished run's."""
        return self._engine if self._engine is not None else self._finished

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return checkpoint_hooks.module_state_dict(
            self._checkpointing, self.lightning_module, self._state_engine, self.is_global_zero,
            replicated=super().lightning_module_state_dict,
        )  # fmt: skip

    @override
    def optimizer_state(self, optimizer: Optimizer) -> Any:
        engine = self._state_engine
        return checkpoint_hooks.optimizer_state(self._checkpointing, engine, self.optimizers, optimizer, self.is_global_zero)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None) -> None:
        check_storage_options(filepath, storage_options)
        self._checkpointing.save(
            self, checkpoint, filepath, self.lightning_module, self._state_engine, file_writer(self.checkpoint_io), storage_options
        )

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
        # ModelCheckpoint removes what the checkpoint it just saved supersedes: with `async_save`
        # only once that one committed, so a crash never leaves no complete checkpoint
        self._checkpointing.remove(filepath, self.is_global_zero, lambda: super(ZeroStrategy, self).remove_checkpoint(filepath))

    def wait_for_checkpoint(self) -> None:
        """Block until the save in flight (``async_save``), if any, has committed; raise its
        ``CheckpointWriteError`` if it failed. Call it on every rank (e.g. before copying the files)."""
        self._checkpointing.wait()

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Also outside a run (after ``fit``, as Lightning's ``_checkpoint_connector.restore`` does):
        the finished run's engine still holds the weights (stage 3: as chunks, the module at rest;
        stages 1-2: the master chunks and the optimizers' state), so the checkpoint is read into it,
        each rank reading its chunks, as a save after ``fit`` writes from it."""
        try:
            return checkpoint_hooks.load_checkpoint(
                self._checkpointing, checkpoint_path, self.lightning_module, self._state_engine, self.optimizers,
                has_schedulers=bool(self.lr_scheduler_configs),
                read_file=lambda path: load_passing_weights_only(super(ZeroStrategy, self).load_checkpoint, path, weights_only),
                weights_only=weights_only,
            )  # fmt: skip
        except UntrustedCheckpointError as err:
            if trainer_takes_weights_only():
                raise
            raise UntrustedCheckpointError(
                f"{err} NOTE: this Lightning's Trainer takes no `weights_only` (from Lightning 2.6.0), so it"
                " cannot resume from this checkpoint: upgrade Lightning to pass `weights_only=False` for a"
                " checkpoint you trust."
            ) from None

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._checkpointing.restored_from_directory:
            return  # done in load_checkpoint
        engine = self._state_engine  # after `fit` too: its optimizers step chunks (see `load_checkpoint`)
        if engine is None:
            return super().load_optimizer_state_dict(checkpoint)
        self._checkpointing.load_full_optimizer_states(engine, self.optimizers, checkpoint["optimizer_states"])

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._checkpointing.restored_from_directory:
            return  # done in load_checkpoint
        engine = self._state_engine  # after `fit` too (see `load_checkpoint`)
        if engine is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        engine.load_full_state_dict(self.lightning_module, checkpoint["state_dict"], strict=strict)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: dict[str, Any]) -> None:
        for base_name, base_params in STRATEGY_NAMES.items():
            # as "ddp" / "ddp_spawn" / "ddp_notebook": ranks started as scripts, spawned, or forked
            for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_notebook", "fork")):
                name, init_params = base_name + suffix, {**base_params, "start_method": start_method}
                if name not in strategy_registry:  # importing twice is harmless
                    strategy_registry.register(name, cls, description=f"ZeRO {init_params} ({cls.__name__})", **init_params)

