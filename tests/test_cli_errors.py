"""``ZeroCLI``'s errors about ``--trainer.strategy``, in this process (no rank starts): each is the
only line on stderr, with exit status 2, where LightningCLI prints 50-80 lines of usage and union
errors, or a traceback; an error about anything else is LightningCLI's, unchanged. The strings are
what a user sees, so they are compared whole."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

from lightning_zero import ZeroCLI

PREFIX = "error: trainer.strategy (lightning_zero.ZeroStrategy): "


def _cli_error(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """stderr of ``fit`` with ``args``, which must exit with status 2 before training."""
    monkeypatch.setattr(sys, "argv", ["train.py"])  # the arguments come from `args` alone
    with pytest.raises(SystemExit) as exited:
        ZeroCLI(BoringModel, BoringDataModule, args=["fit", *args], trainer_defaults={"accelerator": "cpu", "logger": False})
    assert exited.value.code == 2
    return capsys.readouterr().err


def _config(tmp_path: Path, init_args: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(f"trainer:\n  strategy:\n    class_path: lightning_zero.ZeroStrategy\n    init_args:\n{init_args}")
    return str(path)


def test_an_option_that_does_not_parse_names_what_it_accepts(capsys, monkeypatch, tmp_path):
    # jsonargparse: "Expected a <class 'float'>. Got value: big", as the second of the union's errors, after 55 lines of usage
    message = f"{PREFIX}`bucket_size_mb` must be a positive number of MiB, got 'big'.\n"
    assert _cli_error(capsys, monkeypatch, "--config", _config(tmp_path, "      bucket_size_mb: big\n")) == message
    strategy = "--trainer.strategy=lightning_zero.ZeroStrategy"
    assert _cli_error(capsys, monkeypatch, strategy, "--trainer.strategy.bucket_size_mb=big") == message
    # options of several types: jsonargparse's union errors, nested one level deeper
    assert _cli_error(capsys, monkeypatch, strategy, "--trainer.strategy.offload_optimizer=maybe") == (
        f"{PREFIX}`offload_optimizer` must be False, True (or 'cpu': host memory) or 'nvme' (files under `nvme_path`), got 'maybe'.\n"
    )
    assert _cli_error(capsys, monkeypatch, strategy, "--trainer.strategy.unit_classes=Block") == (
        f"{PREFIX}`unit_classes` must be a list of module class names such as ['Block'], got 'Block'.\n"
    )
    # an option the strategy does not check itself: jsonargparse's own reasons, on the one line
    assert _cli_error(capsys, monkeypatch, strategy, "--trainer.strategy.timeout=soon") == (
        f'{PREFIX}`timeout`: Not of type timedelta: Expected a string with form "h:m:s" or "d days, h:m:s" but got'
        " \"soon\"; Expected a <class 'NoneType'>\n"
    )


def test_an_option_the_strategy_refuses_is_one_line_not_a_traceback(capsys, monkeypatch, tmp_path):
    assert _cli_error(capsys, monkeypatch, "--config", _config(tmp_path, "      bucket_size_mb: -1\n")) == (
        f"{PREFIX}`bucket_size_mb` must be a positive, finite number of MiB, got -1.0.\n"
    )
    stage_2 = _config(tmp_path, "      stage: 2\n      unit_classes: [Block]\n")  # a zero3 config switched to stage 2
    assert _cli_error(capsys, monkeypatch, "--config", stage_2) == (
        f"{PREFIX}`unit_classes` only applies at stage 3 (how parameters are gathered), but `stage=2` keeps full"
        " parameters on every rank. Remove them, or use `stage=3`.\n"
    )


def test_options_given_to_a_registered_name_say_how_to_give_them(capsys, monkeypatch):
    # jsonargparse: "Expected a dot import path string: zero3_offload"
    assert _cli_error(capsys, monkeypatch, "--trainer.strategy=zero3_offload", "--trainer.strategy.bucket_size_mb=8") == (
        "error: trainer.strategy: 'zero3_offload' is a registered name, which takes no options (`bucket_size_mb` given)."
        " HINT: give its class with the name's options, then yours: --trainer.strategy=lightning_zero.ZeroStrategy"
        " --trainer.strategy.stage=3 --trainer.strategy.offload_optimizer=true --trainer.strategy.offload_params=true"
        " --trainer.strategy.bucket_size_mb=... (in YAML: `class_path` and `init_args`, as configs/zero_class_path.yaml).\n"
    )
    err = _cli_error(capsys, monkeypatch, "--trainer.strategy=zero2", "--trainer.strategy.bucket_size_mb=8")
    assert "yours: --trainer.strategy=lightning_zero.ZeroStrategy --trainer.strategy.stage=2 --trainer.strategy.bucket_size_mb=..." in err


def test_a_misspelled_strategy_name_gets_the_closest_names(capsys, monkeypatch):
    # Lightning: "You selected an invalid strategy name: `strategy='zer03'`. ... Example choices: auto, ddp, ddp_spawn, deepspeed, ..."
    assert _cli_error(capsys, monkeypatch, "--trainer.strategy=zer03") == (
        "error: trainer.strategy: 'zer03' is not a registered strategy name (Lightning: \"You selected an invalid"
        " strategy name\"). HINT: did you mean 'zero3' or 'zero3pp' or 'zero2'? lightning-zero registers zero1, zero2,"
        " zero3, zero2_offload, zero3_offload, zero3_offload_nvme, zero3_offload_nvme_params, zero3pp (each also with _spawn"
        " and _notebook), or give the class: lightning_zero.ZeroStrategy.\n"
    )


def test_other_errors_are_lightning_clis(capsys, monkeypatch):
    err = _cli_error(capsys, monkeypatch, "--trainer.max_steps=many")
    assert err.startswith("usage: ") and err.endswith(
        "error: Parser key \"trainer.max_steps\":\n  Expected a <class 'int'>. Got value: many\n"
    ), err[-300:]


def test_an_option_of_ours_after_a_default_ddp_points_to_zero_strategy(capsys, monkeypatch):
    """A script whose default strategy is ``ddp`` (examples/train_gpt.py's), given only
    ``--trainer.strategy.bucket_size_mb``: DDPStrategy has no such option, ZeroStrategy has."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit):
        ZeroCLI(BoringModel, BoringDataModule, args=["fit", "--trainer.strategy.bucket_size_mb=8"], trainer_defaults={"strategy": "ddp"})
    assert capsys.readouterr().err == (
        "error: trainer.strategy: 'ddp' is a registered name, which takes no options (`bucket_size_mb` given), and"
        " `bucket_size_mb` is not an option of DDPStrategy. HINT: it is lightning-zero's:"
        " --trainer.strategy=lightning_zero.ZeroStrategy --trainer.strategy.stage=3 --trainer.strategy.bucket_size_mb=..."
        " (or stage 1 or 2; in YAML: `class_path` and `init_args`, as configs/zero_class_path.yaml).\n"
    )


def test_zero3pp_on_one_node_is_one_line(capsys, monkeypatch):
    """The Trainer refuses ZeRO++'s options against the nodes it is given (here one): ZeroCLI prints
    its message alone, where LightningCLI showed a traceback."""
    assert _cli_error(capsys, monkeypatch, "--trainer.strategy=zero3pp", "--trainer.devices=1") == (
        "error: trainer.strategy: `secondary_shard_size='node'`: one node holds every rank, so backward's gather"
        " already stays within the node and a secondary shard would be a whole second copy of each unit. hpZ (and"
        " `strategy='zero3pp'`) is for runs of several nodes; on one node use `strategy='zero3'`.\n"
    )
