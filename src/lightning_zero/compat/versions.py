"""The supported torch and Lightning range, and the check ``import lightning_zero`` runs first.

Outside the range the package would fail later and deep inside (a missing DTensor import, an
unpacking error in Fabric's setup, gloo refusing a reduce-scatter); the check turns that into one
``ImportError`` naming what is installed and what is supported. The lower bounds are the oldest
versions CI runs (``.ci/run``'s compatibility stage, ``scripts/compat_matrix.sh``); there are no upper
bounds until a release is known to break.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Callable, NamedTuple, Optional


class Requirement(NamedTuple):
    distribution: str
    """The name pip installs it by."""
    oldest: tuple[int, int]
    """The oldest (major, minor) CI runs."""


REQUIREMENTS = (Requirement("torch", (2, 6)), Requirement("lightning", (2, 5)))


def release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string: "2.6.0+cpu" -> (2, 6, 0), "2.5.0rc1" -> (2, 5, 0)."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in numbers.group().split(".")) if numbers else ()


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution``, as pip records it; torch built from source (no
    record) by its ``__version__``. Lightning is not imported: the console tools start without it."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        if distribution != "torch":
            raise
        import torch

        return torch.__version__


def check_supported_versions(installed: Callable[[str], str] = installed_version) -> None:
    """Raise ``ImportError`` if torch or Lightning is older than the oldest supported release, or
    missing. ``installed``: a distribution's version by name."""
    problems = [problem for requirement in REQUIREMENTS if (problem := _problem(requirement, installed))]
    if problems:
        wanted = " ".join(f'"{r.distribution}>={_dotted(r.oldest)}"' for r in REQUIREMENTS)
        raise ImportError(
            f"lightning-zero supports {' and '.join(_supported(r) for r in REQUIREMENTS)}, but {'; '.join(problems)}."
            f" HINT: upgrade them (`pip install {wanted}`); docs/getting-started.md#compatibility lists the"
            " combinations CI runs."
        )


def _dotted(release_numbers: tuple[int, ...]) -> str:
    return ".".join(map(str, release_numbers))


def _supported(requirement: Requirement) -> str:
    return f"{requirement.distribution} {_dotted(requirement.oldest)} and newer"


def _problem(requirement: Requirement, installed: Callable[[str], str]) -> Optional[str]:
    try:
        version = installed(requirement.distribution)
    except importlib.metadata.PackageNotFoundError:
        return f"{requirement.distribution} is not installed"
    if release(version)[:2] < requirement.oldest:
        return f"{requirement.distribution} {version} is installed"
    return None
