"""Construction-time behaviour in one process: validation, registry, LightningCLI parsing."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys

import pytest

import lightning_zero
from lightning_zero import ZeroStrategy


@pytest.mark.parametrize("stage", [0, 4, "2", 2.5, 3.0, 2.0, True, None])
def test_bad_stage_is_refused_at_construction(stage):
    with pytest.raises(ValueError, match="must be one of 1, 2 or 3"):
        ZeroStrategy(stage=stage)


@pytest.mark.parametrize(
    "stage, options",
    [
        (1, {"unit_classes": ["Block"]}),
        (2, {"prefetch_units": 2}),
        (2, {"min_unit_params": 1000}),
        (1, {"check_units_every_gather": False}),
        (2, {"unit_classes": ["Block"], "prefetch_units": 0}),
    ],
)
def test_stage_3_options_at_stages_1_and_2_are_refused(stage, options):
    with pytest.raises(ValueError, match="only appl(y|ies) at stage 3") as err:
        ZeroStrategy(stage=stage, **options)
    for name in options:
        assert f"`{name}`" in str(err.value)
    ZeroStrategy(stage=3, **options)  # where they do apply


def test_fused_host_step_without_offload_is_refused():
    with pytest.raises(ValueError, match="only applies with `offload_optimizer=True`"):
        ZeroStrategy(stage=2, fused_host_step=True)
    ZeroStrategy(stage=2, fused_host_step=True, offload_optimizer=True)


NVME_REFUSALS = [
    ({"stage": 2, "offload_optimizer": "nvme"}, "needs `nvme_path`: an existing directory"),
    ({"stage": 2, "offload_optimizer": "disk"}, "must be False, True \\(or 'cpu': host memory\\) or 'nvme'"),
    ({"stage": 3, "offload_optimizer": True, "offload_params": "nvme"}, "`offload_params='nvme'` .* needs `offload_optimizer='nvme'` \\(got `offload_optimizer=True`\\)"),
    ({"stage": 3, "offload_optimizer": "nvme", "offload_params": "disk", "nvme_path": "/tmp"}, "`offload_params` must be False, True \\(or 'cpu'"),
    ({"stage": 2, "offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": "/tmp"}, "`offload_params='nvme'` needs stage 3"),
    ({"stage": 2, "nvme_path": "/tmp"}, "`nvme_path` only applies with `offload_optimizer='nvme'`"),
    ({"stage": 2, "offload_optimizer": True, "nvme_buffer_count": 8}, "`nvme_buffer_count` only applies"),
    ({"stage": 2, "offload_optimizer": "nvme", "nvme_path": "/tmp", "nvme_buffer_count": 1}, "at least 2, got 1"),
]


@pytest.mark.parametrize(("options", "message"), NVME_REFUSALS)
def test_bad_nvme_options_are_refused_at_construction(options, message, monkeypatch):
    from lightning_zero import ZeroFabricStrategy

    monkeypatch.delenv("LIGHTNING_ZERO_NVME_PATH", raising=False)
    for strategy in (ZeroStrategy, ZeroFabricStrategy):
        with pytest.raises(ValueError, match=message):
            strategy(**options)


def test_offload_tiers_by_name(monkeypatch):
    assert ZeroStrategy(stage=2, offload_optimizer="cpu").zero_config.offload_optimizer is True
    config = ZeroStrategy(stage=2, offload_optimizer="nvme", nvme_path="/scratch").zero_config
    assert config.optimizer_state_on_disk and config.nvme_path == "/scratch"
    monkeypatch.setenv("LIGHTNING_ZERO_NVME_PATH", "/from/the/environment")
    assert ZeroStrategy(stage=2, offload_optimizer="nvme").zero_config.nvme_path == "/from/the/environment"


@pytest.mark.parametrize("size", [0, -1, float("nan"), float("inf")])
def test_bad_bucket_size_is_refused(size):
    with pytest.raises(ValueError, match="positive, finite number of MiB"):
        ZeroStrategy(bucket_size_mb=size)


@pytest.mark.parametrize("size", ["10", None, True])
def test_bucket_size_must_be_a_number(size):
    with pytest.raises(TypeError, match="positive number of MiB"):
        ZeroStrategy(bucket_size_mb=size)


def test_registered_names_and_reimport_is_harmless():
    from lightning.pytorch.strategies import StrategyRegistry

    importlib.reload(lightning_zero)
    importlib.reload(lightning_zero)
    for name, stage in (("zero1", 1), ("zero2", 2)):
        assert name in StrategyRegistry
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, lightning_zero.ZeroStrategy) and strategy.stage == stage


def test_the_names_are_registered_whichever_comes_first_and_the_console_tools_start_without_lightning():
    """In a fresh interpreter: ``import lightning_zero`` and the console tools' and benchmark ranks'
    modules leave Lightning and torch.distributed.checkpoint unimported (they need the engine
    alone); the package's checkpoint functions import it on first use; importing Lightning
    afterwards registers every name in both registries, as importing it first does (the tests'
    processes)."""
    code = """
import sys
import lightning_zero
import lightning_zero.cli, lightning_zero.bench.worker, lightning_zero.estimate
assert "lightning" not in sys.modules, sorted(m for m in sys.modules if m.startswith("lightning."))
assert "torch.distributed.checkpoint" not in sys.modules and "lightning_zero.checkpoint" not in sys.modules
from lightning_zero import checkpoint_file, convert_checkpoint
assert convert_checkpoint is sys.modules["lightning_zero.checkpoint"].convert_checkpoint
import lightning
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from lightning_zero.engine.config import STRATEGY_NAMES
missing = [n for n in STRATEGY_NAMES if n not in StrategyRegistry or n not in STRATEGY_REGISTRY]
assert not missing, missing
print(type(lightning.Trainer(strategy="zero3_offload_nvme_params", accelerator="cpu", devices=1, logger=False).strategy).__name__)
"""
    env = {**os.environ, "LIGHTNING_ZERO_NVME_PATH": "/tmp"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ZeroStrategy"]


def test_trainer_accepts_the_names():
    import lightning as L

    trainer = L.Trainer(strategy="zero1", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.stage == 1


def test_constructor_has_explicit_typed_documented_arguments():
    signature = inspect.signature(ZeroStrategy.__init__)
    kinds = {p.kind for p in signature.parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds
    for name, parameter in signature.parameters.items():
        if name == "self":
            continue
        assert parameter.annotation is not inspect.Parameter.empty, name
        assert f"    {name}:" in ZeroStrategy.__doc__, f"{name} is not documented"


def test_lightning_cli_parses_name_and_class_path(tmp_path):
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    cli = LightningCLI(BoringModel, run=False, args=["--trainer.strategy=zero2", "--trainer.accelerator=cpu", "--trainer.logger=false"])
    assert isinstance(cli.trainer.strategy, ZeroStrategy) and cli.trainer.strategy.stage == 2

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  logger: false\n  strategy:\n    class_path: lightning_zero.ZeroStrategy\n"
        "    init_args:\n      stage: 1\n      bucket_size_mb: 4.5\n"
    )
    cli = LightningCLI(BoringModel, run=False, args=["--config", str(config)])
    assert cli.trainer.strategy.stage == 1 and cli.trainer.strategy.zero_config.bucket_size_mb == 4.5

    bad = tmp_path / "bad.yaml"
    bad.write_text(config.read_text().replace("stage: 1", "stage: 5"))
    with pytest.raises((SystemExit, ValueError)):
        LightningCLI(BoringModel, run=False, args=["--config", str(bad)])

    # NVMe offload: the "nvme" tier and its directory in a config; the registered name reads the variable
    nvme = tmp_path / "nvme.yaml"
    nvme.write_text(
        config.read_text().replace("stage: 1", f"stage: 3\n      offload_optimizer: nvme\n      offload_params: true\n      nvme_path: {tmp_path}")
    )
    cli = LightningCLI(BoringModel, run=False, args=["--config", str(nvme)])
    zero_config = cli.trainer.strategy.zero_config
    assert (zero_config.offload_optimizer, zero_config.nvme_path, zero_config.nvme_buffer_count) == ("nvme", str(tmp_path), 4)
    os.environ["LIGHTNING_ZERO_NVME_PATH"] = str(tmp_path)
    try:
        cli = LightningCLI(BoringModel, run=False, args=["--trainer.strategy=zero3_offload_nvme", "--trainer.accelerator=cpu"])
    finally:
        del os.environ["LIGHTNING_ZERO_NVME_PATH"]
    assert cli.trainer.strategy.zero_config.nvme_path == str(tmp_path)


def test_custom_precision_plugin_is_refused():
    from lightning.pytorch.plugins.precision import Precision

    from lightning_zero.lightning.precision import check_precision_supported

    class Custom(Precision):
        pass

    with pytest.raises(ValueError, match="norm of this rank's shard"):
        check_precision_supported(Custom())
