"""The benchmark report's side tables, one per idea, each shown where the run has something for it:
communication by kind (always), the ownership path's rows (`zero2_whole`, `zero3_whole`), hybrid
sharding's traffic within and across shard groups, ZeRO++'s bytes per link (`--nodes`), NVMe
offload's disk next to its raw figures, and each NVMe variant's optimizer step against its I/O floor."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from lightning_zero.bench import theory
from lightning_zero.bench.io_floor import IO_FLOOR_TARGET
from lightning_zero.bench.links import CATEGORIES, INTER, INTRA, link_totals
from lightning_zero.bench.markdown import format_mb, markdown_table, pct
from lightning_zero.bench.results import BenchResult, VariantResult
from lightning_zero.bench.variants import BY_NAME


def comm_by_kind_section(ran: Sequence[VariantResult]) -> list[str]:
    """Every variant's collectives of one step by kind, the busiest rank's: ring MB and calls."""
    kinds = sorted({kind for r in ran for kind in (r.comm_bytes_by_kind or {})})
    if not kinds:
        return []

    def cell(r: VariantResult, kind: str) -> str:
        calls = (r.collective_calls_by_kind or {}).get(kind)
        return "—" if not calls else f"{format_mb((r.comm_bytes_by_kind or {}).get(kind, 0))} ({calls})"

    rows = [[f"`{r.name}`", *(cell(r, kind) for kind in kinds), format_mb(r.comm_bytes_per_step)] for r in ran]
    lines = ["", "Communication per step by kind, the busiest rank: ring MB (calls):", ""]
    return lines + markdown_table(["variant", *kinds, "total"], rows, "l" + "r" * (len(kinds) + 1))


def ownership_section(whole: Sequence[VariantResult], ran: Sequence[VariantResult]) -> list[str]:
    """The ownership path's rows (`zero2_whole`, `zero3_whole`) next to the chunk path's row of their
    stage: the all-to-alls against `theory.owner_exchange_bytes`, what they add, and each rank's
    optimizer state against issue 42's bound."""
    by_name = {r.name: r for r in ran}
    rows = []
    for r in whole:
        chunk = by_name.get(f"zero{r.stage}")
        exchange = (r.comm_bytes_by_kind or {}).get("all_to_all", 0.0)
        states = [rank.phases["step"].optimizer_state for rank in r.ranks if "step" in rank.phases]
        rows.append([
            f"`{r.name}`",
            f"{format_mb(exchange)} / {format_mb(r.theory.owner_exchange_bytes_per_step)}",
            str((r.collective_calls_by_kind or {}).get("all_to_all", 0)),
            f"`{chunk.name}`" if chunk else "—",
            f"{format_mb(chunk.comm_bytes_per_step)} → {format_mb(r.comm_bytes_per_step)}" if chunk else "—",
            f"{chunk.aten_ops_per_step:,} → {r.aten_ops_per_step:,}" if chunk else "—",
            " / ".join(format_mb(state) for state in states) or "—",
            format_mb(chunk.model_state_by_kind["optimizer_state"]) if chunk and chunk.model_state_by_kind else "—",
            format_mb(r.theory.optimizer_state_bound_bytes),
        ])  # fmt: skip
    headers = [
        "variant", "all-to-all MB/step / theory", "all-to-alls", "chunk path", "comm MB/step", "aten ops/step",
        "optimizer state per rank MB", "chunk path's", "bound",
    ]  # fmt: skip
    lines = [
        "",
        "The ownership path (AdamW stepped whole on owner ranks) against the chunk path at its stage: the all-to-alls"
        " (gradients and weights to the owners, updates back; theory from the owner plan and chunk layouts), the"
        " step's communication and aten ops (chunk path → ownership path), and each rank's optimizer state after the"
        " step against issue 42's bound, 1.1 × (total / N + the largest parameter's):",
        "",
    ]
    return lines + markdown_table(headers, rows, "lrrlrrrrr")


def traffic_by_group_section(result: BenchResult, ran: Sequence[VariantResult], shard_group_size: int) -> list[str]:
    """Our variants' collective bytes per step (full buffers, the busiest rank) within a shard group
    and across groups, next to `theory.traffic_by_group`."""
    psi, world = result.model["num_params"], result.environment["world_size"]
    lines = [
        "",
        f"Hybrid sharding, {world // shard_group_size} groups of {shard_group_size} ranks: collective bytes per step"
        " and rank (full buffers), measured / theory (MB):",
        "",
    ]
    rows = []
    for r in ran:
        if not r.ranks or not r.ranks[0].traffic_by_group:
            continue
        measured = max((rank.traffic_by_group for rank in r.ranks), key=lambda t: t["within"] + t["across"])
        expected = theory.traffic_by_group(psi, r.stage, shard_group_size)
        rows.append([
            r.name,
            f"{format_mb(measured['within'])} / {format_mb(expected['within'])}",
            f"{format_mb(measured['across'])} / {format_mb(expected['across'])}",
            format_mb(measured["all"]),
        ])  # fmt: skip
    headers = ["variant", "within a group", "across groups", "over all ranks"]
    return lines + markdown_table(headers, rows, "lrrr")


LINK_BASELINE = "zero3"
"""The variant ZeRO++'s inter-node bytes are divided by."""


def bytes_per_link_section(result: BenchResult, ran: Sequence[VariantResult]) -> list[str]:
    """Our variants' full-buffer bytes per step split into intra-node and inter-node (`links.py`,
    [Note: bytes per link]), measured / expected (`theory.link_bytes`), each variant's inter-node
    bytes against zero3's, its step time, peak memory and final loss; then the bytes by category."""
    measured = [r for r in ran if r.bytes_by_link is not None]
    if not measured:
        return []
    opts, env = result.options, result.environment
    nodes, world = opts["nodes"], env["world_size"]
    baseline = next((r for r in measured if r.name == LINK_BASELINE), None)
    base_inter = link_totals(baseline.bytes_by_link)[INTER] if baseline and baseline.bytes_by_link else None
    base_expected = link_totals(baseline.theory.link_bytes)[INTER] if baseline and baseline.theory.link_bytes else None

    def versus(value: Optional[float], base: Optional[float]) -> str:
        return "—" if value is None or not base else f"{value / base:.3f}"

    rows = []
    for r in measured:
        got = link_totals(r.bytes_by_link or {})
        expected = link_totals(r.theory.link_bytes) if r.theory.link_bytes else None
        rows.append([
            f"`{r.name}`",
            _measured_expected(got[INTRA], None if expected is None else expected[INTRA]),
            _measured_expected(got[INTER], None if expected is None else expected[INTER]),
            f"{versus(got[INTER], base_inter)} ({versus(None if expected is None else expected[INTER], base_expected)})",
            "—" if r.step_time_s is None else _ms(r.step_time_s),
            format_mb(r.peak_memory_bytes),
            "—" if r.final_loss is None else f"{r.final_loss:.4f}",
        ])  # fmt: skip
    dtype = "fp32 (bf16-mixed autocasts activations only)" if opts["precision"] != "fp32" else "fp32"
    lines = [
        "",
        "## ZeRO++: bytes per link",
        "",
        f"{world} ranks as {nodes} nodes of {world // nodes}. Full-buffer bytes of one step's collectives per rank"
        " (an all-gather's output, a reduce-scatter's and an all-to-all's input, an all-reduce's tensor, in the"
        " dtype sent: quantized rows with their scales and padding), the rank that moved the most inter-node;"
        " intra-node where the collective's group lies within one node, inter-node where it spans nodes."
        f" Measured / expected (MB); weights and gradients {dtype}, so qwZ's int8 blocks are ~1/4 of the"
        f" fp32 gather (ZeRO++'s paper: 1/2 of fp16), qgZ's int8 ~1/4 of the fp32 reduce-scatter's rows."
        f" `vs {LINK_BASELINE} inter`: measured (expected). Step time: median of the slowest rank's; peak"
        " memory: the largest rank's; loss: the last step's, rank 0's.",
        "",
    ]
    headers = [
        "variant", "intra-node MB/step", "inter-node MB/step", f"vs {LINK_BASELINE} inter", "step ms", "peak MB",
        "final loss",
    ]  # fmt: skip
    lines += markdown_table(headers, rows, "lrrrrrr")
    same = [
        r.name for r in measured
        if BY_NAME[r.name].zero_plus_plus is not None and baseline is not None and r.bytes_by_link == baseline.bytes_by_link
    ]  # fmt: skip
    if same:
        lines += [
            "",
            f"{', '.join(f'`{name}`' for name in same)} {'moves' if len(same) == 1 else 'move'} zero3's bytes exactly,"
            " on the same links: their ZeRO++ options did not act, which is a bug (report it with this report).",
        ]
    return lines + _link_categories(measured)


def _measured_expected(value: float, expected: Optional[float]) -> str:
    return f"{format_mb(value)} / {format_mb(expected)}"


def _link_categories(measured: Sequence[VariantResult]) -> list[str]:
    """Each variant's bytes by category and link, measured / expected (MB)."""
    seen = {c for r in measured for c in (*(r.bytes_by_link or {}), *r.theory.link_bytes)}
    order = [c for c in CATEGORIES if c in seen] + sorted(seen - set(CATEGORIES))
    rows = []
    for r in measured:
        cells = [f"`{r.name}`"]
        for c in order:
            got = (r.bytes_by_link or {}).get(c, {})
            expected = r.theory.link_bytes.get(c) if r.theory.link_bytes else None
            parts = []
            for link in (INTRA, INTER):
                want = None if expected is None else expected.get(link, 0.0)
                if got.get(link, 0) or want:
                    parts.append(f"{link} {_measured_expected(got.get(link, 0), want)}")
            cells.append("; ".join(parts) or "—")
        rows.append(cells)
    lines = ["", "By collective (all-gathers by the phase they were issued in), measured / expected MB per step:", ""]
    return lines + markdown_table(["variant", *order], rows, "l" + "r" * len(order))


def raw_disk_line(raw: dict[str, Any]) -> str:
    """The raw throughput of the NVMe directory in one sentence (see `disk.py`, [Note: disk figures])."""
    where = f"`{raw['path']}` ({raw['filesystem'] or 'file system unknown'})"
    line = (
        f"NVMe offload's directory {where}, measured raw in this run ({raw['nbytes'] / 1e6:,.0f} MB, one stream):"
        f" write {raw['write_gbps']:.2f} GB/s (pwrite, then fsync), read {raw['read_gbps']:.2f} GB/s"
        + (" (the file dropped from the page cache first)" if raw["cache_dropped"] else " (page cache NOT dropped)")
        + f", read again from the page cache {raw['cached_read_gbps']:.2f} GB/s."
    )
    if raw.get("in_memory"):
        line += " The directory is on a memory file system: these are memory copies, not a disk."
    return line


def nvme_section(raw: dict[str, Any], ran: Sequence[VariantResult]) -> list[str]:
    """The NVMe variants' I/O per step next to the directory's raw throughput, and the optimizer
    step of every offload variant (NVMe's and the CPU's it is compared with)."""
    lines = ["", raw_disk_line(raw), ""]
    rows = []
    for r in ran:
        spec = BY_NAME[r.name]
        if not spec.offload_optimizer:
            continue
        optimizer_ms = "—" if r.optimizer_step_s is None else f"{r.optimizer_step_s * 1e3:,.0f}"
        if r.disk is None:
            rows.append([f"`{r.name}`", optimizer_ms] + ["—"] * 8)
            continue
        d = r.disk
        on_disk = "—"
        if r.ranks and r.model_state_phase in r.ranks[0].engine_reports:
            on_disk = format_mb(r.ranks[0].engine_reports[r.model_state_phase].get("disk"))
        share = d.wait_s_per_step / r.step_time_s if r.step_time_s else None
        rows.append([
            f"`{r.name}`",
            optimizer_ms,
            f"{d.read_gbps:.2f}",
            f"{d.write_gbps:.2f}",
            format_mb(d.read_bytes_per_step),
            format_mb(d.write_bytes_per_step),
            f"{d.waits_per_step:.1f}",
            f"{d.wait_s_per_step * 1e3:,.0f}",
            pct(share).lstrip("+"),
            f"{on_disk} / {format_mb(r.theory.model_state.on_disk)}",
        ])  # fmt: skip
    headers = [
        "variant", "optimizer step ms", "read GB/s", "write GB/s", "read MB/step", "write MB/step", "waits/step",
        "wait ms/step", "wait / step", "on disk MB / floor",
    ]  # fmt: skip
    return lines + markdown_table(headers, rows, "lrrrrrrrrr")


def io_floor_section(ran: Sequence[VariantResult]) -> list[str]:
    """Each NVMe variant's optimizer step against its I/O floor (`io_floor.py`, [Note: the I/O
    floor]): the engine path's rates, the floor's terms, the step, the pipeline's occupancy and
    issue 61's target; nothing where no variant has a floor."""
    measured = [r for r in ran if r.io_floor is not None]
    if not measured:
        return []
    rows = []
    for r in measured:
        f = r.io_floor
        assert f is not None
        rates = f.rates
        rows.append([
            f"`{r.name}`",
            str(f.rank),
            f"{rates.requests} × {format_mb(rates.request_bytes)}",
            f"{rates.read_gbps:.2f} / {rates.write_gbps:.2f}",
            f"{format_mb(f.read_bytes)} / {format_mb(f.write_bytes)}",
            _ms(f.host_step_s),
            f"{_ms(f.read_s)} + {_ms(f.write_s)}",
            f"**{_ms(f.floor_s)}**",
            "—" if f.raw_floor_s is None else _ms(f.raw_floor_s),
            _ms(f.step_s),
            f"**{f.step_vs_floor:.2f}×**",
            f"{f.read_busy:.0%} / {f.update_busy:.0%} / {f.write_busy:.0%}",
            "met" if f.met else "MISSED",
        ])  # fmt: skip
    first = measured[0].io_floor
    assert first is not None
    lines = [
        "",
        f"NVMe optimizer step against its I/O floor, max(host step, read MB / read rate + write MB / write rate),"
        f" medians over the timed steps of the rank that waited longest (its own optimizer step: the table above gives"
        f" the slowest rank's); rates of the engine's own I/O path on the same"
        f" directory ({first.rates.ranks} rank(s) at once, {first.rates.threads} I/O threads each, one request per"
        f" bucket file, no fsync, through the page cache), measured after each variant. Target (issue 61):"
        f" NVMe step ≤ {IO_FLOOR_TARGET:.1f}× the I/O floor.",
        "",
    ]
    headers = [
        "variant", "rank", "requests/step", "engine path read / write GB/s", "read / write MB/step", "host step ms",
        "read + write ms", "floor ms", "floor at raw rates ms", "its optimizer step ms", "step / floor",
        "busy: read / update / write", f"≤ {IO_FLOOR_TARGET:.1f}× floor",
    ]  # fmt: skip
    return lines + markdown_table(headers, rows, "lrrrrrrrrrrrl")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"
