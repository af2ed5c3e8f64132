"""Stage 2 and 3: each bucket's reduce-scatter starts during backward, as soon as it and every bucket
before it are ready (see [Note: no waiting in backward] in ``grad_sync.py``), and at stage 3 a unit's
buckets are ready when the unit's backward ends (see [Note: readiness per unit] in
``unit_readiness.py``)."""

from __future__ import annotations

from collections import deque
from typing import Collection, Optional, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from lightning_zero.engine.buckets.bucket import Bucket, PendingGradientReduction, ReductionState
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.host_reads import HostReads
from lightning_zero.engine.comm.stop_vote import StopReason, StopVote
from lightning_zero.engine.gradients.grad_sync import MAX_IN_FLIGHT, GradientListener, GradientSync
from lightning_zero.engine.gradients.unit_readiness import UnitReadiness, late_after_the_end, late_gradient_error
from lightning_zero.engine.gradients.unreached import UnreachedParameters
from lightning_zero.engine.shards.sharded_param import ShardedParam


class ReduceDuringBackward(GradientSync):
    """Stage 2: a bucket's reduce-scatter starts (asynchronously, overlapping the rest of backward)
    as soon as it and every bucket before it have all their gradients, and its full gradients are
    released right then. Buckets still waiting when backward ends (unused parameters) are flushed.
    At most ``max_in_flight`` reductions are unfinished at once, which bounds the communication
    buffers to that many buckets: on NCCL a ready bucket is launched at once, the oldest finished on
    the reduce stream to make room; where waits block the host, once the oldest is done, never by
    waiting for it during backward (see [Note: no waiting in backward]).

    Every micro-batch is reduced, also those that only accumulate: that keeps gradient memory
    sharded (the choice ZeRO-2 and FSDP make), at the cost of one reduce-scatter per micro-batch.

    This class registers the one post-accumulate-grad hook per parameter; ``listener`` (stage 3's
    gather schedule) hears of the parameter from it before the bucket is told, while its
    ``awaiting`` is not empty. At stage 3 the listener also tells of each unit's end of backward,
    and once those are found to mark the buckets ready as exactly, they do and the hooks go (see
    [Note: readiness per unit] in ``unit_readiness.py``).
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        max_in_flight: int = MAX_IN_FLIGHT,
        listener: Optional[GradientListener] = None,
        votes: Optional[StopVote] = None,
    ) -> None:
        super().__init__(buckets, votes)
        self.max_in_flight = max_in_flight
        self._listener = listener
        self._bucket_of: dict[int, Bucket] = {id(p.param): bucket for bucket in self.buckets for p in bucket.params}
        self._handles: dict[int, RemovableHandle] = {}  # by `id` of the parameter
        self._next_to_launch = 0
        self._in_flight: list[PendingGradientReduction] = []  # launched in this backward
        self._unfinished: deque[PendingGradientReduction] = deque()
        self._full_bytes = [bucket.param_bytes for bucket in self.buckets]
        self._waiting_peak = 0  # the most bytes of full gradients ready buckets not yet launched held in this backward
        self._last_waiting_peak = 0
        self._found_no_room = False  # a ready bucket waits for a reduction in flight to be done
        self._unreached = UnreachedParameters([p for bucket in self.buckets for p in bucket.params])
        self.stream.max_lag = max_in_flight
        self._reached_checks: list[RemovableHandle] = []  # on the parameters marked unreached (`_mark_ready`)
        self._marking = 0  # backwards ended: a check left by an earlier one does nothing
        self._waits_block_host = bool(self.buckets) and _waits_block_host(self.buckets[0])
        """Whether finishing a reduction makes the host wait (see [Note: no waiting in backward])."""
        self._per_unit: Optional[UnitReadiness] = None
        if listener is not None and votes is not None and self.buckets:  # a late gradient is voted on
            self._per_unit = UnitReadiness(self.buckets, listener.root_unit)
            listener.unit_backward_ended = self._unit_backward_ended
        self._last_released = False  # trusted: the last bucket may launch (this backward's end came)
        self._end_queued = False  # trusted: `_at_backward_end` is queued on autograd's engine
        self.open()

    @property
    def waiting_peak_bytes(self) -> int:
        return self._last_waiting_peak

    @property
    def unpacked_peak_bytes(self) -> int:
        return self.stream.last_peak

    def open(self) -> None:
        """Register the hooks (at construction, and again when a module kept sharded after ``fit``
        trains again, or a late gradient was found; a no-op while they are registered). Stage 3 then
        learns again whether the unit ends can replace them (see [Note: readiness per unit])."""
        missing = [p for bucket in self.buckets for p in bucket.params if id(p.param) not in self._handles]
        for p in missing:
            self._handles[id(p.param)] = p.param.register_post_accumulate_grad_hook(self._hook_for(p))
        if missing and self._per_unit is not None:
            self._per_unit.forget()

    def _remove_hooks(self, keep: Collection[int] = ()) -> None:
        """Remove the hooks but those of the parameters whose ``id`` is in ``keep``."""
        for key in [key for key in self._handles if key not in keep]:
            self._handles.pop(key).remove()

    def _hook_for(self, param: ShardedParam):
        # runs once per parameter per backward: what it does for a parameter that does not complete
        # its bucket is one call (``mark_ready``)
        bucket, listener, unreached = self._bucket_of[id(param.param)], self._listener, self._unreached
        per_unit, graph_task = self._per_unit, torch._C._current_graph_task_id

        def on_grad_accumulated(_: object) -> None:
            if listener is not None and listener.awaiting:
                listener.grad_accumulated(param)
            became_ready = bucket.mark_ready(param)
            task = graph_task()
            # this backward's first gradient hook (or a nested backward's); trusting the unit ends, only
            # the root's hooks are left, and the first unit end marks (it can tell a nested backward)
            if task != unreached.task and (per_unit is None or not per_unit.trusted):
                became_ready = self._mark_ready(unreached.seen_task(task, param)) or became_ready
            self._after_marking(became_ready)

        return on_grad_accumulated

    def _after_marking(self, became_ready: bool) -> None:
        """After a gradient hook or a unit end marked what it could: launch what is ready, in order."""
        if became_ready or self._found_no_room:  # a bucket made ready, or one that found no room before
            self._launch_ready_buckets()
        elif self.finish_early and self._unfinished:  # gloo: one launched earlier may be done by now
            self._finish_done()
        if became_ready:  # only then can the bytes waiting grow
            self._note_waiting()

    def _unit_backward_ended(self, unit: int) -> None:
        """Stage 3: unit ``unit``'s backward is over. Trusted, its buckets are ready now (see [Note:
        readiness per unit] in ``unit_readiness.py``); learning, only noted."""
        per_unit = self._per_unit
        assert per_unit is not None
        if not per_unit.trusted:
            per_unit.note_end(unit)
            return
        task = torch._C._current_graph_task_id()
        became_ready = False
        if task != self._unreached.task:  # this backward's first unit end (or a nested backward's)
            became_ready = self._mark_ready(self._unreached.seen_task(task, per_unit.reached_param(unit)))
        for bucket in per_unit.buckets_of(unit):
            if bucket.state is ReductionState.COLLECTING:
                became_ready = bucket.mark_all_ready() or became_ready
        self._after_marking(became_ready)

    def _mark_ready(self, unreached: Sequence[ShardedParam]) -> bool:
        """Parameters this backward will not reach are ready now (see [Note: unreached parameters]
        in ``unreached.py``); True if that made a bucket ready. Each gets a gradient pre-hook for
        this backward, which runs only if autograd reaches it after all (``_reached_after_all``): a
        cost per parameter marked, none where none is."""
        if unreached:
            self._stop_checking()  # those a backward that raised left
        became_ready = False
        for p in unreached:
            bucket = self._bucket_of[id(p.param)]
            became_ready = bucket.mark_ready(p) or became_ready
            self._reached_checks.append(p.param.register_hook(self._reached_check(p, bucket)))
        return became_ready

    def _reached_check(self, param: ShardedParam, bucket: Bucket):
        marking = self._marking

        def reached(_: object) -> None:
            if marking == self._marking:  # this backward's (a backward that raised leaves them)
                self._reached_after_all(param, bucket)

        return reached

    def _reached_after_all(self, param: ShardedParam, bucket: Bucket) -> None:
        """``param`` was marked unreached in this backward and receives its gradient anyway (see
        [Note: accumulation nodes replaced] in ``unreached.py``). Before its bucket's launch the
        gradient goes to ``param.grad``, which the launch reads: exact, and the next backward only
        learns. After it, the bucket went without it: raise (before the gradient is accumulated)."""
        self._unreached.reached_after_all()
        if self.buckets.index(bucket) < self._next_to_launch:
            self._marking += 1  # this backward ends here: its checks do nothing from now on
            raise RuntimeError(
                f"Parameter {param.name!r} received a gradient after lightning-zero had reduced its bucket without"
                " it: at this backward's first gradient the engine found that the backward would not reach it"
                " (see [Note: unreached parameters] in engine/gradients/unreached.py). Two things mislead that"
                " finding: the parameter's gradient accumulator was replaced (its `.data` was assigned a tensor of"
                " another dtype or device, e.g. `model.to(torch.float64)` and back, between steps), or a nested"
                " backward (reentrant activation checkpointing, `checkpoint(..., use_reentrant=True)`, turned on"
                " after the first steps). The engine stops relying on it for the next backward, but this step's"
                " gradients are incomplete. HINT: assign `.data` only tensors of the parameter's own dtype and"
                " device (or change them before the engine is built), and use `use_reentrant=False` or"
                " checkpointing from the first step."
            )

    def _stop_checking(self) -> None:
        for handle in self._reached_checks:
            handle.remove()
        self._reached_checks.clear()

    def _launch_ready_buckets(self, flush: bool = False) -> None:
        """Launch the ready buckets in bucket order, each once there is room in flight; ``flush``
        (after backward): every bucket left, waiting for room. Trusting the unit ends, the last
        bucket waits for the backward's end (``_at_backward_end``, else the flush): it carries the
        late-gradient vote (see [Note: readiness per unit])."""
        self._found_no_room = False
        held = not (flush or self._last_released or self._per_unit is None or not self._per_unit.trusted)
        last = len(self.buckets) - held
        if held and self._next_to_launch == last and self.buckets[last].ready and not self._end_queued:
            self._queue_backward_end()
        while self._next_to_launch < last:
            bucket = self.buckets[self._next_to_launch]
            if not (flush or bucket.ready):
                return
            if not self._make_room(wait=flush or not self._waits_block_host):
                self._found_no_room = True  # polled again at the next gradient hook
                return
            # during a backward whose every rank launches every bucket, the reduce stream's lag is bounded
            self._in_flight.append(self._start(bucket, bounded=not flush and self._unreached.trusted))
            self._unfinished.append(self._in_flight[-1])
            self._next_to_launch += 1
            if self.finish_early:
                self._finish_done()

    def _finish_done(self) -> None:
        """Finish the oldest reductions for as long as that waits for nothing (``finish_early``)."""
        unfinished = self._unfinished
        while unfinished and (not self._waits_block_host or unfinished[0].done()):
            unfinished.popleft().finish()

    def _note_waiting(self) -> None:
        """Raise this backward's peak to the full gradients that ready buckets not yet launched hold now."""
        buckets, full_bytes = self.buckets, self._full_bytes
        waiting = sum([full_bytes[i] for i in range(self._next_to_launch, len(buckets)) if buckets[i].ready])
        self._waiting_peak = max(self._waiting_peak, waiting)

    def _make_room(self, wait: bool) -> bool:
        """While ``max_in_flight`` are unfinished, finish the oldest if it is done (with ``wait``:
        waiting for it, which on NCCL is the reduce stream's wait); True once fewer are unfinished.
        Finishing only for room keeps the buffers lent per step the same whatever the peers' timing
        (the pool allocates in the first step only)."""
        unfinished = self._unfinished
        while len(unfinished) >= self.max_in_flight and (wait or unfinished[0].done()):
            unfinished.popleft().finish()
        return len(unfinished) < self.max_in_flight

    def finish_backward(self, sync: bool, reads: HostReads) -> None:
        self._unreached.backward_ended()
        self._marking += 1
        self._stop_checking()
        self._settle_unit_readiness()
        self._launch_ready_buckets(flush=True)
        while self._unfinished:
            self._unfinished.popleft().finish()
        self._hand_out(self._in_flight, reads)
        self._in_flight.clear()
        self._next_to_launch = 0
        self._last_released = self._end_queued = False
        self._last_waiting_peak, self._waiting_peak = self._waiting_peak, 0

    def _queue_backward_end(self) -> None:
        """Trusted, the last bucket ready (its root parameters' hooks, or its unit's end): launch it
        when this backward's graph has run, with the late-gradient check before it (see [Note:
        readiness per unit]), where this runs in the backward's own graph task (not a nested one, whose end is not the backward's)."""
        if torch._C._current_graph_task_id() == self._unreached.task and not self._unreached.nested:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._at_backward_end)

    def _at_backward_end(self) -> None:
        """Autograd ran this backward's graph: no gradient is still to come, so the check for late
        ones is final; its vote rides on the last bucket, launched now."""
        assert self._per_unit is not None and self.votes is not None  # the engine gives both at stage 3
        if self._per_unit.find_late(self._next_to_launch):
            self.votes.request(StopReason.LATE_GRADIENT)
        self._last_released = True
        self._launch_ready_buckets()

    def _settle_unit_readiness(self) -> None:
        """Stage 3, at the flush: learning, whether the unit ends are trusted from the next backward
        on (the hooks then go, but the root unit's: its buckets come last and launch as their
        gradients arrive); trusted, whether a gradient came after its bucket's launch, which the
        flushed buckets carry as every rank's vote (see [Note: readiness per unit])."""
        per_unit = self._per_unit
        if per_unit is None:
            return
        if per_unit.trusted:
            if not per_unit.late and per_unit.find_late(self._next_to_launch):  # else found at the backward's end
                if self._next_to_launch == len(self.buckets):
                    late_after_the_end(per_unit.late)  # nothing left to carry a vote
                self.votes.request(StopReason.LATE_GRADIENT)
        elif len(self._handles) == per_unit.params and per_unit.learn(self._next_to_launch):
            self._remove_hooks(keep=per_unit.root_params)

    def late_gradients_agreed(self) -> None:
        """Every rank learned that some rank found a gradient after its bucket's launch (see [Note:
        readiness per unit]): raise the same error everywhere, and learn again from the next backward."""
        assert self._per_unit is not None and self.votes is not None  # only a trusted stage 3 votes so
        self.votes.withdraw(StopReason.LATE_GRADIENT)
        late, self._per_unit.late = self._per_unit.late, []
        self.open()
        raise late_gradient_error(late)

    def close(self) -> None:
        self._remove_hooks()
        self._stop_checking()


def _waits_block_host(bucket: Bucket) -> bool:
    """Whether finishing ``bucket``'s reduction (its reduce-scatter, with hybrid sharding also the
    all-reduce across the replicas) makes the host wait; the same for every bucket of an engine."""
    groups = [bucket.group] + ([bucket.replicate_group] if bucket.replicate_group is not None else [])
    return any(collectives.waits_block_host(group, bucket.device) for group in groups)
