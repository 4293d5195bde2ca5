"""Usage that the router must estimate or bound (issue 46): an abandoned non-streamed request is
booked in the usage book and metrics as it is charged, its whole estimate, not 0 (defect 22);
a continuing engine's `/tokenize` count is bounded by the text it was shown, so a lying engine
cannot charge a key a billion tokens (defect 14). Real router, mock engines, the openai SDK.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from router.request.admit.estimate import estimate_tokens
from tests.support.harness import (
    Cluster,
    Proc,
    backend,
    booked,
    control,
    expected_text,
    metric,
    sha,
    stats,
)
from tests.support.wait import wait_for

ADMIN = "admin-bounds-token-0123456789"
GONE = "sk-bounds-gone-0123456789"
MOVED = "sk-bounds-moved-0123456789"
MOVED_TPM = 5000
BREAK_AT = 10  # the first engine closes the stream before this token
LIE = 999_999_999  # the continuing engine's /tokenize count, whatever the text


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    slow = module_procs.mock("slow", itl_ms=20)
    a = module_procs.mock("a", tokens=40)
    b = module_procs.mock("b", tokens=40)
    router = module_procs.router(
        {
            "backends": [
                backend("slow", slow, {"slow": "mock-model"}),
                backend("a", a, {"m": "mock-model"}, weight=1000),
                backend("b", b, {"m": "mock-model"}),
            ],
            "balancer": "round_robin",
            "api_keys": [
                {"sha256": sha(GONE), "name": "gone"},
                {"sha256": sha(MOVED), "name": "moved", "tpm": MOVED_TPM},
            ],
        },
        env={"SLUICEGATE_ADMIN_TOKEN": ADMIN},
    )
    return {"router": router, "slow": slow, "a": a, "b": b}


def test_an_abandoned_whole_answer_is_booked_at_its_estimate(fleet: dict[str, Proc]) -> None:
    router, slow = fleet["router"], fleet["slow"]
    # ~2 s of generation; the client gives up after 0.3 s, before any response head.
    body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    estimate = estimate_tokens(body, len(httpx.Request("POST", "/", json=body).content))
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            router.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {GONE}"},
            timeout=0.3,
        )
    wait_for(lambda: booked(router, "gone", ADMIN)["requests"] == 1, "the abandoned request booked")
    book = booked(router, "gone", ADMIN)
    assert book["prompt_tokens"] + book["completion_tokens"] == estimate
    assert book["estimated_requests"] == 1
    counted = metric(router, "sluicegate_tokens_total", key="gone", kind="prompt") + metric(
        router, "sluicegate_tokens_total", key="gone", kind="completion"
    )
    assert counted == estimate
    wait_for(lambda: stats(slow)["running"] == 0, "the engine stopped")


def test_a_lying_tokenize_count_is_bounded_by_the_text(fleet: dict[str, Proc]) -> None:
    router, a, b = fleet["router"], fleet["a"], fleet["b"]
    control(a, fail_at=[BREAK_AT])  # a breaks every stream; b continues it
    control(b, tokenize_count=LIE)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=MOVED, max_retries=0, timeout=20)
    try:
        chunks = list(
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "tell me a story"}],
                max_tokens=40,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    finally:
        control(a, fail_at=[])
        control(b, tokenize_count=-1)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(40)  # migrated: a's 10 tokens, then b's
    usage = chunks[-1].usage
    assert usage is not None
    # b said the 10 relayed tokens were 999,999,999; they are at most their text's bytes (+8).
    most = 40 + len(expected_text(BREAK_AT).encode()) + 8
    assert 40 <= usage.completion_tokens <= most
    wait_for(lambda: booked(router, "moved", ADMIN)["requests"] == 1, "the request booked")
    book = booked(router, "moved", ADMIN)
    assert book["completion_tokens"] <= most
    # The key is not locked out: its next request is admitted.
    again = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert again.usage is not None and again.usage.completion_tokens == 5
