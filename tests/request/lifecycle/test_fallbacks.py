"""Model fallbacks end to end: mock engines that refuse, rate-limit and die mid-answer, a mock cloud
that checks its API key, one real router, the official openai and anthropic SDKs.

`small` (two engines, a 300-token context they report in /v1/models, a router tokenizer that
counts its prompts) falls back to `cloud` (a
`kind: openai` backend whose key comes from `api_key_env`) on errors, content policy and
mid-stream, and to `big` when the prompt does not fit; `tiny` (one of those engines again, not
scraped, so the router learns its context only from its 400) falls back to `big` on the context
window, and its error chain says `mid_stream: error`. The chains are in LiteLLM's list form.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support.harness import (
    STARVED_S,
    Cluster,
    Proc,
    backend,
    control,
    free_port,
    metric,
    sha,
    stats,
)
from tests.support.otlp_receiver import Receiver, Span
from tests.support.tiny_tokenizer import write_tokenizer
from tests.support.tool_call import NAMED, TOOLS
from tests.support.wait import wait_for

TOKEN = "fallbacks-admin-token"
CLOUD_KEY = "sk-cloud-fallback-test"
MSG = [{"role": "user", "content": "hi"}]
LONG = [{"role": "user", "content": "x" * 2400}]  # over 300 tokens by any count
SMALL = ("s1", "s2")
ALL = ("s1", "s2", "big", "cloud")
POLICY = (
    '{"error": {"message": "Your request was rejected as a result of our safety system.", '
    '"type": "invalid_request_error", "param": null, "code": "content_policy_violation"}}'
)


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster, receiver: Receiver) -> dict[str, Proc]:
    short = ["--max-model-len", "300"]
    tokenizer = write_tokenizer(module_procs.tmp / "tokenizer")
    mocks = {
        "s1": module_procs.mock(
            "s1", tokens=40, engine_args=[*short, "--served-model-name", "small-model"]
        ),
        "s2": module_procs.mock(
            "s2", tokens=40, engine_args=[*short, "--served-model-name", "small-model"]
        ),
        "big": module_procs.mock("big", tokens=40),
        "cloud": module_procs.mock("cloud", tokens=40),
    }
    router = module_procs.router(
        {
            "backends": [
                backend("s1", mocks["s1"], {"small": "small-model"}),
                backend("s2", mocks["s2"], {"small": "small-model"}),
                # s1's engine again, under another name and not scraped: the router knows its
                # context only from its 400.
                backend("t1", mocks["s1"], {"tiny": "small-model"}, metrics_path=None),
                # s2's engine again, scraped (its context is known) but with no tokenizer: the
                # router does not guess its prompts' length, the engine's 400 decides.
                backend("u2", mocks["s2"], {"uncounted": "small-model"}),
                backend("big", mocks["big"], {"big": "big-model"}),
                backend(
                    "cloud",
                    mocks["cloud"],
                    {"cloud": "gpt-4o-mini"},
                    kind="openai",
                    api_key_env="FALLBACK_CLOUD_KEY",
                ),
                # Nothing listens there: every attempt is a connect failure.
                {"name": "dead", "url": f"http://127.0.0.1:{free_port()}", "models": ["gone"]},
                # The same mock cloud as Anthropic's Messages API (x-api-key, anthropic-version).
                backend(
                    "claude",
                    mocks["cloud"],
                    {"claude": "claude-sonnet"},
                    kind="anthropic",
                    api_key_env="FALLBACK_CLOUD_KEY",
                ),
            ],
            # LiteLLM's shapes, carried over as they are.
            "fallbacks": [
                {"small": ["cloud", "claude"]},
                {"tiny": {"models": ["big"], "mid_stream": "error"}},
                {"gone": ["big"]},
            ],
            "context_window_fallbacks": [
                {"small": ["big"]},
                {"tiny": ["big"]},
                {"uncounted": ["big"]},
            ],
            "content_policy_fallbacks": {"small": ["cloud"]},
            # A continuation may go to the cloud model (off by default for kind: openai).
            "migration": {"models": {"small": {"enabled": True}}},
            "balancer": "round_robin",
            "retries": {"attempts": 3},
            "outlier": {"consecutive_failures": 1000},
            "engine_metrics": {"interval": 0.1},
            # What counts `small`'s prompts for the check before the call (none: no check).
            "affinity": {"tokenizers": {"small": {"via": "router", "path": str(tokenizer)}}},
            "admin_token": TOKEN,
            "tracing": {"otlp_endpoint": receiver.url},
            "console": {"enabled": True},
            "api_keys": [
                {"sha256": sha("all"), "name": "all"},
                {"sha256": sha("nocloud"), "name": "nocloud", "models": ["small", "big", "tiny"]},
                {"sha256": sha("off"), "name": "off", "fallbacks": False},
                {"sha256": sha("one"), "name": "one", "max_parallel": 1},
            ],
        },
        env={"FALLBACK_CLOUD_KEY": CLOUD_KEY, "OTEL_BSP_SCHEDULE_DELAY": "50"},
    )
    fleet = {**mocks, "t1": mocks["s1"], "router": router}

    def context_known() -> bool:
        rows = httpx.get(router.url + "/admin/backends", headers=_admin(), timeout=STARVED_S).json()
        return all(
            (r.get("engine") or {}).get("max_model_len") == 300
            for r in rows
            if r["name"] in (*SMALL, "u2")
        )

    wait_for(context_known, "the small engines' max_model_len read from /v1/models")
    return fleet


def _admin() -> dict[str, str]:
    return {"authorization": f"Bearer {TOKEN}"}


def leased(router: Proc) -> int:
    """The router's in-flight count over all its backends (its admin API's)."""
    rows = httpx.get(router.url + "/admin/backends", headers=_admin(), timeout=STARVED_S).json()
    return sum(int(r["in_flight"]) for r in rows)


@pytest.fixture(autouse=True)
def _reset(fleet: dict[str, Proc]) -> None:
    for name in ALL:
        control(
            fleet[name],
            reset_stats=True,
            fail_status=0,
            fail_body=None,
            fail_at=[],
            hold=False,
            require_key=CLOUD_KEY if name == "cloud" else None,
            retry_after=None,
        )


def sdk(router: Proc, key: str = "all", timeout: float = 20) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def requests(fleet: dict[str, Proc], name: str) -> int:
    return int(stats(fleet[name])["requests"])


def fallbacks(router: Proc, reason: str, to: str) -> float:
    return metric(router, "sluicegate_fallbacks_total", reason=reason, to=to)


def both(fleet: dict[str, Proc], **changes: Any) -> None:
    for name in SMALL:
        control(fleet[name], **changes)


def ask_long(router: Proc, model: str) -> Any:
    """A chat request over `small`'s context, answered whole (the raw response)."""
    return sdk(router).chat.completions.with_raw_response.create(
        model=model,
        messages=LONG,  # type: ignore[arg-type]
        max_tokens=5,
    )


def broken_stream(fleet: dict[str, Proc], model: str = "small", **extra: Any) -> tuple[str, str]:
    """A stream that ends with an error event: (the text the client got, the error's text)."""
    text = ""
    with pytest.raises(openai.APIError) as caught:
        for c in sdk(fleet["router"]).chat.completions.create(
            model=model, messages=MSG, stream=True, max_tokens=40, **extra
        ):
            text += (c.choices[0].delta.content or "") if c.choices else ""
    return text, str(caught.value)


def released(fleet: dict[str, Proc], **engines_again: Any) -> None:
    """After a client left: no lease is left, and the key's one parallel slot was given back
    (it gets in again once the engines answer)."""
    router = fleet["router"]
    wait_for(lambda: leased(router) == 0, "no lease left")
    control(fleet["cloud"], hold=False)
    both(fleet, **engines_again)
    sdk(router, "one").chat.completions.create(model="small", messages=MSG, max_tokens=5)


def test_429_on_every_engine_falls_back_to_the_cloud_with_its_key(
    fleet: dict[str, Proc], receiver: Receiver
) -> None:
    router = fleet["router"]
    before = fallbacks(router, "error", "cloud")
    both(fleet, fail_status=429)
    raw = sdk(router).chat.completions.with_raw_response.create(
        model="small", messages=MSG, max_tokens=5, extra_headers={"x-request-id": "fell-back"}
    )
    answer = raw.parse()
    assert raw.headers["x-sluicegate-model"] == "cloud"
    assert answer.model == "gpt-4o-mini"  # the served model's body, as it gave it
    assert requests(fleet, "s1") >= 1 and requests(fleet, "s2") >= 1  # its own tried first
    seen = stats(fleet["cloud"])["recent"][-1]
    assert seen["authorization"] == f"Bearer {CLOUD_KEY}"  # never the client's own key
    assert fallbacks(router, "error", "cloud") == before + 1
    # The log line says which model was asked for, the trace when it moved and why.
    wait_for(lambda: '"fallback_from": "small"' in router.log(), "the log line's fallback_from")
    line = next(
        ln for ln in router.log().splitlines() if "fell-back" in ln and "fallback_from" in ln
    )
    assert '"model": "cloud"' in line

    def moved(spans: list[Span]) -> bool:
        return any(
            s.event("fallback")
            for s in spans
            if s.attributes.get("sluicegate.request_id") == "fell-back"
        )

    spans = receiver.wait_for(moved)
    (event,) = [
        s.event("fallback")
        for s in spans
        if s.attributes.get("sluicegate.request_id") == "fell-back" and s.event("fallback")
    ]
    assert event is not None
    assert event[2] == {
        "sluicegate.fallback.from": "small",
        "sluicegate.fallback.to": "cloud",
        "sluicegate.fallback.reason": "error",
    }


def test_the_body_fallbacks_is_never_forwarded(fleet: dict[str, Proc]) -> None:
    sdk(fleet["router"]).chat.completions.create(
        model="small", messages=MSG, max_tokens=5, extra_body={"fallbacks": ["cloud"]}
    )
    (seen,) = [r for name in SMALL for r in stats(fleet[name])["recent"]]
    assert "messages" in seen["fields"] and "fallbacks" not in seen["fields"]


def test_engines_cooling_down_are_not_asked_again(fleet: dict[str, Proc]) -> None:
    """A 429 with Retry-After cools its engine down: the next request finds no capacity and
    falls back without asking them again."""
    router = fleet["router"]
    both(fleet, fail_status=429, retry_after=1)
    client = sdk(router)
    client.chat.completions.create(model="small", messages=MSG, max_tokens=5)
    asked = requests(fleet, "s1") + requests(fleet, "s2")
    raw = client.chat.completions.with_raw_response.create(
        model="small", messages=MSG, max_tokens=5
    )
    assert raw.headers["x-sluicegate-model"] == "cloud"
    assert requests(fleet, "s1") + requests(fleet, "s2") == asked  # not asked again
    both(fleet, fail_status=0, retry_after=None)

    def cooled() -> bool:
        rows = httpx.get(router.url + "/admin/backends", headers=_admin(), timeout=STARVED_S).json()
        return all(r["healthy"] for r in rows if r["name"] in SMALL)

    wait_for(cooled, "the cool-down's end", within=5)


def test_an_answer_without_fallback_names_its_model(fleet: dict[str, Proc]) -> None:
    raw = sdk(fleet["router"]).chat.completions.with_raw_response.create(
        model="small", messages=MSG, max_tokens=5
    )
    assert raw.headers["x-sluicegate-model"] == "small"
    assert raw.parse().model == "small-model"


def test_a_prompt_over_the_context_goes_to_the_long_model_before_the_call(
    fleet: dict[str, Proc],
) -> None:
    router = fleet["router"]
    before = fallbacks(router, "context_window", "big")
    raw = ask_long(router, "small")
    assert raw.headers["x-sluicegate-model"] == "big"
    assert raw.parse().model == "big-model"
    assert requests(fleet, "s1") == requests(fleet, "s2") == 0  # not asked at all
    assert fallbacks(router, "context_window", "big") == before + 1


def test_a_prompt_over_the_context_goes_to_the_long_model_after_the_engines_400(
    fleet: dict[str, Proc],
) -> None:
    router = fleet["router"]
    before = fallbacks(router, "context_window", "big")
    raw = ask_long(router, "tiny")
    assert raw.headers["x-sluicegate-model"] == "big"
    assert requests(fleet, "t1") == 1 and requests(fleet, "big") == 1
    assert fallbacks(router, "context_window", "big") == before + 1


def test_a_prompt_no_tokenizer_counts_is_not_guessed_but_left_to_the_engines_400(
    fleet: dict[str, Proc],
) -> None:
    router = fleet["router"]
    before = fallbacks(router, "context_window", "big")
    raw = ask_long(router, "uncounted")  # its bytes / 4 alone are over the context
    assert raw.headers["x-sluicegate-model"] == "big"
    assert requests(fleet, "s2") == 1 and requests(fleet, "big") == 1  # asked, refused
    assert fallbacks(router, "context_window", "big") == before + 1


def test_a_content_policy_refusal_falls_back(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    before = fallbacks(router, "content_policy", "cloud")
    both(fleet, fail_status=400, fail_body=POLICY)
    raw = sdk(router).chat.completions.with_raw_response.create(
        model="small", messages=MSG, max_tokens=5
    )
    assert raw.headers["x-sluicegate-model"] == "cloud"
    assert requests(fleet, "s1") + requests(fleet, "s2") == 1  # one engine's refusal is enough
    assert fallbacks(router, "content_policy", "cloud") == before + 1


def test_an_ordinary_400_reaches_the_client_unchanged(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    both(fleet, fail_status=400)  # the engine's own bad-parameter answer
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(router).chat.completions.create(model="small", messages=MSG, max_tokens=5)
    assert "failing on purpose" in str(caught.value)
    assert requests(fleet, "s1") + requests(fleet, "s2") == 1  # not another engine either
    assert caught.value.response.headers["x-sluicegate-model"] == "small"
    assert requests(fleet, "cloud") == requests(fleet, "big") == 0


@pytest.mark.parametrize(
    ("key", "extra"),
    [
        ("nocloud", {}),  # the key may not use the cloud model
        ("off", {}),  # the key's entry turned fallbacks off
        ("all", {"fallbacks": []}),  # the request's body did
        ("all", {"fallbacks": ["big"]}),  # a body never adds a target the chain lacks
    ],
)
def test_without_an_allowed_target_the_client_gets_the_original_error(
    fleet: dict[str, Proc], key: str, extra: dict[str, Any]
) -> None:
    both(fleet, fail_status=429)
    with pytest.raises(openai.RateLimitError) as caught:
        sdk(fleet["router"], key).chat.completions.create(
            model="small", messages=MSG, max_tokens=5, extra_body=extra
        )
    assert "failing on purpose" in str(caught.value)  # the engine's own answer
    assert requests(fleet, "cloud") == requests(fleet, "big") == 0


def test_a_body_fallbacks_that_is_not_a_list_is_refused(fleet: dict[str, Proc]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(fleet["router"]).chat.completions.create(
            model="small", messages=MSG, max_tokens=5, extra_body={"fallbacks": "cloud"}
        )
    assert caught.value.code == "invalid_fallbacks"


def test_a_stream_cut_mid_way_continues_on_the_fallback_and_ends_with_done(
    fleet: dict[str, Proc],
) -> None:
    router = fleet["router"]
    before = fallbacks(router, "mid_stream", "cloud")
    both(fleet, fail_at=[10, 20])  # each engine of `small` dies: the second after the first
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json={"model": "small", "messages": MSG, "stream": True, "max_tokens": 40},
        headers={"authorization": "Bearer all"},
        timeout=20,
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = sdk_chunks(lines[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "".join(f"tok{i} " for i in range(40))  # nothing repeated, nothing lost
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")) == 1
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert requests(fleet, "cloud") == 1
    assert fallbacks(router, "mid_stream", "cloud") == before + 1


def sdk_chunks(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: ") :]) for line in lines]


def test_a_half_streamed_tool_call_ends_with_the_error_event(fleet: dict[str, Proc]) -> None:
    both(fleet, fail_at=[10])
    args = ""
    with pytest.raises(openai.APIError) as caught:
        for c in sdk(fleet["router"]).chat.completions.create(
            model="small",
            messages=MSG,
            stream=True,
            max_tokens=40,
            tools=TOOLS,
            tool_choice=NAMED,
        ):
            for call in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                assert call.function is not None
                args += call.function.arguments or ""
    assert "Not migrated: a tool call was streaming." in str(caught.value)
    assert args == "".join(f"tok{i} " for i in range(10))  # no invented text
    assert requests(fleet, "cloud") == 0


def test_a_chain_with_mid_stream_error_ends_the_stream(fleet: dict[str, Proc]) -> None:
    control(fleet["t1"], fail_at=[10])
    _, error = broken_stream(fleet, "tiny")
    assert "No backend could continue it." in error
    assert requests(fleet, "big") == 0


def test_the_usage_book_charges_the_served_model(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]

    def booked(model: str) -> int:
        r = httpx.get(
            router.url + "/admin/usage",
            params={"key": "all", "model": model},
            headers=_admin(),
            timeout=5,
        )
        r.raise_for_status()
        return sum(int(row["completion_tokens"]) for row in r.json()["data"])

    cloud, small = booked("cloud"), booked("small")
    both(fleet, fail_status=429)
    sdk(router).chat.completions.create(model="small", messages=MSG, max_tokens=7)
    wait_for(lambda: booked("cloud") == cloud + 7, "the cloud model charged")
    assert booked("small") == small


def test_messages_requests_fall_back_too(fleet: dict[str, Proc]) -> None:
    client = anthropic.Anthropic(
        base_url=fleet["router"].url, api_key="all", max_retries=0, timeout=20
    )
    raw = client.messages.with_raw_response.create(
        model="small",
        max_tokens=5,
        messages=LONG,  # type: ignore[arg-type]
    )
    assert raw.headers["x-sluicegate-model"] == "big"
    assert raw.parse().content
    assert requests(fleet, "s1") == requests(fleet, "s2") == 0


def test_a_messages_request_falls_back_to_the_anthropic_backend_only(
    fleet: dict[str, Proc],
) -> None:
    router = fleet["router"]
    before = fallbacks(router, "error", "claude")
    both(fleet, fail_status=429)
    client = anthropic.Anthropic(base_url=router.url, api_key="all", max_retries=0, timeout=20)
    raw = client.messages.with_raw_response.create(
        model="small",
        max_tokens=5,
        messages=MSG,  # type: ignore[arg-type]
    )
    assert raw.headers["x-sluicegate-model"] == "claude"  # `cloud` speaks no Messages API
    assert raw.parse().model == "claude-sonnet"
    seen = stats(fleet["cloud"])["recent"][-1]
    assert seen["path"] == "/v1/messages"
    assert seen["headers"]["x-api-key"] == CLOUD_KEY
    assert seen["headers"]["anthropic-version"] == "2023-06-01"
    assert "authorization" not in seen["headers"]
    assert requests(fleet, "cloud") == 1  # the openai-kind model was never asked
    assert fallbacks(router, "error", "claude") == before + 1


def test_a_connect_failure_falls_back(fleet: dict[str, Proc]) -> None:
    raw = sdk(fleet["router"]).chat.completions.with_raw_response.create(
        model="gone", messages=MSG, max_tokens=5
    )
    assert raw.headers["x-sluicegate-model"] == "big"
    assert requests(fleet, "big") == 1


@pytest.mark.parametrize(("extra", "why"), [({"n": 2}, "n > 1"), ({"logprobs": True}, "logprobs")])
def test_what_cannot_continue_honestly_ends_with_the_error_event(
    fleet: dict[str, Proc], extra: dict[str, Any], why: str
) -> None:
    both(fleet, fail_at=[10])
    text, error = broken_stream(fleet, **extra)
    assert f"Not migrated: it asks for {why}." in error
    assert text == "".join(f"tok{i} " for i in range(10))
    assert requests(fleet, "cloud") == 0


def test_a_target_that_rejects_the_prefill_ends_with_the_error_event(
    fleet: dict[str, Proc],
) -> None:
    both(fleet, fail_at=[10, 20])
    control(fleet["cloud"], fail_status=400)  # refuses the continuation
    text, error = broken_stream(fleet)
    assert "No backend could continue it." in error
    assert text == "".join(f"tok{i} " for i in range(20))  # nothing invented
    assert requests(fleet, "cloud") == 1


def test_the_admin_api_shows_the_chains(fleet: dict[str, Proc]) -> None:
    rows = httpx.get(fleet["router"].url + "/admin/fallbacks", headers=_admin(), timeout=STARVED_S)
    chains = {(r["model"], r["kind"]): r for r in rows.json()["data"]}
    assert chains[("small", "fallbacks")]["to"] == ["cloud", "claude"]
    assert chains[("tiny", "fallbacks")]["mid_stream"] == "error"
    assert chains[("small", "context_window_fallbacks")]["to"] == ["big"]
    assert chains[("small", "content_policy_fallbacks")]["to"] == ["cloud"]
    live = httpx.get(fleet["router"].url + "/console/api/live", headers=_admin(), timeout=STARVED_S)
    assert live.json()["fallbacks"] == rows.json()["data"]  # the console shows the same


def test_nothing_leaks_when_the_client_leaves_during_the_fallback(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    both(fleet, fail_status=429)
    control(fleet["cloud"], hold=True)
    with pytest.raises(openai.APITimeoutError):
        sdk(router, "one", timeout=1).chat.completions.create(
            model="small", messages=MSG, max_tokens=5
        )
    released(fleet, fail_status=0)


def test_nothing_leaks_when_the_client_leaves_a_stream_continued_on_the_fallback(
    fleet: dict[str, Proc],
) -> None:
    router = fleet["router"]
    both(fleet, fail_at=[10, 20])
    control(fleet["cloud"], hold=True)
    with pytest.raises((openai.APITimeoutError, httpx.ReadTimeout)):
        for _ in sdk(router, "one", timeout=1).chat.completions.create(
            model="small", messages=MSG, stream=True, max_tokens=40
        ):
            pass
    released(fleet, fail_at=[])
