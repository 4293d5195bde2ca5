"""`balancer: latency` end to end: two mock vLLM engines, one prefilling 8x slower, a real router.

The router learns from its own requests (refit every 0.1 s, 4 samples make a model) and then
sends long prompts to the fast engine; answers carry an opaque `x-session-token` that, echoed,
routes back to its engine; SLO headers are read (a bad one is a 400 in the client's format), a
sheddable request no engine can serve in time is refused 429 `slo_unattainable` at once; the
token load shows in /admin/backends and /metrics while a stream runs.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.harness import STARVED_S, Cluster, Proc, admin_backends, backend, streamed_chat
from tests.support.wait import wait_for

KEY = "test-session-key"
ENGINE = ["--engine", "--max-num-seqs", "8", "--decode-ms", "4", "--decode-ms-per-seq", "0"]
PROMPT = "word " * 1600  # ~2000 tokens by the router's bytes / 4 estimate
_sent = itertools.count()


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    fast = module_procs.mock("fast", engine_args=[*ENGINE, "--prefill-ms-per-1k", "5"])
    slow = module_procs.mock("slow", engine_args=[*ENGINE, "--prefill-ms-per-1k", "40"])
    router = module_procs.router(
        {
            "backends": [backend("fast", fast), backend("slow", slow)],
            "balancer": "latency",
            "latency": {"refit_interval": 0.1, "min_samples": 4},
            "engine_metrics": {"interval": 0.1, "timeout": 0.2, "stale_after": 1.0},
            "affinity": {"session_token_key": KEY},
            "admission": {"max_wait": 5},
            "expose_backend_header": True,
            "health": {"interval": 60},
        },
        env={"SLUICEGATE_LOG_LEVEL": "warning"},
    )
    return {"fast": fast, "slow": slow, "router": router}


def chat(
    router: Proc, headers: dict[str, str] | None = None, max_tokens: int = 4
) -> httpx.Response:
    """One streamed request, read to its end; its response (status, headers, body)."""
    # Each prompt new (its number first): no engine's prefix cache, nor the index, makes the
    # slow one quick for it.
    return streamed_chat(router, f"{next(_sent)} {PROMPT}", max_tokens, headers)


def metric(router: Proc, name: str, labels: str = "") -> float:
    text = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    total = 0.0
    for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def token_for(name: str) -> str:
    mac = hmac.new(KEY.encode(), name.encode(), hashlib.sha256).digest()[:16]
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


@pytest.fixture(scope="module")
def learnt(fleet: dict[str, Proc]) -> dict[str, Proc]:
    """The router after enough requests for both engines' own models."""
    router = fleet["router"]
    # Each engine is sent requests of its own (an echoed x-session-token keeps them there:
    # 80 against 10 ms predicted is within session_break_ms) until both have their own model.
    urls = {name: fleet[name].url for name in ("fast", "slow")}

    def own_models() -> bool:
        rows = admin_backends(router)
        return all(rows[u]["inflight_tokens"]["own_model"] for u in urls.values())

    for _ in range(20):
        for name in urls:
            chat(router, {"x-session-token": token_for(name)})
        if own_models():
            return fleet
    raise AssertionError("both engines have no model of their own after 40 requests")


def test_it_learns_the_slow_engine_and_sends_long_prompts_to_the_fast_one(
    learnt: dict[str, Proc],
) -> None:
    router = learnt["router"]
    got = Counter(chat(router).headers["x-sluicegate-backend"] for _ in range(10))
    assert got["fast"] >= 9, got  # 2 % of picks explore: at most a stray one
    assert metric(router, "sluicegate_predicted_ttft_seconds_count") > 0
    assert metric(router, "sluicegate_ttft_prediction_ratio_count") > 0


def test_an_echoed_session_token_goes_back_to_its_engine(learnt: dict[str, Proc]) -> None:
    router = learnt["router"]
    r = chat(router)
    token = r.headers["x-session-token"]
    name = r.headers["x-sluicegate-backend"]
    assert token == token_for(name)
    assert name not in token and "127.0.0.1" not in token
    # The slow engine's token: kept there, its predicted TTFT within session_break_ms (200 ms)
    # of the fast one's (prefill of 2000 tokens: 80 against 10 ms).
    for header in ("x-session-token",):
        for _ in range(3):
            back = chat(router, {header: token_for("slow")})
            assert back.headers["x-sluicegate-backend"] == "slow"
    # A token of no backend here: routed as without one.
    assert chat(router, {"x-session-token": "bogus"}).status_code == 200


def test_slo_headers_are_checked_and_a_sheddable_request_out_of_reach_is_refused(
    learnt: dict[str, Proc],
) -> None:
    router = learnt["router"]
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-slo-ttft-ms": "soon"},
        )
    assert bad.value.code == "invalid_slo"
    before = metric(router, "sluicegate_slo_requests_total", 'kind="ttft"')
    # No engine prefills 2000 tokens in 0.1 ms: sheddable is refused at once, with Retry-After.
    tight = {"x-llm-d-slo-ttft-ms": "0.1", "x-sluicegate-priority": "sheddable"}
    shed = chat(router, tight)
    assert shed.status_code == 429
    assert shed.json()["error"]["code"] == "slo_unattainable"
    assert int(shed.headers["retry-after"]) >= 1
    # Standard traffic is never shed for its SLO: served, counted, its miss counted.
    missed = metric(router, "sluicegate_slo_violations_total", 'kind="ttft"')
    assert chat(router, {"x-slo-ttft-ms": "0.1"}).status_code == 200
    wait_for(
        lambda: metric(router, "sluicegate_slo_requests_total", 'kind="ttft"') == before + 1,
        "the SLO request counted",
    )
    assert metric(router, "sluicegate_slo_violations_total", 'kind="ttft"') == missed + 1
    # A generous SLO: served, no violation.
    assert chat(router, {"x-slo-ttft-ms": "60000"}).status_code == 200
    wait_for(
        lambda: metric(router, "sluicegate_slo_requests_total", 'kind="ttft"') == before + 2,
        "the second SLO request counted",
    )
    assert metric(router, "sluicegate_slo_violations_total", 'kind="ttft"') == missed + 1


def test_token_load_shows_while_a_stream_runs_and_clears_after(
    learnt: dict[str, Proc],
) -> None:
    router = learnt["router"]
    body: dict[str, Any] = {
        "model": "m",
        "stream": True,
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as r:
        name = r.headers["x-sluicegate-backend"]
        chunks: Iterator[bytes] = r.iter_raw()
        next(chunks)  # the first token came: the prompt is no longer queued
        url = learnt[name].url
        view = admin_backends(router)[url]["inflight_tokens"]
        assert view["prefill"] == 0 and view["own_model"] and view["samples"] >= 4
        assert 0 < view["decode"] <= 200
        labels = f'backend="{name}",phase="decode"'
        gauge = metric(router, "sluicegate_engine_inflight_tokens", labels)
        assert 0 < gauge <= view["decode"]  # read a little later: a few more tokens streamed
        for _ in chunks:
            pass
    wait_for(
        lambda: admin_backends(router)[url]["inflight_tokens"]["decode"] == 0,
        "the token load cleared",
    )
