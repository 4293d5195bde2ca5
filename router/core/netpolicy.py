"""Which network addresses a backend added at run time may have (`admin.allowed_backend_networks`,
`admin.denied_backend_networks`).

    policy = NetPolicy.from_config(settings.admin)
    policy.refusal("169.254.169.254")          -> "169.254.169.254 is in a denied network ..."
    await policy.check_host("models.internal")  -> None (every address it resolves to is allowed)
    await policy.addresses("models.internal", 8000)  -> allowed addresses, or NetworkRefused

An address is refused when it is in a denied network, or when allowed networks are given and it
is in none of them. Denied wins. IPv6 forms that carry an IPv4 address (`::ffff:a.b.c.d`,
NAT64 `64:ff9b::/96`, 6to4 `2002::/16`) are judged by that address too, so the metadata service
cannot be reached as `::ffff:169.254.169.254`. Loopback is allowed by default; the metadata
services, link-local and unspecified addresses (`0.0.0.0`, `::`) are denied
(DEFAULT_DENIED_NETWORKS).

A name is judged by every address it resolves to (one denied address refuses the name), at
registration and again each time a connection opens (the transport connects to the addresses
checked, so a name that resolves differently later, DNS rebinding, is caught there). Spellings
the OS resolver reads as numbers (`2852039166`, `0x7f.1`, `0`) resolve like names and are judged
by what they resolve to.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

from router.core.settings import DEFAULT_DENIED_NETWORKS, AdminConfig

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

RESOLVE_TIMEOUT = 5.0  # s a registration waits for DNS before the name is taken unresolved
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class NetworkRefused(OSError):
    """A backend address the policy refuses; str() names the address and why."""


def _networks(specs: Iterable[str]) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(s, strict=False) for s in specs)


def _forms(ip: IPAddress) -> list[IPAddress]:
    """The address and any IPv4 address it carries."""
    out: list[IPAddress] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            out.append(ip.ipv4_mapped)
        elif ip.sixtofour is not None:
            out.append(ip.sixtofour)
        elif ip in _NAT64:
            out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out


def dotted_quad(text: str) -> int | None:
    """`text` as an IPv4 address (its integer) when it is one in its own canonical spelling
    (`10.0.0.1`, not `010.0.0.1`), else None: the C parser's verdict, a tenth of the cost of
    `ipaddress` (discovery reads 50,000 at a time). Any other text may still be an address."""
    try:
        packed = socket.inet_pton(socket.AF_INET, text)
    except (OSError, ValueError, TypeError):
        return None
    if socket.inet_ntop(socket.AF_INET, packed) != text:
        return None
    return int.from_bytes(packed, "big")


def ip_literal(text: str) -> IPAddress | None:
    """`text` as a strict IP literal, else None: what `ipaddress.ip_address` accepts."""
    n = dotted_quad(text)
    if n is not None:
        return ipaddress.IPv4Address(n)
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def parse_address(text: str) -> IPAddress | None:
    """`text` as a strict IP literal (brackets and a zone index allowed), else None."""
    return ip_literal(text.strip("[]").split("%", 1)[0])


def _v4(nets: Iterable[IPNetwork]) -> tuple[tuple[int, int, IPNetwork], ...]:
    return tuple(
        (int(n.netmask), int(n.network_address), n)
        for n in nets
        if isinstance(n, ipaddress.IPv4Network)
    )


@dataclass(frozen=True, slots=True)
class NetPolicy:
    allowed: tuple[IPNetwork, ...] = ()  # empty: anywhere not denied
    denied: tuple[IPNetwork, ...] = _networks(DEFAULT_DENIED_NETWORKS)
    # (mask, network, net) of the IPv4 networks: an IPv4 address is judged by two integer
    # operations per network (discovery judges 50,000 at a time).
    _denied4: tuple[tuple[int, int, IPNetwork], ...] = field(
        init=False, repr=False, compare=False, default=()
    )
    _allowed4: tuple[tuple[int, int, IPNetwork], ...] = field(
        init=False, repr=False, compare=False, default=()
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "_denied4", _v4(self.denied))
        object.__setattr__(self, "_allowed4", _v4(self.allowed))

    @classmethod
    def from_config(cls, cfg: AdminConfig) -> NetPolicy:
        return cls(_networks(cfg.allowed_backend_networks), _networks(cfg.denied_backend_networks))

    def refusal(self, address: str | IPAddress) -> str | None:
        """Why `address` (an IP) may not be a backend's, or None when it may. A string that is
        not an IP literal is refused: resolve names with `check_host`."""
        if isinstance(address, str):
            n = dotted_quad(address)
            if n is not None:
                return self._refusal4(n, address)
        ip = parse_address(address) if isinstance(address, str) else address
        if ip is None:
            return f"{str(address)[:100]!r} is not an IP address"
        if isinstance(ip, ipaddress.IPv4Address):
            return self._refusal4(int(ip), str(ip))
        forms = _forms(ip)
        for form in forms:
            for net in self.denied:
                if form.version == net.version and form in net:
                    return f"{ip} is in a denied network ({net})"
        if self.allowed and not any(
            form.version == net.version and form in net for form in forms for net in self.allowed
        ):
            return f"{ip} is in none of the allowed networks"
        return None

    def _refusal4(self, n: int, shown: str) -> str | None:
        # An IPv4 address carries no other form: two integer operations per network.
        for mask, base, net in self._denied4:
            if n & mask == base:
                return f"{shown} is in a denied network ({net})"
        if self.allowed and not any(n & mask == base for mask, base, _ in self._allowed4):
            return f"{shown} is in none of the allowed networks"
        return None

    async def resolve(self, host: str, port: int | None = None) -> list[str]:
        """Every address `host` resolves to (itself when it is an IP literal); raises OSError
        (socket.gaierror) when it does not resolve."""
        literal = parse_address(host)
        if literal is not None:
            return [str(literal)]
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )
        seen: dict[str, None] = {}
        for *_, sockaddr in infos:
            seen.setdefault(str(sockaddr[0]).split("%", 1)[0], None)
        return list(seen)

    async def addresses(self, host: str, port: int | None = None) -> list[str]:
        """The addresses to connect to for `host`, every one allowed; NetworkRefused when any
        it resolves to is refused, OSError when it does not resolve."""
        found = await self.resolve(host, port)
        for address in found:
            reason = self.refusal(address)
            if reason is not None:
                raise NetworkRefused(f"backend address refused: {reason}")
        return found

    async def check_host(self, host: str, wait: float = RESOLVE_TIMEOUT) -> str | None:
        """Why `host` (an IP literal or a name: every address it resolves to) may not be a
        backend's, or None. A name that does not resolve (yet) is not refused here: there is
        nothing to connect to, and each connection checks again."""
        try:
            async with asyncio.timeout(wait):
                found = await self.resolve(host)
        except (OSError, TimeoutError, UnicodeError):
            return None
        for address in found:
            reason = self.refusal(address)
            if reason is not None:
                return reason
        return None


OPEN = NetPolicy(allowed=(), denied=())  # no policy: every address (the file's own backends)
