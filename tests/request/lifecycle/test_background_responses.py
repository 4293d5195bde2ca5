"""Responses with `background: true` under the key's tpm (issue 46, defect 3): the engine answers
at once (`status: queued`, `usage: null`) and generates on, so the answer's usage says nothing of
the work. Such a response is charged, and booked, its whole estimate (prompt + max_output_tokens)
by the request that made it; the GETs that fetch it cost requests, not tokens.

The mock engine's background mode, as vLLM's: queued at once, GET returns it done with its usage
later, cancel stops it. Real router, the official openai SDK.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.support.harness import Cluster, Proc, backend, booked, control, sha, stats
from tests.support.wait import wait_for

ADMIN = "admin-background-token-0123456789"
TPM = 2000
BUDGET = 1000
KEY = "sk-background-0123456789"
OPEN = "sk-background-open-0123456789"


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    mock = module_procs.mock("a")
    router = module_procs.router(
        {
            "backends": [backend("a", mock)],
            "api_keys": [
                {"sha256": sha(KEY), "name": "bg", "tpm": TPM},
                {"sha256": sha(OPEN), "name": "open"},
            ],
        },
        env={"SLUICEGATE_ADMIN_TOKEN": ADMIN},
    )
    return {"router": router, "mock": mock}


def sdk(router: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=20)


def finished(client: openai.OpenAI, response_id: str, within: float = 30.0) -> Any:
    got: list[Any] = []

    def done() -> bool:
        got.append(client.responses.retrieve(response_id))
        return got[-1].status not in ("queued", "in_progress")

    wait_for(done, f"{response_id} finished", within, 0.05)
    return got[-1]


def test_background_responses_are_charged_their_whole_estimate(fleet: dict[str, Proc]) -> None:
    router, mock = fleet["router"], fleet["mock"]
    control(mock, itl_ms=1)  # each takes about a second: generation goes on after the answer
    client = sdk(router, KEY)
    made, refused = [], 0
    for _ in range(20):
        try:
            r = client.responses.create(
                model="m", input="write a lot", max_output_tokens=BUDGET, background=True
            )
        except openai.RateLimitError as exc:
            assert "tokens per minute" in str(exc)
            refused += 1
            continue
        assert r.status == "queued" and r.usage is None and r.background is True
        made.append(r.id)
    # ~1,010 tokens each against 2,000 a minute: one, and never the 20 that went through.
    assert 1 <= len(made) <= TPM // BUDGET and refused == 20 - len(made)
    for response_id in made:
        done = finished(client, response_id)
        assert done.usage is not None and done.usage.output_tokens == BUDGET
        assert done.output_text.startswith("tok0 tok1 ")
    assert stats(mock)["tokens_generated"] >= len(made) * BUDGET
    # The usage book holds what the quota charged: the estimate, marked estimated; the GETs
    # that fetched the outputs added nothing.
    book = booked(router, "bg", ADMIN)
    assert book["requests"] == book["estimated_requests"] == len(made)
    assert book["prompt_tokens"] + book["completion_tokens"] >= len(made) * BUDGET


def test_background_response_through_get_and_cancel(fleet: dict[str, Proc]) -> None:
    router, mock = fleet["router"], fleet["mock"]
    control(mock, itl_ms=20, reset_stats=True)  # 100 s for 5,000 tokens: cancelled long before
    client = sdk(router, OPEN)
    try:
        r = client.responses.create(
            model="m", input="go on", max_output_tokens=5000, background=True
        )
        assert r.status == "queued"
        wait_for(lambda: client.responses.retrieve(r.id).status == "in_progress", "generating")
        cancelled = client.responses.cancel(r.id)
        assert cancelled.status == "cancelled"
        wait_for(lambda: stats(mock)["running"] == 0, "the generation stopped")
        assert stats(mock)["aborted"] == 1
        assert client.responses.retrieve(r.id).status == "cancelled"
        with pytest.raises(openai.BadRequestError):  # vLLM: only a running one can be
            client.responses.cancel(r.id)
        # As vLLM's: background needs a stored response.
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="m", input="x", background=True, store=False)
        assert "store" in str(refused.value)
    finally:
        control(mock, itl_ms=0)
