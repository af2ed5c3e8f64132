"""Two "nodes" on this machine (loopback only), launched as users launch them: ``torchrun --nnodes=2``
with ``--node-rank`` 0 and 1, and the environment variables SLURM's ``srun`` sets. Each trains
``Trainer(num_nodes=2, devices=1)`` and saves a checkpoint that one node with 2 devices resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multiprocess import free_port, run_on_ranks, script_environment

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "multinode_worker.py")
TIMEOUT_S = 240


def _run_nodes(commands: list[list[str]], environments: list[dict[str, str]]) -> None:
    processes = [
        subprocess.Popen(command, env=env, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for command, env in zip(commands, environments)
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for process in processes:
            process.kill()
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-4000:]


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory) -> Path:
    """zero3 with `shard_group_size="node"`: each node's one rank shards alone, the nodes replicate."""
    out = tmp_path_factory.mktemp("torchrun")
    port = free_port()
    commands = [
        [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--master-addr=127.0.0.1", f"--master-port={port}",
            WORKER, str(out), "3", "node",
        ]
        for node in (0, 1)
    ]  # fmt: skip
    _run_nodes(commands, [script_environment(), script_environment()])
    return out


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory) -> Path:
    """zero2 over both nodes, with the variables `srun --nodes=2 --ntasks-per-node=1` sets."""
    out = tmp_path_factory.mktemp("slurm")
    port = free_port()
    environments = []
    for rank in (0, 1):
        env = script_environment()
        env.update(
            SLURM_JOB_ID="4242", SLURM_JOB_NAME="zero", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1",
            SLURM_NNODES="2", SLURM_NODELIST="localhost", SLURM_PROCID=str(rank), SLURM_LOCALID="0",
            SLURM_NODEID=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
        environments.append(env)
    _run_nodes([[sys.executable, WORKER, str(out), "2", "none"]] * 2, environments)
    return out


def _resume_on_one_node(rank: int, world_size: int, path: str, stage: int) -> dict[str, torch.Tensor]:
    import lightning as L
    from lightning_helpers import GPTModule, full_weights, make_trainer, token_data

    from lightning_zero import ZeroStrategy

    L.seed_everything(5, verbose=False)
    module = GPTModule()
    trainer = make_trainer(ZeroStrategy(stage=stage), 1, devices=world_size)
    trainer.validate(module, token_data(4), ckpt_path=path, verbose=False)
    return full_weights(module, trainer.strategy)


@pytest.mark.parametrize(
    ("run", "environment", "shard_group_size", "resume_stage"),
    [("torchrun_run", "TorchElasticEnvironment", 1, 1), ("slurm_run", "SLURMEnvironment", None, 3)],
)
def test_two_nodes_train_and_one_node_resumes(request, run: str, environment: str, shard_group_size, resume_stage: int) -> None:
    out: Path = request.getfixturevalue(run)
    seen = json.loads((out / "seen.json").read_text())
    assert seen == {"environment": environment, "world_size": 2, "num_nodes": 2, "shard_group_size": shard_group_size}
    saved = torch.load(out / "weights.pt", weights_only=True)
    for loaded in run_on_ranks(_resume_on_one_node, str(out / "checkpoint"), resume_stage, world_size=2, init_process_group=False):
        assert loaded.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
