"""ZeRO++'s options at construction, in one process: each bad value and combination refused with a
message naming it and what is accepted, when the strategy is built (values, stage, offload) or when
the Trainer / Fabric that holds it is (what needs the world: K against the ranks, one node, the
precision's dtype, hybrid sharding). Every rank builds its own Trainer, so every rank raises alike,
before any process group exists."""

from __future__ import annotations

import pytest
import torch

from lightning_zero import ZeroFabricStrategy, ZeroStrategy
from lightning_zero.engine.comm.quantization import FORMATS
from lightning_zero.engine.config import STRATEGY_NAMES, ZeroConfig
from lightning_zero.engine.zero_plus_plus import NodeLayout, check_quantizable, resolve_secondary_shard_size

STRATEGIES = (ZeroStrategy, ZeroFabricStrategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    "options, message",
    [
        ({"secondary_shard_size": 0}, "`secondary_shard_size` must be None"),
        ({"secondary_shard_size": "nodes"}, "`secondary_shard_size` must be None"),
        ({"secondary_shard_size": True}, "`secondary_shard_size` must be None"),
        ({"secondary_shard_size": 2.0}, "`secondary_shard_size` must be None"),
        ({"quantize_weights": "int4"}, "`quantize_weights` must be False, True"),
        ({"quantize_weights": 8}, "`quantize_weights` must be False, True"),
        ({"quantize_gradients": "fp8"}, "`quantize_gradients` must be False, True"),
        ({"quantize_gradients": "int2"}, "`quantize_gradients` must be False, True"),
        (
            {"secondary_shard_size": 2, "offload_optimizer": True, "offload_params": True},
            "which `offload_params=True` exists to avoid",
        ),
    ],
)
def test_bad_values_are_refused_at_construction(strategy, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        strategy(stage=3, **options)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_plus_plus_options_need_stage_3(strategy, stage):
    for options in ({"quantize_weights": True}, {"quantize_gradients": "int4"}, {"secondary_shard_size": "node"}):
        with pytest.raises(ValueError, match="only applies at stage 3") as err:
            strategy(stage=stage, **options)
        assert f"`{next(iter(options))}`" in str(err.value) and "zero3pp" in str(err.value)


def test_the_options_read_as_formats():
    config = ZeroConfig(stage=3, quantize_weights=True, quantize_gradients=True)
    assert (config.weight_quantization, config.gradient_quantization) == ("int8", "int8")
    config = ZeroConfig(stage=3, quantize_weights="fp8", quantize_gradients="int4")
    assert (config.weight_quantization, config.gradient_quantization) == ("fp8", "int4")
    assert ZeroConfig(stage=3).weight_quantization is None
    # quantization composes with parameter offload (only hpZ's device copy does not)
    ZeroConfig(stage=3, quantize_weights=True, quantize_gradients=True, offload_optimizer=True, offload_params=True)
    assert STRATEGY_NAMES["zero3pp"] == {
        "stage": 3, "secondary_shard_size": "node", "quantize_weights": "int8", "quantize_gradients": "int8"
    }  # fmt: skip


def test_k_is_checked_against_the_world():
    layout = NodeLayout(world_size=8, ranks_per_node=4)
    assert resolve_secondary_shard_size("node", layout) == 4
    assert resolve_secondary_shard_size(2, layout) == 2
    assert resolve_secondary_shard_size(None, layout) is None
    with pytest.raises(ValueError, match=r"`secondary_shard_size=3` \(K = 3\) does not divide the 8 ranks") as err:
        resolve_secondary_shard_size(3, layout)
    assert "(1, 2, 4 here)" in str(err.value)
    with pytest.raises(ValueError, match="K = 8 is every rank"):
        resolve_secondary_shard_size(8, layout)
    with pytest.raises(ValueError, match="one node holds every rank"):
        resolve_secondary_shard_size("node", NodeLayout(world_size=4, ranks_per_node=4))


def _trainer(strategy, **kwargs):
    import lightning.pytorch as pl

    return pl.Trainer(strategy=strategy, accelerator="cpu", logger=False, enable_progress_bar=False, **kwargs)


def test_the_trainer_refuses_what_the_node_layout_cannot_take():
    with pytest.raises(ValueError, match="one node holds every rank") as err:
        _trainer("zero3pp", devices=2)
    assert "strategy='zero3'" in str(err.value)
    with pytest.raises(ValueError, match=r"`secondary_shard_size=3` \(K = 3\) does not divide the 4 ranks"):
        _trainer(ZeroStrategy(stage=3, secondary_shard_size=3), devices=2, num_nodes=2)
    with pytest.raises(ValueError, match="cannot be combined with hybrid sharding"):
        _trainer(ZeroStrategy(stage=3, secondary_shard_size="node", shard_group_size="node"), devices=2, num_nodes=2)
    with pytest.raises(ValueError, match="cannot be combined with hybrid sharding"):
        _trainer(ZeroStrategy(stage=3, quantize_gradients=True, shard_group_size=2), devices=2, num_nodes=2)
    for options in ({"quantize_weights": True}, {"quantize_gradients": "int4"}):
        with pytest.raises(ValueError, match="float32, bfloat16 or float16 parameters, but this model has torch.float64"):
            _trainer(ZeroStrategy(stage=3, **options), devices=2, precision="64-true")
    # what the layout takes: zero3pp on 2 nodes; qwZ/qgZ alone on one node
    trainer = _trainer("zero3pp", devices=2, num_nodes=2)
    assert trainer.strategy.zero_config.secondary_shard_size == "node"
    _trainer(ZeroStrategy(stage=3, quantize_weights="fp8", quantize_gradients="int4"), devices=2, precision="bf16-true")


def test_fabric_refuses_what_the_node_layout_cannot_take():
    from lightning.fabric import Fabric

    with pytest.raises(ValueError, match="one node holds every rank"):
        Fabric(strategy="zero3pp", accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match=r"does not divide the 4 ranks"):
        Fabric(strategy=ZeroFabricStrategy(stage=3, secondary_shard_size=3), accelerator="cpu", devices=2, num_nodes=2)
    with pytest.raises(ValueError, match="torch.float64"):
        Fabric(strategy=ZeroFabricStrategy(stage=3, quantize_weights=True), accelerator="cpu", devices=2, precision="64-true")
    Fabric(strategy="zero3pp", accelerator="cpu", devices=2, num_nodes=2)


def test_parameter_dtypes_quantization_cannot_take_are_named():
    check_quantizable({torch.float32, torch.bfloat16}, "int8", None)
    check_quantizable({torch.float64}, None, None)  # nothing quantized
    with pytest.raises(ValueError, match="`quantize_gradients` quantizes .* torch.float64"):
        check_quantizable({torch.float64, torch.float32}, None, "int4")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_block_formats_round_trip_within_half_a_step_and_keep_zeros_and_non_finite(name):
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 1000, generator=g) * torch.tensor([[1.0], [1e-4], [0.0]])
    packed = fmt.quantize(rows, torch.empty(3, fmt.packed_bytes(1000), dtype=torch.uint8))
    assert packed.shape[1] % 4 == 0
    back = fmt.dequantize(packed, 1000)
    blocks = rows.new_zeros(3, fmt.blocks(1000) * fmt.block)
    blocks[:, :1000] = rows
    scale = blocks.view(3, -1, fmt.block).abs().amax(dim=2, keepdim=True) / fmt.largest
    # int codes: half a step of the block's scale; e4m3: 3 mantissa bits, half an ulp (2^-4 relative)
    bound = (scale / 2).expand(-1, -1, fmt.block) if name != "fp8" else blocks.view(3, -1, fmt.block).abs() / 16 + scale * 2**-9
    error = (back - rows).abs()
    assert torch.all(error <= bound.reshape(3, -1)[:, :1000] * (1 + 1e-6)), name
    assert torch.equal(back[2], torch.zeros(1000))  # a row of zeros comes back as zeros
    assert back.dtype == torch.float32 and fmt.dequantize(packed, 1000, torch.bfloat16).dtype == torch.bfloat16
    rows[0, 3] = float("inf")
    rows[1, 700] = float("nan")
    back = fmt.dequantize(fmt.quantize(rows, torch.empty_like(packed)), 1000)
    first = slice(0, fmt.block)
    assert back[0, first].isnan().all() and back[0, fmt.block :].isfinite().all()  # only the block that held it
    assert back[1, 700].isnan()


def test_int4_packs_two_codes_a_byte():
    fmt = FORMATS["int4"]
    assert fmt.packed_bytes(128) == 4 + 64 and FORMATS["int8"].packed_bytes(256) == 4 + 256
    rows = torch.arange(-7, 8, dtype=torch.float32).repeat(9)[:128].view(1, -1)  # every code, the block's max 7
    back = fmt.dequantize(fmt.quantize(rows, torch.empty(1, fmt.packed_bytes(128), dtype=torch.uint8)), 128)
    assert torch.equal(back, rows)
