"""The memory estimator's arithmetic against the ZeRO paper's figures, its recommendation, the meta-device
parameter counter and the `lightning-zero estimate` command line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zero import estimate as est
from lightning_zero.engine import ZeroStage
from lightning_zero.cli import model_spec
from lightning_zero.cli import main
from lightning_zero.cli.arguments import parse_count, parse_memory

REPO = Path(__file__).resolve().parents[1]
GPT_FILE = REPO / "src" / "lightning_zero" / "models" / "gpt.py"
GB = 10**9
MIXED, FP32, HALF = (est.precision_scheme(name) for name in ("mixed", "fp32", "half"))


def device_totals(num_params: int, scheme: est.PrecisionScheme, devices: int, nodes: int = 1) -> dict:
    estimates = est.estimate_all(num_params, scheme, est.Topology(devices, nodes))
    return {e.layout.label: e.device.total for e in estimates}


def test_zero_paper_figure_1_per_device():
    # ZeRO paper, figure 1: 7.5B parameters, K = 12, N = 8.
    totals = device_totals(7_500_000_000, MIXED, devices=8)
    assert totals["ddp"] == 120 * GB
    assert totals["zero1"] == pytest.approx(41.25 * GB, rel=1e-12)
    assert totals["zero2"] == pytest.approx(28.125 * GB, rel=1e-12)
    assert totals["zero3"] == 15 * GB


def test_fp32_and_half_schemes_under_ddp():
    assert device_totals(7_000_000_000, FP32, devices=8)["ddp"] == 112 * GB
    # Half precision with no fp32 master copy: 2 + 2 + 8 bytes per parameter.
    assert device_totals(7_240_000_000, HALF, devices=8)["ddp"] == pytest.approx(86.88 * GB, rel=1e-12)


def test_breakdown_by_term_for_each_stage():
    psi, n = 8_000, 4
    by_label = {e.layout.label: e for e in est.estimate_all(psi, MIXED, est.Topology(n))}
    assert by_label["ddp"].device == est.StateBytes(2 * psi, 2 * psi, 12 * psi)
    assert by_label["zero1"].device == est.StateBytes(2 * psi, 2 * psi, 12 * psi // n)
    assert by_label["zero2"].device == est.StateBytes(2 * psi, 2 * psi // n, 12 * psi // n)
    assert by_label["zero3"].device == est.StateBytes(2 * psi // n, 2 * psi // n, 12 * psi // n)
    assert all(e.host.total == 0 for label, e in by_label.items() if "offload" not in label)


def test_offload_moves_terms_to_the_host_of_each_node():
    psi, devices, nodes = 16_000, 4, 2
    n = devices * nodes
    by_label = {e.layout.label: e for e in est.estimate_all(psi, MIXED, est.Topology(devices, nodes))}

    zero2 = by_label["zero2 + offload optimizer"]
    assert zero2.device == est.StateBytes(2 * psi, 2 * psi // n, 0)
    # The host holds the optimizer shards of the node's `devices` ranks, not of all n.
    assert zero2.host == est.StateBytes(optimizer_state=devices * 12 * psi // n)

    zero3 = by_label["zero3 + offload optimizer, params"]
    assert zero3.device == est.StateBytes(0, 2 * psi // n, 0)
    assert zero3.host == est.StateBytes(parameters=devices * 2 * psi // n, optimizer_state=devices * 12 * psi // n)


def test_uneven_shards_round_up():
    # 10 parameters on 4 ranks: chunks of 3, 3, 3, 1 padded to 3; the estimate is the largest rank's.
    assert est.shard_numel(10, 4) == 3
    zero3 = est.estimate(10, est.Layout(ZeroStage.PARAMETERS), FP32, est.Topology(4))
    assert zero3.device.total == 3 * FP32.total_bytes


@pytest.mark.parametrize(
    ("gpu_memory", "expected"),
    [
        (80 * GB, "zero1"),  # DDP needs 120 GB
        (30 * GB, "zero2"),  # 28.125 GB
        (20 * GB, "zero3"),  # 15 GB
        (10 * GB, "zero3 + offload optimizer"),  # 3.75 GB; zero1/zero2 with offload still need 30/16.875
        (2 * GB, "zero3 + offload optimizer, params"),  # 1.875 GB
    ],
)
def test_recommend_prefers_lower_stages_then_offload(gpu_memory, expected):
    estimates = est.estimate_all(7_500_000_000, MIXED, est.Topology(8))
    recommendation = est.recommend(estimates, gpu_memory)
    assert recommendation.choice is not None
    assert recommendation.choice.layout.label == expected
    assert expected in recommendation.message
    assert "activations" in recommendation.message  # says what the estimate leaves out


def test_recommend_says_when_nothing_fits_and_respects_host_memory():
    estimates = est.estimate_all(7_500_000_000, MIXED, est.Topology(8))
    nothing = est.recommend(estimates, 1 * GB)
    assert nothing.choice is None
    assert "No layout fits" in nothing.message and "1.875 GB" in nothing.message

    # Offloading the optimizer needs 90 GB of host memory on the node: with 64 GB no offload layout
    # fits, and at 10 GB per device no on-device layout does either.
    assert est.recommend(estimates, 10 * GB, host_memory=64 * GB).choice is None
    assert est.recommend(estimates, 10 * GB, host_memory=100 * GB).choice.layout.label == "zero3 + offload optimizer"


def test_invalid_configurations_are_refused():
    with pytest.raises(ValueError, match="DDP has no offload"):
        est.Layout(ZeroStage.NOTHING, offload_optimizer=True)
    with pytest.raises(ValueError, match="needs stage 3"):
        est.Layout(ZeroStage.GRADIENTS, offload_optimizer=True, offload_params=True)
    with pytest.raises(ValueError, match="offload_optimizer=True"):
        est.Layout(ZeroStage.PARAMETERS, offload_params=True)
    with pytest.raises(ValueError, match="mixed, fp32, half"):
        est.precision_scheme("fp16")
    with pytest.raises(ValueError, match="at least 1"):
        est.Topology(devices=0)


def test_format_bytes():
    assert est.format_bytes(28_125_000_000) == "28.125 GB"
    assert est.format_bytes(120 * GB) == "120 GB"
    assert est.format_bytes(16_000_000) == "16 MB"


# --- counting parameters on the meta device ---------------------------------------------------------


def test_meta_count_of_example_gpt_matches_the_real_model():
    from lightning_zero.models import gpt

    shape = {"block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32}
    real = gpt.GPT(gpt.GPTConfig(**shape))
    real_count = sum(p.numel() for p in real.parameters())
    # The tied LM head shares the token embedding's tensor: counted once, not twice.
    every_reference = sum(p.numel() for _, p in real.named_parameters(remove_duplicate=False))
    assert every_reference - real_count == 256 * 32

    counted = model_spec.count_parameters(f"{GPT_FILE}:GPT", {"config": shape})
    assert counted == real_count == real.num_parameters()
    as_json = '{"config": {"block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32}}'
    assert model_spec.count_parameters("lightning_zero.models.gpt:GPT", as_json) == real_count


def test_meta_count_allocates_nothing():
    # 10^10 fp32 parameters would need 40 GB if they were real.
    assert model_spec.count_parameters("torch.nn:Linear", {"in_features": 100_000, "out_features": 100_000}) == 10**10 + 10**5
    assert torch.empty(0).device.type == "cpu"  # the meta device context does not leak



@pytest.mark.parametrize(
    ("spec", "init_args", "message"),
    [
        ("torch.nn.Linear", None, "not of the form package.module:Class"),
        ("torch.nn:", None, "not of the form"),
        ("no_such_module_xyz:Net", None, "cannot import module 'no_such_module_xyz'"),
        ("torch.nn:NoSuchLayer", None, "has no attribute 'NoSuchLayer'"),
        ("missing/file.py:Net", None, "does not exist"),
        ("torch.nn:Linear", '{"in_features": 3', "not valid JSON"),
        ("torch.nn:Linear", "[3, 4]", "must be a JSON object"),
        ("torch.nn:Linear", '{"in_features": 3, "out_feat": 4}', "unexpected keyword argument 'out_feat'"),
        ("torch:float32", None, "not a class"),
    ],
)
def test_bad_model_specs_say_what_is_wrong(spec, init_args, message):
    with pytest.raises(model_spec.ModelSpecError, match=message):
        model_spec.count_parameters(spec, init_args)


# --- the command line -------------------------------------------------------------------------------


def test_cli_plain_output_has_the_figures(capsys):
    assert main(["estimate", "--params", "7.5e9", "--devices", "8", "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # not a terminal: no rich styling
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()}
    assert rows["ddp"][1] == "120.000"
    assert rows["zero1"][1] == "41.250"
    assert rows["zero2"][1] == "28.125"
    assert rows["zero3"][1] == "15.000"
    assert "Recommended for 80 GB per device: zero1" in out


def test_cli_counts_a_model(capsys):
    init_args = '{"config": {"n_layer": 1, "n_embd": 32, "n_head": 2}}'
    args = ["estimate", "--model", f"{GPT_FILE}:GPT", "--init-args", init_args]
    assert main(args + ["--devices", "2", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    expected = model_spec.count_parameters(f"{GPT_FILE}:GPT", {"config": {"n_layer": 1, "n_embd": 32, "n_head": 2}})
    assert f"Model states of {expected:,} parameters, precision fp32" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--params", "lots", "--devices", "8"], "expected a positive whole number such as"),
        (["--params", "1.5", "--devices", "8"], "not a whole number of parameters"),
        (["--params", "7e9", "--devices", "0"], "not a positive whole number"),
        (["--params", "7e9", "--devices", "8", "--gpu-memory", "80XB"], "units B, KB, MB, GB"),
        (["--params", "7e9", "--devices", "8", "--precision", "fp16"], "choose from 'mixed', 'fp32', 'half'"),
        (["--devices", "8"], "one of the arguments --params --model is required"),
        (["--params", "7e9", "--model", "a:B", "--devices", "8"], "not allowed with argument"),
        (["--params", "7e9", "--init-args", "{}", "--devices", "8"], "--init-args needs --model"),
        (["--model", "no_such_module_xyz:Net", "--devices", "8"], "cannot import module"),
        (["--model", "torch.nn:Linear", "--init-args", "{oops", "--devices", "8"], "not valid JSON"),
    ],
)
def test_cli_bad_input_exits_2_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: lightning-zero estimate" in err
    assert message in err


def test_argument_parsers():
    assert parse_count("7.24e9") == 7_240_000_000
    assert parse_count("7.5B") == parse_count("7_500_000_000") == 7_500_000_000
    assert parse_count("125M") == 125_000_000
    assert parse_memory("80") == parse_memory("80GB") == parse_memory("80 gb") == 80 * GB
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("512MB") == 512 * 10**6


def test_python_dash_m_piped_output():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "lightning_zero", "estimate", "--params", "7e9", "--devices", "8"]
        + ["--precision", "fp32"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "112.000" in result.stdout and "\x1b[" not in result.stdout
