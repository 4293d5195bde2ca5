"""A request's way along its model's chains (router/request/placement/fallbacks.py), in process:
which target comes next, and the context check before the call."""

from __future__ import annotations

import dataclasses

from router.core.backend import Backend
from router.core.engine import NEVER
from router.core.errors import FallbackReason
from router.core.settings import BackendConfig, Settings
from router.request.placement.fallbacks import Fallbacks, body_fallbacks, context_limit, too_long

ERROR, CONTEXT, MID = (
    FallbackReason.ERROR,
    FallbackReason.CONTEXT_WINDOW,
    FallbackReason.MID_STREAM,
)


def backend(name: str, model: str, kind: str = "vllm") -> Backend:
    cfg = BackendConfig(name=name, url=f"http://{name}.invalid", models=[model], kind=kind)  # type: ignore[arg-type]
    return Backend.from_config(cfg)


FLEET = {
    "llama": (backend("v", "llama"),),
    "gpt": (backend("o", "gpt", "openai"),),
    "claude": (backend("c", "claude", "anthropic"),),
    "long": (backend("l", "long"),),
}


def fallbacks(**chains: object) -> Fallbacks:
    backends = [{"name": m, "url": f"http://{m}.invalid", "models": [m]} for m in FLEET]
    return Fallbacks(Settings(backends=backends, **chains))  # type: ignore[arg-type]


def test_targets_come_in_order_each_once() -> None:
    route = fallbacks(fallbacks={"llama": ["gpt", "long"]}).route("llama", None, None)
    assert route is not None
    assert [route.next(ERROR, FLEET), route.next(ERROR, FLEET), route.next(ERROR, FLEET)] == [
        "gpt",
        "long",
        None,
    ]


def test_a_target_the_key_may_not_use_the_body_did_not_name_or_nobody_serves_is_skipped() -> None:
    chains = fallbacks(fallbacks={"llama": ["gpt", "long"]})
    no_gpt = chains.route("llama", frozenset({"llama", "long"}), None)
    assert no_gpt is not None and no_gpt.next(ERROR, FLEET) == "long"
    only_gpt = chains.route("llama", None, ["gpt", "claude"])
    assert only_gpt is not None and only_gpt.next(ERROR, FLEET) == "gpt"
    assert only_gpt.next(ERROR, FLEET) is None  # "claude" is not in the chain: never added
    gone = chains.route("llama", None, None)
    assert gone is not None and gone.next(ERROR, {**FLEET, "gpt": ()}) == "long"


def test_a_target_that_cannot_serve_the_requests_api_is_skipped() -> None:
    chains = fallbacks(fallbacks={"llama": ["gpt", "claude"]})
    messages = chains.route("llama", None, None)
    assert messages is not None and messages.next(ERROR, FLEET, "anthropic") == "claude"
    chat = chains.route("llama", None, None)
    assert chat is not None and chat.next(ERROR, FLEET, "openai") == "gpt"
    assert chat.next(ERROR, FLEET, "openai") is None


def test_each_reason_takes_its_own_chain() -> None:
    chains = fallbacks(
        fallbacks={"llama": {"models": ["gpt"], "mid_stream": "error"}},
        context_window_fallbacks={"llama": ["long"]},
    )
    route = chains.route("llama", None, None)
    assert route is not None
    assert route.next(FallbackReason.CONTENT_POLICY, FLEET) is None  # no such chain
    assert route.next(MID, FLEET) is None  # mid_stream: error
    assert route.next(CONTEXT, FLEET) == "long"
    assert route.next(ERROR, FLEET) == "gpt"


def test_the_body_member() -> None:
    assert body_fallbacks({}) is None
    assert body_fallbacks({"fallbacks": []}) == []
    assert body_fallbacks({"fallbacks": ["gpt"]}) == ["gpt"]
    assert isinstance(body_fallbacks({"fallbacks": "gpt"}), str)
    assert isinstance(body_fallbacks({"fallbacks": [1]}), str)


def test_the_context_check_before_the_call() -> None:
    short = dataclasses.replace(NEVER, max_model_len=300)
    backends = FLEET["llama"]
    assert context_limit(backends, {"v": short}) == 300
    assert context_limit(backends, {"v": NEVER}) is None  # no report, no check
    assert context_limit(backends, {}) is None
    assert too_long(500, {}, 300)  # a prompt counted at 500 tokens
    assert not too_long(200, {}, 300)
    assert too_long(200, {"max_tokens": 200}, 300)  # 200 + 200 > 300
    assert too_long(200, {"max_completion_tokens": 200}, 300)
    assert not too_long(100, {"max_tokens": 200}, 300)  # exactly the context fits
    # A prompt not counted (no tokenizer) is 0, never a guess: only max_tokens alone decides.
    assert too_long(0, {"max_tokens": 301}, 300) and not too_long(0, {"max_tokens": 300}, 300)
    assert not too_long(0, {"max_tokens": True}, 300)
