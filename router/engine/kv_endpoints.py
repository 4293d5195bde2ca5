"""Where a KV-event socket may point (router/engine/kv_events.py opens them).

    resolve("tcp://*:5557", "http://10.1.2.3:8000")     -> ("tcp://10.1.2.3:5557", False)
    local_refusal("ipc:///run/kv.sock", binds=False)      -> "an ipc:// path ..."
    await vetted("tcp://engine.internal:5557", policy)    -> "tcp://10.1.2.3:5557" | raises
    path_refusal("ipc:///etc/passwd")                     -> "... is not a socket ..."

The router binds or connects as vLLM's own rule decides (`resolve`). A backend from the YAML file is
the operator's own. One added at run time (the admin API, discovery) is held to the admin network
policy, as its HTTP traffic is (router/core/netpolicy.py): a tcp endpoint it connects to must
resolve to allowed addresses only, and is then opened by the address checked (ZMQ would resolve a
name itself, later and on every reconnection). The admin API may not make the router bind a socket
(a listener), nor use an `ipc://` path (a file on this machine), unless
`admin.kv_events_bind_and_ipc` allows it; nor may what an engine not from the file answers in its
`GET /kv_event_sources`. Whatever the source, a bind never replaces a file that is not a socket,
or a socket something listens on (ZMQ removes what is at the path before it binds).
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from urllib.parse import urlsplit

from router.core.netpolicy import RESOLVE_TIMEOUT, NetPolicy, NetworkRefused
from router.core.settings import KvEventsConfig

SETTING = "admin.kv_events_bind_and_ipc"


class EndpointRefused(ValueError):
    """A KV-event endpoint the rules above refuse; str() says why."""


def vllm_binds(endpoint: str) -> bool:
    """vLLM's own rule (`ZmqEventPublisher._is_bind_endpoint`)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def resolve(endpoint: str, backend_url: str, bind: bool | None = None) -> tuple[str, bool]:
    """(the address this router uses, whether it binds it) for an engine's endpoint."""
    binds = (not vllm_binds(endpoint)) if bind is None else bind
    if binds or not endpoint.startswith("tcp://"):
        return endpoint, binds
    hostport = endpoint[len("tcp://") :]
    host, _, port = hostport.rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::", "[::0]"):
        target = urlsplit(backend_url).hostname or "127.0.0.1"
        host = f"[{target}]" if ":" in target else target
    return f"tcp://{host}:{port}", False


def host_of(endpoint: str) -> str | None:
    """The host a `tcp://HOST:PORT` endpoint names, brackets off; None for another scheme. A
    host that is no address or DNS name (ZMQ's `source;host` form, an interface name with `%`)
    is refused."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c in host for c in ";%/[]*") or host.strip() != host:
        raise EndpointRefused(f"{endpoint[:100]!r} does not name one host (tcp://HOST:PORT)")
    return host


def local_refusal(endpoint: str, binds: bool) -> str | None:
    """Why a backend added at run time may not have the router use `endpoint` (bound when
    `binds`) without SETTING, or None."""
    if endpoint.startswith("ipc://"):
        return f"an ipc:// path is a file on the router's machine ({SETTING} allows it)"
    if binds:
        return f"the router would bind it, a listener ({SETTING} allows it)"
    return None


def path_refusal(endpoint: str) -> str | None:
    """Why the router may not bind the `ipc://` path of `endpoint`, or None: what is there
    would be removed first, so only nothing or a socket nobody listens on (one left behind)."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None  # not a file (tcp, or Linux's abstract namespace)
    path = endpoint[len("ipc://") :]
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path[:200]}: {exc.strerror}"
    if not stat.S_ISSOCK(mode):
        return f"{path[:200]} exists and is not a socket: not replaced"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return None  # left behind by a process that is gone
        except OSError:
            pass  # its backlog is full: someone listens
        return f"{path[:200]} is a socket in use: not replaced"


def _checked(endpoint: str, address: str) -> str:
    port = endpoint.rpartition(":")[2]
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


async def vetted(endpoint: str, policy: NetPolicy) -> str:
    """`endpoint`, to connect to for a backend not from the file: a tcp host resolved, every
    address checked by `policy`, and spelled as the first of them (IPv4 first, as ZMQ itself
    resolves). EndpointRefused (with NetworkRefused's reason) when refused; OSError or
    TimeoutError when the name does not resolve (yet)."""
    host = host_of(endpoint)
    if host is None:
        return endpoint
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT):
            found = await policy.addresses(host)
    except NetworkRefused as exc:
        raise EndpointRefused(str(exc)) from None
    return _checked(endpoint, next((a for a in found if ":" not in a), found[0]))


async def config_refusal(
    cfg: KvEventsConfig, url: str, policy: NetPolicy, local_ok: bool
) -> str | None:
    """Why the admin API may not register a backend at `url` with `cfg`, or None (what an
    engine answers later is judged when it is opened)."""
    plans = [("endpoint", cfg.endpoint, cfg.bind), ("replay_endpoint", cfg.replay_endpoint, False)]
    for name, endpoint, bind in plans:
        if endpoint is None:
            continue
        addr, binds = resolve(endpoint, url, bind)
        reason = None if local_ok else local_refusal(addr, binds)
        if reason is None and binds:
            reason = path_refusal(addr)
        if reason is None and not binds:
            try:
                host = host_of(addr)
            except EndpointRefused as exc:
                reason = str(exc)
            else:
                if host is not None:
                    reason = await policy.check_host(host)
        if reason is not None:
            return f"kv_events.{name}: {reason}"
    if cfg.endpoint is None and cfg.bind and not local_ok:
        return f"kv_events.bind: the router would bind what the engine names ({SETTING} allows it)"
    return None
