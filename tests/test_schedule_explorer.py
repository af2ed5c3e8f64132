"""The schedule explorer itself, on recordings written by hand (see [Note: the schedule explorer] in
``tests/schedules/__init__.py``): each kind of finding on the smallest trace that has it, and its
absence once the missing wait is there. One process, no ranks: milliseconds."""

from __future__ import annotations

import pytest
from schedules.explorer import Replay, explore
from schedules.policies import adversaries, host_ahead, random_order, starving
from schedules.trace import (
    Await, Collective, CollectiveWait, HostOp, HostWait, Kernel, KeepAlive, RecordEvent, Release, Signal, Trace,
    WaitEvent, WaitStream,
)  # fmt: skip

pytestmark = pytest.mark.schedules

COMPUTE, SIDE, GROUP_STREAM = 0, 1, 2
MAIN, WORKER = 0, 1
BUFFER = 7


def trace(rank: int, entries: list) -> Trace:
    return Trace(
        rank, entries, threads={MAIN: "main", WORKER: "worker"},
        streams={COMPUTE: "compute", SIDE: "side", GROUP_STREAM: "group 0"}, buffers={BUFFER: "device float32 (4,)"},
    )  # fmt: skip


def produce_then_consume(waits: bool) -> Trace:
    """A kernel on a side stream fills a buffer, one on the compute stream reads it; ``waits``: the
    compute stream waits for the side stream's event first."""
    entries = [
        Kernel(MAIN, SIDE, "fill", writes=((BUFFER, 0, 16),)),
        RecordEvent(MAIN, SIDE, 0),
        *([WaitEvent(MAIN, COMPUTE, 0)] if waits else []),
        Kernel(MAIN, COMPUTE, "read", reads=((BUFFER, 0, 16),)),
    ]
    return trace(0, entries)


def test_a_read_not_ordered_after_its_producer_is_found_in_every_order():
    unordered = produce_then_consume(waits=False)
    for outcome in explore([unordered], adversaries([0, 1])):
        assert not outcome.hazards or outcome.hazards[0].kind == "read before its producer"
    # a replay that runs the side stream first hides it from the scheduled check, not from the race check
    outcome = Replay([unordered]).run(starving("compute", 0), races=True)
    assert [h.kind for h in outcome.hazards] == ["may read before its producer"], outcome.summary()
    assert "read" in outcome.hazards[0].later and "fill" in outcome.hazards[0].earlier


def test_the_adversarial_orders_show_the_read_before_its_producer():
    outcomes = explore([produce_then_consume(waits=False)], [starving("side", 0)])
    assert [h.kind for h in outcomes[0].hazards] == ["read before its producer"], outcomes[0].summary()


def test_the_wait_makes_every_order_clean():
    for outcome in [Replay([produce_then_consume(waits=True)]).run(p, races=True) for p in adversaries([0, 1, 2])]:
        assert outcome.clean, outcome.summary()


def test_a_buffer_written_again_before_its_last_reader_ran_is_found():
    entries = [
        Kernel(MAIN, SIDE, "read", reads=((BUFFER, 0, 16),)),
        Kernel(MAIN, COMPUTE, "overwrite", writes=((BUFFER, 0, 16),)),  # no wait for the side stream
    ]
    outcome = Replay([trace(0, entries)]).run(starving("side", 0), races=True)
    assert {h.kind for h in outcome.hazards} == {"may reuse before the last reader", "reuse before the last reader"}, outcome.summary()
    fixed = [entries[0], WaitStream(MAIN, COMPUTE, SIDE), entries[1]]
    assert Replay([trace(0, fixed)]).run(starving("side", 0), races=True).clean


def test_disjoint_bytes_of_one_buffer_do_not_conflict():
    entries = [
        Kernel(MAIN, SIDE, "write first half", writes=((BUFFER, 0, 8),)),
        Kernel(MAIN, COMPUTE, "write second half", writes=((BUFFER, 8, 16),)),
    ]
    assert Replay([trace(0, entries)]).run(random_order(0), races=True).clean


def test_a_host_read_of_a_copy_to_the_host_needs_the_host_wait():
    copy = [Kernel(MAIN, SIDE, "copy to host", writes=((BUFFER, 0, 16),)), RecordEvent(MAIN, SIDE, 3)]
    read = HostOp(WORKER, "optimizer step", reads=((BUFFER, 0, 16),))
    racy = Replay([trace(0, [*copy, read])]).run(host_ahead(0))
    assert [h.kind for h in racy.hazards] == ["read before its producer"], racy.summary()
    waited = Replay([trace(0, [*copy, HostWait(WORKER, "event.synchronize", event=3), read])]).run(host_ahead(0), races=True)
    assert waited.clean, waited.summary()


def test_a_handoff_orders_the_threads():
    job = [Kernel(MAIN, COMPUTE, "produce", writes=((BUFFER, 0, 16),)), HostWait(MAIN, "sync", stream=COMPUTE)]
    handed = [*job, Signal(MAIN, 0, "job queued"), Await(WORKER, 0, "job started"), HostOp(WORKER, "use", reads=((BUFFER, 0, 16),))]
    assert Replay([trace(0, handed)]).run(host_ahead(0), races=True).clean
    not_handed = [*job, HostOp(WORKER, "use", reads=((BUFFER, 0, 16),))]
    assert not Replay([trace(0, not_handed)]).run(random_order(0), races=True).clean


def two_collectives(rank: int, first: int, waits: bool) -> Trace:
    """The compute stream issues a collective on group ``first`` then one on the other group, and
    (``waits``) waits for the first to complete before issuing the second."""
    streams = {0: GROUP_STREAM, 1: 3}
    entries = []
    for number, group in enumerate((first, 1 - first)):
        entries += [WaitStream(MAIN, streams[group], COMPUTE), Collective(MAIN, streams[group], group, 0, f"collective on group {group}", (0, 1))]
        if waits or number == 1:
            entries.append(CollectiveWait(MAIN, COMPUTE, group, 0))
    t = trace(rank, entries)
    t.streams[3] = "group 1"
    return t


def test_a_cycle_across_ranks_is_reported_with_its_waits():
    # rank 0 issues group 0's collective first, rank 1 group 1's, and each waits for its first before
    # issuing its second: each rank's second waits for the other rank's first, which waits for ...
    deadlocked = [two_collectives(0, 0, waits=True), two_collectives(1, 1, waits=True)]
    for outcome in explore(deadlocked, adversaries([0])):
        assert outcome.deadlock is not None, outcome.summary()
        text = "\n".join(outcome.deadlock)
        assert "rank 0" in text and "rank 1" in text and "collective on group 1" in text, text
    fine = [two_collectives(0, 0, waits=False), two_collectives(1, 1, waits=False)]
    assert all(outcome.clean for outcome in explore(fine, adversaries([0])))


def test_collectives_issued_differently_by_the_ranks_are_reported():
    a = trace(0, [WaitStream(MAIN, GROUP_STREAM, COMPUTE), Collective(MAIN, GROUP_STREAM, 0, 0, "all_gather", (0, 1))])
    b = trace(1, [WaitStream(MAIN, GROUP_STREAM, COMPUTE), Collective(MAIN, GROUP_STREAM, 0, 0, "reduce_scatter", (0, 1))])
    outcome = Replay([a, b]).run(random_order(0))
    assert outcome.mismatches and not outcome.clean, outcome.summary()


def test_kept_alive_bytes_count_until_the_stream_ran_past_them():
    entries = [
        Kernel(MAIN, SIDE, "pack", reads=((BUFFER, 0, 16),)),
        KeepAlive(MAIN, SIDE, 0, 1000),
        Release(MAIN, 0),
        Kernel(MAIN, SIDE, "later"),
    ]
    starved = Replay([trace(0, entries)]).run(starving("side", 0))
    assert starved.kept_alive_peak == {(0, "side"): 1000}
    eager = Replay([trace(0, entries)]).run(starving("none", 0))
    assert eager.kept_alive_peak.get((0, "side"), 0) in (0, 1000)
