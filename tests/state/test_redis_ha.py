"""Redis that survives a node loss: routers as real processes on a real 3-master Redis Cluster and
on a master + replica watched by 3 real sentinels, with a `SENTINEL FAILOVER` under load; and the
other ways to reach one server, TLS (`rediss://`) and a unix socket (`unix://`).

What a user relies on: counts shared by every replica (the same in Redis, in each router's admin
API and on the backends), admin changes reaching every replica, no failed request while the
master changes, and counts true again within the lease time after it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from redis.cluster import RedisCluster

from router.registry.sync import RedisRecords
from tests.support.harness import (
    STARVED_S,
    Cluster,
    Proc,
    backend,
    control,
    expected_text,
    free_port,
    stats,
    stream_text,
    wait_http,
)
from tests.support.wait import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]

NAMES = ("a", "b")
TOKEN = "admin-token-for-redis-ha-tests"
LEASE_TTL = 2.0
# Generous: this machine's 2 cores are shared; the default (50 ms) is for a quiet host.
BASE_ENV = {
    "SLUICEGATE_ADMIN_TOKEN": TOKEN,
    "SLUICEGATE_REDIS_TIMEOUT": "0.5",
    "SLUICEGATE_REDIS_LEASE_TTL": str(LEASE_TTL),
    "SLUICEGATE_REGISTRY_RESYNC": "0.5",
}


def admin(router: Proc, method: str = "GET", **kw: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {TOKEN}"}
    return httpx.request(method, router.url + "/admin/backends", headers=headers, timeout=10, **kw)


def admin_counts(router: Proc) -> dict[str, int]:
    return {r["name"]: int(r["in_flight"]) for r in admin(router).json() if r["name"] in NAMES}


def running(mocks: dict[str, Proc]) -> dict[str, int]:
    return {n: int(stats(m)["running"]) for n, m in mocks.items()}


def live_leases(client: redis.Redis | RedisCluster) -> dict[str, int]:
    now_ms = int(time.time() * 1000)
    return {n: int(client.zcount("{sluicegate}:inflight:" + n, now_ms, "+inf")) for n in NAMES}


def cli(port: int, *command: str) -> str:
    out = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *command],
        capture_output=True,
        text=True,
        timeout=5,
    )
    return out.stdout.strip()


@pytest.fixture(scope="module")
def mocks(module_procs: Cluster) -> dict[str, Proc]:
    return {n: module_procs.mock(n) for n in NAMES}


def reset(mocks: dict[str, Proc], itl_ms: float) -> None:
    for m in mocks.values():
        control(m, reset_stats=True, ttft_ms=0, itl_ms=itl_ms, fail_status=0)


def config(mocks: dict[str, Proc]) -> dict[str, Any]:
    return {"backends": [backend(n, m) for n, m in mocks.items()]}


def start_routers(procs: Cluster, mocks: dict[str, Proc], envs: list[dict[str, str]]) -> list[Proc]:
    """One replica per env, started side by side."""
    routers = [procs.router(config(mocks), env=env, wait=False) for env in envs]
    for r in routers:
        wait_http(r.url + "/healthz", proc=r.popen)
    return routers


def stop_together(routers: list[Proc]) -> None:
    """SIGTERM to all, then wait: they drain side by side rather than one after another."""
    for r in routers:
        r.signal(signal.SIGTERM)
    for r in routers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.popen.wait(10)
        r.kill9()  # only if it has not exited: teardown, not a test of shutdown


def aclient(router: Proc) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=router.url + "/v1",
        api_key="k",
        max_retries=0,
        http_client=httpx.AsyncClient(timeout=httpx.Timeout(60, connect=10)),
    )


def registry_reaches(source: Proc, other: Proc, mock: Proc, name: str) -> float:
    """Seconds until a backend registered on `source` is routable by name on `other`."""
    record = backend(name, mock)

    tried: list[int] = []

    def registered() -> bool:
        # 503 `registry_unavailable`: the write missed SLUICEGATE_REDIS_TIMEOUT on a starved
        # host, and the admin client's answer is to try again; a 409 then means the timed-out
        # write had landed after all.
        r = admin(source, "POST", json=record)
        allowed = (201, 503, 409) if 503 in tried else (201, 503)
        assert r.status_code in allowed, r.text
        tried.append(r.status_code)
        return r.status_code != 503

    wait_for(registered, f"{name} registered on the first replica", STARVED_S, 0.2)
    return wait_for(
        lambda: name in {r["name"] for r in admin(other).json()},
        f"{name} on the other replica",
        5,
        0.1,
    )


def test_cluster_shares_counts_and_registry(module_procs: Cluster, mocks: dict[str, Proc]) -> None:
    nodes = module_procs.redis_cluster(3)
    reset(mocks, itl_ms=30)
    env = {**BASE_ENV, "SLUICEGATE_REDIS_URL": nodes[1].url, "SLUICEGATE_REDIS_CLUSTER": "true"}
    routers = start_routers(module_procs, mocks, [env, env])
    # ~4.5 s streams: the counts are compared while all 20 run, on a loaded host too.
    tokens = 150
    seen: dict[str, Any] = {}

    async def main() -> list[str | BaseException]:
        clients = [aclient(r) for r in routers]
        jobs = [asyncio.ensure_future(stream_text(c, tokens)) for c in clients for _ in range(10)]
        loop = asyncio.get_running_loop()

        def observe() -> None:
            wait_for(lambda: sum(running(mocks).values()) == 20, "20 streams running", 10, 0.1)
            with RedisCluster(host="127.0.0.1", port=nodes[0].port) as rc:

                def agree() -> bool:
                    seen.update(truth=running(mocks), redis=live_leases(rc))
                    seen["admin"] = [admin_counts(r) for r in routers]
                    # All 20 still running: counts that agree at 0 after the streams ended
                    # would prove nothing.
                    if sum(seen["truth"].values()) != 20:
                        raise AssertionError(f"streams ended before the counts agreed: {seen}")
                    return all(v == seen["truth"] for v in (seen["redis"], *seen["admin"]))

                wait_for(agree, "Redis, every admin API and the backends agree", 5, 0.1)

        await loop.run_in_executor(None, observe)
        out = await asyncio.gather(*jobs, return_exceptions=True)
        for c in clients:
            await c.close()
        return out

    results = asyncio.run(main())
    assert results == [expected_text(tokens)] * 20, [r for r in results if isinstance(r, Exception)]
    # Both replicas' picks went through the shared counts: an even spread over a and b.
    assert sorted(seen["truth"].values()) == [10, 10], seen
    # Every count key sits in the hash tag's one slot (the scripts' multi-key picks need it).
    slots = {cli(nodes[0].port, "CLUSTER", "KEYSLOT", "{sluicegate}:inflight:" + n) for n in NAMES}
    assert slots == {cli(nodes[0].port, "CLUSTER", "KEYSLOT", "sluicegate")}
    with RedisCluster(host="127.0.0.1", port=nodes[0].port) as rc:
        wait_for(lambda: live_leases(rc) == dict.fromkeys(NAMES, 0), "no lease left", 5, 0.1)
    # An admin change on one replica reaches the other through the Cluster (pub/sub + resync).
    registry_reaches(routers[0], routers[1], mocks["b"], "b-admin")
    logs = "".join(r.log() for r in routers)
    assert "counting locally" not in logs and "Traceback" not in logs
    stop_together(routers)


def test_sentinel_failover_under_load(module_procs: Cluster, mocks: dict[str, Proc]) -> None:
    master, replica, sentinels = module_procs.redis_sentinel("mymaster")
    reset(mocks, itl_ms=40)
    env = {
        **BASE_ENV,
        "SLUICEGATE_REDIS_SENTINELS": json.dumps([f"127.0.0.1:{s.port}" for s in sentinels]),
        "SLUICEGATE_REDIS_SENTINEL_MASTER": "mymaster",
    }
    routers = start_routers(module_procs, mocks, [env, env])
    # Longs run through the failover and are left by their clients once counts are checked: at
    # 40 ms a token they outlast every bound main() waits on before it counts them (3 x 30 s, the
    # counts' 3 lease TTLs, and a starved machine's stall), else they end first and the counts
    # agree at 0, which proves nothing.
    short_tokens = 4
    long_tokens = int((3 * 30 + 3 * LEASE_TTL + STARVED_S) / 0.040)

    def master_port() -> int:
        addr = cli(sentinels[0].port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster")
        return int(addr.split()[-1])

    assert master_port() == master.port

    async def main() -> dict[str, Any]:
        clients = [aclient(r) for r in routers]
        received: list[list[str]] = [[] for _ in range(8)]

        async def long_stream(c: openai.AsyncOpenAI, into: list[str]) -> None:
            stream = await c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                max_tokens=long_tokens,
            )
            async for chunk in stream:
                if chunk.choices:
                    into.append(chunk.choices[0].delta.content or "")

        longs = [
            asyncio.ensure_future(long_stream(clients[i % 2], into))
            for i, into in enumerate(received)
        ]
        results: list[tuple[float, str | BaseException]] = []
        stop = asyncio.Event()

        async def worker(c: openai.AsyncOpenAI) -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    results.append((t0, await stream_text(c, short_tokens)))
                except Exception as exc:
                    results.append((t0, exc))

        workers = [asyncio.ensure_future(worker(c)) for c in clients for _ in range(4)]
        loop = asyncio.get_running_loop()

        async def served(since: float) -> None:
            # As many requests as workers, started at `since` or later, came back (counted
            # rather than waited for: a loaded machine serves fewer in a given time).
            deadline = loop.time() + 30
            while sum(t0 >= since for t0, _ in results) < len(workers):
                assert loop.time() < deadline, f"traffic stalled: {len(results)} requests"
                await asyncio.sleep(0.05)

        await served(0.0)
        started = time.monotonic()
        assert (
            await loop.run_in_executor(
                None, cli, sentinels[0].port, "SENTINEL", "FAILOVER", "mymaster"
            )
            == "OK"
        )
        await loop.run_in_executor(
            None,
            lambda: wait_for(
                # A bound, not a figure: the sentinels' vote is slow on a loaded machine.
                lambda: master_port() == replica.port,
                "the replica promoted",
                30,
                0.1,
            ),
        )
        switched = time.monotonic()
        await served(switched)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), 30)
        quiet = time.monotonic()

        last: dict[str, Any] = {}

        def settled() -> bool:
            truth = running(mocks)
            with redis.Redis(host="127.0.0.1", port=replica.port) as new_master:
                leases = live_leases(new_master)
            last.update(truth=truth, leases=leases, admin=[admin_counts(r) for r in routers])
            return sum(truth.values()) == 8 and all(v == truth for v in (leases, *last["admin"]))

        try:
            await loop.run_in_executor(
                None, lambda: wait_for(settled, "counts true again", 3 * LEASE_TTL, 0.1)
            )
        except AssertionError:
            notes = [
                line
                for r in routers
                for line in r.log().splitlines()
                # The runner logs a chore's failures (the heartbeat's among them) as its own.
                if any(
                    f'"sluicegate.{name}"' in line for name in ("inflight", "registry", "runner")
                )
            ]
            where = master_port()
            raise AssertionError(
                f"counts never agreed: {last}; master now on {where} (new: {replica.port}); "
                f"{notes[-20:]}"
            ) from None
        true_after = time.monotonic() - quiet
        # A long stream that ended by now broke (they are far from their last token).
        failed_longs = [repr(t.exception()) for t in longs if t.done() and not t.cancelled()]
        for t in longs:  # the clients leave mid-stream: every lease must go, in the new master too
            t.cancel()
        await asyncio.gather(*longs, return_exceptions=True)

        def released() -> bool:
            with redis.Redis(host="127.0.0.1", port=replica.port) as new_master:
                leases = live_leases(new_master)
            idle = dict.fromkeys(NAMES, 0)
            return running(mocks) == leases == idle and all(
                admin_counts(r) == idle for r in routers
            )

        await loop.run_in_executor(
            None, lambda: wait_for(released, "every lease released", LEASE_TTL, 0.1)
        )
        for c in clients:
            await c.close()
        return {
            "results": results,
            "failed_longs": failed_longs,
            "longs": ["".join(r) for r in received],
            "failover_s": switched - started,
            "true_after": true_after,
        }

    out = asyncio.run(main())
    failures = [r for _, r in out["results"] if r != expected_text(short_tokens)]
    assert not failures, failures[:3]
    # Served before, through and after the switch (main() waited for as many before and after
    # as there are workers).
    assert len(out["results"]) >= 2 * 8, len(out["results"])
    assert out["failed_longs"] == [], out["failed_longs"]
    for text in out["longs"]:  # unbroken through the failover, up to where their clients left
        assert expected_text(long_tokens).startswith(text) and len(text) > 100, text
    # Counts in the new master, both routers and on the backends agree within the lease time
    # of the last request that raced the switch (a release sent to the old master is lost: that
    # lease expires), plus one poll of five processes on a loaded machine.
    assert out["true_after"] <= LEASE_TTL + 1.0, out
    # The registry follows the new master too (the subscriber reconnects through the sentinels).
    lag = registry_reaches(routers[1], routers[0], mocks["a"], "a-admin")
    assert "Traceback" not in "".join(r.log() for r in routers)
    stop_together(routers)
    print(
        f"\n{len(out['results'])} requests, 0 failed; failover took {out['failover_s']:.1f}s; "
        f"counts true {out['true_after']:.1f}s after the load stopped; "
        f"registry change seen in {lag:.2f}s"
    )


def make_tls_files(where: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1, made by the openssl CLI."""
    files = {n: where / f"{n}" for n in ("ca.key", "ca.crt", "srv.key", "srv.csr", "srv.crt")}
    ext = where / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca = ["-CA", files["ca.crt"], "-CAkey", files["ca.key"], "-CAcreateserial"]
    steps = [
        ["req", "-x509", *ec, "-keyout", files["ca.key"], "-out", files["ca.crt"], "-days", "1"],
        ["req", *ec, "-keyout", files["srv.key"], "-out", files["srv.csr"], "-subj", "/CN=redis"],
        ["x509", "-req", "-in", files["srv.csr"], *ca, "-out", files["srv.crt"], "-extfile", ext],
    ]
    steps[0] += ["-subj", "/CN=sluicegate-test-ca"]
    for step in steps:
        subprocess.run(["openssl", *map(str, step)], check=True, capture_output=True, timeout=30)
    return files


def test_tls_and_unix_socket_urls_share_one_count(
    module_procs: Cluster, mocks: dict[str, Proc]
) -> None:
    """One server reached two ways: a router over TLS and one over a unix socket see one count."""
    tls = make_tls_files(module_procs.tmp)
    tls_port, sock = free_port(), module_procs.tmp / "redis.sock"
    server = module_procs.redis_node(
        free_port(),
        *("--tls-port", str(tls_port), "--tls-auth-clients", "no"),
        *("--tls-cert-file", str(tls["srv.crt"]), "--tls-key-file", str(tls["srv.key"])),
        *("--tls-ca-cert-file", str(tls["ca.crt"])),
        *("--unixsocket", str(sock), "--unixsocketperm", "700"),
    )
    reset(mocks, itl_ms=50)
    urls = [f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={tls['ca.crt']}", f"unix://{sock}?db=0"]
    routers = start_routers(
        module_procs, mocks, [{**BASE_ENV, "SLUICEGATE_REDIS_URL": u} for u in urls]
    )
    held = []
    for r in routers:  # one stream through each
        c = openai.OpenAI(base_url=r.url + "/v1", api_key="k", max_retries=0)
        s = c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=200
        )
        next(iter(s))
        held.append(s)
    with redis.Redis(host="127.0.0.1", port=server.port) as plain:
        # Least-in-flight through shared counts: the second stream went to the other backend.
        wait_for(lambda: live_leases(plain) == {"a": 1, "b": 1}, "one lease on each", 5, 0.1)
        assert all(admin_counts(r) == {"a": 1, "b": 1} for r in routers)
        clients = plain.client_list()
        assert any(c["laddr"] == f"127.0.0.1:{tls_port}" for c in clients), clients
        assert any(c["laddr"].startswith(str(sock)) for c in clients), clients
        for s in held:
            s.close()
        wait_for(lambda: live_leases(plain) == dict.fromkeys(NAMES, 0), "no lease left", 5, 0.1)
    # The router closes the upstream stream before it releases the lease; the engine, another
    # process, sees the close when it next runs. Bounded below the stream's own length
    # (200 tokens at 50 ms): an upstream left open would still be generating then.
    wait_for(lambda: running(mocks) == dict.fromkeys(NAMES, 0), "the engines' streams ended", 5)
    stop_together(routers)


def test_registry_kept_across_the_key_rename(module_procs: Cluster) -> None:
    """Backends registered by a version that kept the registry under `sluicegate:registry:*` are
    still there after an upgrade: the hash-tagged keys are filled from the old ones, once."""
    server = module_procs.redis()
    record = {"config": {"name": "from-before", "url": "http://127.0.0.1:9", "models": ["m"]}}
    with redis.Redis.from_url(server.url) as old:
        old.hset("sluicegate:registry:records", "from-before", json.dumps(record))
        old.set("sluicegate:registry:version", 7)

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        first = RedisRecords(server.url)
        upgraded = await first.load()
        await first.change("from-before", lambda _: None)  # deleted after the upgrade
        await first.aclose()
        again = RedisRecords(server.url)  # the next start must not bring it back
        after_restart = await again.load()
        await again.aclose()
        return upgraded, after_restart

    upgraded, after_restart = asyncio.run(main())
    assert upgraded == {"from-before": record}
    assert after_restart == {}
    with redis.Redis.from_url(server.url) as r:  # replicas of the old version still read theirs
        assert r.hexists("sluicegate:registry:records", "from-before")


def test_redis_prefix_keeps_two_deployments_registries_apart(module_procs: Cluster) -> None:
    """Two deployments sharing one Redis under different `redis_prefix` values see only their own
    admin changes; one upgraded from a version that kept every prefix's records under the default
    keys finds its records there, once."""
    from router.core.redis_client import RedisConfig
    from router.core.runner import Runner
    from router.core.settings import Settings
    from router.ops.metrics import Metrics
    from router.stores import STORES, Wiring, build

    server = module_procs.redis()
    before = {"config": {"name": "old", "url": "http://127.0.0.1:9", "models": ["m"]}}
    with redis.Redis.from_url(server.url) as r:
        r.hset("{sluicegate:registry}:records", "old", json.dumps(before))
        r.set("{sluicegate:registry}:version", 3)
    blue = Settings(redis_url=server.url, redis_prefix="blue")
    green = Settings(redis_url=server.url, redis_prefix="green")
    default = Settings(redis_url=server.url)

    async def main() -> tuple[dict[str, Any], ...]:
        stores = [
            build(STORES.registry, Wiring(s, Metrics(), Runner(), RedisConfig.from_settings(s)))
            for s in (blue, green, default)
        ]
        try:
            b, g, d = stores
            adopted = await b.load()
            await g.load()
            await b.change("only-blue", lambda _: {"config": {"name": "only-blue"}})
            await g.change("old", lambda _: None)  # green removes its copy, not blue's
            return await b.load(), await g.load(), await d.load(), adopted
        finally:
            for store in stores:
                await store.aclose()

    blue_after, green_after, default_after, adopted = asyncio.run(main())
    assert adopted == {"old": before}
    assert set(blue_after) == {"old", "only-blue"}
    assert green_after == {}
    assert default_after == {"old": before}  # the default deployment keeps its own keys
