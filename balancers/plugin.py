"""An installed plugin balancer as the router sees every balancer: `pick(candidates, ctx)`
returns a `Choice`, `needs_counts`, `needs_engine` and `needs_hints` are declared.

Plugins are written to the documented plugin contract (docs/balancers.md): `pick(candidates,
exclude)`, returning a `Choice` or a bare `Candidate`, the declarations optional (then: counts
needed, engine readings not). `adapted(cls)` makes, once per plugin class, a subclass of
`Plugin` that builds the plugin, supplies what it leaves out, hands it the context's exclusions
and wraps its answer, so the request path never dispatches on the shape. A request for a LoRA
adapter offers it only the engines that may run the adapter, and its choice takes the adapter
tier's reason (balancers/lora.py). A plugin that returns a `Choice` keeps its reason otherwise;
its Lua form (`RedisForm`) is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, ClassVar, cast

from balancers.base import Balancer, Candidate, Choice
from balancers.context import NO_CONTEXT, PickContext
from balancers.lora import eligible, labelled


class Plugin:
    """The base of each adapted plugin class (`adapted`)."""

    name: ClassVar[str]
    needs_counts: ClassVar[bool]
    needs_engine: ClassVar[bool]
    needs_hints: ClassVar[bool] = False
    needs_tokens: ClassVar[bool] = False
    plugin: ClassVar[type]

    def __init__(self) -> None:
        self.inner = self.plugin()
        self._pick: Callable[..., Any] = self.inner.pick

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext = NO_CONTEXT) -> Choice | None:
        want = ctx.adapter
        if want is not None:
            return labelled(self._choice(eligible(candidates, want), ctx), want)
        return self._choice(candidates, ctx)

    def _choice(self, candidates: Sequence[Candidate], ctx: PickContext) -> Choice | None:
        got = self._pick(candidates, ctx.exclude)
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
