"""Stage 3's meta-device build draws the numbers of the usual eager build, ``torch.manual_seed(s);
Model().to(device)`` on the CPU's generator, whatever the compute device (see [Note: meta-device
models] in ``engine/parameters/materialize.py``): each module is initialised on the host and then
moved, one module at a time.

On CPU the test below runs here. On a GPU the same comparison is
:func:`meta_build_against_eager_cpu_build` with ``torch.device("cuda", 0)``, for the GPU tier
(``tests/test_cuda_*.py``) to run as a case of its own: before the fix every layer drew from the
CUDA generator there and no weight matched.
"""

from __future__ import annotations

from typing import Any

import torch


def meta_build_against_eager_cpu_build(device: torch.device) -> dict[str, Any]:
    """A GPT (GPT-2's init in each layer's ``reset_parameters``, a head tied to the embedding) built
    on the meta device and materialized by a stage-3 engine on ``device``, against the same GPT
    built eagerly on the CPU from the same seed: the names of the weights whose bits differ (none
    expected), and how many were compared. One rank; call it where ``device`` exists."""
    from lightning_zero.engine import ZeroConfig, ZeroEngine
    from lightning_zero.models.gpt import GPT, GPTConfig

    config = GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=32, init_per_layer=True)
    torch.manual_seed(0)
    eager = GPT(config).state_dict()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built from the meta model, as Lightning's
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3), device=device)
    materialized = engine.full_state_dict(model)  # gathered a unit at a time, copied to the CPU
    on_device = all(p.device == device for p in (sp.param for sp in engine.params))
    engine.close()
    return {
        "compared": len(eager),
        "mismatched": sorted(k for k, v in eager.items() if not torch.equal(v, materialized[k])),
        "on_device": on_device,
        "tied": model.lm_head.weight is model.wte.weight,
    }


def test_a_meta_build_holds_the_eager_cpu_builds_weights():
    result = meta_build_against_eager_cpu_build(torch.device("cpu"))
    assert result["compared"] > 10 and result["mismatched"] == [], result
    assert result["on_device"] and result["tied"]
