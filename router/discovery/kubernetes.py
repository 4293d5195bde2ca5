"""Kubernetes source: list, then watch EndpointSlices of one Service (or a label selector).

Client: kubernetes-asyncio. Its watch takes `resource_version` and `allow_watch_bookmarks`,
keeps the version from every event and BOOKMARK, and raises `ApiException(410)` for an expired
version (the ERROR event), so the list-then-watch loop below stays explicit. Config: the pod's
service account in a cluster, else `kubeconfig:` or `KUBECONFIG`.

    list (resourceVersion R) -> watch from R with bookmarks -> events update the slice set
    410 Gone                 -> re-list at once
    watch closed / dropped   -> watch again from the last version (capped backoff on errors)
    every `resync` seconds   -> full re-list and reconcile, even when the watch looks fine:
                                this is what catches a DELETE lost while the watch was down
    API server unreachable   -> the last set stays (never emptied); the source is stale
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from router.core.settings import KubernetesDiscovery
from router.discovery.reconcile import Endpoint, Reconciler

log = logging.getLogger("sluicegate.discovery")

_LIST_TIMEOUT = 10.0


class KubernetesSource:
    def __init__(
        self,
        cfg: KubernetesDiscovery,
        reconciler: Reconciler,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.rec = reconciler
        self._clock = clock
        self._slices: dict[str, dict[str, Any]] = {}
        self._good: dict[str, list[Endpoint]] = {}  # per slice: its last usable endpoints
        self._bad_port: set[str] = set()  # slices already warned about (once until fixed)

    async def _api(self) -> Any:
        from kubernetes_asyncio import client, config

        # In a pod (the variable Kubernetes sets) the service account; elsewhere a kubeconfig.
        if self.cfg.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            return client.DiscoveryV1Api(client.ApiClient())
        conf = client.Configuration()
        await config.load_kube_config(config_file=self.cfg.kubeconfig, client_configuration=conf)
        return client.DiscoveryV1Api(client.ApiClient(configuration=conf))

    async def run(self) -> None:
        import aiohttp
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException
        from kubernetes_asyncio.config import ConfigException

        backoff = 0.2
        api: Any = None
        version: str | None = None
        next_list = 0.0
        try:
            while True:
                started = self._clock()
                try:
                    if api is None:
                        api = await self._api()
                    if version is None or self._clock() >= next_list:
                        version = await self._list(api)
                        next_list = self._clock() + self.cfg.resync
                        backoff = 0.2
                    remaining = max(1, int(next_list - self._clock()))
                    w = watch.Watch()
                    try:
                        async for ev in w.stream(
                            api.list_namespaced_endpoint_slice,
                            self.cfg.namespace,
                            label_selector=self.cfg.selector,
                            resource_version=version,
                            allow_watch_bookmarks=True,
                            timeout_seconds=remaining,
                            _request_timeout=remaining + _LIST_TIMEOUT,
                        ):
                            version = w.resource_version or version
                            await self._event(ev)
                            backoff = 0.2
                    finally:
                        await w.close()
                    # Closed by the server (its timeout, or a restart): watch again from
                    # `version`; a watch that keeps closing at once is slowed down.
                    if self._clock() - started < 1.0:
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, self.cfg.backoff_max)
                except ApiException as exc:
                    if exc.status == 410:
                        self.rec.event("expired")
                        version = None  # too old to resume: re-list now
                        continue
                    self.rec.failed("error", f"HTTP {exc.status}")
                    if exc.status in (401, 403, 404):
                        version = None
                    if exc.status == 401 and api is not None:
                        # An expired token (exec plugins, rotated service-account tokens):
                        # read the config again before the next try.
                        await api.api_client.close()
                        api = None
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.cfg.backoff_max)
                except ConfigException as exc:
                    self.rec.failed("error", f"kubeconfig: {type(exc).__name__}")
                    api = None
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.cfg.backoff_max)
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                    self.rec.failed("error", type(exc).__name__)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.cfg.backoff_max)
                except (KeyError, TypeError, AttributeError, Exception) as exc:
                    # The client raises a bare Exception for a malformed watch line; whatever
                    # the API server answered, keep the last set and start over with a list.
                    self.rec.failed("bad_answer", type(exc).__name__)
                    version = None
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.cfg.backoff_max)
        finally:
            if api is not None:
                await api.api_client.close()

    async def _list(self, api: Any) -> str:
        resp = await api.list_namespaced_endpoint_slice(
            self.cfg.namespace,
            label_selector=self.cfg.selector,
            _preload_content=False,
            _request_timeout=_LIST_TIMEOUT,
        )
        body = json.loads(await resp.read())
        self._slices = {
            item["metadata"]["name"]: item
            for item in body.get("items") or []
            if isinstance(item, dict) and item.get("metadata", {}).get("name")
        }
        self.rec.event("relist")
        await self.rec.update(self._endpoints())
        return str(body["metadata"]["resourceVersion"])

    async def _event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        if kind == "BOOKMARK":
            self.rec.event("bookmark")
            self.rec.synced()
            return
        obj = ev.get("raw_object") or {}
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            self.rec.warn("bad_answer", "ignoring a watch event without an object name")
            return
        if kind in ("ADDED", "MODIFIED"):
            self._slices[name] = obj
        elif kind == "DELETED":
            self._slices.pop(name, None)
            self._good.pop(name, None)
        else:
            return
        self.rec.event("watch_" + kind.lower())
        await self.rec.update(self._endpoints())

    def _endpoints(self) -> list[Endpoint]:
        out: list[Endpoint] = []
        for name, sl in self._slices.items():
            port = self._port(sl)
            if port is None:
                # A slice without the port: keep what it had (never empty the fleet on it).
                if name not in self._bad_port:
                    self._bad_port.add(name)
                    self.rec.warn(
                        "bad_port",
                        "EndpointSlice has no such port; keeping its last endpoints",
                        slice=name,
                        port=str(self.cfg.port),
                    )
                out.extend(self._good.get(name, ()))
                continue
            self._bad_port.discard(name)
            found = list(_slice_endpoints(sl, port))
            self._good[name] = found
            out.extend(found)
        for gone in set(self._good) - set(self._slices):
            self._good.pop(gone, None)
        self._bad_port &= self._slices.keys()  # deleted slices: not remembered for ever
        return out

    def _port(self, sl: dict[str, Any]) -> int | None:
        ports = [p for p in sl.get("ports") or [] if isinstance(p, dict)]
        if isinstance(self.cfg.port, int):
            return self.cfg.port  # a number is the target port, listed or not
        for p in ports:
            if p.get("name") == self.cfg.port and isinstance(p.get("port"), int):
                return int(p["port"])
        return None


def _slice_endpoints(sl: dict[str, Any], port: int) -> list[Endpoint]:
    out = []
    for ep in sl.get("endpoints") or []:
        if not isinstance(ep, dict) or not ep.get("addresses"):
            continue
        cond = ep.get("conditions") or {}
        terminating = bool(cond.get("terminating"))
        # The API says: an unknown `ready` counts as ready; unknown `serving` follows `ready`.
        ready = cond.get("ready") is not False and not terminating
        serving = cond.get("serving")
        serving = (cond.get("ready") is not False) if serving is None else bool(serving)
        if ready:
            out.append(Endpoint(str(ep["addresses"][0]), port, True))
        elif serving and terminating:
            out.append(Endpoint(str(ep["addresses"][0]), port, False))
    return out
