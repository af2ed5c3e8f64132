"""A whole-tensor optimizer stepping each parameter whole, on the parameter's owner rank.

[Note: whole-tensor step]
The optimizer keeps its param groups pointed at the shards, like any other (``sharded_optimizer.py``):
the gradients are reduce-scattered into chunks, clipped, unscaled and checkpointed as chunks, as on
the chunk path. Only around its ``step`` (and around ``train()``/``eval()``, see ``weight_swaps.py``)
does it see whole tensors:

1. after the step's gradients are final (after the closure, where one is passed), each rank sends its
   gradient and weight chunks of every parameter to the parameter's owner (``tensor_owners.py``),
   two all-to-alls per dtype (``owner_exchange.py``);
2. on the owner, each owned shard's ``.data`` and ``.grad`` become the full tensors (in the master
   dtype, where the shard lives: the host under offload); every other shard's ``.grad`` is None, so
   the optimizer skips it, as any torch optimizer skips a parameter without a gradient;
3. the optimizer steps: its state for a parameter is created on the owner only, full-shaped, keyed by
   the same shard object, so ``state_dict`` indices keep their meaning;
4. after the step the owner sends each rank its chunk of the updated weights (one all-to-all per
   dtype), and every shard gets its chunk storage and gradient back.

The module then sees the update as after any step (stages 1-2 all-gather the chunks, stage 3 gathers
them at the next use). The per-step cost over the chunk path: 2Ψ'/N elements sent and received per
rank for the gradients and weights in, Ψ'/N for the weights out (Ψ' the elements this optimizer steps).

Checkpoints see chunks (``chunk_state``): the owner's full-shaped state entries are scattered to
every rank's chunk, so a sharded checkpoint has the chunk path's layout, reshards N→M (the owner
may change) and converts to a DDP-format file; ``load_chunk_state`` is the inverse. Entries that
are not parameter-shaped (step counts, Adafactor's row and column factors) are copied from the owner
to every rank.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.owner_exchange import OwnedTensor, gather_to_owners, scatter_from_owners
from lightning_zero.engine.optimizer.tensor_owners import OwnerPlan, plan_owners
from lightning_zero.engine.shards.sharded_param import ShardedParam

STEP_KEY = "step"
CHUNKED, COPIED = "chunked", "copied"


class ChunkedState(NamedTuple):
    """An optimizer's ``state_dict`` as the chunk path keeps it, and which of its entries are this
    rank's chunks of parameter-shaped state (``(position, key)``; the same on every rank)."""

    state_dict: dict[str, Any]
    chunked: frozenset[tuple[int, str]]


@dataclass
class _Swapped:
    """A shard showing its full tensor (or no gradient) during a step, and what it had before."""

    index: int
    data: Tensor
    grad: Optional[Tensor]


class WholeTensorStep:
    """``optimizer`` (which steps ``params``, in ``state_dict`` order) stepping whole tensors on owner
    ranks of ``group`` (see [Note: whole-tensor step]); collectives run on ``comm_device``."""

    def __init__(
        self,
        optimizer: Optimizer,
        params: Sequence[ShardedParam],
        group: collectives.ProcessGroup,
        comm_device: torch.device,
        reduced: Callable[[], Optional[frozenset[int]]] = lambda: None,
    ) -> None:
        self.optimizer = optimizer
        self._reduced = reduced  # see `_participants`
        self.params = list(params)
        self.group = group
        self.rank = collectives.rank(group)
        self.comm_device = comm_device
        self.plan: OwnerPlan = plan_owners([p.layout.numel for p in self.params], collectives.world_size(group))
        self._tensors = [OwnedTensor(p.layout, owner) for p, owner in zip(self.params, self.plan.owners)]
        self._swapped: Optional[list[_Swapped]] = None
        self._depth = 0  # steps entered and not left (see `_before_step`)
        self._handles = [optimizer.register_step_pre_hook(self._before_step), optimizer.register_step_post_hook(self._after_step)]

    def owns(self, index: int) -> bool:
        return self.plan.owners[index] == self.rank

    # ---- the step ------------------------------------------------------------------------------
    def _before_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        # a subclass whose `step` calls `super().step()` runs the hooks again, inside: only the
        # outermost step gathers and scatters
        self._depth += 1
        if self._depth > 1:
            return None
        # torch hands the hook the step's arguments with the optimizer first: (self, closure?)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._show_whole(with_grads=True)
            return None
        wrapped = self._closure_then_whole(closure)
        return ((args[0], wrapped, *args[2:]), kwargs) if len(args) > 1 else (args, {**kwargs, "closure": wrapped})

    def _closure_then_whole(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (the step's forward and backward), after which the owners get whole tensors."""
        calls = 0

        def closure_then_whole() -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                raise RuntimeError(
                    f"{type(self.optimizer).__name__} evaluated its closure a second time in one step (as LBFGS"
                    " does), and each evaluation's gradients would need their own reduction; lightning-zero"
                    " steps optimizers that evaluate it at most once."
                )
            loss = closure()
            self._show_whole(with_grads=True)
            return loss

        return closure_then_whole

    def _after_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
        self._depth -= 1
        if self._depth == 0 and self._swapped is not None:
            self._back_to_chunks()

    @contextmanager
    def whole_weights(self) -> Iterator[None]:
        """Inside, each owner's shards are its parameters' full weights (no gradients), and updates
        to them reach every rank's chunk on the way out (``optimizer.train()``/``eval()``)."""
        self._show_whole(with_grads=False)
        try:
            yield
        finally:
            self._back_to_chunks()

    def _show_whole(self, with_grads: bool) -> None:
        """Steps 1-2 of [Note: whole-tensor step]. With ``with_grads``, only parameters with a gradient
        take part (the others are skipped by the optimizer anyway), the same ones on every rank
        (``_participants``)."""
        if self._swapped is not None:
            raise RuntimeError(f"{type(self.optimizer).__name__}: a step began inside another one.")
        active = self._participants() if with_grads else list(range(len(self.params)))
        tensors = [self._tensors[i] for i in active]
        weights = gather_to_owners([self.params[i].shard.detach() for i in active], tensors, self.group, self.comm_device)
        grads = {}
        if with_grads:
            grads = gather_to_owners([self.params[i].shard.grad for i in active], tensors, self.group, self.comm_device)
        swapped = []
        with torch.no_grad():
            for k, i in enumerate(active):
                shard = self.params[i].shard
                swapped.append(_Swapped(i, shard.data, shard.grad))
                shard.grad = None
                if k in weights:
                    shape = self.params[i].shape
                    shard.data = weights[k].to(shard.device).view(shape)
                    if with_grads:
                        shard.grad = grads[k].to(shard.device).view(shape)
        self._swapped = swapped

    def _participants(self) -> list[int]:
        """The parameters with a gradient in this step, by index, decided alike on every rank: the
        all-to-alls' split sizes follow from them, and splits that differ between ranks hang NCCL
        (or fail on gloo) far from the cause. The reduction decided which parameters have a gradient
        on every rank; an assignment ``param.grad = None`` since then is agreed on with one small
        all-reduce (and one host read) per step: dropped on every rank, the parameter sits this step
        out, as under DDP; dropped on some ranks only, every rank raises the same error. Without a
        reduction to go by (gradients set by hand), the shards holding a gradient."""
        reduced = self._reduced()
        if reduced is None:
            return [i for i, p in enumerate(self.params) if p.shard.grad is not None]
        agreed = [i for i, p in enumerate(self.params) if id(p) in reduced]
        if not agreed:
            return []
        dropped = torch.tensor([float(self.params[i].shard.grad is None) for i in agreed], device=self.comm_device)
        counts = collectives.all_reduce(dropped, self.group).tolist()
        n = collectives.world_size(self.group)
        partly = [f"{self.params[i].name!r} on {int(c)} of {n}" for i, c in zip(agreed, counts) if 0 < c < n]
        if partly:
            self._depth = 0  # the step ends here, on every rank
            name = type(self.optimizer).__name__
            raise RuntimeError(
                f"{name} steps each parameter whole on one owner rank, which needs every rank's chunk of its"
                f" gradient, but after the gradients were reduced `param.grad` was set to None on some ranks"
                f" only: {', '.join(partly)} ranks. Drop a parameter's gradient on every rank or on none"
                " (under DDP a rank-local drop would silently desynchronize the replicas)."
            )
        return [i for i, c in zip(agreed, counts) if c == 0]

    def _back_to_chunks(self) -> None:
        """Step 4 of [Note: whole-tensor step]."""
        swapped, self._swapped = self._swapped, None
        assert swapped is not None
        full = {k: self.params[s.index].shard.detach().reshape(-1) for k, s in enumerate(swapped) if self.owns(s.index)}
        for s in swapped:
            shard = self.params[s.index].shard
            shard.grad = None
            shard.data = s.data
            shard.grad = s.grad
        tensors = [self._tensors[s.index] for s in swapped]
        scatter_from_owners(full, tensors, [s.data.view(-1) for s in swapped], self.group, self.comm_device)

    # ---- checkpoints ---------------------------------------------------------------------------
    def chunk_state(self, state_dict: dict[str, Any]) -> ChunkedState:
        """``state_dict`` (this rank's ``optimizer.state_dict()``) as the chunk path would hold it: a
        collective (see [Note: whole-tensor step])."""
        states = state_dict["state"]
        mine: dict[int, dict[str, tuple[str, Any]]] = {}
        for i in self.plan.owned_by(self.rank):
            if i in states:
                mine[i] = {key: self._describe(i, key, value) for key, value in states[i].items()}
        described: dict[int, dict[str, tuple[str, Any]]] = {}
        for part in collectives.gather_objects(mine, self.group):
            described.update(part)
        entries = sorted((i, key) for i, entry in described.items() for key, (kind, _) in entry.items() if kind == CHUNKED)
        chunks = [torch.empty(self.params[i].owned_numel, dtype=described[i][key][1], device=self.params[i].shard.device) for i, key in entries]
        full = {k: states[i][key].reshape(-1) for k, (i, key) in enumerate(entries) if self.owns(i)}
        scatter_from_owners(full, [self._tensors[i] for i, _ in entries], chunks, self.group, self.comm_device)
        chunk_states: dict[int, dict[str, Any]] = {
            i: {key: value for key, (kind, value) in entry.items() if kind == COPIED} for i, entry in described.items()
        }
        for (i, key), chunk in zip(entries, chunks):
            chunk_states[i][key] = chunk
        return ChunkedState({"state": chunk_states, "param_groups": state_dict["param_groups"]}, frozenset(entries))

    def _describe(self, index: int, key: str, value: Any) -> tuple[str, Any]:
        if key != STEP_KEY and isinstance(value, Tensor) and value.shape == self.params[index].shape:
            return CHUNKED, value.dtype
        return COPIED, value.detach().to("cpu", copy=True) if isinstance(value, Tensor) else value

    def load_chunk_state(self, state_dict: dict[str, Any], chunked: frozenset[tuple[int, str]]) -> dict[str, Any]:
        """The inverse of ``chunk_state``: the ``state_dict`` this rank's optimizer loads, each owner
        with its parameters' full state, from every rank's chunks (a collective)."""
        states = {int(i): s for i, s in state_dict["state"].items()}
        entries = sorted(chunked)
        chunks = [states[i][key].reshape(-1) for i, key in entries]
        full = gather_to_owners(chunks, [self._tensors[i] for i, _ in entries], self.group, self.comm_device)
        owned = {i: {k: v for k, v in states[i].items() if (i, k) not in chunked} for i in self.plan.owned_by(self.rank) if i in states}
        for k, (i, key) in enumerate(entries):
            if self.owns(i):
                owned[i][key] = full[k].view(self.params[i].shape)
        return {"state": owned, "param_groups": state_dict["param_groups"]}

    def owners_part(self, full_state_dict: dict[str, Any]) -> dict[str, Any]:
        """An unsharded (DDP-format) ``state_dict`` reduced to the entries this rank steps."""
        states = {int(i): s for i, s in full_state_dict["state"].items()}
        return {"state": {i: states[i] for i in self.plan.owned_by(self.rank) if i in states}, "param_groups": full_state_dict["param_groups"]}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
