"""Chat turns against a router, measured from the client: random words as a prompt's text, one
streamed chat completion's time to first token, tokens and the engine's cached share
(`send_turn`), and the router's routing reasons from its /metrics. The cache-aware scenarios'
client side.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import httpx

from bench.kit.cluster import CHAT

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we their can has been if more when will "
    "would who so no model token cache engine router prompt request stream batch queue block "
    "policy customer invoice order refund shipping account billing support ticket contract"
).split()


def random_text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens (four characters each, as the mock counts) of random words."""
    words: list[str] = []
    chars = 0
    while chars < tokens * 4:
        w = rng.choice(_WORDS)
        words.append(w)
        chars += len(w) + 1
    return " ".join(words)


@dataclass
class Turn:
    ttft: float
    tokens: int
    content: str
    backend: str
    cached: int  # the engine's usage.prompt_tokens_details.cached_tokens
    prompt: int  # usage.prompt_tokens


async def send_turn(
    client: httpx.AsyncClient, messages: list[dict[str, str]], out_tokens: int
) -> Turn | None:
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": out_tokens,
        "messages": messages,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    first: float | None = None
    parts: list[str] = []
    cached = prompt = 0
    async with client.stream("POST", CHAT, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            text = choices[0].get("delta", {}).get("content") if choices else None
            if text:
                if first is None:
                    first = time.monotonic() - t0
                parts.append(text)
            usage = event.get("usage")
            if usage:
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
                prompt = int(usage.get("prompt_tokens", 0))
    if first is None:
        return None
    backend = r.headers.get("x-sluicegate-backend", "?")
    return Turn(first, len(parts), "".join(parts), backend, cached, prompt)


def routing_reasons(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("sluicegate_routing_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
