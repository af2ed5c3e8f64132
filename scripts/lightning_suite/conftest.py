"""Harness conftest (ours): the fixtures Lightning's tests use, a tmp_path that every rank of a popen
launch agrees on, the strategy swap selected by LZ_SWAP (ddp | zero1 | zero2 | zero3), and a record of
each launch of ranks (``launches.jsonl`` in LZ_RUN_DIR: launcher, processes, accelerator, strategy, and
whether the swap reached it). With LZ_PROBE=1 every test stops at its first launch, once recorded: how
``derive_ids.py`` finds the tests that start ranks without running them."""
import json
import os
import re
import signal
import sys
from pathlib import Path
from unittest.mock import Mock

import pytest
import torch
import torch.distributed

import lightning.fabric
import lightning.pytorch
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.fabric.utilities.distributed import _destroy_dist_connection, _distributed_is_initialized

IS_CHILD = "LOCAL_RANK" in os.environ  # a rank started by the popen launcher re-running this pytest
SWAP = os.environ.get("LZ_SWAP", "ddp")
RUN_DIR = os.environ.get("LZ_RUN_DIR")
DDP_NAMES = {"ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true",
             "ddp_find_unused_parameters_false", "ddp_spawn_find_unused_parameters_true",
             "ddp_spawn_find_unused_parameters_false", "ddp_fork_find_unused_parameters_true",
             "ddp_fork_find_unused_parameters_false", "ddp_notebook_find_unused_parameters_true",
             "ddp_notebook_find_unused_parameters_false"}
SWAPPED = []


def _reached(strategy) -> bool:
    """Whether the swap replaces ``strategy`` (a DDP name, or a plain ``DDPStrategy``, not a subclass)."""
    from lightning.pytorch.strategies import DDPStrategy

    return (isinstance(strategy, str) and strategy in DDP_NAMES) or type(strategy) is DDPStrategy


def _swap_strategy(strategy):
    from lightning.pytorch.strategies import DDPStrategy
    from lightning_zero import ZeroStrategy

    stage = int(SWAP[-1])
    if isinstance(strategy, str) and strategy in DDP_NAMES:
        SWAPPED.append(strategy)
        start = "spawn" if "spawn" in strategy else "fork" if ("fork" in strategy or "notebook" in strategy) else "popen"
        return ZeroStrategy(stage=stage, start_method=start)
    if type(strategy) is DDPStrategy:
        SWAPPED.append("DDPStrategy")
        return ZeroStrategy(stage=stage, start_method=strategy._start_method, process_group_backend=strategy._process_group_backend,
                            timeout=strategy._timeout, cluster_environment=strategy._cluster_environment,
                            checkpoint_io=strategy._checkpoint_io, precision_plugin=strategy._precision_plugin)
    return strategy


_original_init = lightning.pytorch.Trainer.__init__


def _init(self, *args, **kwargs):
    reached = _reached(kwargs.get("strategy"))
    if reached and SWAP != "ddp":
        kwargs["strategy"] = _swap_strategy(kwargs["strategy"])
    _original_init(self, *args, **kwargs)
    self._lz_reached = reached  # read by the launch record


lightning.pytorch.Trainer.__init__ = _init


CURRENT_TEST = {"id": ""}
"""The running test's id (a test may clear ``os.environ``, and ``PYTEST_CURRENT_TEST`` with it)."""


def pytest_runtest_setup(item):
    CURRENT_TEST["id"] = item.nodeid


class ProbeStop(BaseException):
    """Ends a probed test at its first launch (a BaseException: ``pytest.raises(Exception)`` lets it by)."""


def _recorded(launch):
    def record(self, function, *args, trainer=None, **kwargs):
        if RUN_DIR is not None and not IS_CHILD:
            strategy = getattr(self, "_strategy", None) or getattr(trainer, "strategy", None)
            processes = getattr(self, "num_processes", None) or getattr(strategy, "num_processes", 1)
            nodes = getattr(self, "num_nodes", None) or getattr(strategy, "num_nodes", 1)
            entry = {"id": CURRENT_TEST["id"],
                     "launcher": type(self).__name__, "ranks": processes * nodes,
                     "accelerator": type(getattr(trainer, "accelerator", None)).__name__,
                     "strategy": type(strategy).__name__, "reached": getattr(trainer, "_lz_reached", None)}
            with open(os.path.join(RUN_DIR, "launches.jsonl"), "a") as f:
                f.write(json.dumps(entry) + "\n")
            if os.environ.get("LZ_PROBE"):
                raise ProbeStop(entry)
        return launch(self, function, *args, trainer=trainer, **kwargs)

    return record


def _record_launches():
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

    for cls in (_MultiProcessingLauncher, _SubprocessScriptLauncher):
        cls.launch = _recorded(cls.launch)


_record_launches()


def pytest_runtest_logreport(report):
    if RUN_DIR is None or (report.when != "call" and not (report.when == "setup" and report.outcome != "passed")):
        return
    name = "results.jsonl" if not IS_CHILD else f"child-{os.environ['LOCAL_RANK']}.jsonl"
    outcome = "skipped" if report.skipped else report.outcome
    with open(os.path.join(RUN_DIR, name), "a") as f:
        f.write(json.dumps({"id": report.nodeid, "outcome": outcome, "swapped": list(SWAPPED),
                            "error": ("" if report.passed or report.skipped else report.longreprtext[-3000:])}) + "\n")
    SWAPPED.clear()


@pytest.fixture
def tmp_path(request, tmp_path_factory):
    """One directory for every rank of a launch: the popen launcher's ranks re-run this pytest."""
    if RUN_DIR is None:
        return tmp_path_factory.mktemp(re.sub(r"[^\w]", "_", request.node.name)[:30])
    path = Path(RUN_DIR) / "tmp" / re.sub(r"[^\w.-]", "_", request.node.nodeid)[-120:]
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def tmpdir(tmp_path):
    import py

    return py.path.local(tmp_path)


@pytest.fixture(scope="session")
def datadir():
    from tests_pytorch import _PATH_DATASETS

    return Path(_PATH_DATASETS)


@pytest.fixture(autouse=True)
def preserve_global_rank_variable():
    from lightning_utilities.core.rank_zero import rank_zero_only as a
    from lightning.fabric.utilities.rank_zero import rank_zero_only as b
    from lightning.pytorch.utilities.rank_zero import rank_zero_only as c

    fns = (a, b, c)
    ranks = [getattr(fn, "rank", None) for fn in fns]
    yield
    for fn, rank in zip(fns, ranks):
        if rank is not None:
            fn.rank = rank


@pytest.fixture(autouse=True)
def restore_env_variables():
    backup = os.environ.copy()
    yield
    os.environ.clear()
    os.environ.update(backup)


@pytest.fixture(autouse=True)
def teardown_process_group():
    yield
    _destroy_dist_connection()


@pytest.fixture(autouse=True)
def reset_deterministic_algorithm():
    yield
    torch.use_deterministic_algorithms(False)


def mock_cuda_count(monkeypatch, n):
    monkeypatch.setattr(lightning.fabric.accelerators.cuda, "num_cuda_devices", lambda: n)
    monkeypatch.setattr(lightning.pytorch.accelerators.cuda, "num_cuda_devices", lambda: n)


@pytest.fixture
def cuda_count_0(monkeypatch):
    mock_cuda_count(monkeypatch, 0)


@pytest.fixture
def cuda_count_1(monkeypatch):
    mock_cuda_count(monkeypatch, 1)


@pytest.fixture
def cuda_count_2(monkeypatch):
    mock_cuda_count(monkeypatch, 2)


@pytest.fixture
def cuda_count_4(monkeypatch):
    mock_cuda_count(monkeypatch, 4)


def mock_mps_count(monkeypatch, n):
    monkeypatch.setattr(lightning.fabric.accelerators.mps, "_get_all_available_mps_gpus", lambda: [0] if n > 0 else [])
    monkeypatch.setattr(lightning.fabric.accelerators.mps.MPSAccelerator, "is_available", lambda *_: n > 0)


@pytest.fixture
def mps_count_0(monkeypatch):
    mock_mps_count(monkeypatch, 0)


@pytest.fixture
def mps_count_1(monkeypatch):
    mock_mps_count(monkeypatch, 1)


def mock_xla_available(monkeypatch, value=True):
    """Every module that reads ``_XLA_AVAILABLE`` at call time sees ``value``."""
    import importlib

    for name in ("pytorch.strategies.xla", "pytorch.strategies.single_xla", "pytorch.plugins.precision.xla",
                 "pytorch.strategies.launchers.xla", "fabric.accelerators.xla", "fabric.plugins.environments.xla",
                 "fabric.plugins.io.xla", "fabric.strategies.launchers.xla"):
        monkeypatch.setattr(importlib.import_module(f"lightning.{name}"), "_XLA_AVAILABLE", value)


def mock_tpu_available(monkeypatch, value=True):
    """An XLA device (8 of them) seen as present, with ``torch_xla`` stood in by mocks."""
    mock_xla_available(monkeypatch, value)
    for accelerator in (lightning.pytorch.accelerators.xla.XLAAccelerator, lightning.fabric.accelerators.xla.XLAAccelerator):
        monkeypatch.setattr(accelerator, "is_available", lambda: value)
        monkeypatch.setattr(accelerator, "auto_device_count", lambda *_: 8)
    for name in ("torch_xla", "torch_xla.core.xla_model", "torch_xla.experimental"):
        monkeypatch.setitem(sys.modules, name, Mock())


@pytest.fixture
def xla_available(monkeypatch):
    mock_xla_available(monkeypatch)


@pytest.fixture
def tpu_available(monkeypatch):
    mock_tpu_available(monkeypatch)


@pytest.fixture
def caplog(caplog):
    import logging

    root = logging.getLogger()
    old = root.propagate
    root.propagate = True
    names = {n: logging.getLogger(n).propagate for n in logging.root.manager.loggerDict if n.startswith("lightning.pytorch")}
    for n in names:
        logging.getLogger(n).propagate = True
    yield caplog
    root.propagate = old
    for n, p in names.items():
        logging.getLogger(n).propagate = p


@pytest.fixture
def single_process_pg():
    if _distributed_is_initialized():
        raise RuntimeError("single_process_pg: a process group already exists")
    env = os.environ.copy()
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(find_free_network_port()), RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo")
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
