"""Migration end to end: mock engines that die mid-answer, a real router, the openai SDK.

The mocks fail at answer positions (`fail_at`: before token k of the whole answer, counted across
a continuation), so which backend serves which part does not matter: a stream that dies at token
10 of 40 must reach the client as the same 40 tokens an uninterrupted run gives, in one stream.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.harness import STARVED_S, Cluster, Proc, backend, control, in_flight, stats
from tests.support.wait import wait_for

MSG = [{"role": "user", "content": "tell me a long story"}]
TOKEN = "migration-admin-token"


def expected(n: int, start: int = 0) -> str:
    return "".join(f"tok{i} " for i in range(start, n))


def metric(router: Proc, name: str, **labels: str) -> float:
    page = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    total = 0.0
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def sdk(router: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    mocks = {n: module_procs.mock(n, tokens=40) for n in ("a", "b", "c")}
    router = module_procs.router(
        {
            # Each backend names the model its own way: the client must see the first one's.
            "backends": [
                backend(n, m, {"m": f"model-{n}", "solo": f"model-{n}"}) for n, m in mocks.items()
            ],
            "balancer": "round_robin",
            # No plain retries: what goes on after a failure here is migration's doing.
            "retries": {"attempts": 1},
            "outlier": {"consecutive_failures": 1000},
            "migration": {"models": {"solo": {"enabled": False}}},
        }
    )
    return {**mocks, "router": router}


@pytest.fixture(autouse=True)
def _reset(fleet: dict[str, Proc]) -> None:
    for name in ("a", "b", "c"):
        control(fleet[name], reset_stats=True, fail_at=[], fail_how="close", fresh_ids=True)


def stream_chat(router: Proc, **extra: Any) -> tuple[str, list[Any]]:
    chunks = list(
        sdk(router).chat.completions.create(
            model="m", messages=MSG, stream=True, max_tokens=40, **extra
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def set_all(fleet: dict[str, Proc], **changes: Any) -> None:
    for name in ("a", "b", "c"):
        control(fleet[name], **changes)


def requests_seen(fleet: dict[str, Proc]) -> int:
    return sum(stats(fleet[n])["requests"] for n in ("a", "b", "c"))


@pytest.mark.parametrize("how", ["close", "error", "finish_error"])
def test_a_stream_that_dies_at_10_of_40_reaches_the_client_whole(
    fleet: dict[str, Proc], how: str
) -> None:
    router = fleet["router"]
    whole, _ = stream_chat(router, stream_options={"include_usage": True})
    assert whole == expected(40)
    ok = metric(router, "sluicegate_migrations_total", model="m", result="ok")

    set_all(fleet, fail_at=[10], fail_how=how, reset_stats=True)
    text, chunks = stream_chat(router, stream_options={"include_usage": True})
    assert text == whole  # stitched: nothing lost, nothing twice
    assert requests_seen(fleet) == 2  # the first engine's 10 tokens, then the continuation
    # One stream: every chunk carries the first chunk's id, created and model.
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    assert chunks[0].model.startswith("model-")
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant"]
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 40
    # The prompt counted once, as an uninterrupted run counts it.
    assert usage.prompt_tokens == max(1, len(MSG[0]["content"]) // 4)
    assert metric(router, "sluicegate_migrations_total", model="m", result="ok") == ok + 1


def test_completions_continue_from_the_prompt_plus_the_text(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    set_all(fleet, fail_at=[10])
    chunks = list(
        sdk(router).completions.create(model="m", prompt="once upon ", stream=True, max_tokens=40)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected(40)
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_second_failure_migrates_again(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    set_all(fleet, fail_at=[10, 20])
    text, chunks = stream_chat(router)
    assert text == expected(40)
    assert requests_seen(fleet) == 3
    assert len({c.id for c in chunks}) == 1


def test_the_limit_reached_ends_with_an_error_event(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    limit = metric(router, "sluicegate_migrations_total", model="m", result="limit")
    set_all(fleet, fail_at=[10, 20, 30])
    text = ""
    with pytest.raises(openai.APIError) as caught:
        for c in sdk(router).chat.completions.create(
            model="m", messages=MSG, stream=True, max_tokens=40
        ):
            if c.choices:
                text += c.choices[0].delta.content or ""
    assert text == expected(30)  # each token once, up to where the third engine died
    assert "Not migrated: it broke after 2 migrations" in str(caught.value)
    assert metric(router, "sluicegate_migrations_total", model="m", result="limit") == limit + 1


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"n": 2}, "it asks for n > 1"),
        ({"logprobs": True}, "it asks for logprobs"),
        ({"response_format": {"type": "json_object"}}, "it asks for structured output"),
    ],
)
def test_what_must_not_migrate_ends_as_before_and_says_why(
    fleet: dict[str, Proc], extra: dict[str, Any], why: str
) -> None:
    router = fleet["router"]
    set_all(fleet, fail_at=[10])
    text = ""
    with pytest.raises(openai.APIError) as caught:
        for c in sdk(router).chat.completions.create(
            model="m", messages=MSG, stream=True, max_tokens=40, **extra
        ):
            if c.choices:
                text += c.choices[0].delta.content or ""
    assert text == expected(10)
    assert f"Not migrated: {why}." in str(caught.value)
    assert requests_seen(fleet) == 1


def test_a_model_with_migration_off_ends_as_before(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    set_all(fleet, fail_at=[10])
    text = ""
    with pytest.raises(openai.APIError) as caught:
        for c in sdk(router).chat.completions.create(
            model="solo", messages=MSG, stream=True, max_tokens=40
        ):
            if c.choices:
                text += c.choices[0].delta.content or ""
    assert text == expected(10)
    assert "Not migrated" not in str(caught.value)
    assert requests_seen(fleet) == 1


def test_tokens_total_counts_what_the_client_got_and_the_prompt_once(
    fleet: dict[str, Proc],
) -> None:
    router = fleet["router"]
    labels = {"key": "unnamed", "model": "m"}
    before = {
        kind: metric(router, "sluicegate_tokens_total", kind=kind, **labels)
        for kind in ("prompt", "completion")
    }
    set_all(fleet, fail_at=[10, 20])
    text, _ = stream_chat(router)  # usage not asked: the router asks for it and hides it
    received = text.count("tok")
    assert received == 40
    after = {
        kind: metric(router, "sluicegate_tokens_total", kind=kind, **labels)
        for kind in ("prompt", "completion")
    }
    assert after["completion"] - before["completion"] == received
    assert after["prompt"] - before["prompt"] == max(1, len(MSG[0]["content"]) // 4)
    assert in_flight(router) == 0
    assert all(stats(fleet[n])["running"] == 0 for n in ("a", "b", "c"))


def test_a_whole_answer_lost_mid_generation_is_served_elsewhere(
    procs: Cluster, fleet: dict[str, Proc]
) -> None:
    victim, other = procs.mock("victim", tokens=40, itl_ms=20), fleet["a"]
    router = procs.router(
        {
            # The victim is picked first (smooth weighted round robin, 1000:1).
            "backends": [backend("victim", victim, weight=1000), backend("other", other)],
            "balancer": "round_robin",
            "retries": {"attempts": 1},  # no plain retry: migration re-sends it
        }
    )
    got: dict[str, Any] = {}

    def ask() -> None:
        answer = sdk(router).chat.completions.create(model="m", messages=MSG, max_tokens=40)
        got["text"] = answer.choices[0].message.content

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    wait_for(lambda: stats(victim)["running"] >= 1, "the victim got the request")
    time.sleep(0.1)
    victim.kill9()  # as an engine OOM-killed mid-generation
    asking.join(15)
    assert got.get("text") == expected(40)
    assert stats(other)["requests"] == 1
    assert metric(router, "sluicegate_migrations_total", model="m", result="ok") == 1
    assert in_flight(router) == 0


def test_deleting_a_backend_moves_streams_that_outlive_its_grace(
    procs: Cluster, fleet: dict[str, Proc]
) -> None:
    a, b = fleet["a"], fleet["b"]
    set_all(fleet, itl_ms=20, tokens=60)
    router = procs.router(
        {
            "backends": [backend("a", a), backend("b", b)],
            "drain_grace": 0.3,
            "expose_backend_header": True,
        },
        env={"SLUICEGATE_ADMIN_TOKEN": TOKEN},
    )
    got: dict[str, Any] = {}
    started = threading.Event()

    def read() -> None:
        stream = sdk(router).chat.completions.with_raw_response.create(
            model="m", messages=MSG, stream=True, max_tokens=60
        )
        got["backend"] = stream.headers["x-sluicegate-backend"]
        started.set()
        got["text"] = "".join(c.choices[0].delta.content or "" for c in stream.parse() if c.choices)

    try:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert started.wait(10)
        time.sleep(0.1)
        removed = httpx.delete(
            f"{router.url}/admin/backends/{got['backend']}",
            headers={"authorization": f"Bearer {TOKEN}"},
            timeout=10,
        )
        assert removed.status_code == 200, removed.text
        reader.join(15)
    finally:
        set_all(fleet, itl_ms=0, tokens=40)
    assert got.get("text") == expected(60)  # 60 tokens take 1.2 s: well past the 0.3 s grace
    gone, kept = (a, b) if got["backend"] == "a" else (b, a)
    kept_name = "b" if got["backend"] == "a" else "a"
    assert stats(gone)["aborted"] == 1 and stats(kept)["completed"] == 1
    assert metric(router, "sluicegate_migrations_total", model="m", result="ok") == 1
    rows = httpx.get(
        router.url + "/admin/backends", headers={"authorization": f"Bearer {TOKEN}"}, timeout=5
    ).json()
    assert [(r["name"], r["in_flight"]) for r in rows] == [(kept_name, 0)]
