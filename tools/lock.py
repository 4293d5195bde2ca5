"""`make lock`: the container image's hash-pinned requirement locks, generated from pyproject.toml.

    requirements.lock        the router's dependencies with the `kubernetes` extra (what the
                             image runs), every version pinned with the hashes of its files
    requirements-build.lock  what builds the router's wheel (the build backend, and pip)

The tool is uv's `pip compile`: one universal resolution (`--universal`) whose environment
markers hold on every Python the project supports (3.11 and up) and every platform, so the same
lock installs on the 3.11 and 3.12 bases and on amd64 and arm64; and with `--generate-hashes` it
records the hashes of every file of each pinned version, which is what
`pip install --require-hashes` checks. pip-tools resolves only for the interpreter it runs on (a
3.12-only answer can miss a 3.11-only dependency) and is much slower; pip's own `pip lock`
writes pylock.toml, which `pip install` cannot install from yet.

Each lock starts with the digest of the pyproject.toml fields it was made from;
tests/project/test_lock.py fails when they no longer match (a dependency added without `make lock`).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_LOCK = ROOT / "requirements.lock"
BUILD_LOCK = ROOT / "requirements-build.lock"
EXTRAS = ("kubernetes",)  # what the image installs beyond the core dependencies
MARK = "# pyproject-sha256: "
UV = [sys.executable, "-m", "uv", "pip", "compile", "--quiet", "--universal", "--generate-hashes"]


def inputs(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, object]:
    """The fields of pyproject.toml the locks are made from."""
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    project = data["project"]
    extras = project.get("optional-dependencies", {})
    return {
        "requires-python": project.get("requires-python", ""),
        "dependencies": sorted(project.get("dependencies", [])),
        "extras": {name: sorted(extras.get(name, [])) for name in EXTRAS},
        "build": sorted(build_requirements(data)),
    }


def build_requirements(data: dict[str, object]) -> list[str]:
    system = data.get("build-system", {})
    assert isinstance(system, dict)
    return [*system.get("requires", []), "pip>=23"]


def digest(pyproject: Path = ROOT / "pyproject.toml") -> str:
    blob = json.dumps(inputs(pyproject), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def recorded(lock: Path) -> str | None:
    """The digest a lock file says it was made from."""
    for line in lock.read_text(encoding="utf-8").splitlines():
        if line.startswith(MARK):
            return line[len(MARK) :].split()[0]
    return None


def _compile(args: list[str], stdin: str | None = None) -> str:
    python = str(inputs()["requires-python"]).lstrip(">=~ ").split(",")[0] or "3.11"
    cmd = [*UV, "--python-version", python, "--custom-compile-command", "make lock", *args]
    out = subprocess.run(cmd, input=stdin, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"make lock: uv pip compile failed:\n{out.stderr.strip()}")
    return out.stdout


def _write(lock: Path, body: str, sha: str) -> None:
    lock.write_text(f"{MARK}{sha}\n{body}", encoding="utf-8")
    pins = sum(1 for line in body.splitlines() if "==" in line and not line.startswith("#"))
    print(f"make lock: {lock.name}: {pins} pinned packages")


def main() -> int:
    sha = digest()
    extras = [arg for name in EXTRAS for arg in ("--extra", name)]
    _write(RUNTIME_LOCK, _compile(["pyproject.toml", *extras, "--only-binary", ":all:"]), sha)
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    build = "\n".join(build_requirements(data)) + "\n"
    _write(BUILD_LOCK, _compile(["-", "--only-binary", ":all:"], stdin=build), sha)
    return 0


if __name__ == "__main__":
    sys.exit(main())
