"""Four things for the whole suite.

**Lean imports in every process.** ``startup/`` goes on ``PYTHONPATH`` (for every process the tests
start: workers, scripts, command-line tools, spawned and torchrun ranks) and is imported here, so
torchmetrics skips its optional ``transformers`` and ``matplotlib`` imports (see
``startup/sitecustomize.py``): ~2 CPU-seconds for each of the ~50 Python processes the suite
starts, ~90 of its ~520 CPU-seconds on the 2-core CI machine.

**Bytecode is cached, even under ``PYTHONDONTWRITEBYTECODE``.** The test command installs with
``pip install --no-compile``: pip would byte-compile every file of torch and the test dependencies
(~11,800, a minute of one core), where the suite imports ~4,600 of them. Python compiles those on
first import (~25 CPU-seconds, more where two processes import a module at once) and caches them,
here even where the environment says not to (as this machine's does): otherwise each of the
suite's processes would compile what it imports from source again, ~15 CPU-seconds each.

**The smoke subset** (``pytest -m smoke``): the files in ``SMOKE_FILES``, which ``.ci/run``'s
compatibility stage runs on the oldest and the newest supported torch and Lightning
(``scripts/compat_matrix.sh``): the Trainer at stages 1-3 against DDP, Fabric, a checkpoint round trip
with a reshard, gradient views, offload, and the version check. About a minute on 2 cores.

**The longest test files start first** when the suite runs on several workers
(``-n 2 --dist loadfile``).

pytest-xdist hands each worker one file at a time, in collection order, and by default reorders the
files by their number of tests. Here the number of tests says little about the time: a file of one
test may run a whole GPU-check script, one of 73 asserts on a single group of ranks. When a long
file is handed out last, one worker runs it while the other idles, so the files below (the longest
on the 2-core CI machine, longest first, measured with ``--durations`` and
``CASE_TIMES_FILE``, see ``case_groups.py``) go first and the rest follow in file order. A file not
listed here only costs time at the end if it is long: add it when it is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

STARTUP = str(Path(__file__).resolve().parent / "startup")

LONGEST_FIRST = (
    "test_compile.py",
    "test_gpu_check_script.py",
    "test_offload.py",
    "test_multinode.py",
    "test_start_methods.py",
    "test_example_gpt.py",
    "test_zero_pp_training.py",  # the example GPT for 50 steps under six ZeRO++ variants on 4 ranks: ~45 s
    "test_bench.py",
    "test_lightning_suite.py",  # Lightning's own tests in a process of their own: ~30 s, started early
    "test_preemption.py",
    "test_drop_in.py",
    "test_after_fit.py",
    "test_reliability.py",
    "test_capacity.py",
    "test_sharded_averaging.py",
    "test_checkpoint.py",
    "test_hybrid.py",
    "test_remote_checkpoints.py",
    "test_big_models.py",
    "test_examples_hf_litgpt.py",
)

SMOKE_FILES = (
    "test_strategy.py",  # the Trainer at stages 1 and 2, every step against DDP
    "test_stage3.py",  # stage 3 against DDP, evaluation after fit, bytes at rest
    "test_fabric.py",  # Fabric's setup, precisions, offload and checkpoints against Fabric's DDP
    "test_checkpoint.py",  # sharded save, load, a 2 -> 1 reshard, convert
    "test_grad_views.py",  # clipping and gradient reads as under DDP
    "test_offload.py",  # CPU offload at stages 1-3, its checkpoints
    "test_compat.py",  # the version check and the shims for older releases
)


def pytest_configure(config: Any) -> None:
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # for every process started from here on
    # whether the host step steps during backward must not depend on how loaded the machine is: a
    # step judged costly by its timing backs off (engine/offload/backoff.py); tests of the judgement
    # call `paid_off` with timings of their own
    os.environ.setdefault("LIGHTNING_ZERO_JUDGE_HOST_STEPS_FROM_S", "inf")
    sys.dont_write_bytecode = False
    os.environ["PYTHONPATH"] = os.pathsep.join(path for path in (STARTUP, os.environ.get("PYTHONPATH")) if path)
    sys.path.insert(0, STARTUP)
    import sitecustomize  # noqa: F401 - this process started before PYTHONPATH named it

    config.addinivalue_line("markers", f"smoke: the compatibility stage's subset, the files {', '.join(SMOKE_FILES)} (tests/conftest.py)")
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order set below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        if Path(str(item.fspath)).name in SMOKE_FILES:
            item.add_marker("smoke")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: the rest keep their order
