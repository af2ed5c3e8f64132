"""The host step's threads one at a time, switched at the handoff points by a seeded random (see
[Note: handoffs] in ``engine/offload/handoffs.py``).

One thread holds the baton; at each point it hands it to a thread picked from those that can go on
(a thread at a point, a worker with a job queued, a thread whose awaited event is set or job done).
The same seed gives the same interleaving; each seed one of the orders the real threads could run
in at handoff granularity. A handoff that depends on something no thread can do is a host deadlock,
raised here. Where a simulated device records, every handoff is written into its trace
(``Signal``/``Await``), so that the replays order the threads' work as the handoffs do.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future
from typing import Callable, Optional

from schedules.simulated_device import SimulatedDevice

RUNNING, READY, IDLE, WAITING = "running", "ready", "idle", "waiting"


class HostThreadsDeadlock(RuntimeError):
    """Every host thread waits for one of the others."""


class SeededThreads:
    """A ``handoffs.HandoffScheduler`` choosing with ``random.Random(seed)``; ``device`` (optional)
    gets the handoffs for its trace. Made on the thread that runs the engine (the training thread)."""

    def __init__(self, seed: int, device: Optional[SimulatedDevice] = None) -> None:
        self.seed = seed
        self._random = random.Random(seed)
        self._device = device
        self._changed = threading.Condition()
        self._holder = threading.get_ident()
        self._state: dict[int, str] = {self._holder: RUNNING}
        self._ready: dict[int, Callable[[], bool]] = {}
        self._jobs: dict[int, int] = {}  # worker thread -> jobs queued and not started
        self._threads: dict[int, int] = {}  # id(worker) -> its thread
        self.switches = 0
        """How many times the baton went to another thread."""
        self._released = False

    # ---- HandoffScheduler ----------------------------------------------------------------------
    def adopt_thread(self, worker: object) -> None:
        me = threading.get_ident()
        with self._changed:
            self._threads[id(worker)] = me
            self._state[me] = IDLE
            self._jobs[me] = 0

    def submitted(self, worker: object, job: Future) -> None:
        with self._changed:
            thread = self._threads[id(worker)]
            self._jobs[thread] += 1
            if self._state[thread] == IDLE:
                self._state[thread] = READY
        self._handoff(True, ("start", job), "job queued")
        self.point("job queued")

    def job_started(self, job: Future) -> None:
        me = threading.get_ident()
        self._wait_for_baton(me)
        with self._changed:
            self._jobs[me] -= 1
        self._handoff(False, ("start", job), "job started")

    def job_finished(self, job: Future) -> None:
        me = threading.get_ident()
        self._handoff(True, ("done", job), "job done")
        with self._changed:
            self._state[me] = READY if self._jobs[me] else IDLE
            self._pass_baton(me)

    def signalled(self, token: object) -> None:
        self._handoff(True, ("event", token), "event set")

    def point(self, name: str) -> None:
        me = threading.get_ident()
        with self._changed:
            if self._released or self._holder != me:
                return
            self._state[me] = READY
            self._pass_baton(me)
        self._wait_for_baton(me)

    def wait_until(self, ready: Callable[[], bool], name: str, token: object) -> None:
        me = threading.get_ident()
        while not ready():
            with self._changed:
                if self._released:
                    break
                self._state[me] = WAITING
                self._ready[me] = ready
                self._pass_baton(me)
            self._wait_for_baton(me)
        kind = "done" if isinstance(token, Future) else "event"
        self._handoff(False, (kind, token), name)

    # ---- the baton ---------------------------------------------------------------------------------
    def _runnable(self) -> list[int]:
        runnable = []
        for thread, state in self._state.items():
            if state == READY or (state == WAITING and self._ready[thread]()):
                runnable.append(thread)
        return runnable

    def _pass_baton(self, me: int) -> None:
        """(Holding the lock, as the holder.) Give the baton to a thread picked among the runnable."""
        runnable = sorted(self._runnable())  # sorted: the choice depends on the seed only
        if not runnable:
            waiting = {t: s for t, s in self._state.items() if s != IDLE}
            raise HostThreadsDeadlock(f"no host thread can go on (seed {self.seed}): {waiting}")
        chosen = self._random.choice(runnable)
        if chosen != me:
            self.switches += 1
        self._holder = chosen
        self._state[chosen] = RUNNING
        self._changed.notify_all()

    def _wait_for_baton(self, me: int) -> None:
        with self._changed:
            while not self._released and self._holder != me:
                self._changed.wait(timeout=1.0)

    def _handoff(self, signal: bool, token: tuple, name: str) -> None:
        if self._device is not None:
            kind, what = token
            self._device.handoff(signal, (kind, id(what)), name)

    def release(self) -> None:
        """Let every thread run freely from now on (the scenario ended)."""
        with self._changed:
            self._released = True
            self._changed.notify_all()
