"""DNS source: re-resolve a name's A and AAAA records every `interval` (dnspython).

New addresses join; vanished ones drain, then go (reconcile.py). A failed or empty answer keeps
the last set and marks the source stale: one bad answer never empties the fleet.
`nameserver: "127.0.0.1:5353"` asks that server instead of the system's resolvers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import dns.asyncresolver
import dns.exception
import dns.resolver

from router.core.settings import DnsDiscovery
from router.discovery.reconcile import Endpoint, Reconciler


def make_resolver(cfg: DnsDiscovery) -> dns.asyncresolver.Resolver:
    if cfg.nameserver is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        host, port = cfg.nameserver, 53
        if host.startswith("["):  # [::1]:5353
            host, _, rest = host[1:].partition("]")
            port = int(rest[1:]) if rest.startswith(":") else 53
        elif host.count(":") == 1:
            host, _, p = host.partition(":")
            port = int(p)
        resolver.nameservers = [host]
        resolver.port = port
    resolver.lifetime = cfg.timeout
    resolver.timeout = cfg.timeout
    return resolver


class DnsSource:
    def __init__(
        self,
        cfg: DnsDiscovery,
        reconciler: Reconciler,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.rec = reconciler
        self._clock = clock
        self._resolver = make_resolver(cfg)

    async def run(self) -> None:
        while True:
            started = self._clock()
            await self.resolve_once()
            await asyncio.sleep(max(0.0, self.cfg.interval - (self._clock() - started)))

    async def resolve_once(self) -> None:
        addresses: list[str] = []
        failures: list[str] = []
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(self.cfg.name, rdtype, search=False)
            except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN) as exc:
                failures.append(type(exc).__name__)
                continue
            except dns.exception.DNSException as exc:
                self.rec.failed("lookup_failed", type(exc).__name__)
                return
            addresses.extend(r.to_text() for r in answer)
        if not addresses:
            self.rec.failed("lookup_failed", "/".join(failures) or "empty answer")
            return
        await self.rec.update(Endpoint(a, self.cfg.port, True) for a in sorted(set(addresses)))
