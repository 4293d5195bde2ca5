"""Active probes: one GET per backend per interval, bounded by the probe timeout.

`GET /health` for `kind: vllm`, `GET /v1/models` with the backend's key for `kind: openai`, or the
configured `health.path`. Any 2xx is healthy. Probes use their own small client, so a request pool
that is full never makes a backend look dead, and probe traffic never queues behind requests.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from health.state import ProbeResult
from router.core.backend import Backend
from router.core.settings import HealthConfig
from router.upstream.pools import NoCookies

DEFAULT_PATHS = {"vllm": "/health", "sglang": "/health", "openai": "/v1/models"}


def probe_path(backend: Backend, cfg: HealthConfig) -> str:
    return cfg.path or DEFAULT_PATHS.get(backend.kind, "/health")


def probe_client(max_connections: int = 64) -> httpx.AsyncClient:
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=16),
        trust_env=False,
        follow_redirects=False,
    )
    client._cookies = NoCookies()  # httpx has no public switch for "no jar"
    return client


async def probe(client: httpx.AsyncClient, backend: Backend, cfg: HealthConfig) -> ProbeResult:
    started = time.perf_counter()
    try:
        # httpx's timeout bounds each phase; the outer one bounds the whole probe.
        async with asyncio.timeout(cfg.timeout):
            response = await client.get(
                backend.url + probe_path(backend, cfg),
                headers=list(backend.auth_headers),
                params=dict(backend.query) or None,
                timeout=cfg.timeout,
            )
    except (TimeoutError, httpx.TimeoutException):
        return ProbeResult(False, None, "timeout")
    except httpx.HTTPError:
        return ProbeResult(False, None, "connect")
    latency = round((time.perf_counter() - started) * 1000, 2)
    if 200 <= response.status_code < 300:
        return ProbeResult(True, latency)
    return ProbeResult(False, latency, f"status_{response.status_code}")
