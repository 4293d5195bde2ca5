"""KV-event endpoints of backends added at run time are held to the admin network policy, and may
not make the router bind or use an ipc:// path unless `admin.kv_events_bind_and_ipc` allows it;
no bind ever replaces a file that is not a socket (issue 46). Real routers, mock engines and ZMQ
sockets on loopback (127.0.0.3 stands for a denied network)."""

from __future__ import annotations

import asyncio
import functools
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from router.core.backend import Backend
from router.core.settings import DEFAULT_DENIED_NETWORKS, BackendConfig
from router.engine.kv_endpoints import EndpointRefused, host_of, path_refusal
from router.engine.kv_events import KvEvents
from tests.support.harness import STARVED_S, Cluster, Proc, backend, free_port
from tests.support.kv_publisher import Publisher, stored
from tests.support.wait import wait_for

TOKEN = "admin-token-for-kv-tests"
AUTH = {"authorization": f"Bearer {TOKEN}"}
DENIED = "127.0.0.3"  # a loopback address, in a denied network for these routers


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("kvp"))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


def _victim(run: Path, name: str) -> Path:
    path = run / name
    path.write_text("the operator's own file\n")
    return path


def _untouched(path: Path) -> bool:
    return stat.S_ISREG(path.lstat().st_mode) and path.read_text() == "the operator's own file\n"


def _router(cluster: Cluster, backends: list[dict[str, Any]], **admin: Any) -> Proc:
    return cluster.router(
        {
            "backends": backends,
            "admin": {
                "denied_backend_networks": [*DEFAULT_DENIED_NETWORKS, f"{DENIED}/32"],
                **admin,
            },
            "health": {"interval": 60},
        },
        env={"SLUICEGATE_ADMIN_TOKEN": TOKEN, "SLUICEGATE_LOG_LEVEL": "warning"},
    )


@pytest.fixture(scope="module")
def router(cluster: Cluster, run: Path) -> Proc:
    """Admin defaults (no bind, no ipc:// through the API), one file backend that binds."""
    plain = cluster.mock("plain")
    victim = _victim(run, "config-victim")
    file_backend = backend(
        "filebound", plain, kv_events={"endpoint": f"ipc://{victim}", "bind": True}
    )
    return _router(cluster, [backend("a", plain), file_backend])


def _publisher(router: Proc, name: str) -> dict[str, Any]:
    r = httpx.get(f"{router.url}/admin/backends/{name}", headers=AUTH, timeout=STARVED_S)
    assert r.status_code == 200, r.text
    state = r.json()["kv_events_state"]
    publishers = state["publishers"] if state else []
    return dict(publishers[0]) if publishers else {}


def _failed(router: Proc, name: str) -> bool:
    return _publisher(router, name).get("state") == "error"


def _register(router: Proc, name: str, url: str, kv_events: dict[str, Any]) -> httpx.Response:
    body = {"name": name, "url": url, "models": ["m"], "kv_events": kv_events}
    return httpx.post(router.url + "/admin/backends", json=body, headers=AUTH, timeout=10)


def _nothing_listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_a_bind_from_the_file_never_replaces_a_file(router: Proc, run: Path) -> None:
    """The YAML file's own backend, binding `ipc://` at a path that holds a regular file: ZMQ
    would delete the file and put its socket there; the feed is `error` instead."""
    wait_for(lambda: _failed(router, "filebound"), "the feed refused")
    assert "not a socket" in _publisher(router, "filebound")["error"]
    assert _untouched(run / "config-victim")


def test_the_api_may_not_make_the_router_bind_or_use_ipc(router: Proc, run: Path) -> None:
    """An ipc:// bind through the API deleted a file and put a socket there, and a tcp bind
    opened a listener: both are refused (400) with the setting that would allow them named."""
    url = router.url  # any allowed address serves: nothing is asked of it here
    victim = _victim(run, "api-victim")
    r = _register(router, "ipcbind", url, {"endpoint": f"ipc://{victim}", "bind": True})
    assert r.status_code == 400 and "kv_events_bind_and_ipc" in r.json()["error"]["message"]
    assert _untouched(victim)
    r = _register(router, "ipc", url, {"endpoint": f"ipc://{run}/engine.sock"})
    assert r.status_code == 400 and "ipc://" in r.json()["error"]["message"]
    port = free_port()
    r = _register(router, "tcpbind", url, {"endpoint": f"tcp://127.0.0.1:{port}"})  # vLLM connects
    assert r.status_code == 400 and "bind" in r.json()["error"]["message"]
    r = _register(router, "bindlater", url, {"bind": True})
    assert r.status_code == 400 and "kv_events.bind" in r.json()["error"]["message"]
    assert _nothing_listens(port)
    names = {
        b["name"]
        for b in httpx.get(router.url + "/admin/backends", headers=AUTH, timeout=STARVED_S).json()
    }
    assert names == {"a", "filebound"}


def test_a_kv_endpoint_in_a_denied_network_is_refused(router: Proc) -> None:
    """An endpoint in a denied network got 18 connections while the same address as a URL was
    refused: the endpoint is held to the URL's policy."""
    port = free_port()
    pub = Publisher(f"tcp://{DENIED}:{port}")
    try:
        r = _register(
            router, "denied", router.url, {"endpoint": f"tcp://{DENIED}:{port}", "bind": False}
        )
        assert r.status_code == 400, r.text
        assert "denied network" in r.json()["error"]["message"]
        assert "kv_events.endpoint" in r.json()["error"]["message"]
        replay = {"endpoint": "tcp://*:5557", "replay_endpoint": f"tcp://{DENIED}:{port}"}
        r = _register(router, "deniedreplay", router.url, replay)
        assert r.status_code == 400 and "kv_events.replay_endpoint" in r.json()["error"]["message"]
        assert not pub.sock.poll(0)  # never subscribed to
    finally:
        pub.close()


def test_what_an_api_engine_names_is_held_to_the_same_rules(
    router: Proc, cluster: Cluster, run: Path
) -> None:
    """A backend registered through the API learns its endpoints from its own engine's
    `GET /kv_event_sources`: an ipc:// path there, or an address in a denied network, leaves
    the feed `error` (refused), with no socket opened."""
    ipc_engine = cluster.mock(
        "ipc-engine", engine_args=["--engine", "--kv-events", f"ipc://{run}/learned.sock"]
    )
    port = free_port()
    tcp_engine = cluster.mock(
        "tcp-engine", engine_args=["--engine", "--kv-events", f"tcp://{DENIED}:{port}"]
    )
    assert _register(router, "learnsipc", ipc_engine.url, {}).status_code == 201
    assert _register(router, "learnstcp", tcp_engine.url, {"bind": False}).status_code == 201
    for name, why in (("learnsipc", "ipc://"), ("learnstcp", "denied network")):
        wait_for(functools.partial(_failed, router, name), f"{name} refused")
        error = _publisher(router, name)["error"]
        assert error.startswith("refused:") and why in error, error


@pytest.fixture(scope="module")
def open_router(cluster: Cluster) -> Proc:
    """`admin.kv_events_bind_and_ipc: true`: the API may have the router bind and use ipc://."""
    return _router(cluster, [backend("a", cluster.mock("plain2"))], kv_events_bind_and_ipc=True)


def test_with_the_setting_the_api_may_bind_but_never_over_a_file(
    open_router: Proc, run: Path
) -> None:
    victim = _victim(run, "open-victim")
    r = _register(
        open_router, "over", open_router.url, {"endpoint": f"ipc://{victim}", "bind": True}
    )
    assert r.status_code == 400 and "not a socket" in r.json()["error"]["message"]
    assert _untouched(victim)
    endpoint = f"ipc://{run}/allowed.sock"
    assert (
        _register(
            open_router, "bound", open_router.url, {"endpoint": endpoint, "bind": True}
        ).status_code
        == 201
    )
    pub = Publisher(endpoint, bind=False)  # an engine that connects, as vLLM does to a named path
    try:
        asyncio.run(pub.subscribed())
        pub.publish([stored([1], None, [1, 2, 3, 4], 4)])
        wait_for(lambda: _publisher(open_router, "bound").get("state") == "live", "the feed live")
    finally:
        pub.close()
    # Still no connection to a denied network.
    r = _register(
        open_router, "far", open_router.url, {"endpoint": f"tcp://{DENIED}:5557", "bind": False}
    )
    assert r.status_code == 400 and "denied network" in r.json()["error"]["message"]


# --- the rules themselves, in one process -------------------------------------------------------


def test_endpoint_hosts_name_one_host() -> None:
    assert host_of("tcp://10.0.0.1:5557") == "10.0.0.1"
    assert host_of("tcp://[fd00::1]:5557") == "fd00::1"
    assert host_of("tcp://engine.internal:5557") == "engine.internal"
    assert host_of("ipc:///run/kv.sock") is None
    for odd in (
        "tcp://eth0;10.0.0.1:5557",
        "tcp://[fe80::1%eth0]:5557",
        "tcp://*:5557",
        "tcp://:5557",
    ):
        with pytest.raises(EndpointRefused):
            host_of(odd)


def test_a_bind_replaces_only_a_socket_left_behind(tmp_path: Path) -> None:
    assert path_refusal(f"ipc://{tmp_path}/none") is None
    (tmp_path / "file").write_text("x")
    assert "not a socket" in (path_refusal(f"ipc://{tmp_path}/file") or "")
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(tmp_path / "live"))
    live.listen()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "stale"))
    stale.close()  # its file stays, nobody listens
    try:
        assert "in use" in (path_refusal(f"ipc://{tmp_path}/live") or "")
        assert path_refusal(f"ipc://{tmp_path}/stale") is None
    finally:
        live.close()


def _source(name: str, kv: dict[str, Any], source: str) -> Backend:
    cfg = BackendConfig(name=name, url="http://127.0.0.1:9", models=["m"], kv_events=kv)  # type: ignore[arg-type]
    return Backend.from_config(cfg, source)


def test_a_run_time_backends_name_is_connected_to_as_the_address_checked() -> None:
    """ZMQ resolves a name itself (again at each reconnection): the router resolves it, checks
    every address, and connects to the address it checked. The operator's discovery template
    may name an ipc:// path; a registration through the API may not."""

    async def body() -> None:
        port = free_port()
        pub = Publisher(f"tcp://127.0.0.1:{port}")
        kv = KvEvents(capacity=lambda _n: 100)
        try:
            kv.sync(
                [
                    _source("api", {"endpoint": f"tcp://localhost:{port}", "bind": False}, "api"),
                    _source("odd", {"endpoint": f"tcp://x;127.0.0.1:{port}", "bind": False}, "api"),
                    _source("tpl", {"endpoint": "ipc:///nonexistent/kv.sock"}, "dns"),
                    _source("apiipc", {"endpoint": "ipc:///nonexistent/kv.sock"}, "api"),
                ]
            )
            await kv.start()
            await pub.subscribed()
            pub.publish([stored([1], None, [1, 2, 3, 4], 4)])
            async with asyncio.timeout(10):
                while not kv.live("api"):  # noqa: ASYNC110 (another socket's reader)
                    await asyncio.sleep(0.01)
            rows = {n: kv.status(n)["publishers"][0] for n in ("api", "odd", "tpl", "apiipc")}  # type: ignore[index]
            assert rows["api"]["endpoint"] == f"tcp://127.0.0.1:{port}"  # IPv4 first, as ZMQ
            assert rows["odd"]["state"] == "error" and "one host" in rows["odd"]["error"]
            assert rows["tpl"]["state"] == "waiting" and rows["tpl"]["error"] is None
            assert rows["apiipc"]["state"] == "error" and "ipc://" in rows["apiipc"]["error"]
        finally:
            await kv.aclose()
            pub.close()

    asyncio.run(body())


def test_zmq_would_replace_the_file() -> None:
    """Why the check is the router's own: libzmq removes whatever is at an ipc:// path before
    it binds (this test fails the day it stops, and the check may go)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f"
        path.write_text("x")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.bind(f"ipc://{path}")
            assert stat.S_ISSOCK(path.lstat().st_mode)
        finally:
            sock.close(0)
            ctx.term()
