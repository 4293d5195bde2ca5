"""A local stand-in for `python:X.Y-slim-bookworm`, for machines that cannot pull it.

The same shape as the official image: Debian bookworm minbase with the shared libraries CPython
links, ca-certificates, netbase and tzdata; a CPython under /usr/local (here the machine's pyenv
build, copied without its tests, bytecode, static library and site-packages), `python` on PATH,
pip (and on 3.11 setuptools and wheel) from the interpreter's own ensurepip, as the official image
has them. The host's local CAs (an intercepting proxy's, on some machines) are added, so the build
can reach the package index: that is the build machine's business, never the Dockerfile's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
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


def bootstrap(root: Path) -> None:
    """Debian bookworm minbase into `root` (a directory)."""
    sources = debian_sources()
    if not sources:
        raise RuntimeError("no Debian apt source on this machine to bootstrap from")
    cmd = ["mmdebstrap", "--variant=minbase", "--quiet", f"--include={LIBS}"]
    cmd += [f"--dpkgopt=path-exclude={p}" for p in EXCLUDE]
    cmd += ["--dpkgopt=force-unsafe-io"]  # a throwaway root: no fsync per file
    subprocess.run([*cmd, "bookworm", str(root), *sources], check=True, stdin=subprocess.DEVNULL)


def add_python(root: Path, version: str) -> None:
    src = pyenv_python(version)
    if src is None:
        raise RuntimeError(f"no CPython {version} build (pyenv) on this machine for the base")
    local = root / "usr" / "local"
    lib = f"python{version}"
    for name in (f"python{version}",):
        shutil.copy2(src / "bin" / name, local / "bin" / name)
    for link in ("python3", "python"):
        (local / "bin" / link).symlink_to(f"python{version}")
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
        shared.append(local / "bin" / f"python{version}")
        subprocess.run(["strip", "--strip-unneeded", *map(str, shared)], check=True)
    for ca in LOCAL_CAS.glob("*.crt") if LOCAL_CAS.is_dir() else []:
        shutil.copy2(ca, root / "usr/local/share/ca-certificates" / ca.name)

    def chroot(*args: str) -> None:
        out = subprocess.run(["chroot", str(root), *args], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"base: {' '.join(args)}: rc {out.returncode}: {out.stderr[-500:]}")

    chroot("ldconfig")  # the pyenv build's RUNPATH is its own folder: find libpython by the cache
    chroot("update-ca-certificates")
    chroot(f"/usr/local/bin/python{version}", "-m", "ensurepip", "--default-pip")
    for cache in list((local / "lib" / lib).rglob("__pycache__")):
        shutil.rmtree(cache)
    pips = sorted(p.name for p in (local / "bin").glob("pip*"))
    if not pips:
        raise RuntimeError("ensurepip installed no pip in the base")


def make(docker: list[str], env: dict[str, str], work: Path, tag: str, versions: list[str]) -> None:
    """Import one base per Python version as `<tag>:<version>`, from one bootstrap."""
    minbase = work / "minbase"
    t0 = time.monotonic()
    bootstrap(minbase)
    print(f"image-test: debian minbase in {time.monotonic() - t0:.0f} s", flush=True)
    for i, version in enumerate(versions):
        root = minbase  # the last version takes the bootstrap itself, the others a copy
        if i < len(versions) - 1:
            root = work / f"root-{version}"
            subprocess.run(["cp", "-a", str(minbase), str(root)], check=True)
        add_python(root, version)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(
            [
                *docker,
                "import",
                "--change",
                f"ENV PATH={PATH}",
                "--change",
                "ENV LANG=C.UTF-8",
                "--change",
                'CMD ["python3"]',
                "-",
                f"{tag}:{version}",
            ],
            stdin=tar.stdout,
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        if tar.wait() != 0:
            raise RuntimeError(f"tar of the {version} base failed")
        shutil.rmtree(root)
