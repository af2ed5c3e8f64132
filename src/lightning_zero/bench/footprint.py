"""What a capacity try is predicted to need per rank, so each measured row stands next to a prediction.

Model states are `lightning_zero.estimate`'s arithmetic (the `estimate` subcommand) in the
benchmark's fp32 scheme (`theory.BENCH_SCHEME`), the bytes it puts on the device: offloaded state is
in host memory, outside a GPU's budget, and not charged on a CPU either (`budget.py`) — unless the
budget is the host's (`budget_scope="host"`), where the host's share counts too (NVMe's files do
not: the host keeps its master and gradient chunks and a few buckets' moments). `estimate`
counts model states only ([Note: what the estimate leaves out]); a budget must hold more, so the
prediction adds three terms:
- the baseline: memory in use before the model is built, measured in the try's own ranks (on CPU
  the resident set of Python, torch and gloo, ~300 MB; on CUDA 0: the context is outside the budget);
- setup: every rank builds the whole fp32 model before the variant shards it (wΨ), so a rank's
  peak is at least that, whatever the stage (it bounds offload and stage 3 on many ranks);
- activations: counted, not modelled. The GPT runs one forward on fake tensors (`FakeTensorMode`:
  real shapes, dtypes and kernel choices, no memory) at 1 and 2 blocks and 1 and 2 samples, and the
  bytes autograd saves (`saved_tensors_hooks`, parameters excluded) give a part per block and sample,
  per sample, per block (bf16 autocast's weight copies) and fixed. Each grows linearly.
Left out, as by `estimate`: stage 3's gathered units and the communication buffers, the optimizer
step's temporaries, activation gradients in backward, the allocator's retention. They are what a
measured row falls short of its prediction by.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lightning_zero import estimate as est
from lightning_zero.bench.rank import checkpoint_every_block
from lightning_zero.bench.theory import BENCH_SCHEME
from lightning_zero.bench.variants import VariantSpec
from lightning_zero.bench.wrappers import autocast_for
from lightning_zero.engine import ZeroStage
from lightning_zero.estimate_schemes import Layout
from lightning_zero.models.gpt import GPT, GPTConfig


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes autograd saves in one forward, as f(L, B) = fixed + per_block·L + (per_sample + per_block_sample·L)·B
    for L blocks and B samples per rank (see the module doc)."""

    fixed: int
    """Independent of blocks and batch."""
    per_block: int
    """Per block, whatever the batch: bf16 autocast's copies of the block's weights (0 in fp32)."""
    per_sample: int
    """Per sample, outside the blocks: embeddings, final norm, logits and loss."""
    per_block_sample: int
    """Per block and sample: what each block keeps for its backward."""

    def at(self, n_layer: int, batch_size: int) -> int:
        """The bytes saved by a forward of `n_layer` blocks over `batch_size` samples."""
        return self.fixed + self.per_block * n_layer + (self.per_sample + self.per_block_sample * n_layer) * batch_size


def count_activations(config: GPTConfig, precision: str, checkpointing: bool) -> ActivationBytes:
    """Count `ActivationBytes` for GPTs of `config`'s width and sequence length (see the module doc)."""
    saved = {
        (blocks, batch): saved_bytes(dataclasses.replace(config, n_layer=blocks), batch, precision, checkpointing)
        for blocks in (1, 2)
        for batch in (1, 2)
    }
    per_block_sample = saved[2, 2] - saved[1, 2] - saved[2, 1] + saved[1, 1]
    per_block = saved[2, 1] - saved[1, 1] - per_block_sample
    per_sample = saved[1, 2] - saved[1, 1] - per_block_sample
    fixed = saved[1, 1] - per_block - per_sample - per_block_sample
    return ActivationBytes(fixed, per_block, per_sample, per_block_sample)


def saved_bytes(config: GPTConfig, batch_size: int, precision: str, checkpointing: bool) -> int:
    """Bytes of the distinct storages autograd saves in a forward with the loss, parameters excluded."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage._cdata] = storage.nbytes()  # _cdata: the storage itself, shared by its views
        return t

    with FakeTensorMode():
        model = GPT(config)
        if checkpointing:
            checkpoint_every_block(model)
        tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1))
        autocast = autocast_for(precision, torch.device("cpu"))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
            model(tokens[:, :-1], tokens[:, 1:])
        parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    return sum(nbytes for key, nbytes in storages.items() if key not in parameters)


@dataclass(frozen=True)
class Footprint:
    """The predicted peak of one rank, by term (see the module doc)."""

    baseline: int
    """The process before the model is built."""
    setup: int
    """The whole fp32 model, as every rank builds it before sharding."""
    model_states: int
    """`estimate.estimate`'s bytes on the device for the variant's layout."""
    activations: int
    """`ActivationBytes.at` the try's blocks and batch."""

    @property
    def total(self) -> int:
        """The peak: setup, or training (model states and activations), on top of the baseline."""
        return self.baseline + max(self.setup, self.model_states + self.activations)

    def as_dict(self) -> dict[str, int]:
        return {
            "baseline": self.baseline, "setup": self.setup, "model_states": self.model_states,
            "activations": self.activations, "total": self.total,
        }  # fmt: skip


def model_states(
    spec: VariantSpec, num_params: int, devices: int, nvme: est.NvmeStaging = est.NvmeStaging()
) -> est.MemoryEstimate:
    """`estimate.estimate` for `spec`'s layout, in the benchmark's fp32 scheme, on `devices` ranks."""
    offload = {"offload_optimizer": spec.offload_optimizer, "offload_params": spec.offload_params}
    layout = Layout(ZeroStage(spec.stage), **offload)
    return est.estimate(num_params, layout, BENCH_SCHEME, est.Topology(devices), nvme)


def footprint(
    spec: VariantSpec,
    config: GPTConfig,
    num_params: int,
    batch_size: int,
    devices: int,
    baseline: int,
    activations: ActivationBytes,
    charge_host: bool = False,
    nvme: est.NvmeStaging = est.NvmeStaging(),
) -> Footprint:
    """The predicted peak of a rank training `spec` on a GPT of `config` (Ψ = `num_params`) with
    `batch_size` samples per rank on `devices` ranks; `charge_host`: the budget is host memory, so the
    offloaded state counts too (`nvme` sizes NVMe offload's host buffers)."""
    states = model_states(spec, num_params, devices, nvme)
    return Footprint(
        baseline=baseline,
        setup=BENCH_SCHEME.weight_bytes * num_params,
        model_states=states.device.total + (states.host_per_rank.total if charge_host else 0),
        activations=activations.at(config.n_layer, batch_size),
    )
