"""`lightning-zero bench --offload-overlap` (issue 53's CPU stand-in) and its memory probe, on a tiny GPT.

What is asserted is that the measurement is sound and complete (every field there, positive, the
ranks' shards adding up), never a speed: the targets are the bench's to judge, in its notes.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zero.bench.host_bandwidth import adamw_step_bytes, measure_host_bandwidth


def test_probe_measures_a_positive_bandwidth_with_the_current_threads() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        probe = measure_host_bandwidth(nbytes=4 * 2**20, repeats=2)
    finally:
        torch.set_num_threads(before)
    assert probe.bytes_per_s > 0 and probe.best_s > 0
    assert probe.tensor_bytes == 4 * 2**20
    assert probe.threads == 1
    assert probe.bytes_per_s == pytest.approx(3 * probe.tensor_bytes / probe.best_s)


def test_adamw_moves_28_bytes_per_fp32_parameter() -> None:
    assert adamw_step_bytes(10) == 280
    assert adamw_step_bytes(10, element_bytes=2) == 140
    assert adamw_step_bytes(0) == 0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: measure_host_bandwidth(nbytes=2), "`nbytes` must be an integer of at least 4"),
        (lambda: measure_host_bandwidth(repeats=0), "`repeats` must be a positive integer"),
        (lambda: adamw_step_bytes(-1), "`numel` must be a non-negative number"),
        (lambda: adamw_step_bytes(1, element_bytes=0), "`element_bytes` must be a positive number"),
    ],
)
def test_probe_and_byte_count_refuse_bad_input(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
