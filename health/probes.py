"""Active probes: one GET per backend per interval, bounded by the probe timeout.

`GET /health` for `kind: vllm`, `GET /v1/models` with the backend's key for `kind: openai`, or the
configured `health.path`. Any 2xx is healthy. A probe goes through a transport of the backend's
own from `backend_transport` (router/upstream/pools.py): the same TLS context, SNI name and network
policy as its traffic, so a certificate traffic refuses fails the probe too, and the reverse. It
is not the traffic pool: a pool that is full never makes a backend look dead, and probes never
queue behind requests. It keeps no idle connection (a fleet of thousands holds no probe sockets),
so each probe also proves that a new connection and TLS handshake succeed.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlencode

import httpx

from health.state import ProbeResult
from router.core.backend import Backend
from router.core.errors import UpstreamTlsError
from router.core.netpolicy import NetPolicy
from router.core.settings import HealthConfig
from router.upstream.pools import backend_transport, join_url
from router.upstream.transport import LeanTransport

# A probe's answer is read to its end (so the exchange finishes cleanly) up to this much.
MAX_PROBE_BODY = 1024 * 1024
_ONE = httpx.Limits(max_connections=1, max_keepalive_connections=0)

DEFAULT_PATHS = {
    "vllm": "/health",
    "sglang": "/health",
    "openai": "/v1/models",
    "anthropic": "/v1/models",  # Anthropic's model list, with the key
}


def probe_path(backend: Backend, cfg: HealthConfig) -> str:
    return cfg.path or DEFAULT_PATHS.get(backend.kind, "/health")


def probe_transport(backend: Backend, policy: NetPolicy | None = None) -> LeanTransport:
    return backend_transport(backend, _ONE, policy)


async def probe(transport: LeanTransport, backend: Backend, cfg: HealthConfig) -> ProbeResult:
    started = time.perf_counter()
    url = join_url(
        httpx.URL(backend.url + "/"),
        urlencode(backend.query).encode("ascii"),
        probe_path(backend, cfg),
    )
    phases = dict.fromkeys(("connect", "read", "write", "pool"), cfg.timeout)
    request = httpx.Request("GET", url, headers=list(backend.auth_headers))
    request.extensions["timeout"] = phases
    try:
        # The phase timeouts bound each step; the outer one bounds the whole probe.
        async with asyncio.timeout(cfg.timeout):
            response = await transport.handle_async_request(request)
            try:
                size = 0
                async for chunk in response.aiter_raw():
                    size += len(chunk)
                    if size > MAX_PROBE_BODY:
                        break
            finally:
                await response.aclose()
    except (TimeoutError, httpx.TimeoutException):
        return ProbeResult(False, None, "timeout")
    except UpstreamTlsError as exc:  # the why is not secret, and the operator needs it
        return ProbeResult(False, None, f"tls: {exc}")
    except httpx.HTTPError:
        return ProbeResult(False, None, "connect")
    latency = round((time.perf_counter() - started) * 1000, 2)
    if 200 <= response.status_code < 300:
        return ProbeResult(True, latency)
    return ProbeResult(False, latency, f"status_{response.status_code}")
