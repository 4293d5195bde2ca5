"""Memory a flood of big request bodies freed goes back to the system (glibc's allocator).

Bounds (`max_body_bytes`, `server.body_timeout`, `admission.max_queue_bytes`) cap what a flood
can hold; once it is over, the freed memory must leave the process too, or the next flood of
another kind starts from the last one's peak. glibc keeps it in two ways, and each has a fix:

- `pin_mmap_threshold()`, at startup: buffers of 256 KiB or more (a body, its parsed text) are
  always mapped, so freeing one unmaps it. glibc otherwise raises the threshold to the size of
  the first big buffer freed, and later bodies land in the heap, which keeps what they free.
- `Trimmer.step()`, every 5 s: while the resident size is more than `slack` above the lowest it
  has been, `malloc_trim(0)` hands the heap's free pages back (the socket reads' 64 KiB chunks
  live there). A process at its resting size never trims; a trim costs a few milliseconds.

Elsewhere (musl, macOS) both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("sluicegate.app")

_M_MMAP_THRESHOLD = -3
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_LIBC = _libc()


def pin_mmap_threshold(size: int = 256 * 1024) -> bool:
    return _LIBC is not None and bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, size))


def resident_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


class Trimmer:
    """`step()` trims while the resident size is `slack` above the lowest it has been."""

    def __init__(self, slack: int = 16 * 1024 * 1024) -> None:
        self.slack = slack
        self._floor = resident_bytes()
        self.trims = 0

    async def step(self) -> None:
        now = resident_bytes()
        if now and now < self._floor:
            self._floor = now
        if _LIBC is not None and now > self._floor + self.slack:
            _LIBC.malloc_trim(0)
            self.trims += 1
