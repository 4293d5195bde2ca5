"""`sluicegate epp`: the endpoint picker's processes' faces, on one event loop.

The gRPC port serves Envoy's `envoy.service.ext_proc.v3.ExternalProcessor/Process` (one
bidirectional stream per HTTP request, router/picker/stream.py) and the gRPC health service
(`liveness` from the start; `readiness` and the ExternalProcessor's own name SERVING while
backends are known and the process is not draining). The HTTP port is `create_app`'s app without
its /v1 routes (requests come through the gateway): /metrics, /healthz, /readyz, the admin API,
/admin/usage and the console. The same config file, settings and parts as `sluicegate serve`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from router.app import AppParts, create_app
from router.core.settings import Settings
from router.picker.proto.external_processor_pb2 import (
    ProcessingRequest,
    ProcessingResponse,
)
from router.picker.stream import PickerStream

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY = ("readiness", SERVICE)
# Room for a 62,000-byte chunk and a request's headers; Envoy's own limit is larger.
_MESSAGE_BYTES = 4 * 1024 * 1024
log = logging.getLogger("sluicegate.picker")


class Picker:
    """The ExternalProcessor service on the app's parts."""

    def __init__(self, app: AppParts) -> None:
        self.app = app

    async def process(
        self,
        requests: AsyncIterator[ProcessingRequest],
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
    ) -> AsyncIterator[ProcessingResponse]:
        """One stream: every message answered as the protocol asks; what the stream took is
        given back when it ends, also when the gateway cancels it (a cancelled generator runs
        its `finally`)."""
        stream = PickerStream(self.app)
        try:
            async for msg in requests:
                for out in await stream.handle(msg):
                    yield out
                if stream.done:
                    return
        finally:
            await asyncio.shield(stream.close())

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.stream_stream_rpc_method_handler(
            self.process,
            request_deserializer=ProcessingRequest.FromString,
            response_serializer=ProcessingResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"Process": method})


def grpc_server(app: AppParts, address: str) -> tuple[grpc.aio.Server, HealthServicer, int]:
    """The gRPC server (not started), its health service, and the port it bound."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", _MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MESSAGE_BYTES),
        ]
    )
    server.add_generic_rpc_handlers((Picker(app).handler(),))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(address)
    return server, health, port


def follow_readiness(app: AppParts, health: HealthServicer) -> None:
    """`readiness` and the service's own name follow the backend set and the drain (a chore)."""

    async def step() -> None:
        ready = bool(app.registry.snapshot.backends) and not app.lifecycle.draining
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in READY:
            await health.set(name, status)

    app.runner.every("picker_readiness", step, 0.5, immediately=True)


async def run(settings: Settings, host: str, port: int, metrics_port: int) -> None:
    """Both ports until a signal: the HTTP app's lifespan starts and stops the parts; the gRPC
    server stops after it, once the streams it drained are over."""
    app = create_app(settings, proxy_routes=False)
    parts = app.parts
    server, health, _ = grpc_server(parts, f"{host}:{port}")
    await health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    for name in READY:
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    follow_readiness(parts, health)
    web = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=metrics_port,
            loop="none",
            lifespan="on",
            access_log=False,
            server_header=False,
            log_config=None,
            log_level=settings.log_level,
            timeout_graceful_shutdown=max(1, int(settings.drain_grace) + 1),
        )
    )
    await server.start()
    log.info("endpoint picker listening", extra={"fields": {"grpc": port, "http": metrics_port}})
    try:
        await web.serve()
    finally:
        await health.enter_graceful_shutdown()
        await server.stop(settings.drain_grace)
