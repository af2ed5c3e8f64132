"""Stage 3: a unit's gradient buckets are ready when its backward ends, not parameter by parameter.

[Note: readiness per unit]
A bucket is reduce-scattered once every gradient of its parameters for this backward is accumulated
(see ``grad_sync.py``). Counting them takes one Python hook per parameter per backward. At stage 3
the engine already knows when a unit's backward is over, once per unit call: the identity node its
forward pre-hook put on the call's inputs (``gather_schedule._UnitBoundary``) runs once their
gradients are computed, and frees the unit. Autograd runs the nodes of one device in decreasing
order of creation wherever the graph allows (every edge of the backward graph runs from a later node
to an earlier one, and a parameter's ``AccumulateGrad`` goes first of all), so when that node runs,
every node made after it in the forward has run: the gradient of every parameter used only from
that call on — the unit's own parameters, used by its modules — is accumulated. FSDP2 reduces a
group's gradients at the same point (its ``RegisterPostBackwardFunction``).

What that argument does not cover is a parameter of the unit also used *before* the call in the
forward (a unit's weight read by an earlier module: its ``AccumulateGrad`` waits for that earlier
use's backward, which comes after the unit's). Nothing about a module tells; a backward shows it. So:

- **learning** (the first backward after the hooks are registered, and after any finding below):
  the per-parameter hooks count as before, and at each unit's end the engine notes whether its
  buckets are complete there. A backward in which every bucket launched during it belonged to a unit
  that was complete at its end (the root unit's buckets, last in bucket order, excepted) makes the
  engine trust the unit ends: the per-parameter hooks are removed, but the root unit's (it is
  gathered for the whole step and has no end of its own; its few parameters — embeddings, final
  norm, head — keep launching its buckets as their gradients arrive).
- **trusted**: a unit's end marks its buckets ready (parameters it did not reach contribute zeros and
  a 0 used flag, as before) and launches what is ready in bucket order; the backward's first hook or
  end also marks the parameters that backward cannot reach (see [Note: unreached parameters] in
  ``unreached.py``). The last bucket in order is held until autograd has run the whole backward
  graph (a callback queued on its engine once that bucket is ready, where it is ready in the
  backward's own graph task; else until the flush after backward). Then nothing more can arrive, and
  the engine looks for gradients that arrived after their bucket was launched (a ``.grad`` set again
  after the launch took it: one list comprehension over the parameters, one C-level count) and
  carries the finding in the last bucket's reduce-scatter as a stop vote
  (``StopReason.LATE_GRADIENT``, see [Note: stop votes] in ``stop_vote.py``). Every rank then reads
  the same vote with the backward's one host read and raises the same error
  (``ZeroEngine.finish_backward``): this step's gradients miss what arrived late, and no rank steps
  with them. The engine goes back to learning. (Holding that bucket to the flush instead cost the
  benchmark's overlap stand-in a third more exposed step: the root's host step started later.)

A unit whose inputs need no gradient has no end node; its backward ends with its last parameter
gradient, which only a per-parameter hook sees. Trusted, such a unit is freed after backward and its
buckets launched by the flush (FSDP2 does the same, from its final callback); learning keeps the
hooks where such a unit's buckets launched before buckets of other units, so that no other bucket
waits behind it. The same goes for a unit whose end node never runs (non-reentrant activation
checkpointing recomputes the call, whose second end node is in no graph): it stays learning.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

from lightning_zero.engine.buckets.bucket import Bucket, ReductionState
from lightning_zero.engine.shards.sharded_param import ShardedParam


class UnitReadiness:
    """Whether the unit ends are trusted to mark ``buckets`` ready, what each unit end marks, and the
    check for gradients that came after their bucket's launch (see [Note: readiness per unit]).
    ``buckets`` in launch order; each bucket's ``index`` is its unit's; ``root`` the root unit's."""

    def __init__(self, buckets: Sequence[Bucket], root: int) -> None:
        self.trusted = False
        self._root = root
        self._unit_at = [bucket.index for bucket in buckets]  # by launch position
        self._buckets_of: dict[int, list[Bucket]] = {}
        for bucket in buckets:
            self._buckets_of.setdefault(bucket.index, []).append(bucket)
        self._tensors = [p.param for bucket in buckets for p in bucket.params]  # in launch order
        self._launched_before = [0, *itertools.accumulate(len(bucket.params) for bucket in buckets)]
        self._named = [p for bucket in buckets for p in bucket.params]
        self.params = len(self._named)
        self.root_params = frozenset(id(p.param) for bucket in buckets if bucket.index == root for p in bucket.params)
        """The root unit's parameters, which keep their hooks: the root has no end of its own (it is
        gathered for the whole step), and its buckets, last in launch order, launch as its gradients
        arrive, as before."""
        self._complete_units: set[int] = set()  # learning: units complete at their end in this backward
        self._incomplete = False  # learning: a unit whose end came before its last gradient
        self.late: list[str] = []
        """The parameters found with a gradient after their bucket's launch in the last trusted
        backward (names; empty: none)."""

    # ---- learning ----------------------------------------------------------------------------
    def note_end(self, unit: int) -> None:
        """Learning: unit ``unit``'s backward ended; note whether its buckets were complete then."""
        if all(b.ready or b.state is ReductionState.REDUCING for b in self._buckets_of.get(unit, ())):
            self._complete_units.add(unit)
        else:
            self._incomplete = True

    def learn(self, launched: int) -> bool:
        """Learning, at the flush of a backward whose first ``launched`` buckets were launched
        during it: whether the unit ends would have launched them as exactly (and the engine trusts
        them from now on)."""
        complete, root = self._complete_units, self._root
        self.trusted = (
            bool(complete)
            and not self._incomplete
            and all(self._unit_at[k] in complete or self._unit_at[k] == root for k in range(launched))
        )
        self._complete_units, self._incomplete = set(), False
        return self.trusted

    # ---- trusted -----------------------------------------------------------------------------
    def buckets_of(self, unit: int) -> list[Bucket]:
        return self._buckets_of.get(unit, [])

    def reached_param(self, unit: int) -> Optional[ShardedParam]:
        """A parameter of ``unit`` whose gradient this backward accumulated (so its node is in this
        backward's graph), for ``UnreachedParameters.seen_task``; None if none has one."""
        for bucket in self._buckets_of.get(unit, ()):
            for p in bucket.params:
                if p.param.grad is not None:
                    return p
        return None

    def find_late(self, launched: int) -> bool:
        """At the flush: whether a parameter of the first ``launched`` buckets (launched during
        backward, which took their ``.grad``) received a gradient since; their names go to ``late``."""
        tensors = self._tensors[: self._launched_before[launched]]
        with torch._C.DisableTorchFunctionSubclass():  # stage-3 parameters at rest: a plain attribute read
            grads = [t.grad for t in tensors]
        if grads.count(None) == len(grads):
            return False
        self.late = [p.name for p, g in zip(self._named, grads) if g is not None]
        return True

    def forget(self) -> None:
        """Back to learning (hooks registered again, or a late gradient found)."""
        self.trusted = False
        self._complete_units, self._incomplete = set(), False


def late_gradient_error(late: Sequence[str]) -> RuntimeError:
    """The error every rank raises once the ranks agreed that a gradient came late; ``late``: the
    parameters this rank found (empty: another rank found them)."""
    here = f"on this rank: {list(late[:5])}{' ...' if len(late) > 5 else ''}" if late else "on another rank"
    return RuntimeError(
        "A gradient reached a ZeRO-3 parameter after its bucket had been reduce-scattered in this backward"
        f" ({here}). lightning-zero reduces a unit's gradients when the unit's backward ends; a parameter that"
        " some module uses before its unit in the forward (a weight read by an earlier module) gets its"
        " gradient later, and past backwards did not show such a use. This step's gradients are incomplete, so"
        " no rank steps with them. The engine counts gradients per parameter again from the next backward."
        " HINT: give such a parameter to a unit that covers both uses (`unit_classes`, or leave it to the root"
        " unit), or keep the use the same in every step."
    )


def late_after_the_end(late: Sequence[str]) -> None:
    """Raise: gradients reached parameters after this backward's graph had run and every bucket was
    launched (a second ``backward()`` before ``finish_backward``), so no reduction is left to carry
    a vote; raised on the rank that found them."""
    raise RuntimeError(
        f"Parameters {list(late[:5])}{' ...' if len(late) > 5 else ''} received gradients after lightning-zero had"
        " reduced every bucket of this backward: a second `backward()` reached them before the engine's"
        " `finish_backward()`. lightning-zero reduces each gradient once per backward. HINT: call"
        " `finish_backward()` after each backward (the strategies do), or run one backward over the summed losses."
    )
