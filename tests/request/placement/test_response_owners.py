"""Stored responses belong to the client key that made them (issue 46, case 4): another key gets
OpenAI's 404 for GET, cancel and `previous_response_id` (with one engine too, where an unknown
id would pass), an id reused on another engine (vLLM takes a client's request id) does not
replace the owner's binding, each key keeps at most `response_ids.max_per_key`, and without
client keys everything has one owner. Two mock engines, redis-server, two router replicas
sharing it and single-engine routers; the official openai SDK as the client."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest
import redis

from router.request.placement.response_ids import owner_of
from tests.support.harness import STARVED_S, Cluster, Proc, backend, sha, stats

A = "sk-owner-a-0123456789"
B = "sk-owner-b-0123456789"
C = "sk-owner-c-0123456789"
CAP = 3


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    c = module_procs
    a, b = c.mock("a", tokens=2), c.mock("b", tokens=2)
    server = c.redis()
    keys = [{"sha256": sha(k), "name": n} for k, n in ((A, "a"), (B, "b"), (C, "c"))]
    shared = {
        "backends": [backend("a", a), backend("b", b)],
        "balancer": "round_robin",
        "api_keys": keys,
        "response_ids": {"max_per_key": CAP},
        # Redis must answer for the owners to be shared: the 50 ms default is a serving
        # budget, and a loaded test machine can miss it (the store then keeps ids locally).
        "redis_timeout": 1.0,
    }
    env = {"SLUICEGATE_REDIS_URL": server.url}
    r1 = c.router(shared, env=env)
    r2 = c.router(shared, env=env)
    one = c.router({"backends": [backend("a", a)], "api_keys": keys})
    anon = c.router({"backends": [backend("a", a)], "response_ids": {"max_per_key": 2}})
    return {"a": a, "b": b, "redis": server, "r1": r1, "r2": r2, "one": one, "anon": anon}


def oai(router: Proc, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=20)


def create(router: Proc, key: str, secret: str, request_id: str | None = None, **extra: Any) -> str:
    headers = {"x-request-id": request_id} if request_id else None
    made = oai(router, key).responses.create(
        model="m",
        input="hello",
        instructions=secret,
        max_output_tokens=2,
        extra_headers=headers,
        **extra,
    )
    return made.id


def instructions(router: Proc, key: str, response_id: str) -> str | None:
    return oai(router, key).responses.retrieve(response_id).instructions


def assert_not_found(error: openai.NotFoundError, secret: str) -> None:
    body = error.body
    assert isinstance(body, dict) and body["code"] == "response_not_found"
    assert error.response.json()["error"]["type"] == "invalid_request_error"
    assert secret not in error.response.text


def engine_calls(fleet: dict[str, Proc], response_id: str) -> int:
    """Requests the engines saw that name the response: GETs, cancels and continuations."""
    return sum(
        1
        for name in ("a", "b")
        for r in stats(fleet[name])["recent"]
        if response_id in (r.get("response_id"), r.get("previous_response_id"))
    )


def test_another_key_gets_404_for_get_cancel_and_continuation(fleet: dict[str, Proc]) -> None:
    secret = f"A's private instructions {uuid.uuid4().hex}"
    response_id = create(fleet["r1"], A, secret)
    seen = engine_calls(fleet, response_id)
    for router in (fleet["r1"], fleet["r2"]):  # this process's map, and Redis's
        other = oai(router, B)
        with pytest.raises(openai.NotFoundError) as got:
            other.responses.retrieve(response_id)
        assert_not_found(got.value, secret)
        with pytest.raises(openai.NotFoundError) as got:
            other.responses.cancel(response_id)
        assert_not_found(got.value, secret)
        with pytest.raises(openai.NotFoundError) as got:
            other.responses.create(
                model="m", input="go on", max_output_tokens=2, previous_response_id=response_id
            )
        assert_not_found(got.value, secret)
    assert engine_calls(fleet, response_id) == seen  # none of them reached an engine
    # The owner reaches it from either replica.
    assert instructions(fleet["r1"], A, response_id) == secret
    assert instructions(fleet["r2"], A, response_id) == secret
    more = oai(fleet["r2"], A).responses.create(
        model="m", input="go on", max_output_tokens=2, previous_response_id=response_id
    )
    assert more.previous_response_id == response_id


def test_with_one_engine_another_key_cannot_continue_either(fleet: dict[str, Proc]) -> None:
    """One engine: an id the router does not know goes to it, but another key's does not."""
    router = fleet["one"]
    secret = f"A's one-engine instructions {uuid.uuid4().hex}"
    response_id = create(router, A, secret)
    with pytest.raises(openai.NotFoundError) as got:
        oai(router, B).responses.create(
            model="m", input="go on", max_output_tokens=2, previous_response_id=response_id
        )
    assert_not_found(got.value, secret)
    with pytest.raises(openai.NotFoundError):
        oai(router, B).responses.retrieve(response_id)
    assert instructions(router, A, response_id) == secret


def test_an_id_reused_on_another_engine_does_not_replace_the_owners(
    fleet: dict[str, Proc],
) -> None:
    r1 = fleet["r1"]
    request_id = f"reuse-{uuid.uuid4().hex[:12]}"
    secret = f"the owner's {uuid.uuid4().hex}"
    response_id = create(r1, A, secret, request_id)
    # The same request id through the same replica: round robin puts it on the other engine,
    # which stores a response under the same id.
    planted = create(r1, B, "planted", request_id)
    assert planted == response_id
    held = {
        name: httpx.get(fleet[name].url + f"/v1/responses/{response_id}", timeout=STARVED_S).json()
        for name in ("a", "b")
    }
    assert sorted(h["instructions"] for h in held.values()) == sorted([secret, "planted"])
    for router in (r1, fleet["r2"]):
        assert instructions(router, A, response_id) == secret
        with pytest.raises(openai.NotFoundError):
            oai(router, B).responses.retrieve(response_id)
    # The owner's own reuse of an id on the other engine does not move it either.
    request_id = f"reuse-{uuid.uuid4().hex[:12]}"
    first = create(r1, A, "first", request_id)
    assert create(r1, A, "second", request_id) == first  # on the other engine
    for router in (r1, fleet["r2"]):
        assert instructions(router, A, first) == "first"


def test_each_key_keeps_at_most_max_per_key(fleet: dict[str, Proc]) -> None:
    made = [create(fleet["r1"], C, f"c{i}") for i in range(CAP + 1)]
    kept_by_a = create(fleet["r1"], A, "a's")
    for router in (fleet["r1"], fleet["r2"]):
        with pytest.raises(openai.NotFoundError):  # the key's oldest is forgotten
            oai(router, C).responses.retrieve(made[0])
        for i, response_id in enumerate(made[1:], 1):
            assert instructions(router, C, response_id) == f"c{i}"
        assert instructions(router, A, kept_by_a) == "a's"  # another key's are not touched
    store = redis.Redis.from_url(fleet["redis"].url)
    assert store.zcard(f"sluicegate:resp-owner:{owner_of(sha(C))}") == CAP
    assert not store.exists(f"sluicegate:resp:{made[0]}")
    # What Redis holds names no key, nor the hash that identifies it in the config.
    for name in store.scan_iter("sluicegate:resp*"):
        value = store.get(name) if store.type(name) == b"string" else b""
        for key in (A, B, C):
            assert key.encode() not in name + (value or b"")
            assert sha(key).encode() not in name + (value or b"")


def test_without_client_keys_everything_has_one_owner(fleet: dict[str, Proc]) -> None:
    router = fleet["anon"]
    made = [create(router, "none", f"anon{i}") for i in range(3)]
    with pytest.raises(openai.NotFoundError):  # max_per_key 2 here: the oldest is forgotten
        oai(router).responses.retrieve(made[0])
    assert instructions(router, "other", made[2]) == "anon2"  # any caller is that one owner
    more = oai(router).responses.create(
        model="m", input="go on", max_output_tokens=2, previous_response_id=made[1]
    )
    assert more.previous_response_id == made[1]
