"""pip's settings on this machine as uv's options, one per line (scripts/compat_matrix.sh installs with uv,
which reads no pip.conf). Reads `pip config list` on stdin: where an option is set in several places,
pip's order decides (environment, then site, user and global files); an option may hold several
values separated by spaces (extra index URLs, find-links)."""

from __future__ import annotations

import shlex
import sys

UV_OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links", "constraint": "--constraint"}
PRECEDENCE = (":env:", "site", "user", "global")  # pip's: the first place that sets an option wins


def uv_options(pip_config_list: str) -> list[str]:
    chosen: dict[str, tuple[int, str]] = {}
    for line in pip_config_list.splitlines():
        key, _, value = line.strip().partition("=")
        place, _, name = key.rpartition(".")
        if name not in UV_OPTIONS or not value:
            continue
        rank = PRECEDENCE.index(place) if place in PRECEDENCE else len(PRECEDENCE)
        if name not in chosen or rank < chosen[name][0]:
            chosen[name] = (rank, shlex.split(value)[0])
    options = []
    for name, (_, value) in chosen.items():
        for item in value.split():
            options += [UV_OPTIONS[name], item]
    return options


if __name__ == "__main__":
    print("\n".join(uv_options(sys.stdin.read())))
