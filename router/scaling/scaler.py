"""KEDA's external scaler (externalscaler.proto, `external-push`) on `scale_from_zero.scaler_port`.

One gRPC (grpc.aio) server on the app's event loop serves each declared model's demand, chosen
by the ScaledObject's `scalerMetadata: {model: <name>}`:
- `IsActive`: demand > 0 (held, in flight or queued; every replica's with Redis);
- `StreamIsActive`: the same, pushed: the current value when the stream opens, then each change
  as it happens (the demand book's listener wakes the stream; nothing polls), so a pool at zero
  starts on the first held request without waiting for KEDA's polling interval;
- `GetMetricSpec`: one metric, `sluicegate_demand`, targeting `target_per_replica`;
- `GetMetrics`: the demand.
A model that is not declared reads inactive with demand 0, and is logged as an error (once per
name): a typo in a ScaledObject must show, and must not take the scaler down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from router.core.settings import ScaleFromZeroConfig
from router.scaling.demand import DemandBook
from router.scaling.keda import externalscaler_pb2 as pb
from router.scaling.keda.externalscaler_pb2_grpc import (
    ExternalScalerServicer,
    add_ExternalScalerServicer_to_server,
)

log = logging.getLogger("sluicegate.scaler")

METRIC = "sluicegate_demand"
_MAX_LOGGED = 256  # unknown names logged, at most (each once)


class Scaler(ExternalScalerServicer):
    def __init__(self, demand: DemandBook, cfg: ScaleFromZeroConfig, host: str) -> None:
        self._demand = demand
        self._cfg = cfg
        self._host = host
        self._server: grpc.aio.Server | None = None
        self.port = 0  # bound, once started
        self._streams: dict[str, set[asyncio.Event]] = {}  # model -> its open streams' wakes
        self._logged: set[str] = set()
        demand.listen(self._changed)

    # --- the protocol ------------------------------------------------------------------------

    async def IsActive(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.IsActiveResponse:
        return pb.IsActiveResponse(result=self._active(self._model(request)))

    async def StreamIsActive(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext[object, object]
    ) -> AsyncIterator[pb.IsActiveResponse]:
        model = self._model(request)
        wake = asyncio.Event()
        streams = self._streams.setdefault(model or "", set())
        streams.add(wake)
        try:
            last: bool | None = None
            while True:
                active = self._active(model)
                if active != last:
                    last = active
                    yield pb.IsActiveResponse(result=active)
                await wake.wait()
                wake.clear()
        finally:
            streams.discard(wake)

    async def GetMetricSpec(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.GetMetricSpecResponse:
        self._model(request)
        target = self._cfg.target_per_replica
        spec = pb.MetricSpec(metricName=METRIC, targetSize=target, targetSizeFloat=float(target))
        return pb.GetMetricSpecResponse(metricSpecs=[spec])

    async def GetMetrics(
        self, request: pb.GetMetricsRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.GetMetricsResponse:
        model = self._model(request.scaledObjectRef)
        n = self._demand.total(model) if model is not None else 0
        value = pb.MetricValue(
            metricName=request.metricName or METRIC, metricValue=n, metricValueFloat=float(n)
        )
        return pb.GetMetricsResponse(metricValues=[value])

    # --- demand ------------------------------------------------------------------------------

    def _model(self, ref: pb.ScaledObjectRef) -> str | None:
        """The declared model `ref` names; None (logged) when it names none."""
        model: str = ref.scalerMetadata.get("model", "")
        if self._demand.declared(model):
            return model
        if model not in self._logged and len(self._logged) < _MAX_LOGGED:
            self._logged.add(model)
            log.error(
                "KEDA asked about a model that is not declared in scale_from_zero",
                extra={"fields": {"model": model[:200], "scaled_object": ref.name[:200]}},
            )
        return None

    def _active(self, model: str | None) -> bool:
        return model is not None and self._demand.total(model) > 0

    def _changed(self, model: str) -> None:
        for wake in self._streams.get(model, ()):
            wake.set()

    # --- start and stop ----------------------------------------------------------------------

    async def start(self) -> None:
        server = grpc.aio.server()
        add_ExternalScalerServicer_to_server(self, server)
        self.port = server.add_insecure_port(f"{self._host}:{self._cfg.scaler_port}")
        await server.start()
        self._server = server
        log.info("KEDA external scaler listening", extra={"fields": {"port": self.port}})

    async def aclose(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=0.5)  # open StreamIsActive calls end with it
