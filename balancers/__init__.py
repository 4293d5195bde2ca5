"""Balancers by name: the built-ins, plus any registered under the `sluicegate.balancers`
entry-point group by an installed package (built through `balancers.plugin`, so that every
balancer the router holds returns a `Choice` and declares what it needs)."""

from __future__ import annotations

from importlib.metadata import entry_points

from balancers.base import Balancer, Candidate, Choice
from balancers.cache_aware import CacheAware
from balancers.latency import Latency
from balancers.least_inflight import LeastInflight
from balancers.least_load import LeastLoad
from balancers.plugin import adapted
from balancers.round_robin import RoundRobin

ENTRY_POINT_GROUP = "sluicegate.balancers"
BUILTIN: dict[str, type[Balancer]] = {
    RoundRobin.name: RoundRobin,
    LeastInflight.name: LeastInflight,
    LeastLoad.name: LeastLoad,
    CacheAware.name: CacheAware,
    Latency.name: Latency,
}

__all__ = [
    "BUILTIN",
    "Balancer",
    "Candidate",
    "Choice",
    "available",
    "balancer_class",
    "balancer_type",
]


def _plugins() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available() -> list[str]:
    return sorted(set(BUILTIN) | set(_plugins()))


def balancer_class(name: str) -> type:
    """The class registered under `name`, as registered; KeyError names the choices when there
    is none."""
    if name in BUILTIN:
        return BUILTIN[name]
    ep = _plugins().get(name)
    if ep is None:
        raise KeyError(f"unknown balancer {name!r}; available: {', '.join(available())}")
    cls = ep.load()  # type: ignore[attr-defined]
    if not callable(getattr(cls, "pick", None)):
        raise KeyError(f"balancer plugin {name!r} ({ep.value}) has no pick() method")  # type: ignore[attr-defined]
    return cls  # type: ignore[no-any-return]


def balancer_type(name: str) -> type[Balancer]:
    """The class the router builds for `name`: a built-in, or the plugin behind its adapter."""
    cls = balancer_class(name)
    return BUILTIN[name] if name in BUILTIN else adapted(cls, name)
