"""The garbage collector's pauses: what the router starts with is taken out of its walk, and
young objects are collected in larger batches.

A full collection walks every tracked object the process holds and blocks the event loop
meanwhile. What a started router holds is mostly what it will hold until it exits (modules,
classes, functions, the app's routes and settings: ~130,000 objects, about three quarters of a
full collection's time), and a walk of those never frees anything. `tune_collector()`, once the
app is built and before it serves, collects what is already garbage, then moves the rest to the
collector's permanent generation (`gc.freeze`): later collections walk only what the router
made since (requests' objects, discovered backends).

It also raises the youngest generation's threshold from 700 to `YOUNG` allocations. A full
collection is considered every 100 young ones; at 700, a large discovery apply (50,000
backends made in well under a second) ran eight full collections on its way, each walking
the backends made so far; at `YOUNG`, two. A young collection of that size takes about a
millisecond, and a request's own objects die young either way.

A frozen object is still freed when its last reference goes; only a reference cycle among
frozen objects that becomes garbage later is never collected, and startup objects do not do that.
"""

from __future__ import annotations

import gc

YOUNG = 10_000


def tune_collector() -> int:
    """Collect, freeze what is left, raise the young threshold; returns the objects frozen."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(max(YOUNG, gc.get_threshold()[0]), middle, old)
    return gc.get_freeze_count()
