"""`scripts/gpu_check.sh`'s two Python steps: the versions it runs against, and its summary.

    python scripts/gpu_summary.py versions DETAIL_DIR [--dry-run]   # print them, write versions.json
    python scripts/gpu_summary.py summary OUT_DIR [--dry-run]       # write summary.md and summary.json

The summary reads what the check's steps left in ``OUT_DIR/detail`` (see ``gpu_check.sh``): each
step's exit status and time (``steps.tsv``), the CUDA tier's JUnit XML files, ``bench.json`` of
``overhead_gpu.sh`` per precision, of the NVMe run and of the capacity run, ``offload_gpu.json``, and
the concurrency checks' figures (``concurrency/figures.json``, from ``tests/test_cuda_concurrency.py``);
and gives each target its measured value and a verdict: PASS, FAIL, or NOT MEASURED with the reason
(the step failed, ran out of time, or left no figure). The concurrency figures have no target of
their own (the tier's tests assert on them): they are reported as they were measured. It imports nothing beyond the standard library (the
versions step imports torch to report it and its GPU), so it runs whatever broke before it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

STEP_TIME_TARGETS = {"zero1": 1.03, "zero2": 1.03, "zero3": 1.15}
"""Step time of ours at world size 1 as a multiple of DDP's (issues 8 and 11, restated in issue 26;
zero1 and zero2 tightened from 1.05x to 1.03x)."""
NVME_STEP_TIME_TARGET = 1.5
IO_FLOOR_TARGET = 1.2
"""An NVMe variant's optimizer step over its I/O floor (``bench/io_floor.py``'s target, issue 61)."""
"""NVMe offload's step time as a multiple of zero3_offload's in the same run (issue 28)."""
NVME_VARIANTS = ("zero3_offload_nvme", "zero3_offload_nvme_params")
OVERHEAD_PRECISIONS = ("fp32", "bf16-mixed")
"""The runs of ``overhead_gpu.sh``, each in ``detail/overhead/<precision>/bench.json``."""
CONCURRENCY_STEP = "cuda-tier-concurrency"
"""The tier's step of ``tests/test_cuda_concurrency.py`` (in the dry run, part of the one "cuda-tier")."""
TIMED_OUT = (124, 137)
"""Exit statuses of a command ``timeout`` stopped (TERM, then KILL)."""
PASS, FAIL, NOT_MEASURED = "PASS", "FAIL", "NOT MEASURED"


@dataclass(frozen=True)
class Row:
    """One target: what is checked, the target, what was measured and the verdict."""

    check: str
    target: str
    measured: str
    verdict: str


@dataclass(frozen=True)
class Step:
    """One step of the check, from ``steps.tsv``."""

    name: str
    status: int
    seconds: int
    limit_s: int

    @property
    def outcome(self) -> str:
        if self.status == 0:
            return "ok"
        if self.status in TIMED_OUT:
            return f"timed out after {self.limit_s} s"
        return f"failed (exit {self.status})"


# ---- versions --------------------------------------------------------------------------------------


def versions(dry_run: bool) -> dict[str, Any]:
    """What this check runs against; a package that does not import is reported, not raised."""
    found: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable, "dry_run": dry_run}
    try:
        import torch

        found.update(torch=torch.__version__, cuda=torch.version.cuda, gpus=torch.cuda.device_count())
        found["gpu"] = torch.cuda.get_device_name(0) if found["gpus"] else None
    except Exception as error:  # noqa: BLE001 - any failure is what there is to report
        found.update(torch=f"not importable ({type(error).__name__}: {error})", cuda=None, gpus=0, gpu=None)
    try:  # its metadata: importing Lightning costs seconds, and the tier imports it anyway
        found["lightning"] = importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:
        found["lightning"] = "not installed"
    found["jsonargparse"] = importlib.util.find_spec("jsonargparse") is not None
    return found


def version_lines(found: dict[str, Any]) -> list[str]:
    gpu = f"{found['gpu']} ({found['gpus']} device(s))" if found.get("gpu") else "none: torch sees no CUDA device"
    jsonargparse = "importable" if found["jsonargparse"] else (
        "MISSING (LightningCLI and the YAML configs need it; nothing in this check does)"
    )
    return [
        f"python {found['python']} ({found['executable']})",
        f"torch {found['torch']}, CUDA {found.get('cuda') or 'none'}",
        f"GPU: {gpu}",
        f"lightning {found['lightning']}",
        f"jsonargparse: {jsonargparse}",
    ]


# ---- reading what the steps left -------------------------------------------------------------------


def read_steps(detail: Path) -> dict[str, Step]:
    steps = {}
    path = detail / "steps.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, status, seconds, limit_s = line.split("\t")
        steps[name] = Step(name, int(status), int(seconds), int(limit_s))
    return steps


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_junit(paths: list[Path]) -> dict[str, Any]:
    """Counts over the JUnit files, and each failed test's name with the first line of its message."""
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed, skip_reasons = [], set()
    for path in paths:
        try:
            root = ElementTree.parse(path).getroot()
        except (OSError, ElementTree.ParseError):
            continue
        for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
            for key in totals:
                totals[key] += int(suite.get(key, 0))
            for case in suite.iter("testcase"):
                for kind in ("failure", "error"):
                    problem = case.find(kind)
                    if problem is not None:
                        message = (problem.get("message") or problem.text or "").strip().splitlines()
                        failed.append(f"{case.get('name')}: {message[0] if message else kind}")
                skipped = case.find("skipped")
                if skipped is not None:
                    skip_reasons.add((skipped.get("message") or "").strip())
    return {**totals, "failed": failed, "skip_reasons": sorted(skip_reasons), "files": len(paths)}


def variants_by_name(report: Optional[dict]) -> dict[str, dict]:
    return {v["name"]: v for v in (report or {}).get("variants", [])}


# ---- the targets -----------------------------------------------------------------------------------


def not_measured(steps: dict[str, Step], step: str, what: str = "no figure") -> str:
    ran = steps.get(step)
    if ran is None:
        return f"{NOT_MEASURED}: step {step} did not run"
    return f"{NOT_MEASURED}: step {step} {ran.outcome}" if ran.status else f"{NOT_MEASURED}: {what}"


def tier_rows(tier: dict[str, Any], steps: dict[str, Step], tier_steps: list[str]) -> list[Row]:
    ran = tier["tests"] - tier["skipped"]
    bad = tier["failures"] + tier["errors"]
    measured = f"{ran - bad} passed, {bad} failed, {tier['skipped']} skipped"
    broken = [name for name in tier_steps if name in steps and steps[name].status not in (0, 1)]  # 1: tests failed
    if bad:  # a failure is a verdict, also when another part of the tier did not finish
        verdict = FAIL
    elif broken or not tier["files"]:
        verdict = not_measured(steps, broken[0] if broken else tier_steps[0], "no JUnit file")
    elif ran == 0:
        verdict = f"{NOT_MEASURED}: every test skipped ({'; '.join(tier['skip_reasons']) or 'no reason given'})"
    else:
        verdict = PASS
    return [Row("CUDA tier (tests/test_cuda_*.py)", "every test passes", measured, verdict)]


def overhead_rows(reports: dict[str, Optional[dict]], steps: dict[str, Step]) -> list[Row]:
    rows = []
    for precision in OVERHEAD_PRECISIONS:
        step = f"overhead-{precision}"
        variants = variants_by_name(reports.get(precision))
        ddp = variants.get("ddp", {})
        for name, limit in STEP_TIME_TARGETS.items():
            check, target = f"{name} step time, {precision}", f"≤ {limit:.2f}× DDP"
            ratio = variants.get(name, {}).get("step_time_ratio_to_ddp")
            if ratio is None:
                reason = variants.get(name, {}).get("reason") or "no ratio in bench.json"
                rows.append(Row(check, target, "—", not_measured(steps, step, reason)))
                continue
            ms = f"{variants[name]['step_time_s'] * 1e3:.1f} ms vs DDP {ddp['step_time_s'] * 1e3:.1f} ms"
            rows.append(Row(check, target, f"{ratio:.2f}× ({ms})", PASS if ratio <= limit else FAIL))
        ours = [variants[name] for name in STEP_TIME_TARGETS if variants.get(name, {}).get("status") == "ok"]
        check, target = f"our host syncs, {precision}", "none in forward/backward, ≤ 1 per step"
        if not ours:
            rows.append(Row(check, target, "—", not_measured(steps, step)))
            continue
        in_passes = max(v["host_syncs_ours_forward_backward"] for v in ours)
        per_step = max(v["host_syncs_ours_per_step"] for v in ours)
        met = in_passes == 0 and per_step <= 1
        rows.append(Row(check, target, f"{in_passes} in forward/backward, {per_step} per step", PASS if met else FAIL))
    return rows


def offload_rows(report: Optional[dict], steps: dict[str, Step]) -> list[Row]:
    ratio_check = "zero3_offload step / max(zero3 step, CPU AdamW step alone)"
    state_check = "device model state, zero3_offload"
    if report is None:
        return [
            Row(ratio_check, "≤ 1.25", "—", not_measured(steps, "offload")),
            Row(state_check, "0 B", "—", not_measured(steps, "offload")),
        ]
    rows = []
    ratio, limit = report.get("ratio"), report.get("ratio_target", 1.25)
    if ratio is None:
        errors = "; ".join(report[k]["error"] for k in ("zero3", "zero3_offload") if "error" in report.get(k, {}))
        rows.append(Row(ratio_check, f"≤ {limit}", "—", not_measured(steps, "offload", errors or "no ratio")))
    else:
        seconds = [report[k]["median_step_s"] for k in ("zero3_offload", "zero3", "cpu_adamw")]
        measured = f"{ratio:.2f} ({seconds[0]:.3f} s / max({seconds[1]:.3f} s, {seconds[2]:.3f} s))"
        rows.append(Row(ratio_check, f"≤ {limit}", measured, PASS if ratio <= limit else FAIL))
    state = report.get("offload_device_model_state_bytes")
    verdict = not_measured(steps, "offload") if state is None else PASS if state == 0 else FAIL
    rows.append(Row(state_check, "0 B", "—" if state is None else f"{state:,} B", verdict))
    return rows


def zeropp_rows(report: Optional[dict], steps: dict[str, Step]) -> list[Row]:
    """Issue 63: per unit, qwZ's quantize + dequantize against the link time its bytes save
    (``zeropp_gpu.py``)."""
    if report is None:
        return [Row("qwZ kernels per unit, against the link time saved", "kernels < time saved", "—", not_measured(steps, "zeropp"))]
    rows = []
    link = f"{report['link_gbps']:g} Gb/s"
    for unit in report["units"]:
        check = f"qwZ {report['format']} kernels, unit of {unit['unit_elements'] / 1e6:g}M {report['dtype']} elements, N = {report['world']}"
        measured = (
            f"{unit['kernels_ms']:.3f} ms ({unit['quantize_ms']:.3f} + {unit['dequantize_ms']:.3f})"
            f" vs {unit['link_ms_saved']:.3f} ms ({unit['bytes_saved_on_link'] / 1e6:,.1f} MB)"
        )
        rows.append(Row(check, f"< link time saved at {link}", measured, PASS if unit["kernels_below_saving"] else FAIL))
    return rows


def nvme_rows(report: Optional[dict], steps: dict[str, Step]) -> list[Row]:
    """Each NVMe variant's step time against zero3_offload's, with what its disk did."""
    variants = variants_by_name(report)
    reference = variants.get("zero3_offload", {}).get("step_time_s")
    rows = []
    for name in NVME_VARIANTS:
        check, target = f"{name} step time", f"≤ {NVME_STEP_TIME_TARGET:.2f}× zero3_offload"
        variant = variants.get(name, {})
        seconds = variant.get("step_time_s")
        if not reference or seconds is None:
            reason = variant.get("reason") or variants.get("zero3_offload", {}).get("reason") or "no step time in bench.json"
            rows.append(Row(check, target, "—", not_measured(steps, "nvme", reason)))
            continue
        ratio = seconds / reference
        disk = variant.get("disk") or {}
        io = (
            f"; read / write {disk['read_gbps']:.2f} / {disk['write_gbps']:.2f} GB/s, {disk['waits_per_step']:.1f} waits per step"
            if "read_gbps" in disk
            else ""
        )
        measured = f"{ratio:.2f}× ({seconds * 1e3:.1f} ms vs {reference * 1e3:.1f} ms{io})"
        rows.append(Row(check, target, measured, PASS if ratio <= NVME_STEP_TIME_TARGET else FAIL))
        rows.append(io_floor_row(name, variant.get("io_floor")))
    return rows


def io_floor_row(name: str, floor: Optional[dict]) -> Row:
    """An NVMe variant's optimizer step against its I/O floor (the bench's `io_floor`, issue 61)."""
    check, target = f"{name} optimizer step / I/O floor", f"≤ {IO_FLOOR_TARGET:.1f}×"
    if not floor:
        return Row(check, target, "—", "not measured (no io_floor in bench.json)")
    ratio = floor["step_vs_floor"]
    measured = (
        f"{ratio:.2f}× ({floor['step_s'] * 1e3:.1f} ms vs {floor['floor_s'] * 1e3:.1f} ms: host step"
        f" {floor['host_step_s'] * 1e3:.1f} ms, read + write {floor['read_s'] * 1e3:.1f} + {floor['write_s'] * 1e3:.1f} ms)"
    )
    return Row(check, target, measured, PASS if ratio <= IO_FLOOR_TARGET else FAIL)


def capacity_lines(report: Optional[dict], steps: dict[str, Step]) -> list[str]:
    if report is None:
        return [not_measured(steps, "capacity", "no bench.json")]
    options = report.get("options", {})
    lines = [
        f"`{options.get('command', 'lightning-zero bench --capacity')}`",
        "",
        "| variant | largest n_layer | parameters | estimate n_layer | stopped by |",
        "|:--|--:|--:|--:|:--|",
    ]
    for v in report.get("variants", []):
        lines.append(
            f"| `{v['name']}` | {v.get('largest_size', '—')} | {v.get('capacity', {}).get('largest', 0):,} |"
            f" {v.get('estimate_size', '—')} | {v.get('reason') or '—'} |"
        )
    return lines


def _cell(value: Any, decimals: int = 1) -> str:
    """A figure for a table: ``decimals`` places from 1 up, 3 significant digits below (0 as 0)."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return "0" if value == 0 else f"{value:.{decimals}f}" if abs(value) >= 1 else f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v, decimals) for v in value)
    return str(value)


def _failed(entry: Any) -> Optional[str]:
    """Why a case left no figures (its failure's last line, cut at 200 characters), if it did not."""
    why = "no figures" if not isinstance(entry, dict) else entry.get("failed") or entry.get("error")
    return why if why is None or len(why) <= 200 else why[:197] + "..."


def concurrency_lines(figures: Optional[dict], steps: dict[str, Step]) -> list[str]:
    """The concurrency checks' figures (``tests/test_cuda_concurrency.py``, docs/gpu-check.md says what
    each shows): N1's twin runs, the late peer's timings and memory (N2, N4), the copies' streams, the
    host step's modes, the stage-3 storage under the allocator, and the two-GPU check or why it was skipped."""
    step = CONCURRENCY_STEP if CONCURRENCY_STEP in steps else "cuda-tier"
    if not figures:
        return [not_measured(steps, step, "no concurrency/figures.json (the tier's concurrency cases did not run)")]
    one = figures.get("one_gpu") or {}
    lines: list[str] = []

    def runs(prefix: str) -> dict[str, Any]:
        return {name[len(prefix):]: entry for name, entry in one.items() if name.startswith(prefix)}

    lines += ["N1, `gathered(offload_to_cpu=True)` between steps: 4 steps against 2 + the context + 2 (max |Δ| of the weights; 0 expected)", ""]
    lines += ["| variant | max \\|Δ\\| |", "|:--|:--|"]
    for name, entry in runs("n1_").items():
        lines.append(f"| `{name}` | {_failed(entry) or _cell(entry.get('max_diff'))} |")

    lines += ["", "A late peer: each launch of a reduction sleeps on the reduce stream (N2: step 1's backward, the device's"]
    lines += ["time, unstretched: late / on time ≤ 2; N4: from step 2 the peak of active memory within 3 buckets of full"]
    lines += ["gradients above the on-time run's, asserted without `offload_params`; steps 2-3 run without the lead)", ""]
    lines += [
        "| variant | sleep per launch (ms) | step 1 backward on time → late (ms) | ratio | steps 2-3 backward late (ms) |"
        " active peak above on time / bound (MiB) | unpacked / waiting late (MiB) |",
        "|:--|--:|:--|--:|:--|:--|:--|",
    ]
    for name, entry in runs("late_peer_").items():
        if name == "copies":
            continue
        if _failed(entry) or "step1_ratio" not in entry:
            lines.append(f"| `{name}` | {_failed(entry) or 'no figures'} | | | | | |")
            continue
        on, late = entry.get("backward_ms_on_time", []), entry.get("backward_ms_late", [])
        above = (entry.get("active_rise_mb_late") or 0) - (entry.get("active_rise_mb_on_time") or 0)
        asserted = "" if entry.get("memory_asserted", True) else " (recorded)"
        unpacked, waiting = entry.get("unpacked_mb_late", [])[1:], entry.get("waiting_mb_late", [])[1:]
        lines.append(
            f"| `{name}` | {_cell(entry.get('sleep_ms'))} | {_cell(on[:1])} → {_cell(late[:1])} | {_cell(entry['step1_ratio'], 2)} |"
            f" {_cell(late[1:])} | {_cell(round(above, 2))} / {_cell(entry.get('bound_mb'))}{asserted} |"
            f" {_cell(max(unpacked, default=None))} / {_cell(max(waiting, default=None))} |"
        )
    copies = one.get("late_peer_copies")
    if copies is not None:
        if _failed(copies):
            lines += ["", f"Copies' streams: {_failed(copies)}"]
        else:
            trace = f"; Kineto trace: `detail/concurrency/{copies['trace']}`" if copies.get("trace") else ""
            lines += ["", f"Copies' streams in a late step at `zero3_offload` (disjoint expected): to the device {copies.get('h2d_streams')},"
                      f" to the host {copies.get('d2h_streams')}{trace}"]

    lines += ["", "The host step during backward, overlap on against off (max |Δ| after each step; 0 expected):", ""]
    lines += ["| case | max \\|Δ\\| per step | ahead / redone / after backward | reasons |", "|:--|:--|:--|:--|"]
    for name, entry in runs("host_").items():
        if _failed(entry):
            lines.append(f"| `{name}` | {_failed(entry)} | | |")
            continue
        report = entry.get("report") or {}
        counts = " / ".join(str(report.get(k, "—")) for k in ("ahead", "redone", "after_backward"))
        reasons = "; ".join(f"{why}: {n}" for why, n in (report.get("reasons") or {}).items()) or "—"
        scales = f" (scales {_cell(entry['scales'])})" if entry.get("scales") else ""
        lines.append(f"| `{name}` | {_cell(entry.get('diffs'))} | {counts}{scales} | {reasons} |")

    storage = {"caching allocator": one.get("storage"), "expandable segments": (figures.get("expandable_segments") or {}).get("storage")}
    lines += ["", "Stage-3 storage under the allocator (zero3, bf16-mixed, compiled blocks, checkpointing, prefetch 2):", ""]
    lines += [
        "| allocator | max \\|Δ\\| | unit storages allocated / freed | off compute, freed late, reused across streams, while a free waited |"
        " memory report (device + buffers) / allocated at rest / max allocated (MiB) | recompiles |",
        "|:--|:--|:--|:--|:--|:--|",
    ]
    for name, entry in storage.items():
        if entry is None or _failed(entry):
            lines.append(f"| {name} | {_failed(entry) if entry is not None else 'did not run'} | | | | |")
            continue
        allocator, memory = entry.get("allocator", {}), entry.get("memory_mb", {})
        counts = allocator.get("counts", {})
        found = ", ".join(str(counts.get(k, "—")) for k in ("unit_off_compute", "unit_deferred_frees", "reused_across_streams", "reused_while_pending"))
        report = round((memory.get("report_device_total") or 0) + (memory.get("report_comm_buffers") or 0), 2)
        lines.append(
            f"| {name} | {_cell(entry.get('max_diff'))} | {allocator.get('unit_allocs', '—')} / {allocator.get('unit_frees', '—')} | {found} |"
            f" {report} / {_cell(memory.get('allocated_at_rest'))} / {_cell(memory.get('max_allocated_steps_2_on'))} | {_cell(entry.get('recompiles'))} |"
        )

    two = figures.get("two_gpus") or {}
    lines += [""]
    if "skipped" in two:
        lines.append(f"Two ranks on NCCL: NOT MEASURED: {two['skipped']}")
    elif not two:
        lines.append("Two ranks on NCCL: NOT MEASURED: did not run")
    else:
        for name, entry in two.items():
            if _failed(entry):
                lines.append(f"Two ranks on NCCL, `{name}`: {_failed(entry)}")
            else:
                lines.append(f"Two ranks on NCCL, `{name}`: max |Δ| from DDP {_cell(entry.get('max_diff'))}; rank 1 listed on GPU 0: {entry.get('listed_on_gpu_0')}")
    return lines


# ---- the summary -----------------------------------------------------------------------------------


def summarize(out: Path, dry_run: bool) -> dict[str, Any]:
    detail = out / "detail"
    steps = read_steps(detail)
    found = read_json(detail / "versions.json") or {}
    junit = sorted(detail.glob("cuda-tier*.xml"))
    tier_steps = [name for name in steps if name.startswith("cuda-tier")] or ["cuda-tier"]
    tier = read_junit(junit)
    overhead = {p: read_json(detail / "overhead" / p / "bench.json") for p in OVERHEAD_PRECISIONS}
    rows = (
        tier_rows(tier, steps, tier_steps)
        + overhead_rows(overhead, steps)
        + offload_rows(read_json(detail / "offload_gpu.json"), steps)
        + nvme_rows(read_json(detail / "nvme" / "bench.json"), steps)
        + zeropp_rows(read_json(detail / "zeropp_gpu.json"), steps)
    )
    return {
        "dry_run": dry_run,
        "environment": found,
        "targets": [asdict(row) for row in rows],
        "steps": [{**asdict(s), "outcome": s.outcome} for s in steps.values()],
        "tier": tier,
        "capacity": capacity_lines(read_json(detail / "capacity" / "bench.json"), steps),
        "concurrency": concurrency_lines(read_json(detail / "concurrency" / "figures.json"), steps),
    }


def markdown(summary: dict[str, Any]) -> str:
    lines = ["# GPU check", ""]
    if summary["dry_run"]:
        lines += [
            "**Dry run**: tiny sizes on the CPU, to check the pipeline; the CUDA tier is skipped and no",
            "figure below is a GPU's.",
            "",
        ]
    if summary["environment"]:
        lines += [f"- {line}" for line in version_lines(summary["environment"])] + [""]
    rows = summary["targets"]
    verdicts = [r["verdict"].split(":")[0] for r in rows]
    lines += [
        f"## Targets: {verdicts.count(PASS)} passed, {verdicts.count(FAIL)} failed, {verdicts.count(NOT_MEASURED)} not measured",
        "",
        "| check | target | measured | verdict |",
        "|:--|:--|:--|:--|",
    ]
    lines += [f"| {r['check']} | {r['target']} | {r['measured']} | {r['verdict']} |" for r in rows]
    if summary["tier"]["failed"]:
        lines += ["", "Failed tests (tracebacks in `detail/logs/cuda-tier*.log`):", ""]
        lines += [f"- {failure}" for failure in summary["tier"]["failed"]]
    lines += ["", "## Capacity on the GPU (no target: the figures for the README)", "", *summary["capacity"]]
    lines += ["", "## Concurrency on the GPU (`tests/test_cuda_concurrency.py`: the tier's tests assert, these are their figures)", ""]
    lines += summary.get("concurrency", [])
    lines += ["", "## Steps", "", "| step | outcome | seconds (limit) |", "|:--|:--|--:|"]
    lines += [f"| {s['name']} | {s['outcome']} | {s['seconds']} ({s['limit_s']}) |" for s in summary["steps"]]
    lines += ["", "Each step's output is in `detail/logs/<step>.log`, its figures under `detail/`."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("versions", "summary"))
    parser.add_argument("directory", type=Path, help="versions: the detail directory; summary: the check's output directory")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    args.directory.mkdir(parents=True, exist_ok=True)
    if args.what == "versions":
        found = versions(args.dry_run)
        (args.directory / "versions.json").write_text(json.dumps(found, indent=1) + "\n")
        print("\n".join(version_lines(found)))
        return 0
    summary = summarize(args.directory, args.dry_run)
    (args.directory / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = markdown(summary)
    (args.directory / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
