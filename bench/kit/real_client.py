"""One client process of the real-engine benchmark (bench/scenarios/real_engine.py starts a few
of them).

    python -m bench.kit.real_client PLAN.json OUT.json

The plan holds conversations, each with the URL it talks to (the router, or one engine for the
direct baseline), a system prompt and its user turns. Every conversation runs on a thread of
its own, its turns one after another (each resends the whole history, the engine's answer
included), streamed with `include_usage`. Written per request: time to the first content token,
the engine's prompt, completion and cached token counts. A separate process because one Python
process is CPU-bound here before a real engine is (see the benchmark's docstring).
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

CHAT = "/v1/chat/completions"
TIMEOUT_S = 60.0


def turn(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    sent = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", url + CHAT, json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "error": r.read()[:200].decode()}
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage") and not event["choices"]:
                usage = event["usage"]
                continue
            for choice in event["choices"]:
                piece = choice.get("delta", {}).get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter()
                    text.append(piece)
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ok": bool(usage) and first is not None,
        "ttft_s": (first - sent) if first is not None else None,
        "total_s": time.perf_counter() - sent,
        "prompt": usage.get("prompt_tokens", 0),
        "completion": usage.get("completion_tokens", 0),
        "cached": details.get("cached_tokens") or 0,
        "answer": "".join(text),
    }


def conversation(conv: dict[str, Any], model: str, max_tokens: int) -> list[dict[str, Any]]:
    messages: list[dict[str, str]] = [{"role": "system", "content": conv["system"]}]
    out = []
    with httpx.Client(timeout=TIMEOUT_S) as client:
        for i, user in enumerate(conv["turns"]):
            messages.append({"role": "user", "content": user})
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            try:
                rec = turn(client, conv["url"], body)
            except httpx.HTTPError as exc:
                rec = {"ok": False, "error": repr(exc)[:200]}
            rec["turn"] = i
            rec["conversation"] = conv["id"]
            out.append(rec)
            messages.append({"role": "assistant", "content": str(rec.pop("answer", ""))})
    return out


def main() -> int:
    plan = json.loads(open(sys.argv[1]).read())
    started = time.perf_counter()
    with ThreadPoolExecutor(len(plan["conversations"])) as pool:
        futures = [
            pool.submit(conversation, c, plan["model"], plan["max_tokens"])
            for c in plan["conversations"]
        ]
        records = [r for f in futures for r in f.result()]
    result = {"records": records, "elapsed_s": time.perf_counter() - started}
    with open(sys.argv[2], "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
