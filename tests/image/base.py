"""A local stand-in for `python:X.Y-slim-bookworm`, for machines that cannot pull it.

The same shape as the official image: Debian bookworm minbase with the shared libraries CPython
links, ca-certificates, netbase and tzdata; a CPython under /usr/local (here the machine's pyenv
build, copied without its tests, bytecode, static library and site-packages), `python` on PATH,
pip from the interpreter's own ensurepip, as the official image has it. It also carries
setuptools (from the build lock, hash-checked), as the official 3.11 base does: the one image
built on it then shows the Dockerfile removing every installer a base may bring. The host's local
CAs (an intercepting proxy's, on some machines) are added, so the build can reach the package
index: that is the build machine's business, never the Dockerfile's.

Nothing in it is pinned: Debian's packages are the mirror's of the day, the CPython the machine's.
Its root filesystem is kept as a tar in a cache folder (`cache_dir()`) under a key of everything
it is made from, and imported from there on the next run; a week old, it is made again (Debian's
security updates).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

LIBS = (
    "ca-certificates,netbase,tzdata,libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,"
    "libreadline8,libncursesw6,zlib1g,libuuid1,libexpat1,libnsl2,libtirpc3"
)
# As Debian's slim images: no documentation, manual pages or translations.
EXCLUDE = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*")
PATH = "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"  # the official image's
LOCAL_CAS = Path("/usr/local/share/ca-certificates")
BUILD_LOCK = Path(__file__).resolve().parents[2] / "requirements-build.lock"
MAX_AGE = 7 * 24 * 3600


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/sluicegate/image-base` (else `~/.cache/...`): delete it to start over."""
    given = os.environ.get("XDG_CACHE_HOME")
    return (Path(given) if given else Path.home() / ".cache") / "sluicegate" / "image-base"


def debian_sources() -> list[str]:
    """The machine's own apt source files for Debian (the mirror apt already uses)."""
    found = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    return [
        str(p)
        for p in found
        if p.suffix in (".list", ".sources") and p.is_file() and "/debian" in p.read_text()
    ]


def pyenv_python(version: str) -> Path | None:
    """The newest pyenv build of `version` (e.g. 3.12) on this machine."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    builds = [p for p in root.glob(f"{version}.*") if (p / "bin" / f"python{version}").exists()]
    builds.sort(key=lambda p: [int(x) if x.isdigit() else 0 for x in p.name.split(".")])
    return builds[-1] if builds else None


def cache_key(version: str) -> str:
    """A digest of what the base is made from: this file, the CPython build, the local CAs, the
    build lock (setuptools) and the apt sources."""
    src = pyenv_python(version)
    if src is None:
        raise RuntimeError(f"no CPython {version} build (pyenv) on this machine for the base")
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    binary = (src / "bin" / f"python{version}").stat()
    h.update(f"{src.name} {binary.st_size} {binary.st_mtime_ns}".encode())
    for path in [*sorted(LOCAL_CAS.glob("*.crt")), BUILD_LOCK, *map(Path, debian_sources())]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def bootstrap(root: Path) -> None:
    """Debian bookworm minbase into `root` (a directory)."""
    sources = debian_sources()
    if not sources:
        raise RuntimeError("no Debian apt source on this machine to bootstrap from")
    cmd = ["mmdebstrap", "--variant=minbase", "--quiet", f"--include={LIBS}"]
    cmd += [f"--dpkgopt=path-exclude={p}" for p in EXCLUDE]
    cmd += ["--dpkgopt=force-unsafe-io"]  # a throwaway root: no fsync per file
    subprocess.run([*cmd, "bookworm", str(root), *sources], check=True, stdin=subprocess.DEVNULL)


def setuptools_wheel(into: Path) -> Path:
    """The build lock's setuptools wheel, downloaded and checked against the lock's hashes."""
    into.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--require-hashes"]
    subprocess.run(
        [*pip, "--only-binary", ":all:", "-d", str(into), "-r", str(BUILD_LOCK)],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    wheels = sorted(into.glob("setuptools-*.whl"))
    if not wheels:
        raise RuntimeError("the build lock has no setuptools wheel for the base")
    return wheels[-1]


def add_python(root: Path, version: str, setuptools: Path) -> None:
    src = pyenv_python(version)
    if src is None:
        raise RuntimeError(f"no CPython {version} build (pyenv) on this machine for the base")
    local = root / "usr" / "local"
    lib = f"python{version}"
    shutil.copy2(src / "bin" / lib, local / "bin" / lib)
    for link in ("python3", "python"):
        (local / "bin" / link).symlink_to(lib)
    for so in (src / "lib").glob("libpython*.so*"):
        shutil.copy2(so, local / "lib" / so.name, follow_symlinks=False)

    def skip(directory: str, names: list[str]) -> set[str]:
        out = {n for n in names if n in ("test", "tests", "idle_test", "__pycache__")}
        out |= {n for n in names if n.endswith((".pyc", ".a"))}
        if os.path.basename(directory) == "site-packages":
            out |= set(names)  # the official image starts with only what ensurepip installs
        return out

    shutil.copytree(src / "lib" / lib, local / "lib" / lib, ignore=skip, symlinks=True)
    # Stripped, as the official build links them (--strip-all): a pyenv build keeps symbols.
    if shutil.which("strip"):
        shared = [
            *(local / "lib").glob("libpython*.so.*"),
            *(local / "lib").rglob("*.cpython-*.so"),
        ]
        shared.append(local / "bin" / lib)
        subprocess.run(["strip", "--strip-unneeded", *map(str, shared)], check=True)
    for ca in LOCAL_CAS.glob("*.crt") if LOCAL_CAS.is_dir() else []:
        shutil.copy2(ca, root / "usr/local/share/ca-certificates" / ca.name)

    def chroot(*args: str) -> None:
        out = subprocess.run(["chroot", str(root), *args], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"base: {' '.join(args)}: rc {out.returncode}: {out.stderr[-500:]}")

    chroot("ldconfig")  # the pyenv build's RUNPATH is its own folder: find libpython by the cache
    chroot("update-ca-certificates")
    chroot(f"/usr/local/bin/{lib}", "-m", "ensurepip", "--default-pip")
    shutil.copy2(setuptools, root / "tmp" / setuptools.name)
    chroot(
        f"/usr/local/bin/{lib}",
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--disable-pip-version-check",
        "--root-user-action=ignore",
        f"/tmp/{setuptools.name}",
    )
    (root / "tmp" / setuptools.name).unlink()
    for cache in list((local / "lib" / lib).rglob("__pycache__")):
        shutil.rmtree(cache)
    if not sorted((local / "bin").glob("pip*")):
        raise RuntimeError("ensurepip installed no pip in the base")


def rootfs_tar(work: Path, version: str) -> tuple[Path, bool]:
    """The base's root filesystem as a tar: from the cache when it holds a current one (True),
    else made now and stored there (False)."""
    cache = cache_dir()
    tar = cache / f"python{version}-bookworm-{cache_key(version)}.tar"
    if tar.is_file() and time.time() - tar.stat().st_mtime < MAX_AGE:
        return tar, True
    root = work / "base-root"
    t0 = time.monotonic()
    bootstrap(root)
    print(f"image-test: debian minbase in {time.monotonic() - t0:.0f} s", flush=True)
    add_python(root, version, setuptools_wheel(work / "wheels"))
    cache.mkdir(parents=True, exist_ok=True)
    for old in cache.glob(f"python{version}-bookworm-*.tar*"):
        old.unlink()  # one base per Python version: an older key is never used again
    partial = tar.with_suffix(".tar.partial")
    subprocess.run(
        ["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], check=True
    )
    partial.rename(tar)
    shutil.rmtree(root)
    return tar, False


def make(docker: list[str], env: dict[str, str], work: Path, tag: str, version: str) -> bool:
    """Import the base for `version` as `tag`; True when its root came from the cache."""
    tar, cached = rootfs_tar(work, version)
    changes = [f"ENV PATH={PATH}", "ENV LANG=C.UTF-8", 'CMD ["python3"]']
    cmd = [*docker, "import", *(a for c in changes for a in ("--change", c)), str(tar), tag]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    return cached
