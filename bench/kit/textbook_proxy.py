"""A textbook FastAPI proxy: the reference hop the `compare` benchmark sets beside sluicegate.

What a developer writes in an afternoon to put one OpenAI-compatible upstream behind their own
endpoint: a FastAPI app, one shared `httpx.AsyncClient`, `POST /v1/chat/completions` forwarded
as is, a streamed answer relayed with `StreamingResponse(resp.aiter_raw())` and a non-streamed
one returned whole. No balancing, retries, health, cancellation accounting, keys or metrics: it
is the floor a Python proxy on the same stack (uvicorn, uvloop, httptools) starts from. httpx's
default pool (100 connections, 20 kept alive) stays: keeping 64 alive measured no faster at 32
users (streamed, slower), so the default is not a handicap.

    TEXTBOOK_UPSTREAM=http://127.0.0.1:8001 uvicorn bench.kit.textbook_proxy:app \
        --loop uvloop --http httptools --no-access-log --port 8002
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

UPSTREAM = os.environ.get("TEXTBOOK_UPSTREAM", "http://127.0.0.1:8001")
client = httpx.AsyncClient(base_url=UPSTREAM, timeout=httpx.Timeout(300.0, connect=5.0))


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    yield
    await client.aclose()


app = FastAPI(lifespan=lifespan)


@app.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    body = await request.body()
    upstream = client.build_request(
        "POST",
        "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    resp = await client.send(upstream, stream=True)
    if json.loads(body).get("stream"):
        return StreamingResponse(
            resp.aiter_raw(),
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type"),
            background=BackgroundTask(resp.aclose),
        )
    content = await resp.aread()
    await resp.aclose()
    return Response(content, status_code=resp.status_code, media_type="application/json")
