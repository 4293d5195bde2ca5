"""Per-key quotas (rpm, tpm, max_parallel), per process, through the official openai SDK against
a real router and mock engine: 429 in OpenAI's shape with Retry-After and x-ratelimit-* headers,
those headers on successful answers too, tokens corrected by the real usage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from starlette.responses import Response

from router.core.settings import ConfigError, load_settings
from router.request.admit.quota import KeyLimits, Quotas, Reservation
from tests.support.answers import answered
from tests.support.harness import Cluster, Proc, backend, in_flight, sha, stats
from tests.support.wait import wait_for

RPM = "sk-quota-rpm-0123456789"
TPM = "sk-quota-tpm-0123456789"
PAR = "sk-quota-parallel-0123456789"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    mock = module_procs.mock("q", itl_ms=20, tokens=5)
    router = module_procs.router(
        {
            "backends": [backend("q", mock)],
            "api_keys": [
                {"sha256": sha(RPM), "name": "rpm", "rpm": 3},
                {"sha256": sha(TPM), "name": "tpm", "tpm": 200},
                {"sha256": sha(PAR), "name": "par", "max_parallel": 1},
            ],
        }
    )
    return {"mock": mock, "router": router}


def sdk(router: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)


def ask(router: Proc, key: str, max_tokens: int = 5) -> Any:
    """The SDK's raw response: headers and the parsed completion."""
    return sdk(router, key).chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens
    )


def test_rpm_refuses_the_request_over_the_limit_in_openais_shape(fleet: dict[str, Proc]) -> None:
    router, mock = fleet["router"], fleet["mock"]
    remaining = []
    for _ in range(3):
        raw = ask(router, RPM)
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(raw.headers["x-ratelimit-remaining-requests"])
        assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
    assert remaining == ["2", "1", "0"]
    before = stats(mock)["requests"]
    with pytest.raises(openai.RateLimitError) as info:
        ask(router, RPM)
    err = info.value
    assert err.status_code == 429
    body = err.body
    assert isinstance(body, dict)
    assert body["type"] == "rate_limit_exceeded" and body["code"] == "rate_limit_exceeded"
    assert "requests per minute" in body["message"]
    h = err.response.headers
    assert 1 <= int(h["retry-after"]) <= 61  # a use counts 60 s plus the second it began in
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-limit-requests"] == "3"
    assert stats(mock)["requests"] == before  # refused before any backend saw it
    assert RPM not in err.response.text
    text = httpx.get(router.url + "/metrics").text
    assert 'sluicegate_ratelimited_total{key="rpm",limit="rpm"} 1.0' in text


def test_tpm_counts_real_usage_and_refuses_past_the_limit(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    first = ask(router, TPM, max_tokens=5)
    reserved = 200 - int(first.headers["x-ratelimit-remaining-tokens"])
    assert first.headers["x-ratelimit-limit-tokens"] == "200"
    used = first.parse().usage
    assert used is not None
    # The next answer's remaining count reflects the first one's real usage, not its estimate.
    second = ask(router, TPM, max_tokens=5)
    left = int(second.headers["x-ratelimit-remaining-tokens"])
    assert abs(left - (200 - used.total_tokens - reserved)) <= 1  # same request, same estimate
    assert used.total_tokens != reserved  # (so the check above tells the two apart)
    # A request asking for more than is left is refused.
    with pytest.raises(openai.RateLimitError) as info:
        ask(router, TPM, max_tokens=190)
    assert "tokens per minute" in str(info.value.body)
    assert info.value.response.headers["x-ratelimit-limit-tokens"] == "200"


def test_max_parallel_refuses_while_the_key_has_a_request_in_flight(
    fleet: dict[str, Proc],
) -> None:
    router = fleet["router"]
    body = {"model": "m", "stream": True, "messages": [], "max_tokens": 200}  # ~4 s
    with httpx.Client(timeout=10) as http:
        with http.stream(
            "POST", router.url + CHAT, json=body, headers={"authorization": f"Bearer {PAR}"}
        ) as held:
            assert held.status_code == 200
            with pytest.raises(openai.RateLimitError) as info:
                ask(router, PAR)
            assert "parallel" in str(info.value.body)
        # The client left: its slot is free at once.
        wait_for(lambda: in_flight(router) == 0, "its slot free", 5)
    assert ask(router, PAR).parse().choices[0].message.content


@pytest.mark.parametrize(
    ("entry", "field"),
    [({"rpm": -1}, "rpm"), ({"tpm": 0}, "tpm"), ({"max_parallel": 10**9}, "max_parallel")],
)
def test_absurd_limits_stop_startup_naming_the_field(
    tmp_path: Path, entry: dict[str, int], field: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"api_keys": [{"sha256": sha(RPM), **entry}]}))
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert f"api_keys[0].{field}" in str(info.value)


def test_local_window_slides_by_the_second_and_a_refund_leaves_with_its_estimate() -> None:
    clock = [1000.0]
    quotas = Quotas(clock=lambda: clock[0])
    limits = KeyLimits("k", rpm=2, tpm=1000)
    first = quotas.admit_now(limits, 600, "a")
    assert isinstance(first, Reservation)
    assert isinstance(answered(quotas.admit_now, limits, 500, "b"), Response)  # 600 + 500 > 1000
    clock[0] += 30
    first.close(100)  # 500 back, into the bucket of 30 s ago
    held = quotas.admit_now(limits, 500, "c")
    assert isinstance(held, Reservation)
    held.close(500)
    assert dict(held.headers)[b"x-ratelimit-remaining-requests"] == b"0"
    refused = answered(quotas.admit_now, limits, 1, "d")  # rpm 2 reached
    assert isinstance(refused, Response)
    # The first request's second leaves 61 s after it began: 31 s from now, not 30.
    assert dict(refused.raw_headers)[b"retry-after"] == b"31"
    clock[0] += 30.5
    assert isinstance(answered(quotas.admit_now, limits, 1, "e"), Response)
    clock[0] += 0.5
    third = quotas.admit_now(limits, 500, "f")  # the first one's tokens and refund are gone
    assert isinstance(third, Reservation)
    assert dict(third.headers)[b"x-ratelimit-remaining-tokens"] == b"0"


def test_a_key_without_tpm_counts_no_tokens_against_a_tpm_it_is_given_later() -> None:
    quotas = Quotas(clock=lambda: 1000.0)
    held = quotas.admit_now(KeyLimits("k", rpm=100), 100, "a")
    assert isinstance(held, Reservation)
    held.close(5000)  # no tpm: no token window to correct
    given = quotas.admit_now(KeyLimits("k", rpm=100, tpm=1000), 100, "b")  # keys reloaded
    assert isinstance(given, Reservation)
    assert dict(given.headers)[b"x-ratelimit-remaining-tokens"] == b"900"
