"""Replays: the ranks' recordings run together as devices and host threads would run them, in an order
a policy picks among those the declared waits allow (see [Note: the schedule explorer]).

Every host thread and every stream of every rank is a queue. A device entry is queued on its stream
and may run once the host thread that issued it got there; a stream's head waits for what its entry
declares (an event, another stream's work queued before a ``wait_stream``, a collective); a host
thread's head waits for what it waits for (``HostWait``, a handoff's signal). A collective runs once
every rank's kernel of it reached the head of its stream, and then completes on all of them. At each
step the policy picks one of the queues whose head can run (or one collective all ranks reached).

Checked as the replay goes:

- **deadlock**: nothing can run and something is left: the cycle of waits (each queue waits for
  the next one's head), as rank, queue and entry;
- **read before its producer**: an entry reads bytes that an entry issued before it (on the same
  rank) writes, and that write has not run yet;
- **reuse before the last reader**: an entry writes bytes that an entry issued before it reads or
  writes, and that one has not run yet;
- **kept-alive memory**: bytes the host dropped while a stream still had to run work queued before
  (``KeepAlive`` / ``Release``), the most at once per rank and stream role.

A replay with ``races=True`` also checks every order at once: each entry gets a vector clock (what
it is ordered after, queue by queue, through the waits and collectives), and two entries touching
the same bytes, one writing, issued in one order but not ordered by the waits, are reported whether
or not this replay ran them the wrong way round ("may ..."). So a missing wait fails whatever the
policy, and the policies show the orders.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from schedules.policies import Policy
from schedules.trace import (
    Await, Collective, CollectiveWait, Entry, HostWait, KeepAlive, Mark, RecordEvent, Release, Signal, Trace, WaitEvent, WaitStream,
)  # fmt: skip

QueueKey = tuple[int, str, int]
"""(rank, "thread" or "stream", number)."""


@dataclass(eq=False)
class Node:
    rank: int
    queue: QueueKey
    position: int
    """Its place in its queue, from 1."""
    order: int
    """Its entry's place in the rank's recording (issue order); -1: a launch marker."""
    entry: Optional[Entry]
    deps: list["Node"] = field(default_factory=list)
    done: bool = False
    collective: Optional[tuple[int, int]] = None
    released: Optional[tuple["Node", int]] = None
    """A ``Release``: the node that frees the memory once run, and its bytes."""

    def describe(self, traces: Sequence[Trace]) -> str:
        if self.entry is None:
            return "(launch)"
        entry, trace = self.entry, traces[self.rank]
        what = type(entry).__name__
        detail = getattr(entry, "name", None) or getattr(entry, "kind", None) or ""
        if isinstance(entry, WaitStream):
            detail = f"waits for {trace.streams[entry.waited]}"
        elif isinstance(entry, (WaitEvent, RecordEvent)):
            detail = f"event {entry.event}"
        elif isinstance(entry, Collective):
            detail = f"{entry.kind} #{entry.seq} on group {entry.group}"
        elif isinstance(entry, CollectiveWait):
            detail = f"group {entry.group} #{entry.seq}"
        elif isinstance(entry, HostWait) and entry.stream is not None:
            detail = f"{entry.name} ({trace.streams[entry.stream]})"
        return f"{what} {detail} [entry {self.order}]".replace("  ", " ")


@dataclass(frozen=True)
class Hazard:
    kind: str
    """"read before its producer", "reuse before the last reader" or "write before an earlier write"."""
    rank: int
    buffer: str
    earlier: str
    """The entry that should have run first (queue: entry)."""
    later: str


@dataclass
class Outcome:
    """What one replay found."""

    policy: str
    steps: int
    deadlock: Optional[list[str]] = None
    """The cycle of waits, one line per queue, where nothing could run."""
    hazards: list[Hazard] = field(default_factory=list)
    kept_alive_peak: dict[tuple[int, str], int] = field(default_factory=dict)
    """The most bytes the host had dropped while a stream still held them, by (rank, stream role)."""
    kept_alive_by_phase: dict[tuple[int, str, int], int] = field(default_factory=dict)
    """The same by (rank, stream role, phase): the number of ``Mark`` s the rank had passed when
    the bytes were dropped."""
    mismatches: list[str] = field(default_factory=list)
    """Collectives the ranks issued differently at the same place of a group (kind or ranks)."""

    @property
    def clean(self) -> bool:
        return self.deadlock is None and not self.hazards and not self.mismatches

    def summary(self) -> str:
        lines = [f"policy {self.policy}: {self.steps} steps"]
        if self.mismatches:
            lines += ["collectives that differ between ranks:", *self.mismatches]
        if self.deadlock:
            lines += ["deadlock, each waiting for the next:", *self.deadlock]
        for hazard in self.hazards[:10]:
            order = "is not ordered after" if hazard.kind.startswith("may") else "ran before"
            lines.append(f"{hazard.kind} on rank {hazard.rank}, {hazard.buffer}: {hazard.later} {order} {hazard.earlier}")
        if len(self.hazards) > 10:
            lines.append(f"... {len(self.hazards) - 10} more hazards")
        return "\n".join(lines)


class _Access:
    __slots__ = ("node", "order", "start", "end", "writes")

    def __init__(self, node: Node, order: int, start: int, end: int, writes: bool) -> None:
        self.node, self.order, self.start, self.end, self.writes = node, order, start, end, writes


class Replay:
    """The ranks' ``traces`` built into queues, ready to run once (``run``)."""

    def __init__(self, traces: Sequence[Trace]) -> None:
        self.traces = list(traces)
        self.queues: dict[QueueKey, list[Node]] = {}
        self.heads: dict[QueueKey, int] = {}
        self._collectives: dict[tuple[int, int], dict[int, Node]] = defaultdict(dict)
        self._accesses: dict[tuple[int, int], list[_Access]] = defaultdict(list)  # (rank, buffer) -> not yet run
        self._node_accesses: dict[int, list[tuple[tuple[int, int], _Access]]] = defaultdict(list)
        self._kept: dict[tuple[int, int], tuple[int, int]] = {}  # (rank, keep) -> (stream, bytes)
        self._queue_index: dict[QueueKey, int] = {}
        self._all_accesses: dict[tuple[int, int], list[_Access]] = defaultdict(list)  # (rank, buffer) -> every access
        self._clocks: dict[int, list[int]] = {}  # id(node) -> its vector clock, once run
        self.mismatches: list[str] = []
        for trace in self.traces:
            self._build(trace)
        self._check_collectives()

    # ---- building ---------------------------------------------------------------------------------
    def _queue(self, key: QueueKey) -> list[Node]:
        if key not in self.queues:
            self.queues[key] = []
            self.heads[key] = 0
            self._queue_index[key] = len(self._queue_index)
        return self.queues[key]

    def _node(self, rank: int, key: QueueKey, order: int, entry: Optional[Entry], deps: Optional[list] = None) -> Node:
        return Node(rank, key, len(self._queue(key)) + 1, order, entry, deps or [])

    def _build(self, trace: Trace) -> None:
        rank = trace.rank
        tails: dict[int, Node] = {}  # stream -> its last node so far
        events: dict[int, Node] = {}
        signals: dict[int, Node] = {}
        for order, entry in enumerate(trace.entries):
            thread_key = (rank, "thread", entry.thread)
            stream = trace.stream_of(entry)
            if stream is None:
                node = self._node(rank, thread_key, order, entry)
                if isinstance(entry, HostWait):
                    waited = events.get(entry.event) if entry.event is not None else tails.get(entry.stream)
                    node.deps += [waited] if waited is not None else []
                elif isinstance(entry, Await) and entry.token in signals:
                    node.deps.append(signals[entry.token])
                elif isinstance(entry, Signal):
                    signals[entry.token] = node
                elif isinstance(entry, KeepAlive):
                    self._kept[(rank, entry.keep)] = (entry.stream, entry.nbytes)
                elif isinstance(entry, Release) and (rank, entry.keep) in self._kept:
                    kept_on, nbytes = self._kept[(rank, entry.keep)]
                    if kept_on in tails:
                        node.released = (tails[kept_on], nbytes)
                self._queue(thread_key).append(node)
                self._note_accesses(node)
                continue
            launch = self._node(rank, thread_key, -1, None)
            self._queue(thread_key).append(launch)
            stream_key = (rank, "stream", stream)
            node = self._node(rank, stream_key, order, entry, deps=[launch])
            if isinstance(entry, WaitStream) and entry.waited in tails:
                node.deps.append(tails[entry.waited])
            elif isinstance(entry, RecordEvent):
                events[entry.event] = node
            elif isinstance(entry, WaitEvent) and entry.event in events:
                node.deps.append(events[entry.event])
            elif isinstance(entry, Collective):
                node.collective = (entry.group, entry.seq)
                self._collectives[node.collective][rank] = node
            elif isinstance(entry, CollectiveWait):
                member = self._collectives.get((entry.group, entry.seq), {}).get(rank)
                if member is not None:
                    node.deps.append(member)
            self._queue(stream_key).append(node)
            tails[stream] = node
            self._note_accesses(node)

    def _note_accesses(self, node: Node) -> None:
        entry = node.entry
        for ranges, writes in ((getattr(entry, "reads", ()), False), (getattr(entry, "writes", ()), True)):
            for buffer, start, end in ranges:
                access = _Access(node, node.order, start, end, writes)
                key = (node.rank, buffer)
                self._accesses[key].append(access)
                self._all_accesses[key].append(access)
                self._node_accesses[id(node)].append((key, access))

    def _check_collectives(self) -> None:
        for (group, seq), members in self._collectives.items():
            entries = {rank: node.entry for rank, node in members.items()}
            first = next(iter(entries.values()))
            ranks = set(first.ranks)
            if set(entries) != ranks:
                self.mismatches.append(
                    f"group {group} #{seq}: {first.kind} over ranks {sorted(ranks)} issued by ranks {sorted(entries)} only"
                )
            for rank, entry in entries.items():
                if (entry.kind, entry.ranks) != (first.kind, first.ranks):
                    self.mismatches.append(f"group {group} #{seq}: rank {rank} issued {entry.kind}, another {first.kind}")

    # ---- running --------------------------------------------------------------------------------
    def head(self, key: QueueKey) -> Optional[Node]:
        index = self.heads[key]
        queue = self.queues[key]
        return queue[index] if index < len(queue) else None

    def _ready(self, node: Node) -> bool:
        return all(dep.done for dep in node.deps)

    def runnable(self) -> list[tuple[str, object]]:
        """What can run now: ("queue", key) or ("collective", (group, seq)) (all its ranks reached it)."""
        actions: list[tuple[str, object]] = []
        arrived: dict[tuple[int, int], int] = defaultdict(int)
        for key in self.queues:
            node = self.head(key)
            if node is None or not self._ready(node):
                continue
            if node.collective is None:
                actions.append(("queue", key))
            else:
                arrived[node.collective] += 1
        for collective, count in arrived.items():
            if count == len(self._collectives[collective]) and not self._mismatched(collective):
                actions.append(("collective", collective))
        return actions

    def _mismatched(self, collective: tuple[int, int]) -> bool:
        members = self._collectives[collective]
        first = next(iter(members.values())).entry
        return set(members) != set(first.ranks)

    def run(self, policy: Policy, races: bool = False) -> Outcome:
        """Run every queue to its end (or a deadlock) in the order ``policy`` picks; with ``races``,
        also report the accesses the waits leave unordered, in any order (see the module's docstring)."""
        outcome = Outcome(policy.name, 0, mismatches=list(self.mismatches))
        live: dict[tuple[int, str], int] = defaultdict(int)
        freeing: list[tuple[Node, int, tuple[int, str]]] = []
        phase: dict[int, int] = defaultdict(int)
        while True:
            actions = self.runnable()
            if not actions:
                break
            kind, what = policy.choose(actions, self)
            nodes = list(self._collectives[what].values()) if kind == "collective" else [self.head(what)]
            if races:
                self._clock(nodes)
            for node in nodes:
                if races:
                    self._unordered(node, outcome)
                self._run(node, outcome)
                if isinstance(node.entry, Mark):
                    phase[node.rank] += 1
                if node.released is not None:
                    frees_at, nbytes = node.released
                    if not frees_at.done:
                        trace = self.traces[node.rank]
                        role = (node.rank, trace.streams[trace.stream_of(frees_at.entry)])
                        live[role] += nbytes
                        outcome.kept_alive_peak[role] = max(outcome.kept_alive_peak.get(role, 0), live[role])
                        by_phase = (*role, phase[node.rank])
                        outcome.kept_alive_by_phase[by_phase] = max(outcome.kept_alive_by_phase.get(by_phase, 0), live[role])
                        freeing.append((frees_at, nbytes, role))
            if freeing:
                still = []
                for frees_at, nbytes, role in freeing:
                    if frees_at.done:
                        live[role] -= nbytes
                    else:
                        still.append((frees_at, nbytes, role))
                freeing = still
            outcome.steps += 1
        if any(self.head(key) is not None for key in self.queues):
            outcome.deadlock = self._cycle()
        return outcome

    def _run(self, node: Node, outcome: Outcome) -> None:
        for key, access in self._node_accesses.get(id(node), ()):
            self._check(key, access, outcome)
        node.done = True
        self.heads[node.queue] += 1
        for key, access in self._node_accesses.get(id(node), ()):
            pending = self._accesses[key]
            pending.remove(access)

    def _check(self, key: tuple[int, int], access: _Access, outcome: Outcome) -> None:
        for other in self._accesses[key]:
            if other.order >= access.order or other.node.done or other.node is access.node:
                continue
            if other.end <= access.start or access.end <= other.start:
                continue
            if not (access.writes or other.writes):
                continue
            if not access.writes:
                kind = "read before its producer"
            elif other.writes:
                kind = "write before an earlier write"
            else:
                kind = "reuse before the last reader"
            rank, buffer = key
            trace = self.traces[rank]
            outcome.hazards.append(
                Hazard(kind, rank, f"buffer {buffer} ({trace.buffers.get(buffer, '?')})",
                       self._where(other.node), self._where(access.node))
            )  # fmt: skip
            return

    def _clock(self, nodes: list[Node]) -> None:
        """The vector clock of ``nodes`` (one, or a collective's members, which complete together):
        the latest of what each is ordered after, and its own place."""
        clock = [0] * len(self._queue_index)
        for node in nodes:
            before = [dep for dep in node.deps]
            if node.position > 1:
                before.append(self.queues[node.queue][node.position - 2])
            for dep in before:
                for i, value in enumerate(self._clocks[id(dep)]):
                    if value > clock[i]:
                        clock[i] = value
        for node in nodes:
            own = list(clock)
            own[self._queue_index[node.queue]] = node.position
            self._clocks[id(node)] = own
        if len(nodes) > 1:  # each member completes only once all arrived: ordered after every member
            merged = [max(values) for values in zip(*(self._clocks[id(n)] for n in nodes))]
            for node in nodes:
                self._clocks[id(node)] = merged

    def _ordered_before(self, earlier: Node, later: Node) -> bool:
        clock = self._clocks[id(later)]
        return clock[self._queue_index[earlier.queue]] >= earlier.position

    def _unordered(self, node: Node, outcome: Outcome) -> None:
        """Accesses issued before ``node``'s that the waits do not order before it."""
        for key, access in self._node_accesses.get(id(node), ()):
            for other in self._all_accesses[key]:
                if other.order >= access.order or other.node is node:
                    continue
                if not (access.writes or other.writes) or other.end <= access.start or access.end <= other.start:
                    continue
                if other.node.done and self._ordered_before(other.node, node):
                    continue
                kind = "may read before its producer" if not access.writes else (
                    "may write before an earlier write" if other.writes else "may reuse before the last reader"
                )
                rank, buffer = key
                outcome.hazards.append(
                    Hazard(kind, rank, f"buffer {buffer} ({self.traces[rank].buffers.get(buffer, '?')})",
                           self._where(other.node), self._where(node))
                )  # fmt: skip
                return

    def _where(self, node: Node) -> str:
        rank, kind, number = node.queue
        trace = self.traces[rank]
        name = trace.streams.get(number, "?") if kind == "stream" else trace.threads.get(number, "?")
        return f"rank {rank} {kind} {name}: {node.describe(self.traces)}"

    def _cycle(self) -> list[str]:
        """The queues left, each waiting for another, from one that waits back into a cycle."""
        waits_for: dict[QueueKey, list[tuple[QueueKey, str]]] = {}
        owner = {id(node): key for key, queue in self.queues.items() for node in queue}
        for key in self.queues:
            node = self.head(key)
            if node is None:
                continue
            blockers = [(owner[id(dep)], f"waits for {self._where(dep)}") for dep in node.deps if not dep.done]
            if not blockers and node.collective is not None:
                for member in self._collectives[node.collective].values():
                    if self.head(member.queue) is not member or not self._ready(member):
                        blockers.append((member.queue, f"waits for rank {member.rank} to reach {member.describe(self.traces)}"))
            waits_for[key] = blockers
        for start in waits_for:
            path, seen = [start], {start: 0}
            while waits_for.get(path[-1]):
                following = waits_for[path[-1]][0][0]
                if following in seen:
                    cycle = path[seen[following]:]
                    return [f"{self._where(self.head(k))} {waits_for[k][0][1]}" for k in cycle]
                seen[following] = len(path)
                path.append(following)
        return [f"{self._where(self.head(k))} {', '.join(b for _, b in blocks) or 'waits'}" for k, blocks in waits_for.items()]


def explore(traces: Sequence[Trace], policies: Sequence[Policy]) -> list[Outcome]:
    """Each policy's replay of ``traces`` (the recordings are built afresh for each)."""
    return [Replay(traces).run(policy) for policy in policies]
