"""Versions have one source each (pyproject.toml), and a mismatched ca-core fails at import saying what to do."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import ca_core
import ca_runtime
import pytest
import tomllib
import torch

REPO = Path(__file__).resolve().parents[3]


def _pyproject(package: str) -> dict:
    path = REPO / "packages" / package / "pyproject.toml"
    if not path.exists():
        pytest.skip(f"not run from a checkout ({path} is missing)")
    with path.open("rb") as f:
        return tomllib.load(f)


def test_runtime_versions_come_from_package_metadata() -> None:
    assert ca_core.__version__ == importlib.metadata.version("ca-core")
    assert ca_runtime.__version__ == importlib.metadata.version("ca-runtime")


def test_pins_agree_with_the_released_versions() -> None:
    core, runtime, testkit = (_pyproject(p)["project"] for p in ("ca-core", "ca-runtime", "ca-testkit"))
    # ca-core's version is RELEASE+torchX.Y.Z: the runtime pins the release, the label names the torch pin.
    release, label = core["version"].split("+")
    assert f"ca-core=={release}" in runtime["dependencies"]
    assert f"torch=={label.removeprefix('torch')}" in core["dependencies"]
    assert f"ca-runtime=={runtime['version']}" in testkit["dependencies"]
    # torch is pinned in ca-core only (build and run), and that pin is the torch running here.
    torch_pins = {r for r in core["dependencies"] if r.startswith("torch")}
    assert torch_pins == {f"torch=={torch.__version__.split('+')[0]}"}
    assert torch_pins <= set(_pyproject("ca-core")["build-system"]["requires"])
    assert not [r for r in runtime["dependencies"] + testkit["dependencies"] if r.startswith("torch")]


def test_a_mismatched_ca_core_fails_at_import_saying_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "9.9.9" if d == "ca-core" else real(d))
    with pytest.raises(ImportError, match=r"needs ca-core==.*ca-core 9\.9\.9 is installed.*pip install"):
        ca_runtime._check_ca_core()


@pytest.mark.parametrize("installed", ["0.1.0", "0.1.0+torch2.13.0"])
def test_ca_core_matches_the_pin_whatever_its_torch_label(
    monkeypatch: pytest.MonkeyPatch, installed: str
) -> None:
    """The wheel's version has a local label (``+torch2.13.0``); the pin ``ca-core==0.1.0`` matches it, as in pip."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: installed if d == "ca-core" else real(d))
    monkeypatch.setattr(importlib.metadata, "requires", lambda d: ["ca-core==0.1.0"])
    ca_runtime._check_ca_core()
    monkeypatch.setattr(
        importlib.metadata, "version", lambda d: "0.1.1+torch2.13.0" if d == "ca-core" else real(d)
    )
    with pytest.raises(ImportError, match=r"needs ca-core==0\.1\.0.*0\.1\.1\+torch2\.13\.0 is installed"):
        ca_runtime._check_ca_core()
