"""Per-parameter state, kept in one typed object rather than attributes stuck onto ``nn.Parameter``.

[Note: frozen chunks]
A trained half-precision parameter's chunk is an fp32 master copy: the optimizer steps it, and a
gather casts it back to the parameter dtype (or, offloaded, keeps a device copy in that dtype).
A frozen parameter (``requires_grad=False`` at setup) is never stepped: its chunk holds the
parameter's own values in its own dtype, 2 B/param/N for a bf16 base instead of 4, and offloaded
it needs no device copy (the gather copies the host chunk to the device as it is). Gathers send
the same bf16 values either way, so training is bitwise unchanged. Checkpoints hold the chunk in
its dtype; one written with fp32 chunks for a frozen half parameter (before this) loads all the
same: DCP reads each entry in the dtype it was saved in, and ``load_chunk`` casts it into the
chunk (exact: the fp32 values were made from the half ones). The choice is made once, at setup
(as a bucket's grouping by ``requires_grad`` is, ``parameters/unit.py``): a parameter unfrozen
later has no fp32 master. With only the optimizer offloaded (stage 3), a frozen chunk stays on the
device, its one copy: no host step reads it (``parameters/materialize.py``). At stages 1-2 a frozen
parameter in no optimizer is not sharded at all (whole on every rank, in its dtype); one that an
optimizer holds gets a chunk that views the parameter, without a copy (``aliases_param``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_zero.engine.device_roles import mark_host
from lightning_zero.engine.shards.at_rest import put_to_rest, wake
from lightning_zero.engine.shards.gathered_storage import GatheredStorage
from lightning_zero.engine.shards.partition import ChunkLayout

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def holds_master_copy(param: Tensor) -> bool:
    """Whether the engine keeps ``param``'s chunk as an fp32 master copy: a half-precision parameter
    that is trained. A frozen one is never stepped, so its chunk stays in its own dtype (see
    [Note: frozen chunks])."""
    return param.dtype in _HALF_DTYPES and param.requires_grad


def master_dtype_of(param: Tensor) -> torch.dtype:
    """The dtype of ``param``'s chunk: fp32 where it holds a master copy, else its own."""
    return torch.float32 if holds_master_copy(param) else param.dtype


class ShardedParam:
    """One ``nn.Parameter`` of the module, its layout and this rank's chunk of it.

    ``shard`` is the tensor the optimizer steps in place of the parameter (its ``param_groups`` are
    rebound to it). Its dtype is the master dtype: fp32 where the parameter is half precision and
    trained, otherwise the parameter's own (a frozen one's: see [Note: frozen chunks]).

    With ``keep_full=True`` (stages 1-2) the parameter stays a full tensor; where dtypes agree,
    ``shard`` is a view into it, so stepping the shard updates the parameter's own chunk in place
    at no memory cost. With ``keep_full=False`` (stage 3) ``shard`` owns its chunk and the
    parameter is a view of its bucket's ``GatheredStorage``, whose memory exists only while the
    unit is gathered (see [Note: stage-3 storage] in ``gathered_storage.py``); until the bucket
    attaches it (``attach_gathered``) the parameter holds an empty placeholder.
    """

    def __init__(
        self,
        name: str,
        param: nn.Parameter,
        rank: int,
        world_size: int,
        keep_full: bool = True,
        host: Optional[torch.device] = None,
        keep_device_chunk: bool = False,
    ) -> None:
        if not param.is_contiguous():
            # sharding works on the flat view; this happens at setup only
            param.data = param.data.contiguous()
        self.name = name
        self.param = param
        self.rank = rank
        self.shape = param.shape
        self.device = param.device  # where the full parameter is computed with
        self.layout = ChunkLayout(param.numel(), world_size)
        self.keeps_full = keep_full
        self.holds_master_copy = holds_master_copy(param)
        self.gathered: Optional[GatheredStorage] = None  # stage 3: the bucket's storage of full values
        self._gathered_index = 0  # this parameter's place in it
        chunk = self._owned_chunk()
        self.aliases_param = keep_full and not self.holds_master_copy and host is None
        if self.aliases_param:
            shard_data = chunk.detach()
        else:
            shard_data = _copy_to(chunk.detach(), host or chunk.device, self.master_dtype)
            if host is not None:
                mark_host(shard_data)
        self.shard = nn.Parameter(shard_data, requires_grad=param.requires_grad)
        self.offloaded = host is not None
        # stage 3 with only the optimizer offloaded, or with trained half-precision weights (fp32
        # masters): the chunk the all-gather sends stays on the device in the parameter dtype,
        # refreshed from the host after each step (so casts stay on the device; see [Note: offloaded
        # bucket]); a frozen one's host chunk is already in that dtype (see [Note: frozen chunks])
        keep_device_chunk = keep_device_chunk or (self.offloaded and not keep_full and self.holds_master_copy)
        self.device_chunk: Optional[Tensor] = chunk.detach().clone() if keep_device_chunk else None
        self.placed_ptr = param.data_ptr()
        """Where the storage the engine placed in the parameter starts (``data_was_assigned`` tells
        when ``param.data`` stopped being it)."""
        self.full_flat: Optional[Tensor] = None
        """Stages 1-2: the flat view of the parameter all-gathers write into, made once (again when
        an assigned tensor is adopted); ``full_rows``: the same as the (N, c) block an all-gather
        delivers, where the parameter fills whole rows (numel = N * c), else None. Both are read
        for a whole bucket at once (``full_targets.py``)."""
        self.full_rows: Optional[Tensor] = None
        if keep_full:
            self._place_full(param.detach())
        # made once, not per step (see [Note: batched copies] in partition.py): the alias of the
        # shard the all-gather sends (the optimizer updates it in place), and stage 3's placeholder
        self._shard_data = self.shard.detach()
        self._placeholder = torch.empty(0, dtype=param.dtype, device=self.device)
        self.send_source = self.device_chunk if self.device_chunk is not None else self._shard_data
        """This rank's (updated) chunk as the all-gather sends it (``chunk_to_send``), kept as an
        attribute so that a bucket's gather reads it without a call per parameter."""
        self.master_in_memory: Callable[..., AbstractContextManager] = _always_in_memory
        """``master_in_memory(writing=...)``: a context in which ``shard`` can be read (and written);
        its bucket's where the chunk lives on disk between uses (see ``masters_on_disk.py``)."""

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.float32 if self.holds_master_copy else self.param.dtype

    @property
    def owned_numel(self) -> int:
        return self.layout.owned_numel(self.rank)

    @property
    def padded_chunk_numel(self) -> int:
        return self.layout.padded_chunk_numel

    def _owned_chunk(self) -> Tensor:
        start, end = self.layout.owned_range(self.rank)
        return self.param.detach().view(-1)[start:end]

    # ---- gradients and updates -------------------------------------------------------------
    def show_grad(self, grad: Optional[Tensor]) -> None:
        """Put ``grad`` (a full-shaped view of the gradient, or None) in ``param.grad`` (at stage 3
        too: a parameter at rest keeps its full shape)."""
        with torch._C.DisableTorchFunctionSubclass():
            self.param.grad = grad

    def chunk_to_send(self) -> Tensor:
        """This rank's (updated) chunk as the all-gather sends it: the device copy where one is
        kept, else the shard the optimizer steps."""
        return self.device_chunk if self.device_chunk is not None else self._shard_data

    def move_shard_into(self, storage: Tensor) -> None:
        """Keep ``shard``'s value in ``storage`` from now on (its place in a bucket's host buffer,
        see [Note: offloaded bucket] in ``host_chunks.py``); the optimizer's parameter object stays."""
        with torch.no_grad():
            storage.copy_(self._shard_data)
        self.shard.data = storage
        self._shard_data = self.shard.detach()
        self.send_source = self.chunk_to_send()

    def write_chunk_to(self, out: Tensor) -> None:
        """Copy this rank's (updated) chunk into ``out`` (1D, ``owned_numel`` long), in ``out``'s dtype."""
        out.copy_(self.chunk_to_send())

    def refresh_device_chunk(self) -> None:
        """After the optimizer stepped the host shard: bring the update to the device copy."""
        if self.device_chunk is not None:
            with self.master_in_memory():
                self.device_chunk.copy_(self.shard.detach())

    def load_full_value(self, full: Tensor) -> None:
        """Take this rank's chunk of ``full`` (the whole parameter, e.g. from a checkpoint)."""
        if full.shape != self.shape:
            raise ValueError(f"parameter {self.name!r} has shape {tuple(self.shape)}, the value has {tuple(full.shape)}")
        start, end = self.layout.owned_range(self.rank)
        with torch.no_grad(), self.master_in_memory(writing=True):
            self.shard.copy_(full.detach().reshape(-1)[start:end])
            self.refresh_device_chunk()
            if self.keeps_full:
                self.param.copy_(full)

    def load_chunk(self, chunk: Tensor) -> None:
        """Take this rank's chunk (stage 3; e.g. read from a sharded checkpoint)."""
        if chunk.numel() != self.owned_numel:
            raise ValueError(f"parameter {self.name!r}: expected {self.owned_numel} elements for this rank, got {chunk.numel()}")
        with torch.no_grad(), self.master_in_memory(writing=True):
            self.shard.copy_(chunk.reshape(self.shard.shape))
            self.refresh_device_chunk()

    # ---- `param.data = new_tensor` during training ------------------------------------------
    # DDP allows it, and callbacks do it (spike detection, pruning, weight averaging): the module
    # then holds a tensor the engine never placed. ``adopt_assigned_data`` copies its values into
    # the engine's storage and the chunk the optimizer steps, and points the parameter back at that
    # storage; a new shape, dtype or device cannot be adopted and fails, naming both.
    def data_was_assigned(self) -> bool:
        """``param.data`` is a tensor the engine did not place (at stage 3: while gathered). At
        stages 1-2 a bucket asks this of all its parameters at once (``FullTargets.assigned``)."""
        if self.keeps_full:
            return self.param.data_ptr() != self.placed_ptr
        if self.gathered is None:
            return False
        with torch._C.DisableTorchFunctionSubclass():
            return self.param.data_ptr() != self.gathered.flats[self._gathered_index].data_ptr()

    def adopt_assigned_data(self, between_steps: bool = False) -> None:
        """``between_steps``: at stage 3, outside any forward and backward (a callback editing the
        gathered parameters inside ``summon_full_params(writeback=True)``), where the assigned tensor
        may become the storage the gathers fill, as at stages 1-2."""
        with torch._C.DisableTorchFunctionSubclass():
            new = self.param.data
        placed = self.full_flat if self.keeps_full else self.gathered.flat
        if (new.shape, new.dtype, new.device) != (self.shape, placed.dtype, placed.device):
            raise RuntimeError(
                f"Parameter {self.name!r} was assigned a tensor of shape {tuple(new.shape)} ({new.dtype},"
                f" {new.device}) after lightning-zero sharded it as shape {tuple(self.shape)} ({placed.dtype},"
                f" {placed.device}). Assigning `.data` with the same shape, dtype and device works (the new"
                " values are kept, as under DDP); change shapes, dtypes or devices before `trainer.fit` (or"
                " in `configure_model`)."
            )
        if self.keeps_full and new.is_contiguous():
            self._take_storage_of(new)
            return
        if between_steps and new.is_contiguous() and new.untyped_storage().resizable():
            self._gather_into(new)
            return
        with torch.no_grad():
            full = self.gather_target()  # the storage the engine placed (at stage 3 grown again if freed)
            full.copy_(new.reshape(-1))
            with torch._C.DisableTorchFunctionSubclass():
                self.param.data = full.view(self.shape)
            start, end = self.layout.owned_range(self.rank)
            if not self.aliases_param:
                with self.master_in_memory(writing=True):
                    self.shard.copy_(full[start:end])
            self.refresh_device_chunk()

    def _take_storage_of(self, new: Tensor) -> None:
        """Stages 1-2: the assigned tensor becomes the parameter's storage for good, as under DDP,
        where whoever else holds it sees the updates that follow (Lightning's ModelPruning relies on
        that); all-gathers then write into it and, without a master copy, the shard is a view of it."""
        self._place_full(new)
        if self.aliases_param:
            self.shard.data = self._owned_chunk()
            self._shard_data = self.shard.detach()
            self.send_source = self.chunk_to_send()
        else:
            self.sync_master_from_param()

    def _place_full(self, full: Tensor) -> None:
        """Stages 1-2: ``full`` (the parameter's data, contiguous) is the storage all-gathers write into."""
        self.full_flat = full.view(-1)
        self.placed_ptr = full.data_ptr()
        n, c = self.layout.world_size, self.layout.padded_chunk_numel
        self.full_rows = self.full_flat.view(n, c) if self.layout.numel == n * c and c > 0 else None

    def _gather_into(self, new: Tensor) -> None:
        """Stage 3, between steps: the assigned tensor becomes the parameter's gathered storage, so
        whoever else holds it (Lightning's ModelPruning keeps the tensor its lottery-ticket reset
        assigned, and reads it again at the next reset, inside the gathered context) sees the
        weights whenever the unit is gathered, as under DDP. At rest its storage is freed like any
        other gathered storage. Never mid-step: autograd keeps the previous storage's references."""
        self.gathered.own(self._gathered_index, new)
        start, end = self.layout.owned_range(self.rank)
        with torch.no_grad(), self.master_in_memory(writing=True):
            self.shard.copy_(new.reshape(-1)[start:end].reshape(self.shard.shape))
        self.refresh_device_chunk()

    def check_adoptable(self, value: Tensor) -> None:
        """Stage 3, ``param.data = value`` while the parameter is at rest (outside its unit's use,
        e.g. pretrained weights loaded between steps): raises unless ``value`` has the parameter's
        shape and dtype. It then becomes the parameter's value, this rank keeping its chunk of it
        (``ShardedParameters.write_full_value``), as at stages 1-2; the parameter stays at rest."""
        dtype = self._placeholder.dtype
        if (value.shape, value.dtype) != (self.shape, dtype):
            raise RuntimeError(
                f"Parameter {self.name!r} was replaced or resized while lightning-zero held it sharded:"
                f" its `.data` was assigned a tensor of shape {tuple(value.shape)} ({value.dtype}), the"
                f" parameter has shape {tuple(self.shape)} ({dtype}). HINT: a tensor of the parameter's"
                " shape and dtype is adopted (each rank keeps its chunk of it, as under DDP); change"
                " shapes or dtypes before `trainer.fit` (or in `configure_model`)."
            )

    def check_data_not_assigned(self) -> None:
        """Stages 1-2, right before the all-gather after an optimizer step: ``param.data`` assigned
        between the backward (where it is adopted) and the step could not be stepped."""
        if self.data_was_assigned():
            raise RuntimeError(
                f"Parameter {self.name!r} was assigned a new `.data` between the backward and the"
                " optimizer step, which stepped its previous values. Assign it before the forward (e.g."
                " in `training_step` or `on_train_batch_start`) or after the step."
            )

    def sync_master_from_param(self) -> None:
        """Refresh the optimizer's chunk from the full parameter (after its weights were edited)."""
        if not self.aliases_param:
            with torch.no_grad(), self.master_in_memory(writing=True):
                self.shard.copy_(self._owned_chunk())
                if self.device_chunk is not None:
                    self.device_chunk.copy_(self._owned_chunk())

    # ---- stage 3: full data only while gathered (see [Note: stage-3 storage]) ----------------
    def attach_gathered(self, storage: GatheredStorage, index: int) -> None:
        """Stage 3, once at setup: the parameter becomes view ``index`` of its bucket's storage."""
        self.gathered, self._gathered_index = storage, index
        self.point_at_storage()

    def point_at_storage(self) -> None:
        """``param.data`` is this parameter's view of the bucket's storage (at setup, after a lent
        copy, after the storage was renewed)."""
        with torch._C.DisableTorchFunctionSubclass():
            self.param.data = self.gathered.views[self._gathered_index]

    def gather_target(self) -> Tensor:
        """The flat full tensor an all-gather copies into: the parameter itself at stages 1-2
        (``full_flat``), its view of the bucket's storage at stage 3 (grown first, if freed)."""
        if self.keeps_full:
            return self.full_flat
        self.gathered.grow()
        return self.gathered.flats[self._gathered_index]

    def rest_until_attached(self) -> None:
        """Stage 3 setup, once this rank's chunk is taken: the full values go; until the bucket
        attaches its storage the parameter holds an empty placeholder and refuses reads."""
        self.param.data = self._placeholder
        put_to_rest(self.param)

    def lend_full_copy(self, value: Tensor) -> None:
        """At rest: let the parameter show ``value``, a full copy made for the user (FSDP's
        ``summon_full_params(offload_to_cpu=True)``), until ``end_full_copy``. A copy on another
        device (the host) or in another dtype makes torch drop the parameter's gradient
        accumulator: counted (see ``data_swaps``)."""
        wake(self.param)
        _note_swap(self.param, value)
        self.param.data = value

    def end_full_copy(self, writeback: bool) -> None:
        """Back to rest after ``lend_full_copy``; with ``writeback`` this rank first takes its chunk
        of the (possibly edited or reassigned) copy."""
        lent = self.param.data
        if writeback:
            self.load_full_value(lent.to(self.device))
        _note_swap(lent, self._placeholder)  # the storage's views have the placeholder's dtype and device
        if self.param.__class__ is nn.Parameter:  # a user's own subclass shows a placeholder at rest
            self.point_at_storage()
            put_to_rest(self.param)
        else:
            self.hide_values()

    def hide_values(self) -> None:
        """At rest, for a parameter of a user's own ``nn.Parameter`` subclass (which keeps its
        class, so nothing refuses reads): an empty placeholder instead of a view of freed memory."""
        with torch._C.DisableTorchFunctionSubclass():
            self.param.data = self._placeholder

    def let_go(self) -> None:
        """The engine lets go of the parameter (closed without handing back full values): a plain
        parameter holding an empty placeholder, never a view of freed memory."""
        wake(self.param)
        self.param.data = self._placeholder


def accumulate_grads(params: Sequence[ShardedParam], grads: Sequence[Optional[Tensor]]) -> None:
    """Add each parameter's reduced gradient chunk (None: skip it) to its ``shard.grad``, setting
    it on the first backward. A chunk is a view into a receive buffer no one reuses, so where dtype
    and device already match it becomes the gradient as it is, without a copy. One loop for a
    bucket, with no call per parameter."""
    for p, grad in zip(params, grads):
        if grad is None:
            continue
        shard = p.shard
        if shard.grad is None:
            shard.grad = grad.to(shard.device, shard.dtype)
        else:
            shard.grad.add_(grad.to(shard.device))


_swaps = 0


def data_swaps() -> int:
    """How many times the engine has assigned a parameter's ``.data`` a tensor of another dtype or
    device (in any engine of this process). torch's ``set_data`` then drops the parameter's
    gradient accumulator (``AccumulateGrad``), and the next forward makes a new one: whoever holds
    the old node (``gradients/unreached.py``) must take the new one when this count moves."""
    return _swaps


def _note_swap(old: Tensor, new: Tensor) -> None:
    """``old``'s ``.data`` is about to become (or just became) ``new``: count a change of dtype or device."""
    global _swaps
    if old.dtype != new.dtype or old.device != new.device:
        _swaps += 1


def _always_in_memory(writing: bool = False) -> AbstractContextManager:
    return nullcontext()


def _copy_to(tensor: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """A copy on ``device`` in ``dtype`` (an offloaded shard moves into its bucket's pinned host
    buffer afterwards, see ``host_chunks.py``)."""
    return tensor.to(device=device, dtype=dtype, copy=True)


def place_of(t: torch.Tensor, offloaded: bool, compute_device: torch.device) -> str:
    """Where the memory report (``engine/memory.py``) counts ``t``: "host" when it is a CPU tensor
    and either what it belongs to is offloaded or computes on an accelerator, else "device". So
    offloaded state that something moved to the device counts as device memory, and on a CPU-only
    machine offload stays visible."""
    on_host = t.device.type == "cpu" and (offloaded or compute_device.type != "cpu")
    return "host" if on_host else "device"
