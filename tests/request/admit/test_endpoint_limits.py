"""Every endpoint row under the client key's limits (issue 46, defect 6): each row of the
endpoint table states its `rpm`, `parallel` and `tpm` treatment, and this file walks the table,
sending each row's own request through a real router to the mock engine and checking it does
what its row states. A row added without a request here fails `test_every_row_is_walked`.

Also the two cases as they were found: 60 concurrent `/v1/messages/count_tokens` under rpm 3 and
max_parallel 1 all reached the engine, and non-streamed audio transcriptions were counted as 0
tokens (so tpm never refused them).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from router.core.endpoints import ENDPOINTS, Endpoint
from router.request.admit.quota import KeyLimits
from router.request.lifecycle.getting_in import limits_for
from tests.support.harness import Cluster, Proc, backend, booked, control, sha, stats
from tests.support.wait import wait_for

ADMIN = "admin-limits-token-0123456789"
RPM = 3
ROWS = {(e.method, e.path): e for e in ENDPOINTS}
AUDIO = b"RIFF" + bytes(range(256)) * 8


def rpm_key(i: int) -> str:
    return f"sk-walk-rpm-{i:02d}-0123456789"


def par_key(i: int) -> str:
    return f"sk-walk-par-{i:02d}-0123456789"


SPENT = "sk-walk-spent-0123456789"  # its token window used up before the walk
COUNT = "sk-walk-count-0123456789"
SPEAK = "sk-walk-audio-0123456789"
SPEAK_TPM = 2000
AUDIO_TOKENS = 500


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    mock = module_procs.mock("a", tokens=2)
    speech = module_procs.mock("speech", tokens=AUDIO_TOKENS)
    keys: list[dict[str, Any]] = []
    for i in range(len(ENDPOINTS)):
        keys.append({"sha256": sha(rpm_key(i)), "name": f"rpm{i}", "rpm": RPM})
        keys.append({"sha256": sha(par_key(i)), "name": f"par{i}", "max_parallel": 1})
    keys += [
        {"sha256": sha(SPENT), "name": "spent", "tpm": 300},
        {"sha256": sha(COUNT), "name": "count", "rpm": 3, "max_parallel": 1},
        {"sha256": sha(SPEAK), "name": "speak", "tpm": SPEAK_TPM},
    ]
    router = module_procs.router(
        {
            "backends": [
                backend("a", mock),
                backend("speech", speech, {"whisper": "mock-model"}),
            ],
            "api_keys": keys,
        },
        env={"SLUICEGATE_ADMIN_TOKEN": ADMIN},
    )
    return {"router": router, "mock": mock, "speech": speech}


@pytest.fixture(autouse=True)
def _released(fleet: dict[str, Proc]) -> Iterator[None]:
    yield
    control(fleet["mock"], hold=False)


# --- one request per row ------------------------------------------------------------------------

Send = Callable[[str, str], httpx.Response]  # (key, response id) -> the router's answer
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _json(path: str, body: dict[str, Any], method: str = "POST") -> Send:
    def send(key: str, response_id: str) -> httpx.Response:
        return httpx.request(
            method,
            URL[0] + path.replace("{response_id}", response_id),
            json=body if method == "POST" else None,
            headers={"authorization": f"Bearer {key}"},
            timeout=20,
        )

    return send


def _form(path: str) -> Send:
    def send(key: str, response_id: str) -> httpx.Response:
        return httpx.post(
            URL[0] + path,
            data={"model": "m"},
            files={"file": ("speech.wav", AUDIO, "audio/wav")},
            headers={"authorization": f"Bearer {key}"},
            timeout=20,
        )

    return send


URL = [""]  # the router's, set by `router_url`
REQUESTS: dict[tuple[str, str], Send] = {
    ("POST", "/v1/chat/completions"): _json("/v1/chat/completions", {**CHAT, "max_tokens": 2}),
    ("POST", "/v1/completions"): _json(
        "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}
    ),
    ("POST", "/v1/responses"): _json(
        "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 2}
    ),
    ("GET", "/v1/responses/{response_id}"): _json("/v1/responses/{response_id}", {}, "GET"),
    ("POST", "/v1/responses/{response_id}/cancel"): _json("/v1/responses/{response_id}/cancel", {}),
    ("POST", "/v1/messages"): _json("/v1/messages", {**CHAT, "max_tokens": 2}),
    ("POST", "/v1/messages/count_tokens"): _json("/v1/messages/count_tokens", CHAT),
    ("POST", "/tokenize"): _json("/tokenize", {"model": "m", "prompt": "hi"}),
    ("POST", "/detokenize"): _json("/detokenize", {"model": "m", "tokens": [1, 2]}),
    ("POST", "/v1/embeddings"): _json("/v1/embeddings", {"model": "m", "input": "hi"}),
    ("POST", "/pooling"): _json("/pooling", {"model": "m", "input": "hi"}),
    ("POST", "/classify"): _json("/classify", {"model": "m", "input": "hi"}),
    **{
        ("POST", p): _json(p, {"model": "m", "text_1": "a", "text_2": "b"})
        for p in ("/score", "/v1/score")
    },
    **{
        ("POST", p): _json(p, {"model": "m", "query": "q", "documents": ["d"]})
        for p in ("/rerank", "/v1/rerank", "/v2/rerank")
    },
    ("POST", "/v1/audio/transcriptions"): _form("/v1/audio/transcriptions"),
    ("POST", "/v1/audio/translations"): _form("/v1/audio/translations"),
}


@pytest.fixture
def router_url(fleet: dict[str, Proc]) -> str:
    URL[0] = fleet["router"].url
    return URL[0]


def stored_response(router: str, key: str) -> str:
    """A stored response made with `key` (a row that follows one needs it); costs 1 request."""
    r = httpx.post(
        router + "/v1/responses",
        json={"model": "m", "input": "hi", "max_output_tokens": 2},
        headers={"authorization": f"Bearer {key}"},
        timeout=20,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def refused_for(r: httpx.Response) -> str | None:
    """Which limit a 429 names ('requests', 'parallel', 'tokens'); None: not refused."""
    if r.status_code != 429:
        return None
    message = json.loads(r.text)["error"]["message"]
    for what in ("parallel", "tokens", "requests"):  # "parallel requests" first
        if what in message:
            return what
    raise AssertionError(message)


def row_id(e: Endpoint) -> str:
    return f"{e.method} {e.path}"


# --- the table ----------------------------------------------------------------------------------


def test_every_row_is_walked() -> None:
    assert set(REQUESTS) == set(ROWS), "each endpoint row needs its request in REQUESTS"


def test_a_row_must_state_its_limits() -> None:
    with pytest.raises(TypeError):
        Endpoint("/v1/new", parallel=True, tpm="none")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Endpoint("/v1/new", rpm=True, tpm="none")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Endpoint("/v1/new", rpm=True, parallel=True)  # type: ignore[call-arg]
    for row in ENDPOINTS:
        # Tokens charged are tokens counted at the end, and the other way round: a row whose
        # answer is counted in the usage book is charged to the key's tpm.
        assert (row.tpm == "estimate") == row.counts_tokens, row_id(row)


def test_a_row_passes_on_only_the_limits_it_states() -> None:
    limits = KeyLimits("k", rpm=3, tpm=1000, max_parallel=1)
    assert limits_for(ROWS[("POST", "/v1/chat/completions")], limits) is limits
    assert limits_for(ROWS[("POST", "/tokenize")], limits) == KeyLimits("k", 3, None, 1)
    free = Endpoint("/v1/new", rpm=False, parallel=False, tpm="none")
    assert not free.limited
    assert limits_for(free, limits) == KeyLimits("k", None, None, None)
    rpm_only = Endpoint("/v1/new", rpm=True, parallel=False, tpm="none")
    assert limits_for(rpm_only, limits) == KeyLimits("k", 3, None, None)


@pytest.mark.parametrize("row", ENDPOINTS, ids=row_id)
def test_each_row_counts_against_rpm_as_it_states(router_url: str, row: Endpoint) -> None:
    key = rpm_key(ENDPOINTS.index(row))
    send = REQUESTS[(row.method, row.path)]
    used = 0
    response_id = ""
    if row.state == "follows":
        response_id = stored_response(router_url, key)
        used = 1
    answers = [send(key, response_id) for _ in range(RPM + 2 - used)]
    refused = [refused_for(r) for r in answers]
    for r in answers:
        assert r.status_code < 500, (r.status_code, r.text)
    if row.rpm:
        assert refused == [None] * (RPM - used) + ["requests"] * 2, refused
    else:
        assert refused == [None] * len(answers), refused


@pytest.mark.parametrize("row", ENDPOINTS, ids=row_id)
def test_each_row_holds_a_parallel_slot_as_it_states(
    router_url: str, fleet: dict[str, Proc], row: Endpoint
) -> None:
    key = par_key(ENDPOINTS.index(row))
    send = REQUESTS[(row.method, row.path)]
    mock = fleet["mock"]
    response_id = stored_response(router_url, key) if row.state == "follows" else ""
    control(mock, hold=True)
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(send(key, response_id)))]
    threads[0].start()
    try:
        wait_for(lambda: stats(mock)["held"] == 1, "the first request held at the engine")
        if row.parallel:
            second = send(key, response_id)  # answered by the router at once
            assert refused_for(second) == "parallel", (second.status_code, second.text)
        else:  # not checked: it reaches the engine beside the first
            threads.append(threading.Thread(target=lambda: answers.append(send(key, response_id))))
            threads[1].start()
            wait_for(lambda: stats(mock)["held"] == 2, "the second request held beside it")
    finally:
        control(mock, hold=False)
        for t in threads:
            t.join(20)
    assert len(answers) == len(threads)
    assert all(refused_for(r) is None for r in answers), answers


@pytest.fixture(scope="module")
def spent(fleet: dict[str, Proc]) -> str:
    """The SPENT key, a stored response of its own made first, then its token window used up:
    a completion without `max_tokens` is estimated at the default budget (256, within the
    window), and the engine generates 500."""
    router = fleet["router"].url
    response_id = stored_response(router, SPENT)
    r = httpx.post(
        router + "/v1/completions",
        json={"model": "whisper", "prompt": "hi"},
        headers={"authorization": f"Bearer {SPENT}"},
        timeout=20,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == AUDIO_TOKENS
    return response_id


@pytest.mark.parametrize("row", ENDPOINTS, ids=row_id)
def test_each_row_is_charged_tokens_as_it_states(
    router_url: str, spent: str, row: Endpoint
) -> None:
    answer = REQUESTS[(row.method, row.path)](SPENT, spent)
    if row.tpm == "estimate":
        assert refused_for(answer) == "tokens", (answer.status_code, answer.text)
    else:
        # Neither charged nor refused by tokens: a key out of tokens may still use it.
        assert refused_for(answer) is None, answer.text
        assert not [h for h in answer.headers if h.startswith("x-ratelimit-limit-tokens")]


# --- the cases as found -------------------------------------------------------------------------


def test_concurrent_count_tokens_are_held_to_rpm_and_max_parallel(fleet: dict[str, Proc]) -> None:
    router, mock = fleet["router"], fleet["mock"]
    before = sum(r["path"] == "/v1/messages/count_tokens" for r in stats(mock)["recent"])
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x" * (256 * 1024)}],
    }

    def count(_: int) -> int:
        return httpx.post(
            router.url + "/v1/messages/count_tokens",
            json=body,
            headers={"x-api-key": COUNT},
            timeout=30,
        ).status_code

    with ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(count, range(60)))
    reached = sum(r["path"] == "/v1/messages/count_tokens" for r in stats(mock)["recent"])
    assert codes.count(200) <= 3 and codes.count(429) >= 57, codes
    assert reached - before == codes.count(200)


def test_non_streamed_transcriptions_are_counted_and_held_to_tpm(fleet: dict[str, Proc]) -> None:
    router, speech = fleet["router"], fleet["speech"]
    before = stats(speech)["tokens_generated"]
    codes = []
    for _ in range(10):
        r = httpx.post(
            router.url + "/v1/audio/transcriptions",
            data={"model": "whisper"},
            files={"file": ("speech.wav", AUDIO, "audio/wav")},
            headers={"authorization": f"Bearer {SPEAK}"},
            timeout=20,
        )
        codes.append(r.status_code)
        if r.status_code == 429:
            break
        assert r.status_code == 200 and r.json()["usage"]["type"] == "duration", r.text
    generated = stats(speech)["tokens_generated"] - before
    # 500 tokens each against 2000 a minute: refused before the 2000 are far behind.
    assert codes[-1] == 429, codes
    assert generated <= SPEAK_TPM + AUDIO_TOKENS
    book = booked(router, "speak", ADMIN)
    # Counted from the text in the body (bytes / 4), marked estimated: never below the engine's.
    assert book["completion_tokens"] >= generated > 0
    assert book["estimated_requests"] == codes.count(200)
