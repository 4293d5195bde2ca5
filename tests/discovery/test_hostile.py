"""Discovery against a struggling or hostile control plane, in process.

The Kubernetes source runs with the real client library (kubernetes-asyncio) against the fake
API server (tests/support/fake_kube.py, the real wire protocol) made to answer errors, garbage,
silence and bad slices; `models: auto` asks real loopback HTTP servers that answer slowly. What is
checked is what routing sees: the Fleet's snapshot, the source's staleness and its counters."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from router.core.settings import KubernetesDiscovery
from router.discovery.kubernetes import KubernetesSource
from router.discovery.reconcile import Endpoint, Reconciler
from router.registry.fleet import Fleet, LocalRecords, Registry
from tests.support.fake_kube import FakeKube, endpoint
from tests.support.harness import free_port
from tests.support.wait import wait_for_async

PORTS = [{"name": "http", "port": 8000}]


class Events:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def discovery_event(self, source: str, event: str, n: int = 1) -> None:
        self.seen += [event] * n


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    """A fake of its own per test, not conftest's per module: a hostile case leaves it broken."""
    fk = FakeKube(free_port(), bookmark_every=0.2)
    try:
        yield fk
    finally:
        fk.close()


async def no_streams(names: Any) -> dict[str, int]:
    return {}


class Running:
    def __init__(self, src: KubernetesSource, fleet: Fleet, events: Events) -> None:
        self.src, self.fleet, self.events = src, fleet, events

    @property
    def names(self) -> set[str]:
        return set(self.fleet.registry.snapshot.by_name)


def k8s(port: int | str, models: object = ("m",), **extra: Any) -> KubernetesDiscovery:
    """A Kubernetes source of service `vllm` in namespace `models`, as a config file names it."""
    return KubernetesDiscovery.model_validate(
        {
            "kind": "kubernetes",
            "namespace": "models",
            "service": "vllm",
            "port": port,
            "models": list(models) if isinstance(models, tuple) else models,
            **extra,
        }
    )


def empty_fleet() -> Fleet:
    return Fleet(Registry([], "round_robin"), [], LocalRecords())


@contextlib.asynccontextmanager
async def source(kube: FakeKube, tmp_path: Path, **extra: Any) -> AsyncIterator[Running]:
    cfg = k8s("http", kubeconfig=str(kube.kubeconfig(tmp_path / "kubeconfig")), **extra)
    fleet = empty_fleet()
    events = Events()
    rec = Reconciler("k", cfg, fleet, no_streams, events, 30)
    src = KubernetesSource(cfg, rec)
    task = asyncio.create_task(src.run())
    try:
        yield Running(src, fleet, events)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        rec.forget_questions()


TWO = {"vllm-10.0.0.1-8000", "vllm-10.0.0.2-8000"}


@pytest.mark.parametrize("status", [429, 410, 500])
def test_an_error_answer_to_the_list_keeps_the_fleet_and_marks_the_source_stale(
    kube: FakeKube, tmp_path: Path, status: int
) -> None:
    kube.put_slice("s1", [endpoint("10.0.0.1"), endpoint("10.0.0.2")], PORTS)

    async def run() -> None:
        async with source(kube, tmp_path, backoff_max=0.5) as r:
            await wait_for_async(lambda: r.names == TWO, "both endpoints found")
            kube.list_error = status
            kube.expire()  # the watch resumes with 410: a re-list, which now fails
            kube.drop_watches()
            lists = kube.requests.count("list")
            await wait_for_async(lambda: kube.requests.count("list") >= lists + 2, "re-lists")
            assert r.names == TWO  # never emptied
            assert r.src.rec.stale and r.src.rec.error == f"HTTP {status}"
            kube.list_error = None
            await wait_for_async(lambda: not r.src.rec.stale, "fresh again")
            assert r.names == TWO

    asyncio.run(run())


@pytest.mark.parametrize("hostile", ["garbage", "410"])
def test_a_broken_watch_does_not_cause_a_relist_storm(
    kube: FakeKube, tmp_path: Path, hostile: str
) -> None:
    kube.put_slice("s1", [endpoint("10.0.0.1")], PORTS)
    if hostile == "garbage":
        kube.watch_garbage = True
    else:
        kube.watch_error = 410
    seconds = 3.0

    async def run() -> None:
        async with source(kube, tmp_path) as r:
            await asyncio.sleep(seconds)
            assert r.names == {"vllm-10.0.0.1-8000"}

    asyncio.run(run())
    # Backoff from 0.2 s doubling (half of it jittered off): 0.1 + 0.2 + 0.4 + 0.8 + 1.6 > 3 s,
    # so at most 6 lists (the first, a 410's one at once, then one per pause); no backoff
    # resetting on each good list gave 12-15, and a 410 loop dozens.
    assert kube.requests.count("list") <= 7, kube.requests.count("list")


def test_a_silent_watch_is_restarted_within_the_idle_timeout_and_shows_stale(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.put_slice("s1", [endpoint("10.0.0.1")], PORTS)
    # 6 bookmark intervals: at 3 (0.6 s) a starved machine's stall alone made a flowing watch
    # look idle.
    idle = 1.2

    async def run() -> None:
        async with source(kube, tmp_path, watch_idle_timeout=idle) as r:
            await wait_for_async(lambda: bool(r.names), "endpoint found")
            await asyncio.sleep(2 * idle)  # bookmarks flowing: never idle
            assert not r.src.rec.stale
            kube.silent = True  # the open watch goes quiet: no more bookmarks
            t0 = time.monotonic()
            await wait_for_async(lambda: r.src.rec.stale, "stale", 10 * idle)
            # Noticed after `idle` from the last bookmark (sent at most 0.2 s before the
            # silence), and well within the 310 s of before.
            assert time.monotonic() - t0 >= idle - 0.25
            assert "no watch event" in (r.src.rec.error or "")
            watches = kube.requests.count("watch")
            await wait_for_async(
                lambda: kube.requests.count("watch") > watches, "restart", 10 * idle
            )
            assert r.names == {"vllm-10.0.0.1-8000"}  # kept meanwhile
            kube.silent = False
            await wait_for_async(lambda: not r.src.rec.stale, "fresh after bookmarks", 20 * idle)

    asyncio.run(run())


def test_bad_endpoints_and_slices_are_skipped_and_counted_while_good_ones_apply(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.put_slice(
        "bad",
        [
            endpoint("10.0.0.1"),
            endpoint("not-an-ip"),
            endpoint(""),
            endpoint("fd00::1"),  # an IPv6 address in an IPv4 slice
            {"addresses": "10.0.0.9"},
            "junk",  # type: ignore[list-item]
        ],
        PORTS,
    )
    kube.put_slice("port0", [endpoint("10.0.0.3")], [{"name": "http", "port": 0}])

    async def run() -> None:
        async with source(kube, tmp_path) as r:
            await wait_for_async(lambda: r.names == {"vllm-10.0.0.1-8000"}, "the good endpoint")
            kube.put_slice("good", [endpoint("10.0.0.2")], PORTS)  # later changes still apply
            await wait_for_async(lambda: "vllm-10.0.0.2-8000" in r.names, "a later good slice")
            assert r.names == {"vllm-10.0.0.1-8000", "vllm-10.0.0.2-8000"}
            assert r.events.seen.count("bad_endpoint") >= 2

    asyncio.run(run())


def test_max_endpoints_refuses_the_excess_counts_and_shows_it(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.put_slice("s1", [endpoint(f"10.0.0.{i}") for i in range(1, 6)], PORTS)

    async def run() -> None:
        async with source(kube, tmp_path, max_endpoints=3) as r:
            await wait_for_async(lambda: len(r.names) == 3, "three backends")
            await wait_for_async(lambda: r.src.rec.refused == 2, "the other two refused")
            assert len(r.names) == 3
            assert "refused" in r.events.seen

    asyncio.run(run())


async def _models_server(
    host: str,
    port: int,
    drip: bool,
    ids: tuple[str, ...] = ("m",),
    endless: bool = False,
    asked: list[str] | None = None,
) -> asyncio.Server:
    """`/v1/models` on `host`; each question's head read is noted in `asked`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            if asked is not None:
                asked.append(host)
            body = json.dumps({"object": "list", "data": [{"id": i} for i in ids]}).encode()
            if endless:  # a body that never ends, as fast as the socket takes it
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                chunk = b'{"data": [' + b'{"id": "m"}, ' * 5000
                for _ in range(100_000):  # bounded: ~6 GB, far past the cap
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
            if drip:  # 1 byte every 0.5 s: each read is quick, the whole answer never comes
                for byte in body:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.5)
            writer.write(body)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, host, port)


def test_a_slow_models_answer_delays_only_its_own_endpoint(kube: FakeKube, tmp_path: Path) -> None:
    port = free_port()
    ports = [{"name": "http", "port": port}]
    kube.put_slice("s1", [endpoint("127.0.0.2")], ports)

    async def run() -> None:
        asked: list[str] = []
        slow = await _models_server("127.0.0.2", port, drip=True, asked=asked)
        fast = await _models_server("127.0.0.3", port, drip=False)
        try:
            async with source(kube, tmp_path, models="auto") as r:
                await wait_for_async(lambda: bool(asked), "the slow endpoint's question under way")
                kube.put_slice("s2", [endpoint("127.0.0.3")], ports)
                await wait_for_async(
                    lambda: f"vllm-127.0.0.3-{port}" in r.names, "fast endpoint", 3
                )
                assert f"vllm-127.0.0.2-{port}" not in r.names
        finally:
            for s in (slow, fast):
                s.close()

    asyncio.run(run())


def test_an_endless_models_answer_is_cut_at_the_size_cap_and_delays_no_other(
    kube: FakeKube, tmp_path: Path
) -> None:
    port = free_port()
    ports = [{"name": "http", "port": port}]
    kube.put_slice("s1", [endpoint("127.0.0.2"), endpoint("127.0.0.3")], ports)

    async def run() -> None:
        endless = await _models_server("127.0.0.2", port, drip=False, endless=True)
        fast = await _models_server("127.0.0.3", port, drip=False)
        try:
            async with source(kube, tmp_path, models="auto") as r:
                await wait_for_async(
                    lambda: f"vllm-127.0.0.3-{port}" in r.names, "fast endpoint", 5
                )
                await wait_for_async(lambda: "models_failed" in r.events.seen, "the cap")
                assert f"vllm-127.0.0.2-{port}" not in r.names
        finally:
            for s in (endless, fast):
                s.close()

    asyncio.run(run())


def test_churn_logs_a_bounded_number_of_lines_and_a_summary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = k8s(8000)

    async def run() -> None:
        fleet = empty_fleet()
        rec = Reconciler("k", cfg, fleet, no_streams, Events(), 30)
        await rec.update([Endpoint(f"10.0.1.{i}", 8000, True) for i in range(200)])
        await rec.update([])
        assert fleet.registry.snapshot.backends == ()

    with caplog.at_level(logging.INFO, logger="sluicegate.discovery"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("discovered backend ") for m in lines) <= 20  # not 400
    assert lines.count("discovered backends changed") == 2  # one summary per change set


def test_discovered_addresses_obey_the_backend_network_policy() -> None:
    from router.core.netpolicy import NetPolicy

    cfg = k8s(8000)

    async def run() -> None:
        fleet = empty_fleet()
        events = Events()
        rec = Reconciler("k", cfg, fleet, no_streams, events, 30, time.monotonic, NetPolicy())
        await rec.update(
            [
                Endpoint("169.254.169.254", 8000, True),  # the metadata service: denied
                Endpoint("::ffff:169.254.169.254", 8000, True),
                Endpoint("10.0.0.1", 8000, True),
            ]
        )
        assert set(fleet.registry.snapshot.by_name) == {"vllm-10.0.0.1-8000"}
        assert rec.denied == 2 and "network_refused" in events.seen

    asyncio.run(run())


@pytest.mark.parametrize("shadow", [False, True])
def test_models_auto_keeps_to_models_allow_and_never_shadows_file_or_admin_models(
    shadow: bool,
) -> None:
    """An endpoint claims a model the file serves, one outside `models_allow`, and one of its
    own: it gets its own (and the file's only with `shadow: true`); a model an admin registers
    later is taken from it too."""
    from router.core.settings import BackendConfig

    port = free_port()
    cfg = k8s(port, models="auto", models_allow=["m", "llama-*"], shadow=shadow)
    file_backend = BackendConfig(name="file-a", url="http://127.0.0.1:1", models={"m": "m"})
    name = f"vllm-127.0.0.5-{port}"

    async def run() -> None:
        server = await _models_server("127.0.0.5", port, False, ("m", "llama-3", "evil"))
        fleet = Fleet(Registry([], "round_robin"), [file_backend], LocalRecords())
        events = Events()
        try:
            rec = Reconciler("k", cfg, fleet, no_streams, events, 30)
            await rec.update([Endpoint("127.0.0.5", port, True)])
            await wait_for_async(
                lambda: name in fleet.registry.snapshot.by_name, "the endpoint's models applied"
            )
            snap = fleet.registry.snapshot
            claimed = set(snap.by_name[name].models)
            assert "evil" not in claimed and "models_not_allowed" in events.seen
            if shadow:
                assert claimed == {"m", "llama-3"}
                assert {b.name for b in snap.by_model["m"]} == {"file-a", name}
            else:
                assert claimed == {"llama-3"}
                assert [b.name for b in snap.by_model["m"]] == ["file-a"]
                assert "models_shadowing" in events.seen
            # An admin registers a backend for llama-3: without `shadow` the endpoint
            # loses it, and with nothing left it takes no requests.
            await fleet.register(
                BackendConfig(name="admin-b", url="http://127.0.0.1:2", models=["llama-3"])
            )
            await rec.tick()
            snap = fleet.registry.snapshot
            if shadow:
                assert set(snap.by_name[name].models) == {"m", "llama-3"}
            else:
                assert name not in snap.by_name
                assert [b.name for b in snap.by_model["llama-3"]] == ["admin-b"]
            rec.forget_questions()
        finally:
            server.close()

    asyncio.run(run())


def test_a_bookmark_flood_is_paced_and_leaves_the_loop_free(kube: FakeKube, tmp_path: Path) -> None:
    """A watch sending bookmarks back to back (case 10: 98 % CPU, 748 ms p50 before): the
    source skips those superseded by the ones behind them (issue 46, case 20), warns, works
    through the flood in slices of the loop's time, and other work on the loop keeps its
    turns."""
    from router.discovery.watch import _BOOKMARKS_PER_S

    kube.put_slice("s1", [endpoint("10.0.0.1")], PORTS)
    kube.bookmark_flood = 20_000
    seconds = 2.0

    async def run() -> None:
        async with source(kube, tmp_path) as r:
            await wait_for_async(lambda: bool(r.names), "endpoint found")
            loop = asyncio.get_running_loop()
            turns = 0
            worst = 0.0
            end = loop.time() + seconds
            while loop.time() < end:
                t = loop.time()
                await asyncio.sleep(0.005)
                worst = max(worst, loop.time() - t - 0.005)
                turns += 1
            handled = r.events.seen.count("bookmark")
            # Applied (in sync): the latest of the flood and the periodic ones, not thousands
            # (slack for a watch restart and a slow machine).
            assert handled <= _BOOKMARKS_PER_S * (seconds + 2) * 2, handled
            assert "bookmark_flood" in r.events.seen
            assert r.names == {"vllm-10.0.0.1-8000"}
        # A 5 ms sleeper got most of its turns, never waiting long (a margin of 0.5 s).
        assert turns >= seconds / 0.005 / 4, turns
        assert worst < 0.5, worst

    asyncio.run(run())


def test_models_auto_takes_only_plain_ids_and_at_most_the_cap() -> None:
    """Issue 31, case 11: an endpoint listing thousands of ids, ids with control characters or
    spaces, and a 10 KB id claims only plain ids, at most the cap (64); the rest is refused and
    counted. Before, every id was taken as a routable model."""
    port = free_port()
    cfg = k8s(port, models="auto")
    hostile = ("bad\x00id", "new\nline", "with space", "\x1b[31mred", "x" * 10_000)
    ids = hostile + tuple(f"m{i}" for i in range(5000))
    name = f"vllm-127.0.0.6-{port}"

    async def run() -> None:
        server = await _models_server("127.0.0.6", port, False, ids)
        fleet = empty_fleet()
        events = Events()
        try:
            rec = Reconciler("k", cfg, fleet, no_streams, events, 30)
            await rec.update([Endpoint("127.0.0.6", port, True)])
            await wait_for_async(
                lambda: name in fleet.registry.snapshot.by_name, "the endpoint's models applied"
            )
            claimed = set(fleet.registry.snapshot.by_name[name].models)
            assert claimed == {f"m{i}" for i in range(64)}
            assert not claimed & set(hostile)
            assert len(fleet.registry.snapshot.models) == 64
            assert "models_refused" in events.seen
            rec.forget_questions()
        finally:
            server.close()

    asyncio.run(run())
