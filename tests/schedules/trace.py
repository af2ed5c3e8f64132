"""What one rank's recorded run issued, in issue order (see [Note: the schedule explorer]).

Every entry names the host thread that issued it. Device entries (``Kernel``, ``WaitStream``,
``RecordEvent``, ``WaitEvent``, ``Collective``, ``CollectiveWait``) run on a stream; host entries
(``HostOp``, ``HostWait``, ``Signal``, ``Await``, ``Release``, ``Mark``) on their thread. Memory is named by
``Range``: a buffer (one allocation, numbered as it is first seen) and a byte range of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

Range = tuple[int, int, int]
"""(buffer, first byte, end byte)."""


@dataclass(frozen=True)
class Kernel:
    thread: int
    stream: int
    name: str
    reads: tuple[Range, ...] = ()
    writes: tuple[Range, ...] = ()


@dataclass(frozen=True)
class HostOp:
    """Work the host thread does itself, at this point of its program (an op on host memory, a read of
    a device value it waited for)."""

    thread: int
    name: str
    reads: tuple[Range, ...] = ()
    writes: tuple[Range, ...] = ()


@dataclass(frozen=True)
class WaitStream:
    """``waiter``'s later work waits for everything queued on ``waited`` so far."""

    thread: int
    waiter: int
    waited: int


@dataclass(frozen=True)
class RecordEvent:
    thread: int
    stream: int
    event: int


@dataclass(frozen=True)
class WaitEvent:
    thread: int
    stream: int
    event: int


@dataclass(frozen=True)
class HostWait:
    """The host thread blocks until ``event`` ran, or (``event`` None) everything queued on ``stream``."""

    thread: int
    name: str
    stream: Optional[int] = None
    event: Optional[int] = None


@dataclass(frozen=True)
class Collective:
    """A collective kernel on ``group``'s stream of this rank (which waited for the issuing stream):
    the ``seq``-th on ``group``; it completes once every rank of ``ranks`` reached its own."""

    thread: int
    stream: int
    group: int
    seq: int
    kind: str
    ranks: tuple[int, ...]
    reads: tuple[Range, ...] = ()
    writes: tuple[Range, ...] = ()


@dataclass(frozen=True)
class CollectiveWait:
    """``stream``'s later work waits for collective ``(group, seq)`` (``work.wait()`` on NCCL)."""

    thread: int
    stream: int
    group: int
    seq: int


@dataclass(frozen=True)
class Signal:
    """A host-thread handoff: the thread set ``token`` (a job queued or done, an event set)."""

    thread: int
    token: int
    name: str


@dataclass(frozen=True)
class Await:
    """The thread went on only once ``token`` was signalled."""

    thread: int
    token: int
    name: str


@dataclass(frozen=True)
class KeepAlive:
    """``nbytes`` of memory the host may drop are kept until ``stream``'s work queued so far ran
    (``record_stream``); ``keep`` numbers it for its ``Release``."""

    thread: int
    stream: int
    keep: int
    nbytes: int


@dataclass(frozen=True)
class Release:
    """The host dropped kept-alive memory ``keep``: it is free once its stream ran what was queued
    there when it was kept."""

    thread: int
    keep: int


@dataclass(frozen=True)
class Mark:
    """The scenario's own marker (a step begins): replays count what they measure per phase."""

    thread: int
    name: str


Entry = Union[Kernel, HostOp, WaitStream, RecordEvent, WaitEvent, HostWait, Collective, CollectiveWait, Signal, Await, KeepAlive, Release, Mark]
DEVICE_ENTRIES = (Kernel, WaitStream, RecordEvent, WaitEvent, Collective, CollectiveWait)


@dataclass
class Trace:
    """One rank's recording: its entries, and the names of its threads, streams and buffers."""

    rank: int
    entries: list[Entry] = field(default_factory=list)
    threads: dict[int, str] = field(default_factory=dict)
    streams: dict[int, str] = field(default_factory=dict)
    buffers: dict[int, str] = field(default_factory=dict)
    """A buffer's description (shape and dtype of the tensor it was first seen as, host or device)."""

    def stream_of(self, entry: Entry) -> Optional[int]:
        """The stream a device entry runs on (None: a host entry)."""
        if isinstance(entry, WaitStream):
            return entry.waiter
        return getattr(entry, "stream", None) if isinstance(entry, DEVICE_ENTRIES) else None
