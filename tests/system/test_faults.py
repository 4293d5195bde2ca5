"""The fault suite: things break on purpose, and the router stays correct and bounded."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.harness import Cluster, Proc, backend, control, in_flight, stats
from tests.support.wait import wait_for


def test_upstream_killed_mid_stream(procs: Cluster) -> None:
    victim = procs.mock("victim", itl_ms=30, tokens=200)
    router = procs.router({"backends": [backend("victim", victim)]})
    seen = 0
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={"model": "m", "stream": True}, timeout=10
    ) as r:
        lines = r.iter_lines()
        events = []
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
                seen += 1
                if seen == 3:
                    victim.kill9()
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2].removeprefix("data: "))
    assert err["error"]["code"] == "upstream_mid_stream"
    assert in_flight(router) == 0


def test_sigterm_with_200_streams_in_flight(procs: Cluster) -> None:
    up = procs.mock("up", itl_ms=25, tokens=80)  # about 2 s per stream
    router = procs.router({"backends": [backend("up", up)], "drain_grace": 30})
    n = 200

    async def one(c: httpx.AsyncClient) -> tuple[int, str]:
        async with c.stream(
            "POST", router.url + "/v1/chat/completions", json={"model": "m", "stream": True}
        ) as r:
            body = (await r.aread()).decode()
        return body.count('"content":"tok'), body.rsplit("\n\n", 2)[-2]

    async def main() -> list[tuple[int, str]]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            tasks = [asyncio.create_task(one(c)) for _ in range(n)]
            # Polls another process (in a thread: the loop serves the streams meanwhile).
            # A mock busy with 200 streams on a loaded machine may answer slowly: each poll
            # waits as long as the whole wait may last, rather than fail on a slow answer.
            await asyncio.to_thread(
                wait_for,
                lambda: stats(up, timeout=20)["running"] >= n,
                f"{n} streams running",
                20,
                0.05,
            )
            assert stats(up, timeout=20)["running"] == n
            router.signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    bad = [
        (tokens, last[:200]) for tokens, last in results if tokens != 80 or last != "data: [DONE]"
    ]
    assert not bad, f"{len(bad)} of {n} streams did not end whole: {bad[:5]}"
    assert router.popen.wait(15) == 0


@pytest.mark.parametrize("itl_ms", [0, 1], ids=["at_once", "paced"])
def test_slow_client_memory_stays_bounded(procs: Cluster, itl_ms: int) -> None:
    # Paced, each token is its own upstream read, which the read callback writes to the client
    # itself while the client keeps up (router/core/client_link.py): it must stop when the
    # client's connection pushes back, as `send` does.
    up = procs.mock("fat")
    control(up, tokens=4000, pad_bytes=16 * 1024, itl_ms=itl_ms)  # 64 MB if nobody pushed back
    router = procs.router({"backends": [backend("fat", up)]})
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", router.port))
    body = b'{"model": "m", "stream": true}'
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n"
        b"x-request-id: slow-reader\r\n\r\n%s" % (len(body), body)
    )
    for _ in range(4):  # a client reading one byte a second
        s.recv(1)
        time.sleep(1)
    rec = next(r for r in stats(up)["recent"] if r["request_id"] == "slow-reader")
    generated_mb = rec["tokens"] * 16 / 1024
    s.close()
    # Kernel socket buffers plus the router's read high-water mark hold a few MB at most: the
    # rest is held back in the backend, not in the router (whose RSS the benchmark measures).
    assert generated_mb < 24, generated_mb
    wait_for(lambda: stats(up)["running"] == 0, "the backend stopped", 5, 0.05)
    assert in_flight(router) == 0


@pytest.fixture(scope="module")
def fuzz_target(module_procs: Cluster) -> Proc:
    up = module_procs.mock("fuzz", tokens=3)
    return module_procs.router(
        {"backends": [backend("fuzz", up, ["m", "other"])], "max_body_bytes": 65536}
    )


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_bodies = st.one_of(
    st.binary(max_size=300),
    st.dictionaries(
        st.sampled_from(["model", "stream", "messages", "prompt", "input", "max_tokens", "n"]),
        st.one_of(_json_values, st.sampled_from(["m", "other", "nope", ""])),
        max_size=6,
    ).map(lambda d: json.dumps(d).encode()),
    st.integers(1, 3000).map(lambda n: b'{"model": "m", "x": ' + b"[" * n + b"]" * n + b"}"),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(
        [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/embeddings",
            "/v1/models",
            "/v1/nope",
            "/admin/backends",
        ]
    ),
    method=st.sampled_from(["POST", "GET", "PUT"]),
    body=_bodies,
    ctype=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded"]),
)
def test_fuzzed_requests_never_500_or_leak(
    fuzz_target: Proc, path: str, method: str, body: bytes, ctype: str
) -> None:
    r = httpx.request(
        method, fuzz_target.url + path, content=body, headers={"content-type": ctype}, timeout=10
    )
    assert r.status_code < 500, (r.status_code, r.text[:300])
    assert "Traceback" not in r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["type"]


def test_fuzzing_left_nothing_in_flight(fuzz_target: Proc) -> None:
    assert in_flight(fuzz_target) == 0


def test_huge_body_is_413_and_the_router_goes_on(fuzz_target: Proc) -> None:
    """The body is refused past `max_body_bytes` (the memory it may cost is measured by the
    benchmark, not asserted here on a shared machine)."""

    def gen():  # type: ignore[no-untyped-def]
        yield b'{"model": "m", "x": "'
        for _ in range(200):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(fuzz_target.url + "/v1/chat/completions", content=gen(), timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(fuzz_target.url + "/healthz", timeout=10).status_code == 200
    assert in_flight(fuzz_target) == 0
