"""What offload's copies hold beside model state (``engine/comm/copy_memory.py``), in one process:

- pinned blocks: rounded up to a power of two, and kept by torch's pinned allocator once freed, so a
  master chunk read in from disk and freed still counts; reading one bucket at a time keeps one
  block, reading all at once keeps them all (the defect ``buckets_in_memory`` fixed);
- device rows a copy to the device lands in: counted until the compute stream has read them (an
  event recorded after their consumers, queried, never waited on), and the most at once kept.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero.engine.comm.copy_memory import DeviceTemporaries, PinnedBlocks, pinned_block_bytes
from lightning_zero.engine.offload.masters_on_disk import MasterOnDisk
from lightning_zero.engine.offload.scratch_files import ScratchDirectory

MiB = 2**20


def test_pinned_blocks_are_powers_of_two_kept_once_freed():
    assert [pinned_block_bytes(n) for n in (0, 1, 3, 4096, 4097, MiB + 4)] == [0, 1, 4, 4096, 8192, 2 * MiB]
    blocks = PinnedBlocks()
    blocks.taken(MiB + 4)  # a bucket's master: its block is 2 MiB
    blocks.taken(3 * MiB)  # another size
    assert blocks.live_bytes == blocks.held_bytes == 2 * MiB + 4 * MiB
    blocks.given_back(MiB + 4)  # freed: the allocator keeps the block for the next 2 MiB request
    assert blocks.live_bytes == 4 * MiB and blocks.held_bytes == 6 * MiB
    blocks.taken(MiB + 100)  # served from the cached block
    assert blocks.held_bytes == 6 * MiB
    blocks.taken(MiB + 100)  # two at once of that size: a second block
    assert blocks.held_bytes == 8 * MiB


def _masters(tmp_path, blocks: PinnedBlocks, count: int) -> list[MasterOnDisk]:
    tmp_path.mkdir()
    directory = ScratchDirectory(str(tmp_path), label="rank0")
    masters = []
    for i in range(count):
        master = torch.zeros(MiB // 4 + 1)  # 1 MiB + 4 B: a 2 MiB block each
        shard = nn.Parameter(master.view(-1), requires_grad=False)
        blocks.taken(master.untyped_storage().nbytes())  # as CopyStream.host_buffer counts it
        masters.append(MasterOnDisk(master, [shard], directory.new_file(f"b{i}.bin", holds="test"), blocks))
    return masters


def test_masters_read_one_at_a_time_keep_one_block_pinned(tmp_path):
    one_at_a_time, all_at_once = PinnedBlocks(), PinnedBlocks()
    for master in _masters(tmp_path / "a", one_at_a_time, 4):
        master.acquire()
        master.release()  # freed before the next is read
    held = _masters(tmp_path / "b", all_at_once, 4)
    for master in held:
        master.fetch()
    for master in held:
        master.acquire()
    for master in held:
        master.release()
    # every master is freed in both cases (their storage holds 0 bytes), but not their blocks: the
    # first setup made each in turn (one block), the second read all back at once
    assert one_at_a_time.live_bytes == all_at_once.live_bytes == 0
    assert one_at_a_time.held_bytes == 2 * MiB
    assert all_at_once.held_bytes == 4 * 2 * MiB


class _Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_device_rows_count_until_the_compute_stream_read_them():
    events: list[_Event] = []

    def record() -> _Event:
        events.append(_Event())
        return events[-1]

    rows = DeviceTemporaries(record, _Event.query)  # as CopyStream passes its stream layer's event query
    rows.add(torch.empty(256))  # 1 KiB, being read
    rows.add(torch.empty(512))  # 2 KiB: the first is still unread on the device
    assert rows.bytes_now == 3 * 1024 and rows.most_bytes == 3 * 1024
    for event in events:
        event.done = True  # the compute stream passed both rows' consumers
    assert rows.bytes_now == 0
    rows.add(torch.empty(256))
    assert rows.bytes_now == 1024 and rows.most_bytes == 3 * 1024

    synchronous = DeviceTemporaries()  # nothing asynchronous: a row is read before the next copy
    synchronous.add(torch.empty(256))
    synchronous.add(torch.empty(256))
    assert synchronous.most_bytes == 1024 and synchronous.bytes_now == 0
