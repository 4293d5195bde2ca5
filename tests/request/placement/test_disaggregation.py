"""Prefill/decode disaggregation end to end: real mock engines speaking NIXL's and SGLang's
handoff (router/tools/mock/handoff.py), a real router, the openai SDK as the client.

Every rule of router/request/placement/pd.py: the two legs' bodies and request id, D's stream byte
for byte, short and cached prompts served whole, params never reused, phase 1 retried on another
prefill engine, a refused handoff redone with fresh params, a client leaving in phase 1, no
prefill engine left, tokens counted once, the metrics; then SGLang's bootstrap.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from balancers.disaggregation import decide
from router.discovery.kubernetes import _slice_endpoints
from router.discovery.reconcile import Endpoint
from router.request.placement.pd import PREFILL_PARAMS, BadPrefillAnswer, transfer_params
from tests.support.harness import STARVED_S, Cluster, Proc, backend, control, in_flight, stats
from tests.support.wait import wait_for

FAIL_DELAY_MS = 200  # the mock decode's 500 after a failed pull (vLLM's is ~5 s)
MIN_UNCACHED = 256
LONG = "word " * 400  # ~500 prompt tokens with the chat JSON around it (the mock: 4 chars each)
SHORT = "hi"
TOKENS = 6


def pd_mock(procs: Cluster, name: str, role: str, *extra: str, **kw: Any) -> Proc:
    return procs.mock(
        name,
        tokens=TOKENS,
        engine_args=["--kv-role", role, "--kv-fail-delay-ms", str(FAIL_DELAY_MS), *extra],
        **kw,
    )


def pd_router(
    procs: Cluster, prefill: list[tuple[str, Proc]], decode: list[tuple[str, Proc]], **cfg: Any
) -> Proc:
    backends = [
        backend(n, m, role="prefill", **({"weight": 1000} if i == 0 else {"weight": 0.01}))
        for i, (n, m) in enumerate(prefill)
    ] + [backend(n, m, role="decode") for n, m in decode]
    return procs.router(
        {
            "backends": backends,
            "disaggregation": {"min_uncached_tokens": MIN_UNCACHED},
            "outlier": {"consecutive_failures": 100},
            "health": {"interval": 30},
            **cfg,
        }
    )


def sdk(router: Proc, timeout: float = 20) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0, timeout=timeout)


def text_of(n: int) -> str:
    return "".join(f"tok{i} " for i in range(n))


def chat(router: Proc, content: str, rid: str, stream: bool = True) -> str:
    client = sdk(router)
    messages = [{"role": "user", "content": content}]
    if stream:
        s = client.chat.completions.create(
            model="m", messages=messages, stream=True, extra_headers={"x-request-id": rid}
        )
        return "".join(c.choices[0].delta.content or "" for c in s if c.choices)
    r = client.chat.completions.create(
        model="m", messages=messages, extra_headers={"x-request-id": rid}
    )
    return r.choices[0].message.content or ""


def legs(mock: Proc, rid: str) -> list[dict[str, Any]]:
    return [r for r in stats(mock)["recent"] if r["request_id"] == rid]


def handoff(mock: Proc) -> dict[str, Any]:
    return dict(stats(mock)["handoff"])


def router_metric(router: Proc, name: str, **labels: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_decider_splits_only_an_uncached_remainder_long_enough() -> None:
    assert decide(1500, 0, 512, True).split
    assert decide(1500, 1000, 512, True).reason == "cached"  # 500 left: computed on D
    assert decide(300, 0, 512, True).reason == "short"
    assert decide(1500, 0, 512, False).reason == "no_prefill"
    assert decide(1500, 0, 512, True, client_params=True).reason == "client_params"
    assert decide(512, 0, 512, True).split  # at the threshold


def test_discovery_reads_the_role_from_the_slice_label() -> None:
    def sl(labels: dict[str, str]) -> dict[str, Any]:
        return {"metadata": {"labels": labels}, "endpoints": [{"addresses": ["10.0.0.1"]}]}

    assert _slice_endpoints(sl({"llm-d.ai/role": "prefill"}), 8000)[0] == [
        Endpoint("10.0.0.1", 8000, True, "prefill")
    ]
    assert _slice_endpoints(sl({"tier": "decode"}), 8000, "tier")[0][0].role == "decode"
    assert _slice_endpoints(sl({"llm-d.ai/role": "bogus"}), 8000)[0][0].role is None
    assert _slice_endpoints(sl({}), 8000)[0][0].role is None


def test_long_prompt_goes_through_prefill_then_decode_byte_for_byte(
    pair: tuple[Proc, Proc, Proc],
) -> None:
    p, d, router = pair
    split = router_metric(router, "sluicegate_disaggregated_requests_total", result="disaggregated")
    prefills = router_metric(router, "sluicegate_prefill_seconds_count", backend="p")
    ttft_split = router_metric(router, "sluicegate_ttft_seconds_count", path="disaggregated")
    ttft_direct = router_metric(router, "sluicegate_ttft_seconds_count", path="direct")
    assert chat(router, LONG, "pd-1") == text_of(TOKENS)

    (phase1,) = legs(p, "pd-1")
    (phase2,) = legs(d, "pd-1")  # the same request id on both legs
    sent1, sent2 = phase1["body"], phase2["body"]
    assert sent1["stream"] is False and sent1["max_tokens"] == 1
    assert "stream_options" not in sent1 and "min_tokens" not in sent1
    assert sent1["kv_transfer_params"] == PREFILL_PARAMS
    assert sent1["messages"] == sent2["messages"]  # the same prompt on both
    assert sent2["stream"] is True and sent2.get("max_tokens") is None  # the client's own
    # D got P's params unchanged, pulled them once, and computed none of the prompt itself.
    (held,) = handoff(d)["seen"]
    assert held["remote_engine_id"] == handoff(p)["engine_id"]
    assert held["remote_request_id"] == "pd-1" and held["do_remote_prefill"] is True
    on_d = handoff(d)
    assert on_d["pulled"] == 1 and on_d["prompt_mismatch"] == 0
    assert on_d["external_tokens"] == held["remote_num_tokens"] > MIN_UNCACHED
    assert on_d["local_tokens"] == 0
    assert handoff(p)["held"] == 0  # handed over

    # Byte for byte what D streams for the same request sent to it directly.
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": LONG}]}
    headers = {"x-request-id": "pd-2"}
    via = httpx.post(router.url + "/v1/chat/completions", json=body, headers=headers, timeout=20)
    own = {**body, "model": "mock-model"}  # the backend's own name, as the router sends it
    direct = httpx.post(d.url + "/v1/chat/completions", json=own, headers=headers, timeout=20)
    assert via.status_code == direct.status_code == 200
    assert via.content == direct.content

    assert (
        router_metric(router, "sluicegate_disaggregated_requests_total", result="disaggregated")
        == split + 2
    )
    assert router_metric(router, "sluicegate_prefill_seconds_count", backend="p") == prefills + 2
    assert (
        router_metric(router, "sluicegate_ttft_seconds_count", path="disaggregated")
        == ttft_split + 2
    )
    assert router_metric(router, "sluicegate_ttft_seconds_count", path="direct") == ttft_direct


def test_short_prompt_is_served_whole_on_the_decode_engine(pair: tuple[Proc, Proc, Proc]) -> None:
    p, d, router = pair
    short = router_metric(router, "sluicegate_disaggregated_requests_total", result="short")
    direct = router_metric(router, "sluicegate_ttft_seconds_count", path="direct")
    assert chat(router, SHORT, "short-1") == text_of(TOKENS)
    assert legs(p, "short-1") == []
    (only,) = legs(d, "short-1")
    assert "kv_transfer_params" not in only["body"]
    assert handoff(d)["local_tokens"] > 0 and handoff(d)["external_tokens"] == 0
    assert (
        router_metric(router, "sluicegate_disaggregated_requests_total", result="short")
        == short + 1
    )
    assert router_metric(router, "sluicegate_ttft_seconds_count", path="direct") == direct + 1


def test_whole_answer_counts_the_clients_tokens_once(pair: tuple[Proc, Proc, Proc]) -> None:
    p, _, router = pair
    completion = router_metric(router, "sluicegate_tokens_total", kind="completion")
    prompt = router_metric(router, "sluicegate_tokens_total", kind="prompt")
    requests = router_metric(router, "sluicegate_requests_total")
    client = sdk(router)
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": LONG}],
        max_tokens=4,
        extra_headers={"x-request-id": "whole-1"},
    )
    assert r.choices[0].message.content == text_of(4)
    assert r.usage is not None and r.usage.completion_tokens == 4  # not P's one token
    assert len(legs(p, "whole-1")) == 1 and legs(p, "whole-1")[0]["body"]["max_tokens"] == 1
    assert router_metric(router, "sluicegate_tokens_total", kind="completion") == completion + 4
    # Counted once, as D reported it.
    assert router_metric(router, "sluicegate_tokens_total", kind="prompt") == (
        prompt + r.usage.prompt_tokens
    )
    assert router_metric(router, "sluicegate_requests_total") == requests + 1


def test_phase1_failure_retries_on_another_prefill_engine(procs: Cluster) -> None:
    p1, p2 = pd_mock(procs, "p1", "prefill"), pd_mock(procs, "p2", "prefill")
    d = pd_mock(procs, "d", "decode")
    router = pd_router(procs, [("p1", p1), ("p2", p2)], [("d", d)])
    control(p1, fail_status=500)
    assert chat(router, LONG, "retry-1") == text_of(TOKENS)
    assert len(legs(p1, "retry-1")) == 1 and len(legs(p2, "retry-1")) == 1
    assert len(legs(d, "retry-1")) == 1  # D was asked once, after the phase 1 that worked
    (held,) = handoff(d)["seen"]
    assert held["remote_engine_id"] == handoff(p2)["engine_id"]


def test_refused_handoff_redoes_phase1_with_fresh_params(procs: Cluster) -> None:
    # p1 forgets its blocks at once (a lease of 0): D's pull fails, D answers 500 after its
    # delay, and the router prefills again on p2 rather than send p1's params twice.
    p1 = pd_mock(procs, "p1", "prefill", "--kv-lease-ms", "0")
    p2 = pd_mock(procs, "p2", "prefill")
    d = pd_mock(procs, "d", "decode")
    router = pd_router(procs, [("p1", p1), ("p2", p2)], [("d", d)])
    started = time.monotonic()
    assert chat(router, LONG, "redo-1") == text_of(TOKENS)
    assert time.monotonic() - started >= FAIL_DELAY_MS / 1000  # D's own refusal came first
    assert len(legs(p1, "redo-1")) == 1 and len(legs(p2, "redo-1")) == 1
    assert len(legs(d, "redo-1")) == 2
    on_d = handoff(d)
    assert on_d["failed_transfers"] == 1 and on_d["pulled"] == 1
    first, second = on_d["seen"]
    assert first["remote_engine_id"] == handoff(p1)["engine_id"]
    assert second["remote_engine_id"] == handoff(p2)["engine_id"]  # fresh, never reused
    assert handoff(p1)["expired"] == 1


def test_no_prefill_engine_left_means_a_direct_answer(procs: Cluster) -> None:
    p, d = pd_mock(procs, "p", "prefill"), pd_mock(procs, "d", "decode")
    router = pd_router(procs, [("p", p)], [("d", d)])
    p.kill9()
    assert chat(router, LONG, "nop-1") == text_of(TOKENS)
    (only,) = legs(d, "nop-1")
    assert "kv_transfer_params" not in only["body"]
    assert handoff(d)["local_tokens"] > MIN_UNCACHED and handoff(d)["pulled"] == 0
    assert (
        router_metric(router, "sluicegate_disaggregated_requests_total", result="no_prefill") == 1
    )
    assert in_flight(router) == 0


def test_client_leaving_in_phase1_cancels_the_prefill_call(pair: tuple[Proc, Proc, Proc]) -> None:
    p, d, router = pair
    control(p, ttft_ms=5000)
    with pytest.raises(openai.APITimeoutError):
        sdk(router, timeout=0.5).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": LONG}],
            stream=True,
            extra_headers={"x-request-id": "gone-1"},
        )
    wait_for(
        lambda: bool(legs(p, "gone-1")) and legs(p, "gone-1")[0]["aborted"], "P's leg aborted", 3
    )
    assert legs(d, "gone-1") == []  # phase 2 never went out
    assert handoff(p)["held"] == 0  # it never answered: nothing is held
    wait_for(lambda: in_flight(router) == 0, "nothing in flight", 3)


def test_cached_prefix_on_the_decode_engine_goes_direct(
    procs: Cluster, pair: tuple[Proc, Proc, Proc]
) -> None:
    p, d, _ = pair
    router = pd_router(procs, [("p", p)], [("d", d)], balancer="cache_aware")

    def both_read() -> bool:
        rows = httpx.get(router.url + "/admin/backends", timeout=STARVED_S).json()
        return all(r["engine"] and not r["engine"]["stale"] for r in rows)

    # Until its first scrape an engine has no load to weigh the cache against, so cache_aware
    # picks by load alone and holds nothing (the split then saw D cache nothing: 5 of 15 runs of
    # this file and 2 of 3 `make test` runs on a quiet machine): this test is about the index,
    # not the router's first quarter second.
    wait_for(both_read, "both engines read", STARVED_S)
    assert chat(router, LONG, "c-1") == text_of(TOKENS)  # first: split, D now holds the prefix
    assert chat(router, LONG, "c-2") == text_of(TOKENS)
    assert legs(p, "c-2") == []
    assert router_metric(router, "sluicegate_disaggregated_requests_total", result="cached") == 1


def test_mock_decode_refuses_unknown_or_used_params(pair: tuple[Proc, Proc, Proc]) -> None:
    p, d, _ = pair
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": LONG}]}
    first = httpx.post(
        p.url + "/v1/chat/completions",
        json={**body, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS},
        headers={"x-request-id": "m-1"},
        timeout=10,
    ).json()
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["transfer_mode"] == "pull"
    ok = httpx.post(
        d.url + "/v1/chat/completions", json={**body, "kv_transfer_params": params}, timeout=10
    )
    assert ok.status_code == 200
    for bad in (params, {**params, "remote_engine_id": "nobody"}):
        started = time.monotonic()
        again = httpx.post(
            d.url + "/v1/chat/completions", json={**body, "kv_transfer_params": bad}, timeout=10
        )
        assert again.status_code == 500
        assert time.monotonic() - started >= FAIL_DELAY_MS / 1000
    metrics = httpx.get(d.url + "/metrics", timeout=STARVED_S).text
    assert "vllm:nixl_num_failed_transfers_total" in metrics
    assert 'source="external_kv_transfer"' in metrics


def test_sglang_bootstrap_sends_both_at_once_and_relays_decode(procs: Cluster) -> None:
    p = pd_mock(procs, "p", "prefill", "--kv-connector", "sglang")
    d = pd_mock(procs, "d", "decode", "--kv-connector", "sglang")
    router = procs.router(
        {
            "backends": [
                backend("p", p, role="prefill", bootstrap_port=p.port),
                backend("d", d, role="decode"),
            ],
            "disaggregation": {"connector": "sglang", "min_uncached_tokens": MIN_UNCACHED},
        }
    )
    assert chat(router, LONG, "sg-1") == text_of(TOKENS)
    (on_p,) = legs(p, "sg-1")
    (on_d,) = legs(d, "sg-1")
    for sent in (on_p["body"], on_d["body"]):
        assert sent["bootstrap_host"] == "127.0.0.1" and sent["bootstrap_port"] == p.port
    assert on_p["body"]["bootstrap_room"] == on_d["body"]["bootstrap_room"]
    assert handoff(d)["pulled"] == 1 and handoff(p)["handed_over"] == 1
    assert chat(router, LONG, "sg-2") == text_of(TOKENS)
    rooms = {legs(d, rid)[0]["body"]["bootstrap_room"] for rid in ("sg-1", "sg-2")}
    assert len(rooms) == 2  # a fresh room each time
    wait_for(lambda: in_flight(router) == 0, "nothing in flight", 3)


def test_model_disaggregation_null_turns_it_off(
    procs: Cluster, pair: tuple[Proc, Proc, Proc]
) -> None:
    p, d, _ = pair
    router = pd_router(procs, [("p", p)], [("d", d)], model_disaggregation={"m": None})
    chat(router, LONG, "off-1")
    assert router_metric(router, "sluicegate_disaggregated_requests_total") == 0
    assert all(
        "kv_transfer_params" not in r["body"] for r in stats(p)["recent"] + stats(d)["recent"]
    )


def test_quotas_see_one_request_per_split_request(
    procs: Cluster, pair: tuple[Proc, Proc, Proc]
) -> None:
    import hashlib

    key = "sk-pd-quota-0123456789"
    p, d, _ = pair
    router = pd_router(
        procs,
        [("p", p)],
        [("d", d)],
        api_keys=[{"sha256": hashlib.sha256(key.encode()).hexdigest(), "name": "k", "rpm": 2}],
    )
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=20)
    messages: Any = [{"role": "user", "content": LONG}]
    for i in range(2):
        r = client.chat.completions.create(
            model="m", messages=messages, extra_headers={"x-request-id": f"q-{i}"}
        )
        assert r.choices[0].message.content == text_of(TOKENS)
        assert len(legs(p, f"q-{i}")) == 1  # both legs ran, and count as one request
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="m", messages=messages)


def test_trace_has_both_legs_and_the_log_line_names_both_backends(
    procs: Cluster, pair: tuple[Proc, Proc, Proc]
) -> None:
    import json

    from tests.support.otlp_receiver import Receiver

    receiver = Receiver().start()
    try:
        p, d, _ = pair
        router = pd_router(
            procs,
            [("p", p)],
            [("d", d)],
            tracing={"otlp_endpoint": receiver.url},
        )
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        traceparent = f"00-{trace_id}-00f067aa0ba902b7-01"
        client = sdk(router)
        s = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": LONG}],
            stream=True,
            extra_headers={"x-request-id": "tr-1", "traceparent": traceparent},
        )
        assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == text_of(TOKENS)

        def both(spans: list[Any]) -> bool:
            names = {x.name for x in spans if x.trace_id == trace_id}
            return "prefill p" in names and "attempt d" in names

        spans = [x for x in receiver.wait_for(both, deadline=30) if x.trace_id == trace_id]
        prefill = next(x for x in spans if x.name == "prefill p")
        attempt = next(x for x in spans if x.name == "attempt d")
        assert prefill.parent_span_id == attempt.span_id  # the prefill leg inside the attempt
        assert (
            prefill.end_ns <= attempt.end_ns and prefill.attributes["sluicegate.leg"] == "prefill"
        )
        # Each leg's engine got the trace of its own span.
        assert trace_id in legs(p, "tr-1")[0]["headers"]["traceparent"]
        assert trace_id in legs(d, "tr-1")[0]["headers"]["traceparent"]
    finally:
        receiver.close()
    lines = [json.loads(x) for x in router.log().splitlines() if '"request_id": "tr-1"' in x]
    (line,) = [x for x in lines if x.get("msg") == "request"]
    assert line["backend"] == "d" and line["prefill_backend"] == "p"
    assert line["disaggregation"] == "disaggregated"


def test_client_leaving_in_phase2_stops_the_decode_engine(pair: tuple[Proc, Proc, Proc]) -> None:
    p, d, router = pair
    control(d, tokens=500, itl_ms=20)
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json={"model": "m", "stream": True, "messages": [{"role": "user", "content": LONG}]},
        headers={"x-request-id": "gone-2"},
        timeout=20,
    ) as r:
        for line in r.iter_lines():
            if "tok3 " in line:
                break  # and leave
    wait_for(
        lambda: bool(legs(d, "gone-2")) and legs(d, "gone-2")[0]["aborted"], "D's leg aborted", 5
    )
    assert legs(d, "gone-2")[0]["tokens"] < 500
    assert len(legs(p, "gone-2")) == 1
    wait_for(lambda: in_flight(router) == 0, "nothing in flight", 3)


def test_sglang_prefill_engine_gone_means_a_direct_answer(procs: Cluster) -> None:
    p = pd_mock(procs, "p", "prefill", "--kv-connector", "sglang")
    d = pd_mock(procs, "d", "decode", "--kv-connector", "sglang")
    router = procs.router(
        {
            "backends": [
                backend("p", p, role="prefill", bootstrap_port=p.port),
                backend("d", d, role="decode"),
            ],
            "disaggregation": {"connector": "sglang", "min_uncached_tokens": MIN_UNCACHED},
            "outlier": {"consecutive_failures": 100},
        }
    )
    p.kill9()
    assert chat(router, LONG, "sg-gone") == text_of(TOKENS)
    first, second = legs(d, "sg-gone")
    assert "bootstrap_room" in first["body"]  # refused: the room was never prefilled
    assert "bootstrap_room" not in second["body"]  # then served whole
    assert handoff(d)["failed_transfers"] == 1
    wait_for(lambda: in_flight(router) == 0, "nothing in flight", 3)


def test_the_prefill_answers_params_go_on_as_the_engine_wrote_them() -> None:
    params = b'{"remote_block_ids":[1,2,3],"remote_engine_id":"e-1","big":18446744073709551616}'
    answer = b'{"id":"c","choices":[{"message":{"content":"x"}}],"kv_transfer_params":' + params
    assert transfer_params(answer + b"}") == params  # byte for byte, past 64 bits too


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b"<html>busy</html>", "not JSON"),
        (b'{"kv_transfer_params":{"a":1}', "not JSON"),  # cut short
        (b'[{"kv_transfer_params":{"a":1}}]', "no kv_transfer_params"),
        (b'{"id":"c"}', "no kv_transfer_params"),
        (b'{"kv_transfer_params":null}', "no kv_transfer_params"),
        (b'{"kv_transfer_params":{ }}', "no kv_transfer_params"),
        (b'{"kv_transfer_params":"x"}', "no kv_transfer_params"),
    ],
)
def test_a_prefill_answer_without_params_is_a_failure_of_that_engine(
    answer: bytes, why: str
) -> None:
    with pytest.raises(BadPrefillAnswer, match=why):
        transfer_params(answer)
