"""What crosses the proxy in each direction: hop-by-hop and credentials never do."""

from __future__ import annotations

from collections.abc import Iterable

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Never forwarded upstream: the client's credentials (the backend gets its own key), and what
# httpx derives itself.
_REQUEST_DROP = HOP_BY_HOP | {
    b"host",
    b"authorization",
    b"api-key",
    b"x-api-key",
    b"cookie",
    b"content-length",
    b"expect",
}
_RESPONSE_DROP = HOP_BY_HOP | {b"server", b"date", b"x-request-id", b"set-cookie"}

STREAM_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)

_STREAM_DROP = frozenset({b"content-length", *(k for k, _ in STREAM_HEADERS)})


def _connection_named(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    named: set[bytes] = set()
    for k, v in headers:
        if k.lower() == b"connection":
            named.update(t.strip().lower() for t in v.split(b",") if t.strip())
    return named


def upstream_request_headers(
    client_headers: list[tuple[bytes, bytes]],
    request_id: str,
    backend_headers: list[tuple[bytes, bytes]],
) -> list[tuple[bytes, bytes]]:
    """Client headers minus hop-by-hop and credentials, plus the request id and backend's own."""
    extra = _connection_named(client_headers)
    override = {k for k, _ in backend_headers}
    out = [
        (k, v)
        for k, v in client_headers
        if (lk := k.lower()) not in _REQUEST_DROP
        and lk not in extra
        and lk != b"x-request-id"
        and lk not in override
    ]
    out.append((b"x-request-id", request_id.encode("latin-1")))
    out.extend(backend_headers)
    return out


def downstream_response_headers(
    upstream_headers: Iterable[tuple[bytes, bytes]], request_id: str, streaming: bool
) -> list[tuple[bytes, bytes]]:
    """Upstream headers minus hop-by-hop; Content-Encoding and Content-Length stay because the
    body is forwarded raw, byte for byte. Streams drop Content-Length: they are chunked, so one
    whose upstream body ends short can still end with an error event and `[DONE]`."""
    items = list(upstream_headers)
    extra = _connection_named(items)
    drop = _RESPONSE_DROP | extra
    if streaming:
        drop = drop | _STREAM_DROP
    out = [(k.lower(), v) for k, v in items if k.lower() not in drop]
    if streaming:
        out.extend(STREAM_HEADERS)
    out.append((b"x-request-id", request_id.encode("latin-1")))
    return out
