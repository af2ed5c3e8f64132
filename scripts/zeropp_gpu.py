"""Issue 63's GPU check: do qwZ's quantize and dequantize kernels cost less than the bytes they save?

For each unit size (elements of one stage-3 unit's weights; the defaults, 50M and 200M, are the
blocks of 1B- to 3B-class models) on one GPU, with N ranks sharing the unit (``--world``):

* **kernels**: what one rank runs per quantized all-gather (``engine/comm/quantization.py``,
  [Note: quantized rows]): ``quantize`` of its own row (E/N elements, from ``--dtype``) and
  ``dequantize`` of the N gathered rows (the whole unit, back to ``--dtype``); the median of
  ``--repeats`` timed with CUDA events after ``--warmup`` untimed rounds;
* **bytes saved**: the all-gather's full buffer in ``--dtype`` (E·b) minus the quantized one
  (N · packed_bytes(E/N): codes, fp32 scales, padding); the ring moves (N-1)/N of a full buffer
  through each rank's link, so the bytes a rank's link is spared are (N-1)/N of the difference;
* **time saved** on a ``--link-gbps`` link (default 100 Gb/s = 12.5 GB/s, ZeRO++'s inter-node
  figure): those bytes over its rate; **verdict**: PASS where the kernels take less.

No process group is made: the kernels and the byte counts are a rank's own, and the link is priced
from its rate. Only torch is imported (quantization.py is loaded from its file, so neither Lightning
nor jsonargparse is needed, and lightning-zero's version check does not run). Prints a table and one
JSON line, and writes the JSON to ``--out`` if given. Under a minute on an H100::

    PYTHONPATH=src python scripts/zeropp_gpu.py
    python scripts/zeropp_gpu.py --device cpu --tiny   # the same code on small sizes (the test's)
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

QUANTIZATION = Path(__file__).resolve().parents[1] / "src" / "lightning_zero" / "engine" / "comm" / "quantization.py"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TINY_SIZES = (65_536, 262_144)
"""`--tiny`: two units small enough for a CPU to run every step in well under a second."""


@functools.lru_cache(maxsize=1)
def load_formats() -> dict[str, Any]:
    """`quantization.FORMATS`, loaded from its file (it imports only torch)."""
    spec = importlib.util.spec_from_file_location("zeropp_quantization", QUANTIZATION)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.FORMATS


def parse_sizes(text: str) -> tuple[int, ...]:
    """"50M,200M" -> (50_000_000, 200_000_000); k, M, G suffixes (decimal)."""
    scale = {"k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}
    sizes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        factor = scale.get(part[-1], 1)
        number = part[:-1] if part[-1] in scale else part
        try:
            value = int(float(number) * factor)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a size: {part!r} (e.g. 50M,200M)") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"a unit needs at least one element, got {part!r}")
        sizes.append(value)
    if not sizes:
        raise argparse.ArgumentTypeError("name at least one unit size")
    return tuple(sizes)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (the same code; default: cuda)")
    parser.add_argument("--sizes", type=parse_sizes, default=(50_000_000, 200_000_000), metavar="E,E,...",
                        help="elements per unit (default: 50M,200M)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help=f"units of {', '.join(map(str, TINY_SIZES))} elements, 3 repeats")
    parser.add_argument("--world", type=int, default=8, metavar="N", help="ranks sharing a unit (default: 8)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="the weights' dtype (default: bf16)")
    parser.add_argument("--format", default="int8", help="FORMATS name: int8 (qwZ's default), fp8, int4 (default: int8)")
    parser.add_argument("--link-gbps", type=float, default=100.0, metavar="G", help="the link, Gb/s (default: 100)")
    parser.add_argument("--repeats", type=int, default=20, metavar="K", help="timed rounds, median reported (default: 20)")
    parser.add_argument("--warmup", type=int, default=3, metavar="K", help="untimed rounds first (default: 3)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--dry-run", action="store_true", help="check the arguments and print the plan, time nothing")
    args = parser.parse_args(argv)
    if args.tiny:
        args.sizes, args.repeats, args.warmup = TINY_SIZES, 3, 1
    if args.world < 1 or args.repeats < 1 or args.warmup < 0 or not args.link_gbps > 0:
        parser.error("--world and --repeats must be positive, --warmup non-negative, --link-gbps positive")
    if args.format not in load_formats():
        parser.error(f"--format must be one of {', '.join(load_formats())}, got {args.format!r}")
    if any(size % args.world for size in args.sizes):
        parser.error(f"every unit size must be a multiple of --world ({args.world}): a rank's row is E/N elements")
    return args


def median_ms(run: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> float:
    """The median over `repeats` of `run`'s time in ms (CUDA events on a GPU, the clock on the CPU)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            run()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def measure_unit(numel: int, args: argparse.Namespace, fmt: Any, device: torch.device) -> dict[str, Any]:
    """One unit of `numel` elements: the kernels' times, the bytes saved and what they are worth."""
    dtype, n = DTYPES[args.dtype], args.world
    row = numel // n
    packed = fmt.packed_bytes(row)
    generator = torch.Generator(device=device).manual_seed(0)
    mine = torch.randn((1, row), generator=generator, device=device, dtype=torch.float32).to(dtype)  # (1, E/N)
    sent = torch.empty((1, packed), dtype=torch.uint8, device=device)  # (1, packed)
    gathered = torch.empty((n, packed), dtype=torch.uint8, device=device)  # (N, packed): the all-gather's output
    fmt.quantize(mine, sent)
    gathered.copy_(sent.expand(n, packed))  # every rank's row alike: the same work as distinct ones
    error = (fmt.dequantize(sent, row, torch.float32) - mine.float()).abs().max().item()
    scale = mine.float().abs().max().item() / fmt.largest
    quantize_ms = median_ms(lambda: fmt.quantize(mine, sent), device, args.repeats, args.warmup)
    dequantize_ms = median_ms(lambda: fmt.dequantize(gathered, row, dtype), device, args.repeats, args.warmup)
    del mine, sent, gathered
    element_bytes = torch.tensor([], dtype=dtype).element_size()
    full, quantized = numel * element_bytes, n * packed
    saved_on_link = (full - quantized) * (n - 1) / n
    link_bytes_per_s = args.link_gbps * 1e9 / 8
    saved_ms = saved_on_link / link_bytes_per_s * 1e3
    kernels_ms = quantize_ms + dequantize_ms
    return {
        "unit_elements": numel,
        "row_elements": row,
        "quantize_ms": quantize_ms,
        "dequantize_ms": dequantize_ms,
        "kernels_ms": kernels_ms,
        "full_buffer_bytes": full,
        "quantized_buffer_bytes": quantized,
        "bytes_saved_on_link": saved_on_link,
        "link_ms_saved": saved_ms,
        "kernels_below_saving": kernels_ms < saved_ms,
        "max_error_over_block_scale": error / scale if scale else 0.0,
    }


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"qwZ {args.format} on {args.dtype} units, N = {args.world} ranks, link {args.link_gbps:g} Gb/s"
        f" ({args.link_gbps / 8:g} GB/s); kernels: quantize a row of E/N + dequantize N rows, median of {args.repeats}",
        "",
        "| unit elements | quantize ms | dequantize ms | kernels ms | bytes saved on the link | link ms saved | verdict |",
        "|--:|--:|--:|--:|--:|--:|:--|",
    ]
    for r in results:
        verdict = "PASS (kernels < time saved)" if r["kernels_below_saving"] else "FAIL (kernels >= time saved)"
        lines.append(
            f"| {r['unit_elements']:,} | {r['quantize_ms']:.3f} | {r['dequantize_ms']:.3f} | {r['kernels_ms']:.3f}"
            f" | {r['bytes_saved_on_link'] / 1e6:,.1f} MB | {r['link_ms_saved']:.3f} | {verdict} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    plan = {"device": str(device), "sizes": list(args.sizes), "world": args.world, "dtype": args.dtype, "format": args.format}
    if args.dry_run:
        print(json.dumps({"dry_run": True, **plan}))
        return 0
    if device.type == "cuda" and not torch.cuda.is_available():
        print("zeropp_gpu.py: no CUDA device (run with --device cpu --tiny for the same code on the CPU)", file=sys.stderr)
        return 2
    fmt = load_formats()[args.format]
    results = []
    for numel in args.sizes:
        results.append(measure_unit(numel, args, fmt, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    summary = {**plan, "device_name": name, "torch": torch.__version__, "link_gbps": args.link_gbps, "units": results,
               "all_pass": all(r["kernels_below_saving"] for r in results)}  # fmt: skip
    print(table(results, args))
    print(json.dumps(summary))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
