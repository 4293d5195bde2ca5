"""CPU, memory, descriptors and sockets of a process tree, read from /proc (Linux)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _children(pid: int) -> list[int]:
    out = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for k in kids:
        out.extend(_children(int(k)))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the process and its live descendants."""
    total = 0
    for p in _children(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / _TICK


def rss_mb(pid: int) -> float:
    total = 0
    for p in _children(pid):
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1])
        except OSError:
            continue
    return total * _PAGE / 2**20


def open_fds(pid: int) -> int:
    total = 0
    for p in _children(pid):
        try:
            total += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            continue
    return total


def socket_states(ports: list[int]) -> dict[str, int]:
    """TIME-WAIT and CLOSE-WAIT sockets with one end on one of `ports` (either side)."""
    out = {"time_wait": 0, "close_wait": 0}
    try:
        text = subprocess.run(
            ["ss", "-tanH"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {"time_wait": -1, "close_wait": -1}
    wanted = {f":{p}" for p in ports}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 5:
            continue
        state, local, peer = parts[0], parts[3], parts[4]
        if not any(local.endswith(w) or peer.endswith(w) for w in wanted):
            continue
        if state == "TIME-WAIT":
            out["time_wait"] += 1
        elif state == "CLOSE-WAIT":
            out["close_wait"] += 1
    return out
