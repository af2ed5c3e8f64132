"""`apply_host_threads`: an offloading rank's host step takes its share of the node's cores (issue 53,
item 3), in one process; every test restores torch's thread count."""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

from lightning_zero.engine import ZeroConfig
from lightning_zero.engine.offload import host_threads
from lightning_zero.engine.offload.host_threads import apply_host_threads, host_threads_for

OFFLOAD = dict(stage=2, offload_optimizer=True)


@pytest.fixture(autouse=True)
def threads_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with neither variable set and leaves torch's thread count as it found it."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    yield
    torch.set_num_threads(before)


def _pretend_cores(monkeypatch: pytest.MonkeyPatch, cores: int) -> None:
    monkeypatch.setattr(host_threads.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)


def test_explicit_host_threads_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert apply_host_threads(ZeroConfig(**OFFLOAD, host_threads=1)) == 1
    assert torch.get_num_threads() == 1


def test_omp_num_threads_is_the_users_choice_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_cores(monkeypatch, 64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert apply_host_threads(ZeroConfig(**OFFLOAD)) == 1
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3,2")  # OpenMP's nested levels: the outer one is the pool's
    assert host_threads_for(ZeroConfig(**OFFLOAD)) == 3


def test_default_is_the_cores_divided_by_the_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_cores(monkeypatch, 16)
    assert host_threads_for(ZeroConfig(**OFFLOAD)) == 16  # LOCAL_WORLD_SIZE unset: one rank
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_threads_for(ZeroConfig(**OFFLOAD)) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert host_threads_for(ZeroConfig(**OFFLOAD)) == 5  # the share, rounded down
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert host_threads_for(ZeroConfig(**OFFLOAD)) == 1  # more ranks than cores: one thread each


def test_default_applies_the_share_of_this_machine() -> None:
    """On the machine itself (no pretending): one rank gets every core it may run on."""
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert apply_host_threads(ZeroConfig(**OFFLOAD)) == expected
    assert torch.get_num_threads() == expected


def test_cpu_count_where_affinity_cannot_be_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(host_threads.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(host_threads.os, "cpu_count", lambda: 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert host_threads_for(ZeroConfig(**OFFLOAD)) == 3
    monkeypatch.setattr(host_threads.os, "cpu_count", lambda: None)  # unknown: one core
    assert host_threads_for(ZeroConfig(**OFFLOAD)) == 1


def test_without_offload_the_thread_count_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert apply_host_threads(ZeroConfig(stage=2)) == 1
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("variable", ["OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"])
@pytest.mark.parametrize("value", ["0", "-2", "four", "2.5"])
def test_a_bad_environment_value_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match=rf"{variable}='{value}' is not a positive number.*HINT"):
        apply_host_threads(ZeroConfig(**OFFLOAD))
    assert torch.get_num_threads() == before


def test_nvme_offload_applies_too(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    config = ZeroConfig(stage=3, offload_optimizer="nvme", offload_params=True, nvme_path=str(tmp_path), host_threads=1)
    assert apply_host_threads(config) == 1
    assert torch.get_num_threads() == 1
