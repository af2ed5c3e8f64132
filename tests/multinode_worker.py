"""One rank of a two-"node" run on this machine, started by ``test_multinode.py`` through torchrun
or with the environment variables SLURM sets: ``Trainer(num_nodes=2, devices=1)`` fits the test GPT
for 2 steps and saves a sharded checkpoint; rank 0 also writes the weights and what Lightning saw.

    python multinode_worker.py OUT_DIR STAGE SHARD_GROUP_SIZE
"""

import json
import os
import sys

import lightning as L
import torch
from lightning_helpers import GPTModule, WeightRecorder, token_data

from lightning_zero import ZeroStrategy


def main(out: str, stage: int, shard_group_size: str) -> None:
    L.seed_everything(0, verbose=False)
    strategy = ZeroStrategy(stage=stage, shard_group_size=None if shard_group_size == "none" else shard_group_size)
    recorder = WeightRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        num_nodes=2,
        devices=1,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    trainer.fit(GPTModule(), token_data())
    trainer.save_checkpoint(os.path.join(out, "checkpoint"))
    if trainer.is_global_zero:
        torch.save(recorder.history[-1], os.path.join(out, "weights.pt"))
        seen = {
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "shard_group_size": trainer.strategy._state_engine.shard_group_size,  # the finished fit's engine
        }
        with open(os.path.join(out, "seen.json"), "w") as file:
            json.dump(seen, file)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
