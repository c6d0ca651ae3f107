"""The CPU pins (``scripts/constraints-cpu.txt``) stay installable: each pin lies inside what ``pyproject.toml`` asks
for, so bumping a requirement without the pin fails here instead of in a user's ``bash scripts/demo.sh``."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PINS = ROOT / "scripts" / "constraints-cpu.txt"
tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")


def read_pins() -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in PINS.read_text(encoding="utf-8").splitlines())
    return [Requirement(line) for line in lines if line]


def project_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    found = [Requirement(spec) for spec in project["dependencies"]]
    found += [Requirement(spec) for specs in project["optional-dependencies"].values() for spec in specs]
    return {canonicalize_name(req.name): req for req in found}


def test_every_pin_is_exact_and_inside_the_projects_requirement():
    required = project_requirements()
    problems = []
    for pin in read_pins():
        exact = [spec for spec in pin.specifier if spec.operator == "=="]
        if len(exact) != 1:
            problems.append(f"{pin}: not one exact version")
            continue
        wanted = required.get(canonicalize_name(pin.name))
        if wanted is not None and not wanted.specifier.contains(exact[0].version, prereleases=True):
            problems.append(f"{pin} is outside pyproject.toml's {wanted}")
    assert problems == []


def test_the_pins_hold_the_libraries_whose_rounding_trains_the_demo():
    """numpy (data, matching), pillow (the images), transformers and tokenizers (the model) move the demo's digits."""
    pinned = {canonicalize_name(pin.name) for pin in read_pins()}
    assert {"numpy", "scipy", "pillow", "transformers", "tokenizers"} <= pinned
    assert "torch" not in pinned  # bootstrap.sh installs the CPU build itself; GPU machines keep their own
