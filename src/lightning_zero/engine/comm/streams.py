"""The one place the engine touches a device's streams and events.

[Note: the stream layer]
On a GPU the host only queues work; the device runs it later, each stream in its order, and streams
are ordered against one another only where the engine says so. Every such word the engine says goes
through a :class:`DeviceStreams`:

- ``wait_stream`` / ``record_event`` / ``wait_event``: one stream's later work waits for another's
  work queued so far (or up to an event);
- ``host_waits``: the host thread blocks until an event or a stream is done;
- ``keep_alive``: a tensor the host drops stays allocated until a stream's queued work ran
  (``record_stream``);
- ``use``: the stream that work issued in the body goes to;
- ``collective``: where a collective runs. On CUDA, ProcessGroupNCCL places it itself (its own stream,
  which waits for the current one at issue; ``wait()`` makes the current stream wait for it), so this
  is torch's call as it is.

Three implementations: :class:`CudaStreams` on a CUDA device; none at all on the CPU (``streams_of``
returns None and callers run their copies and reductions where they are called, synchronously); and
in tests a simulated device installed with :func:`simulating` (``tests/schedules/``), which records
every stream operation, kernel and collective of a CPU run and replays them in every order the
declared waits allow, so that a missing wait, a deadlock between ranks or a buffer reused too early
fails on a CPU (the ``schedules`` tests). Nothing in the engine may call ``torch.cuda``'s stream or
event API, ``record_stream`` or ``synchronize`` directly: what bypasses this layer is invisible to
those tests.
"""

from __future__ import annotations

import functools

import abc
import contextlib
from typing import Any, Callable, Hashable, Iterator, Optional, Protocol, Union

import torch
from torch import Tensor

Stream = Any
"""A stream of the device (``torch.cuda.Stream`` on CUDA)."""
Event = Any
"""A point in a stream's work (``torch.cuda.Event`` on CUDA); None where work is synchronous."""


class DeviceStreams(abc.ABC):
    """A device's streams and events, as the engine uses them (see [Note: the stream layer])."""

    pins_host_memory: bool = False
    """Whether host buffers that copies read or fill are page-locked (what makes a copy asynchronous)."""

    @abc.abstractmethod
    def new_stream(self, role: str) -> Stream:
        """A new stream, named by its ``role`` ("reduce", "to_host", ...) for reports."""

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The stream the calling thread issues work to now."""

    @abc.abstractmethod
    def use(self, stream: Stream) -> contextlib.AbstractContextManager:
        """A context in which the calling thread issues its work to ``stream``."""

    @abc.abstractmethod
    def wait_stream(self, waiter: Stream, waited: Stream) -> None:
        """Work queued on ``waiter`` from now on waits for everything queued on ``waited`` so far."""

    @abc.abstractmethod
    def record_event(self, stream: Stream, blocking: bool = False) -> Event:
        """An event marking the work queued on ``stream`` so far. ``blocking``: a host thread waiting
        for it sleeps instead of spinning (for the waits of a thread that has nothing else to do)."""

    @abc.abstractmethod
    def wait_event(self, stream: Stream, event: Event) -> None:
        """Work queued on ``stream`` from now on waits for ``event``."""

    @abc.abstractmethod
    def host_waits(self, what: Union[Event, Stream]) -> None:
        """The calling host thread blocks until ``what`` (an event, or all of a stream's queued work) is done."""

    @abc.abstractmethod
    def is_done(self, event: Event) -> bool:
        """Whether ``event``'s work has run; never blocks."""

    @abc.abstractmethod
    def keep_alive(self, tensor: Tensor, stream: Stream) -> None:
        """``tensor``'s memory is not handed out again before the work queued on ``stream`` so far ran,
        however soon the host drops it."""

    @abc.abstractmethod
    def stream_key(self, stream: Stream) -> Hashable:
        """A key telling streams apart (free lists per stream)."""


class CudaStreams(DeviceStreams):
    """``torch.cuda``'s streams and events on one device."""

    pins_host_memory = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self, role: str) -> Stream:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> Stream:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter: Stream, waited: Stream) -> None:
        waiter.wait_stream(waited)

    def record_event(self, stream: Stream, blocking: bool = False) -> Event:
        event = torch.cuda.Event(blocking=blocking)
        event.record(stream)
        return event

    def wait_event(self, stream: Stream, event: Event) -> None:
        stream.wait_event(event)

    def host_waits(self, what: Union[Event, Stream]) -> None:
        what.synchronize()

    def is_done(self, event: Event) -> bool:
        return event.query()

    def keep_alive(self, tensor: Tensor, stream: Stream) -> None:
        tensor.record_stream(stream)

    def stream_key(self, stream: Stream) -> Hashable:
        return stream.device, stream.stream_id  # "cuda" and "cuda:0" alike: the stream names its device


class Simulation(Protocol):
    """A simulated device for the tests (see [Note: the stream layer]): its streams, where its
    collectives run, and what each new host thread of the engine joins."""

    nccl_semantics: bool
    """Whether collectives keep NCCL's contract (a wait orders streams and never blocks the host),
    so that the engine takes the path it takes on NCCL."""

    def streams_of(self, device: torch.device) -> Optional[DeviceStreams]: ...

    def collective(self, kind: str, group: Any, reads: tuple[Tensor, ...], writes: tuple[Tensor, ...], issue: Callable[[], Any]) -> Any: ...

    def thread_started(self) -> None: ...


_CUDA: dict[torch.device, CudaStreams] = {}
_SIMULATION: Optional[Simulation] = None


def streams_of(device: Union[torch.device, str]) -> Optional[DeviceStreams]:
    """The streams of ``device`` (None where work runs synchronously: the CPU), or the simulated
    device's while one is installed (``simulating``)."""
    device = torch.device(device)
    if _SIMULATION is not None:
        return _SIMULATION.streams_of(device)
    if device.type != "cuda":
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    streams = _CUDA.get(device)
    if streams is None:
        streams = _CUDA[device] = CudaStreams(device)
    return streams


def issue_collective(
    kind: str, group: Any, reads: tuple[Tensor, ...], writes: tuple[Tensor, ...], issue: Callable[..., Any], *args: Any
) -> Any:
    """Issue a collective over ``group`` that reads ``reads`` and fills ``writes`` on behalf of the
    current stream: ``issue(*args)`` is torch's call, and what it returns (a work whose ``wait()`` makes the
    current stream wait for it, or a value) is returned. On CUDA, ProcessGroupNCCL places the kernel on
    its own stream, which waits for the current one at issue; a simulated device records that."""
    if _SIMULATION is not None:
        return _SIMULATION.collective(kind, group, reads, writes, functools.partial(issue, *args))
    return issue(*args)


def waits_order_streams() -> bool:
    """Whether a simulated device with NCCL's contract is installed (see ``Simulation.nccl_semantics``)."""
    return _SIMULATION is not None and _SIMULATION.nccl_semantics


def thread_started() -> None:
    """A thread of the engine's (the host step's worker) starts: it joins a simulated device, if any."""
    if _SIMULATION is not None:
        _SIMULATION.thread_started()


@contextlib.contextmanager
def simulating(simulation: Simulation) -> Iterator[None]:
    """Tests: while open, ``simulation`` serves every device's streams and every collective (see
    [Note: the stream layer])."""
    global _SIMULATION
    if _SIMULATION is not None:
        raise RuntimeError("a simulated device is installed already")
    _SIMULATION = simulation
    try:
        yield
    finally:
        _SIMULATION = None
