"""The supported torch and Lightning range (``lightning_zero/compat``): the check ``import
lightning_zero`` runs, and the shims that call an older Lightning or torch the way it expects.

Which releases actually run is proven by ``.ci/run``'s compatibility stage (``scripts/compat_matrix.sh``);
these tests pin what each shim decides, in this process, with the installed packages swapped for fakes.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from pathlib import Path
from typing import Optional

import lightning
import pytest

from lightning_zero.compat import lightning_api
from lightning_zero.compat.versions import REQUIREMENTS, check_supported_versions, release


def versions(**installed: Optional[str]):
    """A version getter for ``check_supported_versions``: None = not installed."""

    def installed_version(distribution: str) -> str:
        version = installed[distribution]
        if version is None:
            raise importlib.metadata.PackageNotFoundError(distribution)
        return version

    return installed_version


def test_release_reads_the_leading_numbers():
    assert release("2.6.0+cpu") == (2, 6, 0)
    assert release("2.5.0rc1") == (2, 5, 0)
    assert release("2.5.1.post0") == (2, 5, 1)
    assert release("2.15.0") > release("2.6.0")  # numbers, not strings
    assert release("unknown") == ()


@pytest.mark.parametrize(
    "torch, lightning",
    [("2.6.0", "2.5.0"), ("2.6.0+cu124", "2.5.0.post0"), ("2.13.0+cpu", "2.6.6"), ("2.15.0", "2.6.6"), ("3.0.0", "3.1.0")],
)
def test_the_supported_range_imports(torch: str, lightning: str):
    check_supported_versions(versions(torch=torch, lightning=lightning))


@pytest.mark.parametrize(
    "torch, lightning, named",
    [
        ("2.4.1", "2.6.6", ["torch 2.4.1 is installed"]),
        ("2.13.0", "2.4.0", ["lightning 2.4.0 is installed"]),
        ("2.5.1+cpu", "2.4.0", ["torch 2.5.1+cpu is installed", "lightning 2.4.0 is installed"]),
        ("2.13.0", None, ["lightning is not installed"]),
        ("1.13.1", "2.6.6", ["torch 1.13.1 is installed"]),  # (1, 13) < (2, 6) though 13 > 6
    ],
)
def test_outside_the_range_names_installed_and_supported_versions(torch: str, lightning: Optional[str], named: list[str]):
    with pytest.raises(ImportError) as raised:
        check_supported_versions(versions(torch=torch, lightning=lightning))
    message = str(raised.value)
    for part in named:
        assert part in message, message
    assert "torch 2.6 and newer and lightning 2.5 and newer" in message, message
    assert 'pip install "torch>=2.6" "lightning>=2.5"' in message, message
    assert "docs/getting-started.md#compatibility" in message, message


def test_import_lightning_zero_fails_first_with_the_versions(monkeypatch):
    """The check runs before anything that would fail deep inside an old torch or Lightning: the
    package's import, with pip's record of the installed versions patched, raises the check's error."""
    real_version = importlib.metadata.version
    fake = {"torch": "2.4.1", "lightning": "2.4.0"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: fake.get(name) or real_version(name))
    monkeypatch.delitem(sys.modules, "lightning_zero")  # restored afterwards, as are its submodules
    with pytest.raises(ImportError, match=r"torch 2\.4\.1 is installed; lightning 2\.4\.0 is installed"):
        importlib.import_module("lightning_zero")


def test_the_declared_range_is_the_checked_one():
    """pyproject.toml's lower bounds are the ones the import check enforces (and CI's oldest run)."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    for requirement in REQUIREMENTS:
        assert f'"{requirement.distribution}>={requirement.oldest[0]}.{requirement.oldest[1]}"' in text, requirement


def test_fabric_setup_returns_what_the_installed_fabric_unpacks(monkeypatch):
    module, optimizers, scheduler = object(), [object()], object()
    assert lightning_api.fabric_setup_takes_scheduler() == (release(lightning.__version__) >= (2, 6))
    monkeypatch.setattr(lightning_api, "fabric_setup_takes_scheduler", lambda: True)  # Lightning 2.6
    assert lightning_api.fabric_setup_result(module, optimizers, scheduler) == (module, optimizers, scheduler)
    monkeypatch.setattr(lightning_api, "fabric_setup_takes_scheduler", lambda: False)  # Lightning 2.5
    assert lightning_api.fabric_setup_result(module, optimizers, scheduler) == (module, optimizers)


def test_weights_only_reaches_only_loads_that_take_it():
    class NewIO:  # Lightning 2.6's CheckpointIO.load_checkpoint
        def load_checkpoint(self, path, map_location=None, weights_only=None):
            return ("new", path, weights_only)

    class OldIO:  # Lightning 2.5's, or a user's own written for it
        def load_checkpoint(self, path, map_location=None):
            return ("old", path)

    def load_plain(path, state, strict, weights_only=None):
        return (path, state, strict, weights_only)

    assert lightning_api.load_passing_weights_only(NewIO().load_checkpoint, "a.ckpt", False) == ("new", "a.ckpt", False)
    assert lightning_api.load_passing_weights_only(OldIO().load_checkpoint, "a.ckpt", False) == ("old", "a.ckpt")
    assert lightning_api.load_passing_weights_only(load_plain, "a.ckpt", True, {"m": 1}, False) == ("a.ckpt", {"m": 1}, False, True)
