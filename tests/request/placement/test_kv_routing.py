"""Precise prefix routing end to end on the mock: two mock vLLM engines publishing KV events
(one in vLLM's map encoding, one in the older array encoding) on ipc paths, discovered from their
`GET /kv_event_sources`; a real router tokenizing through the engines' `/tokenize`.

Traffic the router never sees (a client straight to an engine) fills that engine's cache, and
the router sends the prefix there (the engine reports it cached); after the engine's cache is
reset (AllBlocksCleared) and the other one gets the prefix, the choice moves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.harness import STARVED_S, Cluster, Proc, backend, control
from tests.support.wait import wait_for

ENGINE = ["--engine", "--max-num-seqs", "16", "--kv-tokens", "8192", "--decode-ms", "2"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    run = Path(tmp_path_factory.mktemp("kv"))
    c = Cluster()
    try:
        mocks = {
            "a": c.mock("a", engine_args=[*ENGINE, "--kv-events", f"ipc://{run}/a.sock"]),
            "b": c.mock(
                "b",
                engine_args=[
                    *ENGINE,
                    "--kv-events",
                    f"ipc://{run}/b.sock",
                    "--kv-events-encoding",
                    "array",
                ],
            ),
        }
        router = c.router(
            {
                "backends": [backend(n, m, kv_events={}) for n, m in mocks.items()],
                "balancer": "cache_aware",
                "affinity": {"tokenizers": {"m": {"via": "engine"}}},
                # A stale reading takes its engine out of the weighing, holder or not: kept
                # fresh for longer than a starved machine's scrape can take.
                "engine_metrics": {"interval": 0.1, "timeout": STARVED_S, "stale_after": 60},
                "expose_backend_header": True,
                "health": {"interval": 60},
            }
        )
        yield {**mocks, "router": router}
    finally:
        c.close()


def chat(base: str, text: str, model: str) -> tuple[str | None, int]:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": "q"}],
        "max_tokens": 2,
    }
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=20)
    r.raise_for_status()
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return r.headers.get("x-sluicegate-backend"), int(details.get("cached_tokens") or 0)


def kv_rows(router: Proc) -> dict[str, Any]:
    rows = httpx.get(router.url + "/admin/backends", timeout=STARVED_S).json()
    return {r["name"]: r["kv_events_state"] for r in rows}


def idle_readings(router: Proc) -> None:
    """Until the router reads both engines fresh and idle: a reading taken while the direct
    request ran shows its engine busy with its KV in use, a fair reason to copy the prefix
    elsewhere (a machine at load average 10 routed one to `a` that way)."""

    def idle() -> bool:
        rows = httpx.get(router.url + "/admin/backends", timeout=STARVED_S).json()
        return all(
            (e := r["engine"]) and not e["stale"] and e["running"] == 0 and e["waiting"] == 0
            for r in rows
        )

    wait_for(idle, "the router reads both engines idle")


def test_hidden_traffic_and_a_reset_move_the_routers_choice(fleet: dict[str, Proc]) -> None:
    router, a, b = fleet["router"], fleet["a"], fleet["b"]
    doc = "You answer for ACME; cite policy sections precisely. " * 80  # ~4k chars, 1k tokens
    wait_for(
        lambda: all(r is not None and r["publishers"] for r in kv_rows(router).values()),
        "a's and b's event feeds found",
    )
    # Straight to b (a client the router never sees): b's events tell the router.
    assert chat(b.url, doc, "mock-model") == (None, 0)
    wait_for(lambda: kv_rows(router)["b"]["blocks"] > 0, "b's blocks indexed")
    assert kv_rows(router)["b"]["state"] == "live"  # its first batch was seq 0
    for _ in range(3):
        idle_readings(router)
        name, cached = chat(router.url, doc, "m")
        assert name == "b" and cached > 0
    text = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    assert 'reason="prefix_exact"' in text and 'sluicegate_kv_events_total{backend="b"' in text
    assert 'sluicegate_kv_index_blocks{backend="b"}' in text

    # b forgets everything (vLLM's reset_prefix_cache publishes AllBlocksCleared), a learns it.
    control(b, reset_prefix_cache=True)
    wait_for(lambda: kv_rows(router)["b"]["blocks"] == 0, "b's index cleared")
    chat(a.url, doc, "mock-model")
    wait_for(lambda: kv_rows(router)["a"]["blocks"] > 0, "a's blocks indexed")
    idle_readings(router)
    name, cached = chat(router.url, doc, "m")
    assert name == "a" and cached > 0
    status = kv_rows(router)["a"]
    assert status["events"]["BlockStored"] >= 1 and status["lag_seconds"] is not None


def test_a_request_counts_on_its_engine_until_it_ends(fleet: dict[str, Proc]) -> None:
    """While a request runs, its prompt's blocks count as held on its engine (so a second one
    joins it); when it ends, also by the client leaving mid-stream, nothing of it stays."""
    router = fleet["router"]
    wait_for(
        lambda: all(r is not None and r["publishers"] for r in kv_rows(router).values()),
        "a's and b's event feeds found",
    )
    # A feed is live from its engine's first batch: a prompt of whole blocks straight to each (a
    # shorter one stores no block, so publishes nothing), so this test does not lean on the one
    # before it for that (alone, no request was counted on a feed not yet live).
    for name in ("a", "b"):
        chat(fleet[name].url, f"First whole blocks for {name}. " * 40, "mock-model")
    wait_for(
        lambda: all(r["state"] == "live" for r in kv_rows(router).values()),
        "a's and b's feeds live",
    )
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Spell out the policy, slowly. " * 60}],
        "max_tokens": 400,
        "stream": True,
    }
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=20) as r:
        name = r.headers["x-sluicegate-backend"]
        lines = r.iter_lines()
        next(lines)  # its first event: answered, so nothing of it is pending
        row = kv_rows(router)[name]
        assert row["in_flight_blocks"] > 0 and row["pending_tokens"] == 0
    wait_for(
        lambda: all(
            (s["in_flight_blocks"], s["pending_tokens"]) == (0, 0) for s in kv_rows(router).values()
        ),
        "its flight ended",
    )


def test_the_engines_tokenize_on_one_that_is_up(fleet: dict[str, Proc]) -> None:
    """`via: engine`: a backend that is down (first in the list, its events not live) does not
    take precise routing with it: the prompt is tokenized on one whose events are live."""
    import asyncio

    from router.request.placement.affinity import RequestAffinity
    from tests.support.kv_affinity import engine_affinity, engine_backend

    down, up = engine_backend("down", "http://127.0.0.1:9"), engine_backend("up", fleet["b"].url)
    affinity = engine_affinity([down, up], live=["up"])
    payload = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}

    async def tokens() -> list[int] | None:
        request = RequestAffinity([], None)
        for _ in range(3):  # every turn, not one lucky one
            got = await affinity.with_tokens(request, "m", payload, [down, up])
            if got.tokens is None:
                return None
        return got.tokens

    ids = asyncio.run(tokens())
    assert ids and all(type(t) is int for t in ids)


def test_a_seen_system_prompt_costs_no_tokenize_round_trip(fleet: dict[str, Proc]) -> None:
    """`via: engine`: a system prompt's first request is tokenized whole and its earlier
    messages alone, at once (a conversation's only on its second request); a later one with
    another last message takes what those render to (the engine's own ids) without asking."""
    import asyncio

    from router.request.placement.affinity import RequestAffinity
    from router.request.placement.token_memo import MARGIN
    from tests.support.kv_affinity import engine_affinity, engine_backend

    b = engine_backend("b", fleet["b"].url)
    affinity = engine_affinity([b], live=["b"])
    tk = affinity._tokenizers["m"]
    asked: list[dict[str, Any]] = []
    real = tk.tokens

    async def counted(payload: dict[str, Any], *args: Any) -> list[int] | None:
        asked.append(payload)
        return await real(payload, *args)

    tk.tokens = counted  # type: ignore[method-assign]
    system = "Answer as the ACME support desk; quote the policy. " * 40  # ~2k chars
    history = [
        {"role": "user", "content": "My parcel is late."},
        {"role": "assistant", "content": "Sorry to hear it; which order?"},
    ]

    def payload(question: str, turns: list[dict[str, str]] | None = None) -> dict[str, Any]:
        return {
            "model": "m",
            "messages": [
                {"role": "system", "content": system},
                *(turns or []),
                {"role": "user", "content": question},
            ],
        }

    async def ask(body: dict[str, Any]) -> tuple[RequestAffinity, int]:
        before = len(asked)
        got = await affinity.with_tokens(RequestAffinity([], None), "m", body, [b])
        return got, len(asked) - before

    async def go() -> list[tuple[RequestAffinity, int, list[int] | None]]:
        out = []
        for body in (
            payload("hi?"),  # a system prompt: learned by its first request
            payload("Where is my parcel, please?"),
            payload("And then?", history),  # a conversation so far: by its second
            payload("Order 17.", history),
            payload("Order 18, sorry.", history),
        ):
            got, calls = await ask(body)
            out.append((got, calls, await real(body, b, "mock-model")))
        return out

    runs = asyncio.run(go())
    assert [calls for _, calls, _ in runs] == [2, 0, 1, 2, 0]
    assert asked[1]["messages"] == payload("hi?")["messages"][:1]  # the earlier messages alone
    assert asked[1]["add_generation_prompt"] is False
    for i, (got, _, whole) in enumerate(runs):
        assert whole is not None and got.tokens is not None
        if i in (1, 4):  # from the memo: the engine's own ids of the earlier messages
            assert got.length is not None
            assert len(whole) - 8 * MARGIN <= len(got.tokens) < len(whole)
            assert whole[: len(got.tokens)] == got.tokens
            assert len(whole) <= got.length <= len(whole) + 2 * MARGIN  # estimated
        else:  # asked: the whole prompt's own ids
            assert got.tokens == whole and got.length is None
