"""Prefill/decode disaggregation against hostile parties (issue 46, cases 9 and 16-19): a client
that writes its own handoff fields, prefill engines whose answers are nested without end, drip,
or name another host (tests/support/hostile_prefill.py), and a decode engine that fails everything.

Real mock engines (router/tools/mock/handoff.py) and a real router on loopback; the openai SDK as
the client.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from router.core.settings import DisaggregationConfig
from router.request.placement.pd import (
    MAX_PARAMS_DEPTH,
    BadPrefillAnswer,
    check_remote,
    client_body,
    transfer_params,
)
from tests.request.placement.test_disaggregation import (
    LONG,
    MIN_UNCACHED,
    SHORT,
    TOKENS,
    handoff,
    legs,
    pd_mock,
    pd_router,
    text_of,
)
from tests.support.harness import Cluster, Proc, admin_backends, backend, control, in_flight, metric
from tests.support.hostile_backend import HostileBackend
from tests.support.hostile_prefill import FAR_HOST, HostilePrefill
from tests.support.wait import wait_for

TRUSTED_KEY = "sk-pd-trusted-0123456789"
OTHER_KEY = "sk-pd-other-0123456789"


@pytest.fixture
def hostile_prefill() -> Iterator[HostilePrefill]:
    h = HostilePrefill()
    h.start()
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture
def victim() -> Iterator[HostileBackend]:
    """A host a client names in its own handoff fields: nothing should connect to it."""
    h = HostileBackend().start()
    try:
        yield h
    finally:
        h.stop()


def hostile_router(
    procs: Cluster, engines: tuple[Proc, Proc, Proc], hostile: HostilePrefill, mode: str, **cfg: Any
) -> Any:
    """The hostile prefill engine (picked first: weight 1000), the module's mock one behind it,
    its decode engine."""
    p2, d, _ = engines
    router = procs.router(
        {
            "backends": [
                {
                    "name": "hp",
                    "url": hostile.url,
                    "models": {"m": mode},
                    "role": "prefill",
                    "weight": 1000,
                },
                backend("p2", p2, role="prefill", weight=0.01),
                backend("d", d, role="decode"),
            ],
            "disaggregation": {"min_uncached_tokens": MIN_UNCACHED},
            "outlier": {"consecutive_failures": 100},
            "health": {"interval": 30},
            **cfg,
        }
    )
    return router, p2, d


def chat_as(router: Proc, key: str, rid: str, content: str, **extra: Any) -> str:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=30)
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": content}],
        extra_headers={"x-request-id": rid},
        extra_body=extra,
    )
    return r.choices[0].message.content or ""


# -- 9: a client's own handoff fields -----------------------------------------------------------


def client_params(victim: HostileBackend) -> dict[str, Any]:
    """What a client would write to make a decode engine pull another request's blocks."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "someone-elses-engine",
        "remote_request_id": "someone-elses-request",
        "remote_block_ids": [[0, 1, 2]],
        "remote_host": "127.0.0.1",
        "remote_port": victim.port,
    }


@pytest.mark.parametrize("content", [SHORT, LONG], ids=["served-whole", "split"])
def test_a_clients_kv_transfer_params_never_reach_the_decode_engine(
    pair: tuple[Proc, Proc, Proc], victim: HostileBackend, content: str
) -> None:
    p, d, router = pair
    before = metric(router, "sluicegate_disaggregated_requests_total", result="client_params")
    rid = f"own-{len(content)}"
    params = client_params(victim)
    assert chat_as(router, "k", rid, content, kv_transfer_params=params) == text_of(TOKENS)
    (on_d,) = legs(d, rid)
    sent = on_d["body"].get("kv_transfer_params")
    if content == SHORT:
        assert sent is None  # removed, and nothing else put there
    else:  # split as any long prompt: P's own params, as P wrote them
        assert sent is not None and sent["remote_engine_id"] == handoff(p)["engine_id"]
    assert all(seen.get("remote_port") != victim.port for seen in handoff(d)["seen"])
    assert victim.connections == 0  # the decode engine never went where the client said
    assert (
        metric(router, "sluicegate_disaggregated_requests_total", result="client_params") == before
    )


def test_sglang_bootstrap_fields_of_a_client_are_removed(
    procs: Cluster, victim: HostileBackend
) -> None:
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
    own = {"bootstrap_host": "127.0.0.1", "bootstrap_port": victim.port, "bootstrap_room": 7}
    assert chat_as(router, "k", "sg-own", SHORT, **own) == text_of(TOKENS)
    (on_d,) = legs(d, "sg-own")
    assert not set(own) & set(on_d["body"])
    assert victim.connections == 0


def test_a_trusted_key_keeps_its_own_kv_transfer_params(
    procs: Cluster, pair: tuple[Proc, Proc, Proc]
) -> None:
    p, d, _ = pair
    keys = [
        {"sha256": hashlib.sha256(key.encode()).hexdigest(), "name": name}
        for key, name in ((TRUSTED_KEY, "trusted"), (OTHER_KEY, "other"))
    ]
    router = pd_router(
        procs,
        [("p", p)],
        [("d", d)],
        api_keys=keys,
        disaggregation={"min_uncached_tokens": MIN_UNCACHED, "trusted_keys": ["trusted"]},
    )
    mine = {"do_remote_decode": False, "note": "the client's own"}  # nothing for D to pull
    for key, rid in ((TRUSTED_KEY, "t-1"), (OTHER_KEY, "o-1")):
        assert chat_as(router, key, rid, LONG, kv_transfer_params=mine) == text_of(TOKENS)
    assert legs(d, "t-1")[0]["body"]["kv_transfer_params"] == mine  # passed on as sent
    assert legs(p, "t-1") == []  # and not split: the client's params are its own handoff
    assert legs(d, "o-1")[0]["body"]["kv_transfer_params"] != mine  # P's, not the client's
    assert len(legs(p, "o-1")) == 1
    assert metric(router, "sluicegate_disaggregated_requests_total", result="client_params") == 1


def test_client_body_keeps_everything_but_the_handoff_fields() -> None:
    rule = DisaggregationConfig(trusted_keys=["t"])
    body = (
        b'{"model":"m","kv_transfer_params":{"a":1},"messages":[{"role":"user",'
        b'"content":"\xc3\xa9"}],"bootstrap_room":1,"kv_transfer_params":{"b":2}}'
    )
    payload = {"model": "m", "kv_transfer_params": {"b": 2}, "bootstrap_room": 1}
    stripped = client_body(rule, "other", dict(payload), body)
    assert stripped == b'{"model":"m","messages":[{"role":"user","content":"\xc3\xa9"}]}'
    assert client_body(rule, "t", dict(payload), body) is None  # trusted: as sent
    assert client_body(rule, None, {"model": "m"}, b'{"model":"m"}') is None  # nothing to do
    # A body msgspec refuses (NaN) is written again from its parsed payload.
    stripped = client_body(
        rule, None, {"model": "m", "kv_transfer_params": {}}, b'{"model":"m","x":NaN}'
    )
    assert stripped == b'{"model":"m"}'


# -- 16: params nested without end ---------------------------------------------------------------


def test_deeply_nested_params_fail_that_prefill_engine_and_another_one_takes_it(
    procs: Cluster, pair: tuple[Proc, Proc, Proc], hostile_prefill: HostilePrefill
) -> None:
    router, p2, d = hostile_router(procs, pair, hostile_prefill, "deep-params")
    assert chat_as(router, "k", "deep-1", LONG) == text_of(TOKENS)
    assert hostile_prefill.seen["deep-1"] == 1  # asked first, and refused
    assert len(legs(p2, "deep-1")) == 1
    (on_d,) = legs(d, "deep-1")  # D got p2's params only
    assert on_d["body"]["kv_transfer_params"]["remote_engine_id"] == handoff(p2)["engine_id"]
    assert metric(router, "sluicegate_upstream_errors_total", backend="hp") >= 1
    wait_for(lambda: in_flight(router) == 0, "nothing in flight", 3)


@pytest.mark.parametrize(
    ("params", "refused"),
    [
        (b'{"a":' + b"[" * (MAX_PARAMS_DEPTH - 1) + b"]" * (MAX_PARAMS_DEPTH - 1) + b"}", False),
        (b'{"a":' + b"[" * MAX_PARAMS_DEPTH + b"]" * MAX_PARAMS_DEPTH + b"}", True),
        (b'{"a":"' + b"[" * 100 + b'"}', False),  # brackets in a string are not nesting
        (b'{"a":[' + b"[]," * 5000 + b"[]]}", True),  # shallow, but past the node bound
        (b'{"a":[' + b"[]," * 100 + b"[]]}", False),
    ],
)
def test_params_depth_is_bounded(params: bytes, refused: bool) -> None:
    answer = b'{"id":"c","kv_transfer_params":' + params + b"}"
    if refused:
        with pytest.raises(BadPrefillAnswer):
            transfer_params(answer)
    else:
        assert transfer_params(answer) == params


def test_an_answer_nested_past_the_readers_limit_is_a_bad_answer() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    for answer in (
        b'{"kv_transfer_params":{"a":' + deep + b"}}",
        b'{"choices":' + deep + b',"kv_transfer_params":{"a":1}}',
    ):
        with pytest.raises(BadPrefillAnswer, match="nested too deeply"):
            transfer_params(answer)


# -- 17: a prefill answer that drips -------------------------------------------------------------


def test_a_dripping_prefill_answer_ends_at_the_read_timeout(
    procs: Cluster, pair: tuple[Proc, Proc, Proc], hostile_prefill: HostilePrefill
) -> None:
    # Each byte comes well within the read timeout, so only a deadline on the whole leg ends
    # it; the drip would go on for 10 s (40 x 0.25 s), ten times the deadline.
    router, p2, d = hostile_router(
        procs, pair, hostile_prefill, "drip", timeouts={"read": 1.0, "connect": 5}
    )
    assert chat_as(router, "k", "drip-1", LONG) == text_of(TOKENS)
    assert len(legs(p2, "drip-1")) == 1 and len(legs(d, "drip-1")) == 1
    wait_for(lambda: hostile_prefill.drips_cut == 1, "the drip cut", 5)
    assert hostile_prefill.drips_done == 0  # the router left before the drip ended
    assert metric(router, "sluicegate_upstream_errors_total", backend="hp", kind="timeout") == 1


# -- 18: a decode engine that fails everything ---------------------------------------------------


@pytest.mark.parametrize("attempts", [1, 2])  # 1: as when the retry budget is spent
def test_a_decode_engine_failing_everything_is_ejected_not_the_prefill_engines(
    procs: Cluster, attempts: int
) -> None:
    p1, p2 = pd_mock(procs, "p1", "prefill"), pd_mock(procs, "p2", "prefill")
    bad, good = pd_mock(procs, "bad", "decode"), pd_mock(procs, "good", "decode")
    control(bad, fail_status=500)
    router = pd_router(
        procs,
        [("p1", p1), ("p2", p2)],
        [("bad", bad), ("good", good)],
        outlier={"consecutive_failures": 3, "base_ejection": 300},
        retries={"attempts": attempts},
    )

    def ejected() -> bool:
        return admin_backends(router)[bad.url]["ejected_until"] is not None

    for i in range(20):  # each request that meets `bad` charges it; far fewer are needed
        try:
            chat_as(router, "k", f"bad-d-{i}", LONG)
        except openai.InternalServerError:
            pass  # every attempt met `bad`
        if ejected():
            break
    assert ejected()
    rows = admin_backends(router)
    for prefill in (p1, p2):  # their handoffs were never the fault
        assert rows[prefill.url]["consecutive_failures"] == 0
        assert rows[prefill.url]["ejected_until"] is None
    assert metric(router, "sluicegate_upstream_errors_total", backend="p1") == 0
    assert metric(router, "sluicegate_upstream_errors_total", backend="p2") == 0
    # With it out, every request is served.
    assert chat_as(router, "k", "after", LONG) == text_of(TOKENS)


def test_a_refused_handoff_taken_by_the_same_decode_engine_from_another_prefill_is_the_first_prefill_engines(  # noqa: E501
    procs: Cluster,
) -> None:
    # p1 forgets its blocks at once: the decode engine refuses p1's handoff and takes p2's.
    p1 = pd_mock(procs, "p1", "prefill", "--kv-lease-ms", "0")
    p2 = pd_mock(procs, "p2", "prefill")
    d = pd_mock(procs, "d", "decode")
    router = pd_router(procs, [("p1", p1), ("p2", p2)], [("d", d)])
    assert chat_as(router, "k", "redo", LONG) == text_of(TOKENS)
    rows = admin_backends(router)
    assert rows[p1.url]["consecutive_failures"] == 1
    assert rows[d.url]["consecutive_failures"] == 0
    assert metric(router, "sluicegate_upstream_errors_total", backend="p1") == 1
    assert metric(router, "sluicegate_upstream_errors_total", backend="d") == 0


def test_a_refused_handoff_then_served_whole_by_that_decode_engine_charges_neither(
    procs: Cluster,
) -> None:
    # The only prefill engine forgets its blocks: D refuses, then serves the request whole.
    # D's pulls or P's blocks: either may be at fault, and D works: nobody is charged.
    p = pd_mock(procs, "p", "prefill", "--kv-lease-ms", "0")
    d = pd_mock(procs, "d", "decode")
    router = pd_router(procs, [("p", p)], [("d", d)])
    assert chat_as(router, "k", "whole-after", LONG) == text_of(TOKENS)
    assert len(legs(d, "whole-after")) == 2 and handoff(d)["failed_transfers"] == 1
    rows = admin_backends(router)
    assert rows[p.url]["consecutive_failures"] == rows[d.url]["consecutive_failures"] == 0
    assert metric(router, "sluicegate_upstream_errors_total") == 0


# -- 19: params naming another host ---------------------------------------------------------------


def test_params_naming_another_host_fail_that_prefill_engine(
    procs: Cluster, pair: tuple[Proc, Proc, Proc], hostile_prefill: HostilePrefill
) -> None:
    router, p2, d = hostile_router(procs, pair, hostile_prefill, "far-params")
    assert chat_as(router, "k", "far-1", LONG) == text_of(TOKENS)
    assert hostile_prefill.seen["far-1"] == 1
    assert len(legs(p2, "far-1")) == 1
    (on_d,) = legs(d, "far-1")  # D was sent p2's params only, and pulled from p2
    assert on_d["body"]["kv_transfer_params"]["remote_engine_id"] == handoff(p2)["engine_id"]
    assert all(seen.get("remote_host") != FAR_HOST for seen in handoff(d)["seen"])
    assert handoff(d)["failed_transfers"] == 0
    assert metric(router, "sluicegate_upstream_errors_total", backend="hp") == 1


NAMED = ("prefill-0.models.svc", "10.0.0.5")  # a URL by name; the address it reached
BY_ADDRESS = ("10.0.0.5", None)  # a URL by address (the peer not known)


@pytest.mark.parametrize(
    ("host", "port", "known", "ok"),
    [
        ("10.0.0.5", 5600, BY_ADDRESS, True),  # the backend URL's host; NIXL's own port
        ("10.0.0.5", 8000, BY_ADDRESS, True),
        ("10.0.0.5", 5600, NAMED, True),  # the address the router's connection reached
        ("prefill-0.models.svc", 5600, NAMED, True),  # the name the router's URL has
        ("PREFILL-0.models.svc.", 5600, NAMED, True),
        ("prefill-0.models.svc", 5600, BY_ADDRESS, False),  # a name never resolved here
        ("10.0.0.6", 5600, NAMED, False),
        ("localhost", 5600, BY_ADDRESS, False),
        ("10.0.0.5", 0, BY_ADDRESS, False),
        ("10.0.0.5", 70000, BY_ADDRESS, False),
        ("10.0.0.5", None, BY_ADDRESS, False),
        (None, 5600, BY_ADDRESS, False),
        ("", 5600, BY_ADDRESS, False),
        (True, 5600, BY_ADDRESS, False),
        ("10.0.0.5", "5600", BY_ADDRESS, False),
    ],
)
def test_check_remote_accepts_only_the_prefill_engines_own_host(
    host: Any, port: Any, known: tuple[str, str | None], ok: bool
) -> None:
    params = json.dumps({"remote_engine_id": "e", "remote_host": host, "remote_port": port})
    if ok:
        check_remote(params.encode(), *known)
    else:
        with pytest.raises(BadPrefillAnswer):
            check_remote(params.encode(), *known)


def test_check_remote_reads_a_dual_stack_peer_as_its_ipv4_address() -> None:
    check_remote(b'{"remote_host":"10.0.0.5","remote_port":1}', "p", "::ffff:10.0.0.5")
    check_remote(b'{"remote_host":"[::1]","remote_port":1}', "p", "0:0:0:0:0:0:0:1")


def test_a_real_prefill_handoff_names_the_engine_it_came_from(
    pair: tuple[Proc, Proc, Proc],
) -> None:
    """The mock's params name the address its backend URL has: they pass, as vLLM's do when
    VLLM_NIXL_SIDE_CHANNEL_HOST is that address."""
    _, d, router = pair
    split = metric(router, "sluicegate_disaggregated_requests_total", result="disaggregated")
    errors = metric(router, "sluicegate_upstream_errors_total")
    assert chat_as(router, "k", "real-1", LONG) == text_of(TOKENS)
    assert handoff(d)["pulled"] == 1
    assert (
        metric(router, "sluicegate_disaggregated_requests_total", result="disaggregated")
        == split + 1
    )
    assert metric(router, "sluicegate_upstream_errors_total") == errors
