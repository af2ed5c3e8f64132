"""scripts/gpu_check.sh (issue 26's one command for a GPU machine): its dry run end to end on the
CPU, and the verdicts scripts/gpu_summary.py gives from the figures the steps leave."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DRY_STEPS = ["cuda-tier", "overhead-fp32", "offload", "nvme", "capacity", "zeropp"]
"""The dry run's steps: on the GPU the tier is a step per module and the overhead two (see gpu_check.sh)."""


def load_summary_module():
    spec = importlib.util.spec_from_file_location("gpu_summary", REPO / "scripts" / "gpu_summary.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The dry run's output and the folder it wrote."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--pack"], capture_output=True, text=True, env=env, timeout=360  # above the dry run's step limits (5 x 60 s + 30 s): a slow step is named in its summary
    )
    return done, out


def test_dry_run_runs_every_step_and_packs_its_output(dry_run):
    done, tmp_path = dry_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    # what the device machine brings back: a few files, no deep folders
    assert sorted(p.name for p in tmp_path.iterdir()) == ["detail.tar.gz", "gpu-check.log", "summary.json", "summary.md"]
    first = done.stdout.splitlines()[:5]
    assert first[0].startswith("python ") and first[1].startswith("torch ") and first[2].startswith("GPU: ")
    assert first[3].startswith("lightning ") and first[4].startswith("jsonargparse: "), first
    assert (tmp_path / "gpu-check.log").read_text() == done.stdout

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dry_run"] is True
    assert [(s["name"], s["outcome"]) for s in summary["steps"]] == [(name, "ok") for name in DRY_STEPS]
    targets = {row["check"]: row["verdict"] for row in summary["targets"]}
    # the tier is collected and skipped, with its reason; every target of the steps run got a figure
    assert summary["tier"]["tests"] == summary["tier"]["skipped"] > 0 and summary["tier"]["files"] == 1
    assert "no CUDA device" in targets.pop("CUDA tier (tests/test_cuda_*.py)")
    not_run = {check for check in targets if check.endswith("bf16-mixed")}
    assert {targets.pop(check) for check in not_run} == {"NOT MEASURED: step overhead-bf16-mixed did not run"}
    # the dry run's NVMe step runs zero3_offload_nvme_params alone (the pipeline; its ratios are
    # judged in test_nvme_rows_judge_each_tier_against_cpu_offload_in_the_same_run)
    for name in ("zero3_offload_nvme", "zero3_offload_nvme_params"):
        assert targets.pop(f"{name} step time") == "NOT MEASURED: no step time in bench.json"
    # zeropp's tiny units on the CPU: a verdict each (FAIL, most likely: their bytes are worth microseconds)
    assert len(targets) == 8 and all(verdict in ("PASS", "FAIL") for verdict in targets.values()), targets
    assert "| `zero3` |" in "\n".join(summary["capacity"])
    # the concurrency checks were skipped with the tier: their section says so
    assert summary["concurrency"] == ["NOT MEASURED: no concurrency/figures.json (the tier's concurrency cases did not run)"]
    assert "**Dry run**" in (tmp_path / "summary.md").read_text()
    assert "## Concurrency on the GPU" in (tmp_path / "summary.md").read_text()

    with tarfile.open(tmp_path / "detail.tar.gz") as packed:
        names = set(packed.getnames())
        (nvme,) = json.load(packed.extractfile("detail/nvme/bench.json"))["variants"]
    for name in (
        "steps.tsv", "versions.json", "offload_gpu.json", "overhead/fp32/bench.json", "nvme/bench.json", "capacity/bench.json",
        "zeropp_gpu.json",
    ):  # fmt: skip
        assert f"detail/{name}" in names, name
    assert {f"detail/logs/{step}.log" for step in DRY_STEPS} <= names
    # the NVMe step trained with the chunks and the moments in files, in a directory outside $OUT
    assert nvme["name"] == "zero3_offload_nvme_params" and nvme["status"] == "ok", nvme.get("reason")
    assert nvme["disk"]["read_bytes_per_step"] > 0 and not any("nvme-files" in n or n.endswith(".bin") for n in names)


def test_the_offload_step_runs_offload_gpu_py_end_to_end_and_writes_every_figure(dry_run):
    """scripts/offload_gpu.py (issue 12's GPU check) on the CPU with a tiny GPT, as the dry run's
    offload step runs it: every figure, and the offloaded state's bytes where they belong."""
    _, out = dry_run
    with tarfile.open(out / "detail.tar.gz") as packed:
        summary = json.load(packed.extractfile("detail/offload_gpu.json"))
        printed = packed.extractfile("detail/logs/offload.log").read().decode()
    for key in ("environment", "model", "zero3", "zero3_offload", "cpu_adamw", "prediction", "largest", "ratio"):
        assert key in summary, key
    for variant in ("zero3", "zero3_offload"):
        assert len(summary[variant]["step_times_s"]) == 3 and summary[variant]["median_step_s"] > 0  # warmup 1, steps 2
    assert summary["cpu_adamw"]["elements"] == summary["model"]["params"] == summary["zero3"]["params"]
    assert summary["ratio"] > 0 and summary["ratio_target"] == 1.25
    # The target: with fp32 weights and parameters offloaded, no model state on the device.
    assert summary["offload_device_model_state_bytes"] == 0 and summary["device_model_state_met"] is True
    assert summary["zero3"]["model_state_host_bytes"] == 0 < summary["zero3_offload"]["model_state_host_bytes"]
    prediction = summary["prediction"]["zero3_offload"]
    assert prediction["layout"] == "zero3 + offload optimizer, params" and prediction["params"] > 0
    assert summary["largest"]["tries"] == [] and summary["largest"]["skipped"] == "no sizes"
    assert "| zero3_offload / max(zero3, CPU step) |" in printed  # the markdown table
    for variant in ("zero3_offload", "zero3_offload_clip", "zero3_offload_after_backward", "zero3_offload_fused"):
        assert summary[variant]["median_step_s"] > 0 and 0 < summary[variant]["share_of_zero3_speed"]
    assert summary["cpu_adamw_fused"]["elements"] == summary["cpu_adamw"]["elements"]  # both kernels, the same chunks
    assert summary["zero3_offload"]["host_step"]["ahead"] == 3 and summary["zero3_offload_after_backward"]["host_step"] is None


# ---- the summary from fixture figures ----------------------------------------------------------------


def _bench(ratios: dict[str, float], ddp_ms: float = 100.0, syncs: int = 0) -> dict:
    variants = [{"name": "ddp", "status": "ok", "step_time_s": ddp_ms / 1e3, "step_time_ratio_to_ddp": 1.0}]
    for name, ratio in ratios.items():
        variants.append({
            "name": name, "status": "ok", "step_time_s": ratio * ddp_ms / 1e3, "step_time_ratio_to_ddp": ratio,
            "host_syncs_ours_forward_backward": syncs, "host_syncs_ours_per_step": 1, "reason": None,
        })  # fmt: skip
    return {"options": {"command": "lightning-zero bench ..."}, "variants": variants}


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="0" tests="3">
<testcase classname="test_cuda_engine" name="test_ok"/>
<testcase classname="test_cuda_engine" name="test_also_ok"/>
<testcase classname="test_cuda_engine" name="test_pinned[zero3_offload]"><failure message="AssertionError: not pinned&#10;more">trace</failure></testcase>
</testsuite></testsuites>
"""


@pytest.fixture
def figures(tmp_path) -> Path:
    """A check's output where some targets pass, some fail and one step ran out of time."""
    detail = tmp_path / "detail"
    (detail / "overhead" / "fp32").mkdir(parents=True)
    (detail / "capacity").mkdir()
    steps = [
        ("cuda-tier-engine", 1, 40, 45), ("cuda-tier-lightning", 0, 80, 100), ("overhead-fp32", 0, 30, 45),
        ("overhead-bf16-mixed", 124, 45, 45), ("offload", 0, 50, 70),
    ]  # fmt: skip
    (detail / "steps.tsv").write_text("".join(f"{n}\t{s}\t{t}\t{limit}\n" for n, s, t, limit in steps))
    (detail / "cuda-tier-engine.xml").write_text(JUNIT)
    passing = '<testsuite name="pytest" errors="0" failures="0" skipped="0" tests="2"><testcase name="a"/><testcase name="b"/></testsuite>'
    (detail / "cuda-tier-lightning.xml").write_text(passing)
    (detail / "overhead" / "fp32" / "bench.json").write_text(json.dumps(_bench({"zero1": 1.02, "zero2": 1.04, "zero3": 1.1})))
    offload = {
        "ratio": 1.69, "ratio_target": 1.25, "offload_device_model_state_bytes": 0,
        "zero3": {"median_step_s": 1.0}, "zero3_offload": {"median_step_s": 1.69}, "cpu_adamw": {"median_step_s": 0.3},
    }  # fmt: skip
    (detail / "offload_gpu.json").write_text(json.dumps(offload))
    (detail / "versions.json").write_text(json.dumps({
        "python": "3.12.3", "executable": "python3", "torch": "2.11.0+cu130", "cuda": "13.0", "gpus": 1,
        "gpu": "NVIDIA H200", "lightning": "2.6.6", "jsonargparse": False, "dry_run": False,
    }))  # fmt: skip
    return tmp_path


def test_summary_gives_each_target_its_figure_and_verdict(figures):
    gpu_summary = load_summary_module()
    summary = gpu_summary.summarize(figures, dry_run=False)
    rows = {row["check"]: row for row in summary["targets"]}
    assert rows["CUDA tier (tests/test_cuda_*.py)"]["verdict"] == "FAIL"
    assert rows["CUDA tier (tests/test_cuda_*.py)"]["measured"] == "4 passed, 1 failed, 0 skipped"  # both files
    assert summary["tier"]["failed"] == ["test_pinned[zero3_offload]: AssertionError: not pinned"]
    assert rows["zero1 step time, fp32"]["verdict"] == "PASS"
    assert rows["zero1 step time, fp32"]["measured"] == "1.02× (102.0 ms vs DDP 100.0 ms)"
    assert rows["zero2 step time, fp32"]["verdict"] == "FAIL"  # 1.04 > 1.03
    assert rows["zero2 step time, fp32"]["target"] == "≤ 1.03× DDP"
    assert rows["zero3 step time, fp32"]["verdict"] == "PASS"  # 1.10 <= 1.15
    assert rows["our host syncs, fp32"]["verdict"] == "PASS"
    assert rows["zero3 step time, bf16-mixed"]["verdict"] == "NOT MEASURED: step overhead-bf16-mixed timed out after 45 s"
    ratio = rows["zero3_offload step / max(zero3 step, CPU AdamW step alone)"]
    assert ratio["verdict"] == "FAIL" and ratio["measured"] == "1.69 (1.690 s / max(1.000 s, 0.300 s))"
    assert rows["device model state, zero3_offload"]["verdict"] == "PASS"
    assert summary["capacity"] == ["NOT MEASURED: step capacity did not run"]

    text = gpu_summary.markdown(summary)
    assert rows["zero3_offload_nvme step time"]["verdict"] == "NOT MEASURED: step nvme did not run"
    assert rows["qwZ kernels per unit, against the link time saved"]["verdict"] == "NOT MEASURED: step zeropp did not run"
    assert "## Targets: 4 passed, 3 failed, 7 not measured" in text
    assert "jsonargparse: MISSING" in text and "Dry run" not in text
    assert "| overhead-bf16-mixed | timed out after 45 s | 45 (45) |" in text


def test_summary_of_a_check_that_left_nothing(tmp_path):
    gpu_summary = load_summary_module()
    summary = gpu_summary.summarize(tmp_path, dry_run=False)
    assert all(row["verdict"].startswith("NOT MEASURED") for row in summary["targets"])
    assert "## Targets: 0 passed, 0 failed, 14 not measured" in gpu_summary.markdown(summary)
    assert summary["concurrency"] == ["NOT MEASURED: step cuda-tier did not run"]


CONCURRENCY = {
    "one_gpu": {
        "n1_zero3_nccl": {"max_diff": 0.0, "error": None},
        "n1_zero3_offload_nccl": {"max_diff": None, "error": "the summoned run, step 3: RuntimeError: received a gradient after"},
        "late_peer_zero3_offload": {
            "sleep_ms": 20.0, "lead_ms": 200.0, "buckets": 9, "largest_bucket_mb": 12.03, "bound_mb": 36.08, "step1_ratio": 1.04,
            "backward_ms_on_time": [2.5, 2.0, 2.1], "backward_ms_late": [2.6, 101.0, 99.5],
            "active_rise_mb_on_time": 80.0, "active_rise_mb_late": 81.5, "memory_asserted": False,
            "unpacked_mb_late": [108.3, 108.3, 108.3], "waiting_mb_late": [0.0, 0.0, 0.0],
        },
        "late_peer_zero2_offload": {"failed": "AssertionError: boom"},
        "late_peer_copies": {"h2d_streams": ["13"], "d2h_streams": ["7"], "copies": 40, "trace": "late_peer_zero3_offload.trace.json.gz"},
        "host_grad_data_edits": {
            "diffs": [0.0, 0.0, 0.0, 0.0], "report_without_overlap": None,
            "report": {"ahead": 2, "redone": 2, "after_backward": 0, "reasons": {"gradients changed after backward": 2}},
        },
        "host_unused_unit": {"error": "RuntimeError: The optimizer step was taken during backward"},
        "storage": {
            "max_diff": 0.0, "recompiles": 0,
            "allocator": {"unit_allocs": 40, "unit_frees": 40, "counts": dict.fromkeys(
                ("unit_off_compute", "unit_deferred_frees", "reused_across_streams", "reused_while_pending"), 0)},
            "memory_mb": {"report_device_total": 30.0, "report_comm_buffers": 4.5, "allocated_at_rest": 40.0, "max_allocated_steps_2_on": 90.0},
        },
    },
    "two_gpus": {"skipped": "one GPU here"},
}  # fmt: skip
"""``concurrency/figures.json`` as ``test_cuda_concurrency.py`` writes it, a case failed, the
expandable-segments process never ran, one GPU."""


def test_the_concurrency_figures_are_reported_as_measured(tmp_path):
    gpu_summary = load_summary_module()
    (tmp_path / "detail" / "concurrency").mkdir(parents=True)
    (tmp_path / "detail" / "concurrency" / "figures.json").write_text(json.dumps(CONCURRENCY))
    (tmp_path / "detail" / "steps.tsv").write_text("cuda-tier-concurrency\t1\t52\t75\n")
    lines = gpu_summary.summarize(tmp_path, dry_run=False)["concurrency"]
    text = "\n".join(lines)
    assert "| `zero3_nccl` | 0 |" in lines
    assert "| `zero3_offload_nccl` | the summoned run, step 3: RuntimeError: received a gradient after |" in lines
    assert "| `zero3_offload` | 20.0 | 2.5 → 2.6 | 1.04 | 101.0, 99.5 | 1.5 / 36.1 (recorded) | 108.3 / 0 |" in lines
    assert "| `zero2_offload` | AssertionError: boom | | | | | |" in lines
    assert "to the device ['13'], to the host ['7']; Kineto trace: `detail/concurrency/late_peer_zero3_offload.trace.json.gz`" in text
    assert "| `grad_data_edits` | 0, 0, 0, 0 | 2 / 2 / 0 | gradients changed after backward: 2 |" in lines
    assert "| `unused_unit` | RuntimeError: The optimizer step was taken during backward | | |" in lines
    assert "| caching allocator | 0 | 40 / 40 | 0, 0, 0, 0 | 34.5 / 40.0 / 90.0 | 0 |" in lines
    assert "| expandable segments | did not run | | | | |" in lines
    assert lines[-1] == "Two ranks on NCCL: NOT MEASURED: one GPU here"
    assert "## Concurrency on the GPU" in gpu_summary.markdown(gpu_summary.summarize(tmp_path, dry_run=False))


def _limits(script: str) -> dict[str, int]:
    """The time limit of each step ``gpu_check.sh`` runs on a GPU (not in its dry run), by step."""
    import re

    gpu = script[script.index("\nelse\n") :]
    limits = {name: int(limit) for name, limit in re.findall(r'"(cuda-tier-[a-z-]+):[a-z_ ]+:(\d+)"', gpu)}
    found = dict(re.findall(r"(overhead|offload|nvme|capacity|zeropp)_limit=(\d+)", gpu))
    precisions = re.search(r"overhead_precisions=\(([^)]*)\)", gpu).group(1).split()
    limits.update({f"overhead-{p}": int(found["overhead"]) for p in precisions})
    limits.update({name: int(found[name]) for name in ("offload", "nvme", "capacity", "zeropp")})
    return limits


def test_the_steps_on_a_gpu_keep_to_ten_minutes_and_include_the_concurrency_checks():
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    limits = _limits(script)
    assert sum(limits.values()) <= 600, limits
    assert limits["cuda-tier-concurrency"] >= 60, limits  # its module's ~60 s on an H200 (docs/gpu-check.md)
    assert " concurrency:60" in script  # and the dry run collects it


def test_nvme_rows_judge_each_tier_against_cpu_offload_in_the_same_run():
    gpu_summary = load_summary_module()
    disk = {"read_gbps": 2.5, "write_gbps": 1.25, "waits_per_step": 3.0}
    report = {"variants": [
        {"name": "zero3_offload", "step_time_s": 0.2},
        {"name": "zero3_offload_nvme", "step_time_s": 0.25, "disk": disk},
        {"name": "zero3_offload_nvme_params", "step_time_s": 0.32, "disk": disk},
    ]}  # fmt: skip
    rows = {row.check: row for row in gpu_summary.nvme_rows(report, {})}
    on_disk = rows["zero3_offload_nvme step time"]
    assert (on_disk.target, on_disk.verdict) == ("≤ 1.50× zero3_offload", "PASS")
    assert on_disk.measured == "1.25× (250.0 ms vs 200.0 ms; read / write 2.50 / 1.25 GB/s, 3.0 waits per step)"
    assert rows["zero3_offload_nvme_params step time"].verdict == "FAIL"  # 1.6x
    # each tier's optimizer step against its I/O floor, where the bench measured one
    assert rows["zero3_offload_nvme optimizer step / I/O floor"].verdict.startswith("not measured")
    floor = {"step_vs_floor": 1.25, "step_s": 0.125, "floor_s": 0.1, "host_step_s": 0.1, "read_s": 0.03, "write_s": 0.04}
    report["variants"][1]["io_floor"] = floor
    row = {r.check: r for r in gpu_summary.nvme_rows(report, {})}["zero3_offload_nvme optimizer step / I/O floor"]
    assert (row.target, row.verdict) == ("≤ 1.2×", "FAIL")
    assert row.measured == "1.25× (125.0 ms vs 100.0 ms: host step 100.0 ms, read + write 30.0 + 40.0 ms)"


def test_every_gpu_tier_module_runs_in_a_step_of_both_runs():
    """A GPU-tier module (``tests/test_cuda_*.py`` with the tier's marks) that no step of the script
    names would never run on a GPU: each is named once, in the GPU run and in the dry run."""
    import re

    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    tier = {path.stem.removeprefix("test_cuda_") for path in (REPO / "tests").glob("test_cuda_*.py") if "MARKS" in path.read_text()}
    runs = re.findall(r"tier_steps=\(([^)]*)\)", script)
    assert len(runs) == 2, runs  # the dry run's, then the GPU's
    for steps in runs:
        named = [module for step in re.findall(r'"([^"]+)"', steps) for module in step.split(":")[1].split()]
        assert sorted(named) == sorted(tier), (steps, tier)
