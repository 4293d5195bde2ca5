"""The backend network policy: which addresses a backend added at run time may have, checked on
the address, on every address a name resolves to, and again when a connection opens."""

from __future__ import annotations

import asyncio
import ipaddress

import httpx
import pytest

from router.core.netpolicy import NetPolicy
from router.core.settings import AdminConfig, ConfigError, load_settings
from router.upstream.transport import LeanTransport
from tests.support.harness import Cluster

DEFAULT = NetPolicy.from_config(AdminConfig())


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack metadata
        "169.254.170.2",  # ECS task metadata
        "fd00:ec2::254",  # AWS metadata over IPv6
        "100.100.100.200",  # Alibaba Cloud metadata
        "169.254.1.1",
        "fe80::1",
        "0.0.0.0",
        "::",
        "::ffff:169.254.169.254",  # the metadata address spelled as IPv6
        "64:ff9b::a9fe:a9fe",  # ... through NAT64
        "2002:a9fe:a9fe::1",  # ... through 6to4
        "[fe80::1%eth0]",
    ],
)
def test_metadata_link_local_and_unspecified_are_denied_by_default(address: str) -> None:
    assert DEFAULT.refusal(address) is not None


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "127.0.0.2", "::1", "10.1.2.3", "192.168.0.5", "8.8.8.8", "fd00::1"]
)
def test_loopback_and_ordinary_addresses_are_allowed_by_default(address: str) -> None:
    assert DEFAULT.refusal(address) is None


def test_allowed_networks_confine_and_denied_wins() -> None:
    policy = NetPolicy.from_config(
        AdminConfig(
            allowed_backend_networks=["10.0.0.0/8", "127.0.0.0/8"],
            denied_backend_networks=["10.9.0.0/16"],
        )
    )
    assert policy.refusal("10.1.2.3") is None
    assert policy.refusal("127.0.0.1") is None
    assert "none of the allowed" in (policy.refusal("192.168.1.1") or "")
    assert "denied" in (policy.refusal("10.9.1.1") or "")
    # Operators who replace the denied list replace the defaults, on purpose.
    assert policy.refusal("::ffff:10.1.2.3") is None
    assert policy.refusal("not-an-address") is not None


def test_a_bad_network_stops_startup() -> None:
    with pytest.raises(ConfigError, match="denied_backend_networks"):
        load_settings(admin={"denied_backend_networks": ["10.0.0.0/33"]})


def test_names_are_judged_by_every_address_they_resolve_to() -> None:
    async def run() -> None:
        assert await DEFAULT.check_host("localhost") is None
        assert await DEFAULT.check_host("127.0.0.1") is None
        # Spellings the resolver reads as numbers: decimal and zero.
        assert "169.254.169.254" in (await DEFAULT.check_host("2852039166") or "")
        assert "0.0.0.0" in (await DEFAULT.check_host("0") or "")
        no_loopback = NetPolicy(denied=(ipaddress.ip_network("127.0.0.0/8"),))
        assert await no_loopback.check_host("localhost") is not None
        # Nothing to connect to (yet): not refused here; each connection checks again.
        assert await DEFAULT.check_host("no-such-host.invalid") is None

    asyncio.run(run())


def test_each_new_connection_checks_what_the_name_resolves_to(procs: Cluster) -> None:
    """The transport of a backend added at run time resolves the host itself and connects only
    to checked addresses: a name that resolves to a denied address is refused at connect time,
    whatever it resolved to when the backend was registered."""
    mock = procs.mock("m")
    body = b'{"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}'

    async def post(policy: NetPolicy | None, host: str) -> httpx.Response:
        transport = LeanTransport(httpx.Limits(max_connections=2), policy=policy)
        request = httpx.Request(
            "POST", f"http://{host}:{mock.port}/v1/chat/completions", content=body
        )
        try:
            response = await transport.handle_async_request(request)
            await response.aread()
            return response
        finally:
            await transport.aclose()

    async def run() -> None:
        assert (await post(DEFAULT, "localhost")).status_code == 200
        no_loopback = NetPolicy(denied=(ipaddress.ip_network("127.0.0.0/8"),))
        for host in ("localhost", "127.0.0.1"):
            with pytest.raises(httpx.ConnectError, match="refused"):
                await post(no_loopback, host)
        assert (await post(None, "localhost")).status_code == 200

    asyncio.run(run())
