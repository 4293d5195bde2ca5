"""The image installs from requirements.lock (and builds its wheel from requirements-build.lock)
with `pip install --require-hashes`: the locks must be what `make lock` makes from pyproject.toml
now. A dependency added, removed or re-ranged without `make lock` fails here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.harness import ROOT
from tools.lock import BUILD_LOCK, EXTRAS, RUNTIME_LOCK, digest, recorded

PIN = re.compile(r"^([A-Za-z0-9._-]+)==([^\s;\\]+)")


def pins(text: str) -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes) for each entry of a hash-pinned lock."""
    out: dict[str, tuple[str, int]] = {}
    name = None
    for line in text.splitlines():
        m = PIN.match(line)
        if m:
            name = canonicalize_name(m.group(1))
            out[name] = (m.group(2), 0)
        elif name and line.strip().startswith("--hash=sha256:"):
            version, n = out[name]
            out[name] = (version, n + 1)
    return out


@pytest.mark.parametrize("lock", [RUNTIME_LOCK, BUILD_LOCK], ids=lambda p: p.name)
def test_lock_was_made_from_this_pyproject(lock: Path) -> None:
    assert recorded(lock) == digest(), (
        f"{lock} is out of date with pyproject.toml: run `make lock` and commit both locks"
    )


def test_every_direct_dependency_is_pinned_within_its_range_with_hashes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in EXTRAS:
        wanted += project["optional-dependencies"][extra]
    locked = pins(RUNTIME_LOCK.read_text())
    assert all(n > 0 for _, n in locked.values()), "an entry without --hash"
    for spec in wanted:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in locked, f"{req.name} is not in {RUNTIME_LOCK.name}"
        assert req.specifier.contains(locked[name][0], prereleases=True), (
            f"{RUNTIME_LOCK.name} pins {req.name}=={locked[name][0]}, outside {req.specifier}"
        )
    build = pins(BUILD_LOCK.read_text())
    assert {"pip", "setuptools"} <= set(build)
    assert "pip" not in locked and "setuptools" not in locked  # the runtime has no installer
