"""A getting-in policy called directly, as its client would see it: the policy's own value when it
lets the request in, else its refusal as the web face answers it (`router.core.errors.answer`,
OpenAI's format)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from starlette.responses import Response

from router.core.errors import Refused, answer

P = ParamSpec("P")
T = TypeVar("T")


def answered(policy: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | Response:
    try:
        return policy(*args, **kwargs)
    except Refused as refused:
        return answer(refused)


async def answered_async(pending: Awaitable[T]) -> T | Response:
    try:
        return await pending
    except Refused as refused:
        return answer(refused)
