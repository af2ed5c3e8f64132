"""Where the host step's worker thread and the training thread hand work to each other.

[Note: handoffs]
The host step during backward (``step_ahead.py``) runs on a worker thread (:class:`WorkerThread`)
beside the thread that runs backward. They share host memory (a bucket's landed row, its master
chunks and optimizer state) and meet only at a few points: a bucket's step is queued (``submit``),
the worker starts and ends a job, a bucket joins a job queued already (``hand_over``, ``take_over``),
the worker has handed a row's gradients out (``signal`` of the
job's ``accepted`` event, which the training thread may ``wait_for``), the verdict waits for every
job (``join``), and a rollback restores what a job stepped (``point``).
Everything here is plain ``threading`` in production.

Tests install a scheduler (``scheduled``; ``tests/schedules/host_threads.py``) that lets one
thread run at a time and, at each of these points, picks with a seeded random which thread goes on,
so every interleaving of the worker with the training thread at handoff granularity can be produced,
and reproduced by its seed. Whatever the worker and the training thread share must be handed over at
one of these points; what is not would race, and the schedule tests are where that shows.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Optional, Protocol

import torch

from lightning_zero.engine import device_roles
from lightning_zero.engine.comm import streams


class HandoffScheduler(Protocol):
    """What a test installs to run the threads one at a time (see [Note: handoffs])."""

    def adopt_thread(self, worker: object) -> None:
        """The calling thread (``worker``'s) runs only when the scheduler says so from now on."""

    def point(self, name: str) -> None:
        """The calling thread may be switched out here."""

    def submitted(self, worker: object, job: Future) -> None:
        """``job`` was queued for ``worker``: its thread becomes runnable."""

    def job_started(self, job: Future) -> None:
        """On a worker's thread, before ``job`` runs: wait until scheduled."""

    def job_finished(self, job: Future) -> None:
        """On a worker's thread, after ``job`` (done): let the others run while it waits for the next."""

    def signalled(self, token: object) -> None:
        """The calling thread set ``token`` (an event a thread may wait for)."""

    def wait_until(self, ready: Callable[[], bool], name: str, token: object) -> None:
        """Block the calling thread until ``ready()`` (``token`` signalled, or a job done), letting the
        others run meanwhile."""


_SCHEDULER: Optional[HandoffScheduler] = None


class WorkerThread:
    """One thread running ``name``'s jobs in the order they are submitted. Its thread computes on
    the device of the thread that made it (a CUDA thread otherwise starts on GPU 0, creating a
    context there from every rank) and joins a simulated device or scheduler where a test installed
    one (see [Note: handoffs])."""

    def __init__(self, name: str) -> None:
        device = current_cuda_device()
        self._scheduler = _SCHEDULER
        adopted = threading.Event()

        def start_thread() -> None:
            if device is not None:
                torch.cuda.set_device(device)
            device_roles.join_tracking()
            streams.thread_started()
            if self._scheduler is not None:
                self._scheduler.adopt_thread(self)
            adopted.set()

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=start_thread)
        self._last: Optional[Future] = None
        if self._scheduler is not None:  # the thread starts now: the schedule must not depend on when it does
            self._pool.submit(lambda: None)
            adopted.wait()

    def submit(self, job: Callable[..., None], *args: object) -> Future:
        """Queue ``job(*args)``; its future says when it ran and what it raised (set by the job's
        thread before it lets the others run, so a scheduler sees it done at its next point)."""
        return self.submit_as(Future(), job, *args)

    def submit_as(self, future: Future, job: Callable[..., None], *args: object) -> Future:
        """``submit``, with ``future`` made beforehand (a caller that hands it out before queueing)."""
        self._last = future
        self._pool.submit(self._run, future, job, *args)
        if self._scheduler is not None:
            self._scheduler.submitted(self, future)
        return future

    def _run(self, future: Future, job: Callable[..., None], *args: object) -> None:
        if self._scheduler is not None:
            self._scheduler.job_started(future)
        try:
            job(*args)
        except BaseException as error:  # noqa: BLE001 - handed to whoever joins the job
            future.set_exception(error)
        else:
            future.set_result(None)
        finally:
            if self._scheduler is not None:
                self._scheduler.job_finished(future)

    def shutdown(self) -> None:
        """Wait for the jobs queued and end the thread."""
        last = self._last
        if self._scheduler is not None and last is not None:  # jobs run in order: the last one done, all are
            self._scheduler.wait_until(last.done, "shutdown", last)
        self._pool.shutdown(wait=True)


def current_cuda_device() -> Optional[int]:
    """The calling thread's CUDA device where this process uses CUDA (None otherwise: asking would
    initialize CUDA). A worker sets it first thing, as the async checkpoint writer does: a new
    thread's current device is 0 whatever the rank's, and a CUDA call there would make a context on
    GPU 0 from every rank (review N10)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def point(name: str) -> None:
    """A handoff point (see [Note: handoffs]); nothing in production."""
    if _SCHEDULER is not None:
        _SCHEDULER.point(name)


def signal(event: threading.Event, name: str) -> None:
    """Set ``event`` for a thread that waits for it (``wait_for``)."""
    event.set()
    if _SCHEDULER is not None:
        _SCHEDULER.signalled(event)
        _SCHEDULER.point(name)


def wait_for(event: threading.Event, name: str) -> None:
    """Block until ``event`` is set (by ``signal`` on another thread)."""
    if _SCHEDULER is not None:
        _SCHEDULER.wait_until(event.is_set, name, event)
    event.wait()


def hand_over(token: object, name: str) -> None:
    """The calling thread hands ``token`` to a job queued already (under a lock of the caller's, not at
    a handoff): nothing in production; a recorded trace orders it before ``take_over``."""
    if _SCHEDULER is not None:
        _SCHEDULER.signalled(token)


def take_over(token: object, name: str) -> None:
    """The worker takes what ``hand_over`` handed it (the two threads met under the caller's lock)."""
    if _SCHEDULER is not None:
        _SCHEDULER.wait_until(_always, name, token)


def _always() -> bool:
    return True


def join(future: Future, name: str) -> Optional[BaseException]:
    """Block until ``future``'s job ran (a ``WorkerThread``'s); the error it raised, if any."""
    if _SCHEDULER is not None:
        _SCHEDULER.wait_until(future.done, name, future)
    return future.exception()


@contextlib.contextmanager
def scheduled(scheduler: HandoffScheduler) -> Iterator[None]:
    """Tests: run the host step's threads under ``scheduler`` while open (see [Note: handoffs])."""
    global _SCHEDULER
    if _SCHEDULER is not None:
        raise RuntimeError("a handoff scheduler is installed already")
    _SCHEDULER = scheduler
    try:
        yield
    finally:
        _SCHEDULER = None
