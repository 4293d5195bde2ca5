"""What the endpoint table costs: router CPU per request for chat completions against a baseline
checkout (the ≤ 2 % budget), and for each other API against chat completions, one run.

    python -m bench.oneoff.api --baseline-src DIR [--rounds 3] [--seconds 3]
    python -m bench.oneoff.api --baseline-src DIR --chat-only --rounds 8   # the chat A/B alone

The overhead scenario's load (the fast mock, 64 tokens, concurrency 32) runs against each
(router, endpoint) pair in alternating rounds, so noise on this shared machine spreads evenly;
ratios are within this one run. Streams are compared with the chat stream, whole answers with
the whole chat answer. A Responses or Messages stream carries more events and bytes per token
than a chat stream (vLLM's shapes, which the mock sends), so its ratio includes relaying those.
`cancel` is `POST /v1/responses/{id}/cancel` of a stored response (routed by the id map; the
engine's answer is its 400 for a finished response).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import httpx

from bench.kit.loadgen import run_load
from bench.kit.procstat import cpu_seconds
from tests.support.harness import Cluster, Proc

_B = "XbenchX"
AUDIO = (
    (
        f'--{_B}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    + bytes(8192)
    + (
        f'\r\n--{_B}\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--{_B}--\r\n'
    ).encode()
)


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


MSG = [{"role": "user", "content": "hello"}]
# name -> (path, body, content type); "chat" rows are the references
CASES: dict[str, tuple[str, bytes, str]] = {
    "chat_stream": (
        "/v1/chat/completions",
        _json({"model": "m", "stream": True, "max_tokens": 64, "messages": MSG}),
        "application/json",
    ),
    "chat_whole": (
        "/v1/chat/completions",
        _json({"model": "m", "max_tokens": 64, "messages": MSG}),
        "application/json",
    ),
    "responses_stream": (
        "/v1/responses",
        _json({"model": "m", "stream": True, "max_output_tokens": 64, "input": "hello"}),
        "application/json",
    ),
    "responses_whole": (
        "/v1/responses",
        _json({"model": "m", "max_output_tokens": 64, "input": "hello"}),
        "application/json",
    ),
    "messages_stream": (
        "/v1/messages",
        _json({"model": "m", "stream": True, "max_tokens": 64, "messages": MSG}),
        "application/json",
    ),
    "messages_whole": (
        "/v1/messages",
        _json({"model": "m", "max_tokens": 64, "messages": MSG}),
        "application/json",
    ),
    "count_tokens": (
        "/v1/messages/count_tokens",
        _json({"model": "m", "messages": MSG}),
        "application/json",
    ),
    "tokenize": ("/tokenize", _json({"model": "m", "prompt": "hello world"}), "application/json"),
    "rerank": (
        "/v1/rerank",
        _json({"model": "m", "query": "q", "documents": ["a", "b"]}),
        "application/json",
    ),
    "audio": ("/v1/audio/transcriptions", AUDIO, f"multipart/form-data; boundary={_B}"),
}
STREAMS = ("responses_stream", "messages_stream")


def _router(c: Cluster, up: Proc, src: str | None = None) -> Proc:
    config = {"backends": [{"name": "b", "url": up.url, "models": {"m": "mock-model"}}]}
    return c.router(config, env={"SLUICEGATE_LOG_LEVEL": "warning"}, src=src)


def _load(r: Proc, path: str, body: bytes, ctype: str, seconds: float) -> tuple[float, int]:
    cpu0 = cpu_seconds(r.pid)
    res = asyncio.run(
        run_load("127.0.0.1", r.port, path, body, 32, duration=seconds, content_type=ctype)
    )
    # cancel's answer is the engine's 400 (a finished response): counted as served
    return cpu_seconds(r.pid) - cpu0, res.ok + (res.errors if "/cancel" in path else 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--baseline-src", default=None, help="a checkout before the endpoint table")
    ap.add_argument("--chat-only", action="store_true", help="only chat, against the baseline")
    opts = ap.parse_args()
    c = Cluster()
    try:
        up = c.mock("fast", tokens=64)
        new = _router(c, up)
        stored = httpx.post(new.url + "/v1/responses", json={"model": "m", "input": "x"}).json()
        cases = {**CASES, "cancel": (f"/v1/responses/{stored['id']}/cancel", b"", "text/plain")}
        if opts.chat_only:
            cases = {k: v for k, v in cases.items() if k.startswith("chat")}
        targets: dict[str, tuple[Proc, str, bytes, str]] = {
            f"new:{k}": (new, *v) for k, v in cases.items()
        }
        if opts.baseline_src:
            base = _router(c, up, opts.baseline_src)
            for k in ("chat_stream", "chat_whole"):
                targets[f"baseline:{k}"] = (base, *CASES[k])
        totals = {k: [0.0, 0] for k in targets}
        for r, path, body, ctype in targets.values():  # warm-up
            _load(r, path, body, ctype, 0.5)
        for rnd in range(opts.rounds):
            order = list(targets)
            order = order[rnd % len(order) :] + order[: rnd % len(order)]
            for name in order:
                cpu, ok = _load(*targets[name], opts.seconds)
                totals[name][0] += cpu
                totals[name][1] += ok
        ms = {k: round(cpu / n * 1000, 4) for k, (cpu, n) in totals.items() if n}
        vs_chat = {}
        for k in cases:
            if k.startswith("chat"):
                continue
            ref = ms["new:chat_stream"] if k in STREAMS else ms["new:chat_whole"]
            vs_chat[k] = round(ms[f"new:{k}"] / ref, 3)
        report: dict[str, Any] = {
            "cpu_ms_per_request": ms,
            "requests": {k: n for k, (_, n) in totals.items()},
            "vs_chat": vs_chat,
        }
        if opts.baseline_src:
            report["chat_vs_baseline"] = {
                k: round(ms[f"new:{k}"] / ms[f"baseline:{k}"], 3)
                for k in ("chat_stream", "chat_whole")
            }
        print(json.dumps(report, indent=2))
    finally:
        c.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
