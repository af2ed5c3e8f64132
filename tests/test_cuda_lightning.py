"""GPU tier, Lightning on ``cuda:0`` (world size 1): the Trainer and Fabric at every stage and both
offloads against DDP, at 32-true, bf16-mixed, 16-mixed and bf16-true, with gradient accumulation and
clipping by norm (checkpoints across devices are ``test_cuda_checkpoint.py``, ``torch.compile``
``test_cuda_compile.py``). Skipped without a CUDA device (see ``cuda_tier.py``).

Tolerances are the CPU matrix's (``test_precision_matrix.py``): fp32, bf16-mixed and 16-mixed
keep fp32 weights and run the same kernels as DDP (deterministic ones, see
``cuda_tier.setup_rank``), so they differ from DDP only where the arithmetic differs (the norm
summed over shards, the offloaded optimizer's CPU kernel): 1e-6. bf16-true steps an fp32 master
copy where DDP steps bf16 weights: one bf16 rounding per step.
"""

from __future__ import annotations

import pytest
import torch

from case_groups import CaseGroup, GroupResults, RankContext
from cuda_tier import MARKS, START_METHOD, setup_rank
from test_precision_matrix import BF16_TRUE_TOLERANCE, FP32_TOLERANCE, STEPS

pytestmark = MARKS

STRATEGIES = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
TRAINER_FLOW = dict(accumulate_grad_batches=2, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
FABRIC_FLOW = dict(steps=STEPS, accumulate=2, clip="norm")


def _tolerance(precision: str) -> float:
    return BF16_TRUE_TOLERANCE if precision == "bf16-true" else FP32_TOLERANCE


def _fabric_options(strategy: str) -> tuple[str, dict]:
    """`test_fabric.train`'s strategy name and options for a registered name such as "zero3_offload"."""
    from lightning_zero.engine.config import STRATEGY_NAMES

    options = dict(STRATEGY_NAMES[strategy])
    return f"zero{options.pop('stage')}", options


# ---- parity with DDP: the Trainer and Fabric --------------------------------------------------------

PARITY = CaseGroup(world_size=1, timeout=600, start_method=START_METHOD)


def _trainer_history(strategy: str, precision: str) -> list[dict[str, torch.Tensor]]:
    from lightning_helpers import fit_and_record

    return fit_and_record(strategy, STEPS, precision=precision, accelerator="cuda", **TRAINER_FLOW)[1]


def trainer_parity(ctx: RankContext, strategy: str, precision: str) -> dict:
    """max |ours - DDP| over the weights after every micro-batch of the Trainer's fit."""
    from lightning_helpers import max_abs_diff

    setup_rank(deterministic=True)
    ddp = ctx.once(("trainer ddp", precision), lambda: _trainer_history("ddp", precision))
    ours = _trainer_history(strategy, precision)
    return {"records": (len(ddp), len(ours)), "diff": max(max_abs_diff(a, b) for a, b in zip(ddp, ours))}


def fabric_parity(ctx: RankContext, strategy: str, precision: str) -> dict:
    """Fabric's loop of ``test_fabric.train`` on CUDA: max |ours - DDP| of the final weights, the
    losses and the clipped norms."""
    from test_fabric import train

    setup_rank(deterministic=True)
    flow = dict(FABRIC_FLOW, precision=precision, accelerator="cuda")
    ddp = ctx.once(("fabric ddp", precision), lambda: train(ctx, "ddp", **flow))
    name, options = _fabric_options(strategy)
    ours = train(ctx, name, **flow, **options)

    def diff(a: list[float], b: list[float]) -> float:
        assert len(a) == len(b), (a, b)
        return max(abs(x - y) for x, y in zip(a, b))

    # DDP's full weights stay on cuda:0, ours are gathered to the CPU: compare them there
    assert ours["weights"].keys() == ddp["weights"].keys(), (sorted(ours["weights"]), sorted(ddp["weights"]))
    weights = max((ours["weights"][k].cpu() - w.cpu()).abs().max().item() for k, w in ddp["weights"].items())
    return {"weights": weights, "losses": diff(ddp["losses"], ours["losses"]), "norms": diff(ddp["norms"], ours["norms"])}


for _precision in PRECISIONS:
    for _strategy in STRATEGIES:
        PARITY.case(trainer_parity, name=f"trainer_{_strategy}_{_precision}", strategy=_strategy, precision=_precision)
        PARITY.case(fabric_parity, name=f"fabric_{_strategy}_{_precision}", strategy=_strategy, precision=_precision)


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> GroupResults:
    return PARITY.run(tmp_path_factory.mktemp("cuda_parity"))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trainer_matches_ddp(parity, strategy, precision):
    (r,) = parity[f"trainer_{strategy}_{precision}"]
    assert r["records"] == (2 * STEPS, 2 * STEPS), r  # a record per micro-batch
    assert r["diff"] <= _tolerance(precision), r


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fabric_matches_ddp(parity, strategy, precision):
    (r,) = parity[f"fabric_{strategy}_{precision}"]
    assert max(r.values()) <= _tolerance(precision), r


# ---- NVMe offload on a GPU: the same steps as CPU offload --------------------------------------------

NVME_PRECISIONS = ("32-true", "bf16-mixed")


def nvme_against_cpu_offload(ctx: RankContext, precision: str) -> dict:
    """zero3_offload_nvme and zero3_offload_nvme_params against zero3_offload on CUDA: the optimizer
    steps on the host either way, so the weights after every micro-batch must be the same bits; and
    what the disk did."""
    import os

    from lightning_helpers import fit_and_record

    setup_rank(deterministic=True)
    os.environ["LIGHTNING_ZERO_NVME_PATH"] = ctx.tmpdir  # what the registered name reads
    flow = dict(precision=precision, accelerator="cuda", **TRAINER_FLOW)
    in_memory = fit_and_record("zero3_offload", STEPS, **flow)[1]
    out = {}
    for name in ("zero3_offload_nvme", "zero3_offload_nvme_params"):  # the moments on disk; the chunks too
        _, on_disk, trainer = fit_and_record(name, STEPS, **flow)
        io = trainer.strategy._state_engine.disk.io
        same = len(in_memory) == len(on_disk) and all(
            all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(in_memory, on_disk)
        )
        out[name] = {"same": same, "records": len(on_disk), "reads": io.reads, "writes": io.writes, "waits": io.waits}
    return out


for _precision in NVME_PRECISIONS:
    PARITY.case(nvme_against_cpu_offload, name=f"nvme_{_precision}", precision=_precision)


@pytest.mark.parametrize("precision", NVME_PRECISIONS)
def test_nvme_offload_steps_as_cpu_offload_on_a_gpu(parity, precision):
    (runs,) = parity[f"nvme_{precision}"]
    for name, r in runs.items():
        assert r["records"] == 2 * STEPS and r["same"], (name, r)
        assert r["reads"] > 0, (name, r)
    assert runs["zero3_offload_nvme"]["writes"] > runs["zero3_offload_nvme"]["reads"]  # the first step writes without reading
    assert runs["zero3_offload_nvme_params"]["reads"] > runs["zero3_offload_nvme"]["reads"]  # the chunks, for every gather
