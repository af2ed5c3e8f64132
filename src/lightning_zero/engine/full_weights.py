"""Full weights (and gradients) from the shards, only where the user asks for them.

``ZeroEngine.gathered`` (``summon_full_params``), ``full_state_dict`` and ``load_full_state_dict``
delegate to :class:`FullWeights`, so that the facade keeps the training step and these paths —
which at stage 3 gather one unit at a time — read in one place.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.gradients.grad_window import GradientWindow, full_gradients
from lightning_zero.engine.parameters.residency import HOST, FullCopies, ParameterResidency
from lightning_zero.engine.shards.sharded_param import ShardedParam


class FullWeights:
    """One engine's full weights on demand: ``residency`` gathers them, ``window`` shows the reduced
    gradient chunks that full gradients are gathered from (over ``group``, ``piece_bytes`` at a time)."""

    def __init__(
        self,
        residency: ParameterResidency,
        params: Sequence[ShardedParam],
        window: GradientWindow,
        group: collectives.ProcessGroup,
        piece_bytes: int,
    ) -> None:
        self.residency = residency
        self.params = params
        self.window = window
        self.group = group
        self.piece_bytes = piece_bytes

    def gathered(self, writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool) -> AbstractContextManager[None]:
        """See ``ZeroEngine.gathered``."""
        if writeback and rank0_only:  # on every rank alike, before any gather
            raise ValueError(
                "summon_full_params(writeback=True) needs the full parameters on every rank, so it cannot be"
                " combined with rank0_only=True: the other ranks would have nothing to write back."
            )
        full_copies = None
        if rank0_only or offload_to_cpu:
            full_copies = FullCopies(
                device=HOST if offload_to_cpu else self.residency.compute_device,
                keep=not rank0_only or collectives.rank() == 0,
            )
        parameters = self.residency.gathered(writeback, full_copies)
        if not with_grads:
            return parameters
        return self._with_full_gradients(parameters, full_copies)

    @contextmanager
    def _with_full_gradients(self, parameters: AbstractContextManager[None], full_copies: Optional[FullCopies]) -> Iterator[None]:
        keep = full_copies is None or full_copies.keep
        device = full_copies.device if full_copies is not None else None
        shown: list[ShardedParam] = []
        self.window.take_assignments()  # the full gradients show what was assigned to `.grad`
        with parameters:
            for p, grad in zip(self.params, full_gradients(self.params, self.group, self.piece_bytes, device, keep)):
                if keep:
                    p.param.grad = grad
                    shown.append(p)
            try:
                yield
            finally:
                for p in shown:
                    p.param.grad = None
        self.window.show_again()

    def state_dict(self, module: nn.Module, keep: bool, device: torch.device) -> dict[str, torch.Tensor]:
        """See ``ZeroEngine.full_state_dict``."""
        entries = module.state_dict(keep_vars=True)  # on every rank: its hooks may communicate
        values: dict[int, torch.Tensor] = {}
        for p, value in self.residency.full_values(device):
            if keep:
                values[id(p.param)] = value
        if not keep:
            return {}
        return {key: values[id(t)] if id(t) in values else t.detach().to(device, copy=True) for key, t in entries.items()}

    def load_into_chunks(self, module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> None:
        """Stage 3's ``ZeroEngine.load_full_state_dict``: each parameter takes its chunk of its full
        value, the buffers are copied as they are."""
        by_id = {id(p.param): p for p in self.params}
        expected = module.state_dict(keep_vars=True)
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if strict and (missing or unexpected):
            raise KeyError(
                f"The state dict does not match the model: missing keys {missing[:10]}, unexpected keys"
                f" {unexpected[:10]}{' (and more)' if len(missing) > 10 or len(unexpected) > 10 else ''}."
            )
        buffers = {key: target for key, target in expected.items() if key in state_dict and id(target) not in by_id}
        for key, target in buffers.items():
            if target.shape != state_dict[key].shape:
                raise ValueError(f"buffer {key!r} has shape {tuple(target.shape)}, the value has {tuple(state_dict[key].shape)}")
        keys_of: dict[int, list[str]] = {}  # a tied parameter under each of its keys, in order (the last one wins)
        for key, target in expected.items():
            if key in state_dict and id(target) in by_id:
                keys_of.setdefault(id(by_id[id(target)]), []).append(key)
        with torch.no_grad():
            for bucket in self.residency.buckets_in_memory(writing=True):  # one bucket's chunks in memory at a time
                for p in bucket:
                    for key in keys_of.get(id(p), ()):
                        p.load_full_value(state_dict[key].to(p.param.device))
            for key, target in buffers.items():
                target.copy_(state_dict[key])
