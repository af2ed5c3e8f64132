"""How each variant wraps the model and optimizer, and what one training step is for it.

Every wrapper gets the same freshly seeded model and the same optimizer factory (`Setup`), runs the
same forward (under autocast for bf16-mixed) and loss, and says which tensors it holds
(`state_tensors`, see `memory.py`). A `probe(phase)` is called at the same four points of every
step — after the forward, after `backward()`, once the gradients are reduced, after the optimizer
step (and the parameter refresh) — where the benchmark's one instrumented step measures model
state; timed steps pass `no_probe`.

A variant that cannot run here (DeepSpeed not installed, an engine feature not written yet) raises
`VariantUnavailable` while being built, and the report lists it with the reason.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.bench.memory import StateTensors, module_and_optimizer_tensors
from lightning_zero.bench.owned_adamw import OwnedAdamW
from lightning_zero.bench.variants import Family, VariantSpec
from lightning_zero.compat.fsdp2_cpu import check_fsdp2_runs_on
from lightning_zero.models.gpt import Block

Probe = Callable[[str], None]
PHASES = ("forward", "backward", "gradients", "step")
"""The points of a step where `probe` is called, in order."""


def no_probe(phase: str) -> None:
    """The probe of timed steps: nothing."""


class VariantUnavailable(Exception):
    """The variant cannot run in this installation; the message says why."""


@dataclass(frozen=True)
class Setup:
    """What every wrapper is built with, identical across variants."""

    optimizer_class: type[Optimizer]
    """AdamW, for every variant."""
    optimizer_kwargs: dict[str, Any]
    """Its settings (lr, betas, eps, weight decay, fused), for every variant."""
    autocast: Callable[[], ContextManager[Any]]
    """Context around the forward: bf16 autocast for bf16-mixed, nothing for fp32."""
    device: torch.device
    """The rank's device; the model is already on it."""
    bucket_size_mb: float
    """Bucket size for the variants that have one."""
    batch_size: int
    """Sequences per rank and step (DeepSpeed's config wants it)."""
    shard_group_size: Optional[int] = None
    """Ours: hybrid sharding's group size (None: shard over all ranks)."""
    ranks_per_node: Optional[int] = None
    """Ours with ZeRO++'s hpZ or qgZ: the ranks of one (simulated) node, whose process groups
    (`engine/comm/node_links.py`) the engine communicates over; None: one node."""
    nvme_path: Optional[str] = None
    """Ours with `offload_optimizer="nvme"`: the directory each rank makes its scratch directory in."""
    engine_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Ours: further `ZeroConfig` fields, over the variant's own (`--offload-overlap` sets
    `overlap_host_step`, see `offload_overlap.py`)."""

    def make_optimizer(self, params: Iterable[Tensor]) -> Optimizer:
        """The benchmark's optimizer over `params`."""
        return self.optimizer_class(params, **self.optimizer_kwargs)


class Wrapped(abc.ABC):
    """One variant's model and optimizer, ready to train."""

    def __init__(self, model: nn.Module, setup: Setup) -> None:
        self.model = model
        self.setup = setup

    @abc.abstractmethod
    def step(self, x: Tensor, y: Tensor, probe: Probe = no_probe) -> Tensor:
        """One full training step on inputs `x` and targets `y` (B, T); returns the loss, detached."""

    @abc.abstractmethod
    def state_tensors(self) -> StateTensors:
        """The model-state tensors this rank holds now."""

    def engine_report(self) -> Optional[dict[str, Any]]:
        """What the implementation itself reports holding, where it reports anything (ours)."""
        return None

    def disk_stats(self) -> Optional[Any]:
        """Ours with NVMe offload: the engine's `IOStats` (reset with `.reset()`); None otherwise."""
        return None

    def units(self) -> Optional[int]:
        """Units gathered and released as one (ours at stage 3, FSDP2's `fully_shard` groups), or None."""
        return None

    def close(self) -> None:
        """Release hooks and resources."""

    def _communicating_backward_step(self, forward: nn.Module, optimizer: Optimizer, x: Tensor, y: Tensor, probe: Probe) -> Tensor:
        """The step of variants whose gradients are synchronised inside ``backward`` (DDP's
        all-reduce, FSDP2's reduce-scatters): there is no separate gradient phase to probe."""
        with self.setup.autocast():
            loss = forward(x, y)[1]
        probe("forward")
        loss.backward()
        probe("backward")
        probe("gradients")
        optimizer.step()
        probe("step")
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()


# --- torch ------------------------------------------------------------------------------------


class DDPWrapped(Wrapped):
    """`DistributedDataParallel`, with gradients as views into its buckets so they are not held twice."""

    def __init__(self, model: nn.Module, setup: Setup) -> None:
        super().__init__(model, setup)
        self.ddp = _ddp(model, setup)
        self.optimizer = self._make_optimizer()

    def _make_optimizer(self) -> Optimizer:
        return self.setup.make_optimizer(self.ddp.parameters())

    def _inner_optimizer(self) -> Optimizer:
        return self.optimizer

    def step(self, x: Tensor, y: Tensor, probe: Probe = no_probe) -> Tensor:
        return self._communicating_backward_step(self.ddp, self.optimizer, x, y, probe)

    def state_tensors(self) -> StateTensors:
        return module_and_optimizer_tensors(self.model, [self._inner_optimizer()])


class ZeroRedundancyWrapped(DDPWrapped):
    """DDP + `torch.distributed.optim.ZeroRedundancyOptimizer` (ZeRO-1): each rank steps the
    parameters it owns and broadcasts them; `parameters_as_bucket_view=True` broadcasts a bucket per
    rank instead of one tensor per parameter."""

    def _make_optimizer(self) -> Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            self.ddp.parameters(),
            optimizer_class=self.setup.optimizer_class,
            parameters_as_bucket_view=True,
            **self.setup.optimizer_kwargs,
        )

    def _inner_optimizer(self) -> Optimizer:
        return self.optimizer.optim  # the local optimizer: state for this rank's parameters only


def _ddp(model: nn.Module, setup: Setup) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model,
        device_ids=[setup.device.index] if setup.device.type == "cuda" else None,
        bucket_cap_mb=setup.bucket_size_mb,
        gradient_as_bucket_view=True,
    )


class FSDP2Wrapped(Wrapped):
    """FSDP2: `fully_shard` on every `Block`, then the root (embeddings, final norm, tied head).
    `reshard_after_forward=True` frees each block's gathered parameters after its forward and
    gathers them again for backward (≈ ZeRO-3); False keeps them until backward (≈ ZeRO-2)."""

    def __init__(self, model: nn.Module, setup: Setup, reshard_after_forward: bool) -> None:
        super().__init__(model, setup)
        from torch.distributed.fsdp import fully_shard

        check_fsdp2_runs_on(setup.device)
        for module in model.modules():
            if isinstance(module, Block):
                fully_shard(module, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        self.optimizer = setup.make_optimizer(model.parameters())

    def units(self) -> Optional[int]:
        return 1 + sum(isinstance(module, Block) for module in self.model.modules())  # the blocks and the root

    def step(self, x: Tensor, y: Tensor, probe: Probe = no_probe) -> Tensor:
        return self._communicating_backward_step(self.model, self.optimizer, x, y, probe)

    def state_tensors(self) -> StateTensors:
        return module_and_optimizer_tensors(self.model, [self.optimizer])


# --- ours --------------------------------------------------------------------------------------


class OursWrapped(Wrapped):
    """lightning-zero's `ZeroEngine` in a plain torch loop, with the engine's step API. A
    `whole_tensor` variant steps the same AdamW as `OwnedAdamW`, which takes the ownership path."""

    def __init__(self, model: nn.Module, setup: Setup, spec: VariantSpec) -> None:
        super().__init__(model, setup)
        from lightning_zero.engine import ZeroConfig, ZeroEngine
        from lightning_zero.engine.comm import collectives

        config = _zero_config(ZeroConfig, spec, setup)
        if spec.whole_tensor:
            self.optimizer: Optimizer = OwnedAdamW(model.parameters(), **setup.optimizer_kwargs)
        else:
            self.optimizer = setup.make_optimizer(model.parameters())
        shard_group = replicate_group = None
        world = collectives.world_size(None)
        if setup.shard_group_size is not None and setup.shard_group_size < world:
            shard_group, replicate_group = collectives.hybrid_groups(setup.shard_group_size)
        self.links = None
        try:
            if spec.zero_plus_plus is not None:
                from lightning_zero.engine.comm.node_links import links_for

                # every rank makes the same groups in the same order (or raises alike, before any)
                self.links = links_for(config, setup.shard_group_size, world, setup.ranks_per_node or world, timeout=None)
            with warnings.catch_warnings():
                # the engine's hint that an unknown class could be declared element-wise: it is, on purpose
                warnings.filterwarnings("ignore", message=f"lightning-zero steps {OwnedAdamW.__name__}")
                self.engine = ZeroEngine(
                    model, [self.optimizer], config, group=shard_group, replicate_group=replicate_group, links=self.links
                )
        except (TypeError, ValueError, NotImplementedError) as error:
            raise VariantUnavailable(f"ZeroEngine does not run {config}: {error}") from error

    def step(self, x: Tensor, y: Tensor, probe: Probe = no_probe) -> Tensor:
        engine, optimizer = self.engine, self.optimizer
        engine.begin_step()
        with self.setup.autocast():
            loss = self.model(x, y)[1]
        probe("forward")
        loss.backward()
        probe("backward")
        engine.finish_backward()
        engine.end_step()
        probe("gradients")
        optimizer.step()
        engine.after_optimizer_step(optimizer)
        probe("step")
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def state_tensors(self) -> StateTensors:
        held = module_and_optimizer_tensors(self.model, [self.optimizer])
        disk = getattr(self.engine, "disk", None)
        if disk is None:
            return held
        # NVMe: the optimizer's state entries are empty placeholders between steps; what it holds
        # is the staging buffers the state streams through
        staging = disk.staging.kept
        return dataclasses.replace(held, optimizer_state=held.optimizer_state + staging)

    def engine_report(self) -> Optional[dict[str, Any]]:
        report = self.engine.memory_report()
        return {**dataclasses.asdict(report), "total": report.total}

    def disk_stats(self) -> Optional[Any]:
        disk = getattr(self.engine, "disk", None)
        return disk.io if disk is not None else None

    def units(self) -> Optional[int]:
        units = getattr(self.engine.residency, "units", None)  # stage 3's
        return len(units) if units is not None else None

    def close(self) -> None:
        self.engine.close()
        if self.links is not None:
            self.links.destroy()


def _zero_config(config_class: type, spec: VariantSpec, setup: Setup) -> Any:
    """The engine config for `spec`; a config that does not know an option the variant needs (yet)
    makes the variant unavailable rather than a crash."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    kwargs: dict[str, Any] = {"stage": spec.stage, "bucket_size_mb": setup.bucket_size_mb}
    if spec.stage == 3 and "unit_classes" in fields:
        kwargs["unit_classes"] = (Block.__name__,)  # one unit per Block, as FSDP2 is applied
    if spec.stage == 3 and "check_units_every_gather" in fields:
        # the GPU setting on every device, so the host-sync column predicts a GPU run (on the CPU
        # the default reads each gather's unit tags from host memory, which waits for nothing)
        kwargs["check_units_every_gather"] = False
    wanted = {"offload_optimizer": spec.offload_optimizer, "offload_params": spec.offload_params}
    if spec.state_on_disk:
        wanted["nvme_path"] = setup.nvme_path
    for name, value in wanted.items():
        if value:
            if name not in fields:
                raise VariantUnavailable(f"ZeroConfig has no `{name}` option (this offload is not implemented yet)")
            kwargs[name] = value
    if spec.zero_plus_plus is not None:
        missing = [name for name in spec.zero_plus_plus.config() if name not in fields]
        if missing:
            raise VariantUnavailable(f"ZeroConfig has no {', '.join(missing)} option (ZeRO++ is not implemented yet)")
        kwargs.update(spec.zero_plus_plus.config())
    if spec.offload_optimizer and setup.device.type == "cpu" and "host_threads" in fields:
        # the rank's threads as the bench set them (`--threads`, `worker.threads_per_rank`), which the
        # engine would otherwise set again from the node's cores (`engine/offload/host_threads.py`)
        kwargs["host_threads"] = torch.get_num_threads()
    kwargs.update(setup.engine_options)
    try:
        return config_class(**kwargs)
    except (TypeError, ValueError, NotImplementedError) as error:
        raise VariantUnavailable(f"ZeroConfig({kwargs}) is refused: {error}") from error


# --- DeepSpeed ---------------------------------------------------------------------------------


class DeepSpeedWrapped(Wrapped):
    """`deepspeed.initialize` with our optimizer object and a config that changes nothing but the
    stage and the bucket sizes. `gradient_clipping` is set to 0: DeepSpeed 0.19 defaults it to 1.0,
    which would train a different model from the other variants.

    Everything else keeps DeepSpeed's defaults, as its users get them. At stage 3 that includes
    `stage3_max_live_parameters` and `stage3_max_reuse_distance` of 1e9 elements, which keep a model
    under a billion parameters gathered from its forward to its backward (so it moves 2Ψ, not 3Ψ,
    and holds full weights meanwhile), and `stage3_param_persistence_threshold` of 1e5, which leaves
    smaller parameters unpartitioned."""

    def __init__(self, model: nn.Module, setup: Setup, stage: int) -> None:
        super().__init__(model, setup)
        try:
            import deepspeed
        except ImportError as error:
            raise VariantUnavailable(f"deepspeed is not importable ({error}); `pip install deepspeed`") from error
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        # DeepSpeed sizes its buckets in elements; the parameters and gradients are fp32 (4 bytes).
        bucket_elements = int(setup.bucket_size_mb * 2**20 / 4)
        zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket_elements}
        if stage < 3:
            zero["allgather_bucket_size"] = bucket_elements
        config = {
            "train_micro_batch_size_per_gpu": setup.batch_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,  # never: its log line would land in the timed steps
            "wall_clock_breakdown": False,
        }
        optimizer = setup.make_optimizer(model.parameters())
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False
        )

    def step(self, x: Tensor, y: Tensor, probe: Probe = no_probe) -> Tensor:
        with self.setup.autocast():
            loss = self.engine(x, y)[1]
        probe("forward")
        self.engine.backward(loss)  # reduces (stage 2-3: reduce-scatters) gradients inside
        probe("backward")
        probe("gradients")
        self.engine.step()  # optimizer step, parameter all-gather and zero_grad
        probe("step")
        return loss.detach()

    def state_tensors(self) -> StateTensors:
        """The module's parameters and their stage-3 shards (`ds_tensor`), the wrapped torch
        optimizer's flat fp32 partitions and state, and every tensor attribute of DeepSpeed's ZeRO
        optimizer whose name mentions gradients (its gradient partitions and accumulators)."""
        zero_optimizer = self.optimizer
        inner = getattr(zero_optimizer, "optimizer", zero_optimizer)
        found = module_and_optimizer_tensors(self.model, [inner], extra_gradients=_grad_attributes(zero_optimizer))
        shards = tuple(
            p.ds_tensor for p in self.model.parameters() if isinstance(getattr(p, "ds_tensor", None), Tensor)
        )
        return dataclasses.replace(found, parameters=found.parameters + shards)


_NESTING = 3
"""How deep `_grad_attributes` looks into containers: DeepSpeed keeps gradient pieces at most two
levels down (a dict of parameter groups holding lists of tensors); one more level is slack."""


def _grad_attributes(obj: object) -> list[Tensor]:
    """Tensors held, directly or in lists and dicts, by `obj`'s attributes named like "*grad*"."""
    tensors: list[Tensor] = []

    def collect(value: Any, depth: int = 0) -> None:
        if isinstance(value, Tensor):
            tensors.append(value)
        elif depth < _NESTING and isinstance(value, (list, tuple)):
            for item in value:
                collect(item, depth + 1)
        elif depth < _NESTING and isinstance(value, dict):
            for item in value.values():
                collect(item, depth + 1)

    for name, value in vars(obj).items():
        if "grad" in name:
            collect(value)
    return tensors


# --- the table's families ---------------------------------------------------------------------


def build(spec: VariantSpec, model: nn.Module, setup: Setup) -> Wrapped:
    """Wrap `model` (already on `setup.device`, identically initialised on every rank) as `spec`."""
    if spec.family is Family.DDP:
        return DDPWrapped(model, setup)
    if spec.family is Family.TORCH_ZERO:
        return ZeroRedundancyWrapped(model, setup)
    if spec.family is Family.FSDP2:
        return FSDP2Wrapped(model, setup, reshard_after_forward=spec.stage == 3)
    if spec.family is Family.OURS:
        return OursWrapped(model, setup, spec)
    if spec.family is Family.DEEPSPEED:
        return DeepSpeedWrapped(model, setup, spec.stage)
    raise ValueError(f"no wrapper for the {spec.family.value} family")


def autocast_for(precision: str, device: torch.device) -> Callable[[], ContextManager[Any]]:
    """bf16 autocast for "bf16-mixed" (what Lightning's plugin does), nothing for "fp32"."""
    if precision == "bf16-mixed":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext
