"""What every rank of ``multiprocess.run_on_ranks`` imports, once per test worker.

Importing torch, Lightning and lightning-zero costs a rank process ~4 CPU-seconds on the 2-core CI
machine, more than most groups of cases spend running. ``run_on_ranks`` therefore forks its ranks
from a server process that imported this module (a ``multiprocessing`` forkserver of its own): each
rank starts as a fresh copy of a process that has imported everything and run nothing, as a spawned
rank would be once its imports are done.

torchmetrics imports neither ``transformers`` nor ``matplotlib`` here (``startup/sitecustomize.py``,
imported below as every test process imports it at start-up).
"""

from __future__ import annotations

import gc
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup"))
import sitecustomize  # noqa: E402,F401 - imported at start-up already where PYTHONPATH names startup/

import pytest  # noqa: E402,F401 - every test module imports it, and the ranks import the test modules
import torch  # noqa: E402,F401
import lightning  # noqa: E402,F401
import lightning_zero  # noqa: E402,F401

import lightning_helpers  # noqa: E402,F401 - and with it the test models and multiprocess

# What most groups' ranks would each import again: Lightning asks whether a checkpoint folder is
# object storage (`lightning.fabric.utilities.cloud_io._is_object_storage`, from every
# ModelCheckpoint's setup) by importing each of these that is installed: s3fs and its ~330
# modules, ~0.3 CPU-seconds a rank (the `test` extra installs it)
import importlib.util  # noqa: E402

for _package in ("adlfs", "gcsfs", "s3fs"):
    if importlib.util.find_spec(_package) is not None:
        importlib.import_module(_package)

# Everything imported so far lives as long as the ranks: out of the collector's sight, a full
# collection in a rank (test_sharded_averaging counts live modules after one) walks only what the
# rank made, and the forked pages holding these objects are not copied by the walk.
gc.freeze()
