"""`sluicegate serve` under a switchable profiler, for the stage breakdown
(bench/oneoff/hop_profile.py).

    python -m bench.oneoff.hop_serve serve --config FILE --port N   # the same arguments as the CLI

SIGUSR1 starts cProfile on the event loop's thread, SIGUSR2 stops it and writes the stats to
$HOP_PROFILE_OUT: only the measured window is profiled (no start-up, no warm-up). The timer is
the thread's CPU clock, so time the machine spends on other processes is not counted.
"""

from __future__ import annotations

import cProfile
import os
import signal
import sys
import time
from types import FrameType

from router.cli import main

_PROFILE = cProfile.Profile(time.thread_time)


def _start(signum: int, frame: FrameType | None) -> None:
    _PROFILE.enable()


def _stop(signum: int, frame: FrameType | None) -> None:
    _PROFILE.disable()
    _PROFILE.dump_stats(os.environ["HOP_PROFILE_OUT"])


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    sys.exit(main(sys.argv[1:]))
