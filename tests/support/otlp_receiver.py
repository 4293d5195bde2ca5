"""A small OTLP/HTTP trace receiver for the tests: the collector side of the real wire protocol.

`POST /v1/traces` bodies are decoded as `ExportTraceServiceRequest` (opentelemetry-proto) and
kept as plain `Span` values. `mode` "hang" accepts and reads each export but never answers until
closed: a collector that is stuck. Listens on 127.0.0.1 only; `close()` stops it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    service: str = ""
    status_code: int = 0

    def event(self, name: str) -> tuple[str, int, dict[str, Any]] | None:
        return next((e for e in self.events if e[0] == name), None)


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Receiver:
    mode: str = "ok"
    port: int = 0  # 0: any free port
    spans: list[Span] = field(default_factory=list)
    exports: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with receiver._lock:
                    receiver.exports += 1
                if receiver.mode == "hang":
                    receiver._closed.wait(30)
                    return
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver._take(ExportTraceServiceRequest.FromString(body))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def _take(self, request: ExportTraceServiceRequest) -> None:
        out = []
        for rs in request.resource_spans:
            service = str(_attrs(rs.resource.attributes).get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes=_attrs(s.attributes),
                            events=[
                                (e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events
                            ],
                            service=service,
                            status_code=s.status.code,
                        )
                    )
        with self._lock:
            self.spans.extend(out)

    def wait_for(self, check: Callable[[list[Span]], bool], deadline: float = 10.0) -> list[Span]:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            with self._lock:
                spans = list(self.spans)
            if check(spans):
                return spans
            time.sleep(0.05)
        raise AssertionError(f"spans not received in time; got {len(self.spans)}")

    def close(self) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
