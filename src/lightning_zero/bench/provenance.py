"""Where a benchmark's figures come from, recorded with them: the versions, the processor or GPU,
the machine's load, and the `lightning-zero bench` command that reproduces the run."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
from typing import Any, Optional

import torch

from lightning_zero.bench import variants
from lightning_zero.bench.options import BenchOptions, shaped


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_environment(options: BenchOptions) -> dict[str, Any]:
    """Where the figures come from: versions, processor or GPU, and the world."""
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(options.devices)]
        if options.device == "cuda" and torch.cuda.is_available()
        else None
    )
    cpus = os.cpu_count() or 1
    return {
        "torch": torch.__version__,
        "lightning": _version("lightning"),
        "lightning_zero": _version("lightning-zero"),
        "deepspeed": _version("deepspeed"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": cpus,
        "gpus": gpus,
        "device": options.device,
        "backend": "nccl" if options.device == "cuda" else "gloo",
        "world_size": options.devices,
        "threads_per_rank": (options.threads or max(1, cpus // options.devices))
        if options.device == "cpu"
        else torch.get_num_threads(),
        "load_average_1min": _load_average(),
    }


def _load_average() -> Optional[float]:
    """The 1-minute load average: how busy the machine already was (step times need it idle)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def command_line(options: BenchOptions) -> str:
    """The `lightning-zero bench` command that reproduces `options`."""
    defaults = shaped(options.shape, offload_overlap=options.offload_overlap)
    parts = ["lightning-zero bench"]
    if options.shape is not None:
        parts.append(f"--shape {options.shape}")
    if options.offload_overlap:
        parts.append("--offload-overlap")
    if options.sleep_ms is not None:
        parts.append(f"--sleep-ms {options.sleep_ms:g}")
    if options.params is not None:
        parts.append(f"--params {options.params}")
    flags = [
        ("n_layer", "--n-layer"),
        ("n_head", "--n-head"),
        ("block_size", "--block-size"),
        ("batch_size", "--batch-size"),
        ("devices", "--devices"),
        ("warmup", "--warmup"),
        ("steps", "--steps"),
        ("precision", "--precision"),
        ("device", "--device"),
        ("seed", "--seed"),
        ("bucket_size_mb", "--bucket-size-mb"),
        ("threads", "--threads"),
    ]
    if options.params is None:
        flags.insert(1, ("n_embd", "--n-embd"))
    for name, flag in flags:
        if getattr(options, name) != getattr(defaults, name):
            parts.append(f"{flag} {getattr(options, name)}")
    default_variants = defaults.variants
    if options.nodes is not None and options.nodes >= 2 and options.capacity is None and not options.offload_overlap:
        default_variants = variants.NODE_VARIANTS  # what the command line picks with --nodes
    if options.variants != default_variants:
        parts.append(f"--variants {','.join(options.variants)}")
    if options.paired:
        parts.append("--paired")
    if options.fused:
        parts.append("--fused")
    if options.activation_checkpointing:
        parts.append("--activation-checkpointing")
    if options.shard_group_size is not None:
        parts.append(f"--shard-group-size {options.shard_group_size}")
    if options.nodes is not None:
        parts.append(f"--nodes {options.nodes}")
    if options.capacity is not None:
        parts.append(f"--capacity {options.capacity} --memory-budget {options.memory_budget}B")
    if options.budget_scope != defaults.budget_scope:
        parts.append(f"--budget-scope {options.budget_scope}")
    if options.nvme_path is not None:
        parts.append(f"--nvme-path {options.nvme_path}")
    if options.timeout_s != defaults.timeout_s:
        parts.append(f"--timeout {options.timeout_s:g}")
    if options.out != defaults.out:
        parts.append(f"--out {options.out}")
    return " ".join(parts)


def options_record(options: BenchOptions) -> dict[str, Any]:
    """`options` as the JSON records them, with the command that reproduces them."""
    paths = ("out", "nvme_path")
    record = {k: str(v) if k in paths and v is not None else v for k, v in dataclasses.asdict(options).items()}
    record["command"] = command_line(options)
    return record
