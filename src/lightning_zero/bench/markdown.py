"""Markdown building blocks every report shares: byte figures and tables.

Bytes are shown in decimal MB (10^6), the unit of the `estimate` subcommand and the ZeRO paper.
"""

from __future__ import annotations

from typing import Optional, Sequence


def format_mb(nbytes: Optional[float]) -> str:
    if nbytes is None:
        return "—"
    value = nbytes / 1e6
    return f"{value:,.1f}" if value >= 10 else f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"


def pct(fraction: Optional[float]) -> str:
    return "—" if fraction is None else f"{fraction:+.1%}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str]) -> list[str]:
    marks = {"l": ":--", "r": "--:"}
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines
