"""OpenAI-format errors: `{"error": {"message", "type", "code"}}`, and the proxy's own failures.

ProxyError                  -> an error answered before any byte went to the client
  ├── UpstreamConnectError  (502, a backend could not be reached)
  ├── UpstreamTimeout       (504, a backend did not answer in time)
  └── NoCapacity            (503, every candidate is full, ejected or cooling down)
"""

from __future__ import annotations

import json

from starlette.responses import Response

# Upstream or our own message text never carries secrets: messages are built here from fixed
# strings plus model/backend names, never from exception reprs that may hold URLs with keys.


def error_payload(message: str, type_: str, code: str | int | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "code": code}}).encode()


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | int | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(
        error_payload(message, type_, code),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def sse_error_event(message: str, type_: str, code: str) -> bytes:
    """The closing events of a stream that failed after it began."""
    return b"data: " + error_payload(message, type_, code) + b"\n\ndata: [DONE]\n\n"


class ProxyError(Exception):
    status = 502
    type_ = "upstream_error"
    code = "upstream_error"

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def response(self, request_id: str) -> Response:
        headers = {"x-request-id": request_id}
        if self.retry_after is not None:
            headers["retry-after"] = str(max(1, round(self.retry_after)))
        return error_response(self.status, self.message, self.type_, self.code, headers)


class UpstreamConnectError(ProxyError):
    status = 502
    code = "upstream_connect_error"


class UpstreamTimeout(ProxyError):
    status = 504
    code = "upstream_timeout"


class NoCapacity(ProxyError):
    status = 503
    type_ = "service_unavailable"
    code = "no_capacity"
