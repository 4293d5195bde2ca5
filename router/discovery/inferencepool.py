"""InferencePool source: the pods an InferencePool selects (`inference.networking.k8s.io/v1`, the
Gateway API Inference Extension's pool), each target port of each ready pod one backend
`podIP:port`. What the pool's endpoint picker routes to, read the way the picker reads it.

Two list-and-watch loops (watch.py: bookmarks, 410 re-list, backoff, resync), one reconciler:
the pool itself (by name: `fieldSelector=metadata.name=NAME`) and the pods its selector names.

    pool ADDED / MODIFIED    `spec.selector.matchLabels` changed -> the pod watch starts again
                             with the new selector (a re-list: pods no longer selected drain
                             and go); `spec.targetPorts` changed -> every known pod's
                             endpoints again, at once
    pool DELETED, or absent  its endpoints drain and go; the pod watch stops until it is back
    pool spec unusable       (no matchLabels, no or bad targetPorts) warned (`bad_pool`); the
                             last set stays
    pod Ready                one routable backend per target port
    pod Ready, terminating   (a deletionTimestamp) draining: no new requests, streams finish
    pod not Ready, no IP     not routed (one that was drains, then goes)

Each pod is one group of the reconciler: a pod's event touches only its own backends.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

from router.core.settings import InferencePoolDiscovery
from router.discovery.kubernetes import canonical_ip, role_of
from router.discovery.reconcile import Endpoint, Reconciler
from router.discovery.watch import Lister, ListWatch

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
PLURAL = "inferencepools"
_MAX_PORTS = 8  # the CRD's maxItems
# A label's key (an optional DNS-subdomain prefix and a name) and value, as Kubernetes has them:
# a selector is built from them, so nothing else may reach it.
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")

# What the source keeps per pod: (address, ready, role). A plain tuple (untracked by the collector).
Pod = tuple[str, bool, str | None]


class InferencePoolSource:
    def __init__(
        self,
        cfg: InferencePoolDiscovery,
        reconciler: Reconciler,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.rec = reconciler
        self._clock = clock
        self.selector: str | None = None  # the pods' label selector, None: no pool
        self.ports: tuple[int, ...] = ()
        self._pods: dict[str, Pod] = {}  # ready (or draining) pods of the current selector
        self._pod_watch: asyncio.Task[None] | None = None
        self._warned: str | None = None  # the last warning's event, so a state warns once
        self._pool = ListWatch(cfg, reconciler, _Pool(self), clock)

    async def run(self) -> None:
        try:
            await self._pool.run()
        finally:
            await self._stop_pods()
            # Started again (the runner's restart): the first pool answer starts the pod
            # watch again; the pods known so far stay until its list replaces them.
            self.selector = None

    async def pool_changed(self, obj: dict[str, Any] | None) -> None:
        """The pool as the API server has it now (None: there is none)."""
        if obj is None:
            self._warn_once("pool_missing", "the InferencePool does not exist; no backends")
            await self._stop_pods()
            self.selector, self.ports = None, ()
            self._pods.clear()
            await self.rec.replace({})
            return
        spec = pool_spec(obj)
        if spec is None:
            # A pool the API server's validation would refuse: never empty the fleet on it.
            self._warn_once("bad_pool", "the InferencePool's spec is unusable; keeping the set")
            self.rec.synced()
            return
        self._warned = None
        selector, ports = spec
        if selector != self.selector:
            await self._stop_pods()
            self.selector, self.ports = selector, ports
            # The old selector's pods stay until the new list replaces them: a selector change
            # never empties the fleet in between.
            watch = ListWatch(self.cfg, self.rec, _Pods(self, selector), self._clock)
            self._pod_watch = asyncio.create_task(watch.run(), name="inferencepool-pods")
        elif ports != self.ports:
            self.ports = ports
            await self.rec.replace(self._groups())
        else:
            self.rec.synced()

    def pods_listed(self, items: dict[str, dict[str, Any]]) -> dict[str, list[Endpoint]]:
        self._pods = {}
        for name, obj in items.items():
            self._read_pod(name, obj)
        return self._groups()

    def pod_changed(self, kind: str, name: str, obj: dict[str, Any]) -> str:
        if kind == "DELETED":
            self._pods.pop(name, None)
        else:
            self._read_pod(name, obj)
        return name

    def endpoints(self, pod: str) -> list[Endpoint] | None:
        """The pod's backends on the pool's ports now; None: not one of the pool's."""
        p = self._pods.get(pod)
        if p is None:
            return None
        host, ready, role = p
        return [Endpoint(host, port, ready, role) for port in self.ports]

    def _groups(self) -> dict[str, list[Endpoint]]:
        return {name: self.endpoints(name) or [] for name in self._pods}

    def _read_pod(self, name: str, obj: dict[str, Any]) -> None:
        pod, bad = read_pod(obj, self.cfg.role_label)
        if bad:
            self.rec.event("bad_endpoint")  # Ready without a usable IP: skipped and counted
        if pod is None:
            self._pods.pop(name, None)
        else:
            self._pods[name] = pod

    def _warn_once(self, event: str, message: str) -> None:
        if self._warned != event:
            self._warned = event
            self.rec.warn(event, message, pool=f"{self.cfg.namespace}/{self.cfg.name}")

    async def _stop_pods(self) -> None:
        task, self._pod_watch = self._pod_watch, None
        if task is not None:
            task.cancel()
            # wait(), not `await task`: this task's own cancellation still propagates.
            await asyncio.wait([task])


class _Pool:
    """The pool, by name (watch.py's Resource)."""

    def __init__(self, source: InferencePoolSource) -> None:
        self.source = source

    def lister(self, client: Any) -> Lister:
        from kubernetes_asyncio.client import CustomObjectsApi

        cfg = self.source.cfg
        return (
            CustomObjectsApi(client).list_namespaced_custom_object,
            (GROUP, VERSION, cfg.namespace, PLURAL),
            {"field_selector": f"metadata.name={cfg.name}"},
        )

    async def listed(self, items: dict[str, dict[str, Any]]) -> None:
        await self.source.pool_changed(items.get(self.source.cfg.name))

    def read(self, kind: str, name: str, obj: dict[str, Any]) -> Any:
        if name != self.source.cfg.name:
            return None
        return ("pool", None if kind == "DELETED" else obj)

    async def apply(self, change: tuple[str, dict[str, Any] | None]) -> None:
        await self.source.pool_changed(change[1])


class _Pods:
    """The pods one selector names (watch.py's Resource); a new selector is a new watch."""

    def __init__(self, source: InferencePoolSource, selector: str) -> None:
        self.source = source
        self.selector = selector

    def lister(self, client: Any) -> Lister:
        from kubernetes_asyncio.client import CoreV1Api

        return (
            CoreV1Api(client).list_namespaced_pod,
            (self.source.cfg.namespace,),
            {"label_selector": self.selector},
        )

    async def listed(self, items: dict[str, dict[str, Any]]) -> None:
        groups = self.source.pods_listed(items)
        items.clear()  # the list's JSON goes before the apply
        await self.source.rec.replace(groups)

    def read(self, kind: str, name: str, obj: dict[str, Any]) -> str:
        return self.source.pod_changed(kind, name, obj)

    async def apply(self, pod: str) -> None:
        # The pod's endpoints as they are when applied (a targetPorts change may have come
        # in between): the reconciler's lock keeps the changes in order.
        await self.source.rec.update_group(pod, self.source.endpoints(pod))


def pool_spec(obj: dict[str, Any]) -> tuple[str, tuple[int, ...]] | None:
    """The pool's pod selector (`k=v,...`) and target ports; None when unusable."""
    spec = obj.get("spec")
    selector = spec.get("selector") if isinstance(spec, dict) else None
    labels = selector.get("matchLabels") if isinstance(selector, dict) else None
    if not isinstance(labels, dict) or not labels:
        return None  # an empty selector would select every pod of the namespace
    for k, v in labels.items():
        if not (isinstance(k, str) and _LABEL_KEY.match(k)):
            return None
        if not (isinstance(v, str) and _LABEL_VALUE.match(v)):
            return None
    targets = spec.get("targetPorts") if isinstance(spec, dict) else None
    if not isinstance(targets, list) or not 1 <= len(targets) <= _MAX_PORTS:
        return None
    ports: list[int] = []
    for t in targets:
        n = t.get("number") if isinstance(t, dict) else None
        if type(n) is not int or not 1 <= n <= 65535 or n in ports:
            return None
        ports.append(n)
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())), tuple(ports)


def read_pod(obj: dict[str, Any], role_label: str) -> tuple[Pod | None, bool]:
    """A pod as (address, ready, role) when it may serve: Ready (`ready` False: Ready but
    terminating, so draining); None when not. The flag: Ready, but no usable IP."""
    status = obj.get("status")
    if not isinstance(status, dict):
        return None, False
    conditions = status.get("conditions")
    ready = isinstance(conditions, list) and any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )
    if not ready:
        return None, False
    ip = status.get("podIP")
    host = canonical_ip(ip) if isinstance(ip, str) else ""
    if not host:
        return None, True
    meta = obj.get("metadata")
    terminating = isinstance(meta, dict) and meta.get("deletionTimestamp") is not None
    return (host, not terminating, role_of(obj, role_label)), False
