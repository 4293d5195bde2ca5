"""Kubernetes source: the EndpointSlices of one Service (or a label selector), listed and
watched by watch.py's loop (list, watch with bookmarks, 410 re-list, backoff, resync).

Each slice is one group of the reconciler: a watch event re-reads only its slice. A slice
without the configured port keeps its last endpoints (warned once until fixed); an endpoint
that is not an IP of the slice's `addressType` is skipped and counted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from router.core.netpolicy import dotted_quad, ip_literal
from router.core.settings import KubernetesDiscovery
from router.discovery.reconcile import Endpoint, Reconciler
from router.discovery.watch import Lister, ListWatch

_YIELD_EVERY = 500  # endpoints parsed between yields to the loop


class KubernetesSource:
    def __init__(
        self,
        cfg: KubernetesDiscovery,
        reconciler: Reconciler,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.rec = reconciler
        # Per slice: its last usable endpoints, as plain tuples (the collector untracks those).
        self._good: dict[str, list[tuple[str, int, bool, str | None]]] = {}
        self._bad_port: set[str] = set()  # slices already warned about (once until fixed)
        self._watch = ListWatch(cfg, reconciler, self, clock)

    async def run(self) -> None:
        await self._watch.run()

    async def _event(self, ev: dict[str, Any]) -> None:
        await self._watch.event(ev)

    # -- the Resource watch.py follows -----------------------------------------------------

    def lister(self, client: Any) -> Lister:
        from kubernetes_asyncio.client import DiscoveryV1Api

        api = DiscoveryV1Api(client)
        return (
            api.list_namespaced_endpoint_slice,
            (self.cfg.namespace,),
            {"label_selector": self.cfg.selector},
        )

    async def listed(self, items: dict[str, dict[str, Any]]) -> None:
        groups: dict[str, list[Endpoint]] = {}
        walked = 0
        for name, sl in items.items():
            groups[name] = self._slice_endpoints(name, sl)
            walked += len(groups[name])
            if walked >= _YIELD_EVERY:  # thousands of endpoints: let requests through
                walked = 0
                await asyncio.sleep(0)
        for gone in set(self._good) - set(items):
            self._good.pop(gone, None)
        self._bad_port &= items.keys()  # deleted slices: not remembered for ever
        # The answer's JSON is not kept (only each slice's endpoints): 50,000 endpoints' dicts
        # and lists would stay for the collector to walk on every full collection.
        items.clear()
        await self.rec.replace(groups)

    def read(self, kind: str, name: str, obj: dict[str, Any]) -> tuple[str, list[Endpoint] | None]:
        """The slice the event changes and its endpoints now (None: the slice is gone). Only
        this slice is looked at again: a change costs the slice, not the fleet."""
        if kind == "DELETED":
            self._good.pop(name, None)
            self._bad_port.discard(name)
            return name, None
        return name, self._slice_endpoints(name, obj)

    async def apply(self, change: tuple[str, list[Endpoint] | None]) -> None:
        await self.rec.update_group(*change)

    def _slice_endpoints(self, name: str, sl: dict[str, Any]) -> list[Endpoint]:
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
            return [Endpoint(*e) for e in self._good.get(name, [])]
        self._bad_port.discard(name)
        found, bad = _slice_endpoints(sl, port, self.cfg.role_label)
        if bad:
            # Skipped and counted; the slice's good endpoints still apply.
            self.rec.event("bad_endpoint", bad)
        self._good[name] = [(e.host, e.port, e.ready, e.role) for e in found]
        return found

    def _port(self, sl: dict[str, Any]) -> int | None:
        ports = [p for p in sl.get("ports") or [] if isinstance(p, dict)]
        if isinstance(self.cfg.port, int):
            return self.cfg.port  # a number is the target port, listed or not
        for p in ports:
            if p.get("name") == self.cfg.port and isinstance(p.get("port"), int):
                return int(p["port"])
        return None


_ROLES = frozenset(("prefill", "decode", "both"))


def role_of(obj: dict[str, Any], role_label: str) -> str | None:
    """The `role` (prefill, decode, both) an object's `role_label` label names; None: none."""
    meta = obj.get("metadata")
    labels = meta.get("labels") if isinstance(meta, dict) else None
    label = labels.get(role_label) if isinstance(labels, dict) else None
    return label if label in _ROLES else None


def canonical_ip(text: str, family: int | None = None) -> str:
    """The address as the router dials it (IPv6 compressed); "" when it is not an IP literal
    (of `family`, 4 or 6, when given)."""
    if family != 6 and dotted_quad(text) is not None:
        return text  # already the canonical spelling
    ip = ip_literal(text)
    if ip is None or (family is not None and ip.version != family):
        return ""
    return ip.compressed


def _slice_endpoints(
    sl: dict[str, Any], port: int, role_label: str = "llm-d.ai/role"
) -> tuple[list[Endpoint], int]:
    """The slice's usable endpoints, and how many it held that are not (no address, an
    address that is not an IP of the slice's `addressType`, a port outside 1-65535). Their
    `role` is the slice's `role_label` (the Service's labels are copied onto its slices), when
    it names one."""
    out: list[Endpoint] = []
    bad = 0
    role = role_of(sl, role_label)
    family = {"IPv4": 4, "IPv6": 6}.get(str(sl.get("addressType") or "IPv4"))
    good_port = 1 <= port <= 65535
    for ep in sl.get("endpoints") or []:
        if not isinstance(ep, dict):
            bad += 1
            continue
        addrs = ep.get("addresses")
        if not isinstance(addrs, list) or not addrs:
            bad += 1
            continue
        host = canonical_ip(str(addrs[0]), family) if family is not None else ""
        if not host or not good_port:
            bad += 1  # FQDN slices too: an address must be an IP the router can dial as is
            continue
        cond = ep.get("conditions")
        cond = cond if isinstance(cond, dict) else {}
        terminating = bool(cond.get("terminating"))
        # The API says: an unknown `ready` counts as ready; unknown `serving` follows `ready`.
        ready = cond.get("ready") is not False and not terminating
        serving = cond.get("serving")
        serving = (cond.get("ready") is not False) if serving is None else bool(serving)
        if ready:
            out.append(Endpoint(host, port, True, role))
        elif serving and terminating:
            out.append(Endpoint(host, port, False, role))
    return out, bad
