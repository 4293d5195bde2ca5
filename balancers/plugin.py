"""An installed plugin balancer as the router sees every balancer: `pick()` returns a `Choice`,
`needs_counts` and `needs_engine` are declared.

The first plugin contract (docs/balancers.md) let `pick()` return a bare `Candidate` and left
the declarations out (then: counts needed, engine readings not). `adapted(cls)` makes, once per
plugin class, a subclass of `Plugin` that builds the plugin, supplies what it leaves out and
wraps its answer, so the request path never dispatches on the shape. A plugin that already
returns a `Choice` passes it through; its Lua form (`RedisForm`) is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from functools import cache
from typing import Any, ClassVar, cast

from balancers.base import Balancer, Candidate, Choice


class Plugin:
    """The base of each adapted plugin class (`adapted`)."""

    name: ClassVar[str]
    needs_counts: ClassVar[bool]
    needs_engine: ClassVar[bool]
    plugin: ClassVar[type]

    def __init__(self) -> None:
        self.inner = self.plugin()
        self._pick: Callable[..., Any] = self.inner.pick

    def pick(
        self, candidates: Sequence[Candidate], exclude: Set[str] = frozenset()
    ) -> Choice | None:
        got = self._pick(candidates, exclude)
        if got is None or isinstance(got, Choice):
            return got
        return Choice(got)


@cache
def adapted(cls: type, name: str) -> type[Balancer]:
    """`cls` (registered as `name`) behind `Plugin`: one class per plugin, so what the stores
    cache per balancer class (the Redis acquire script) stays per plugin."""
    attrs: dict[str, Any] = {
        "name": getattr(cls, "name", name),
        "needs_counts": bool(getattr(cls, "needs_counts", True)),
        "needs_engine": bool(getattr(cls, "needs_engine", False)),
        "plugin": cls,
        "__doc__": cls.__doc__,
    }
    lua = getattr(cls, "redis_pick", None)
    if isinstance(lua, str):
        attrs["redis_pick"] = lua
    return cast("type[Balancer]", type(cls.__name__, (Plugin,), attrs))
