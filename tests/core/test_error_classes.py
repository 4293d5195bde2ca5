"""The error map's fallback classes (router/core/errors.py `refusal_reason`): each engine
version's context-length wording, as that version writes it, is a context-window refusal; the
providers' content-policy codes are content-policy refusals; an ordinary 400 is neither."""

from __future__ import annotations

import json

import pytest

from router.core.errors import CONTEXT_WINDOW_TEXTS, FallbackReason, refusal_reason


def vllm_error(message: str) -> bytes:
    """vLLM's error body (its `ErrorResponse`)."""
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    return json.dumps(body).encode()


# One body per row of CONTEXT_WINDOW_TEXTS, in the wording of that version.
SAMPLES = {
    "vllm-0.6": vllm_error(
        "This model's maximum context length is 4096 tokens. However, you requested 5000 "
        "tokens (4000 in the messages, 1000 in the completion). Please reduce the length of "
        "the messages or completion."
    ),
    "vllm-0.8": vllm_error(
        "This model's maximum context length is 2048 tokens. However, your request has 3000 "
        "input tokens. Please reduce the length of the input messages."
    ),
    "vllm-0.9": vllm_error(
        "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum "
        "context length is 4096 tokens and your request has 2778 input tokens "
        "(8000 > 4096 - 2778)."
    ),
    "vllm-0.11": vllm_error(
        "The decoder prompt (length 5000) is longer than the maximum model length of 4096. "
        "Make sure that `max_model_len` is no smaller than the number of text tokens."
    ),
    "vllm-0.32": vllm_error(
        "This model's maximum context length is 300 tokens. However, your prompt contains at "
        "least 301 input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt."
    ),
    "vllm-0.32-max-tokens": vllm_error(
        "max_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer "
        "output tokens."
    ),
    "sglang": json.dumps(
        {
            "object": "error",
            "message": "Input length (5000 tokens) exceeds the maximum allowed length (4096 "
            "tokens). Use a shorter input or enable --allow-auto-truncate.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    ).encode(),
    "openai": json.dumps(
        {
            "error": {
                "message": "This model's maximum context length is 128000 tokens...",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        }
    ).encode(),
}


def test_every_row_has_its_versions_text() -> None:
    assert {name for name, _ in CONTEXT_WINDOW_TEXTS} == set(SAMPLES)


@pytest.mark.parametrize("version", sorted(SAMPLES))
def test_each_versions_context_length_400_is_a_context_window_refusal(version: str) -> None:
    assert refusal_reason(400, SAMPLES[version]) is FallbackReason.CONTEXT_WINDOW


def test_the_mock_engines_own_text_is_recognised() -> None:
    from router.tools.mock import wire

    with pytest.raises(wire.RequestError) as caught:
        wire.check_prompt(301, 300)
    assert refusal_reason(caught.value.status, wire.dumps(caught.value.body)) == "context_window"


@pytest.mark.parametrize(
    "code", ["content_policy_violation", "content_filter", "ResponsibleAIPolicyViolation"]
)
def test_content_policy_codes(code: str) -> None:
    body = {"error": {"message": "filtered", "type": "invalid_request_error", "code": code}}
    assert refusal_reason(400, json.dumps(body).encode()) is FallbackReason.CONTENT_POLICY


@pytest.mark.parametrize(
    "body",
    [
        vllm_error("temperature must be non-negative, got -1."),
        vllm_error("max_tokens must be at least 1, got 0."),
        b"not json at all",
        b"",
    ],
)
def test_an_ordinary_400_is_no_fallback(body: bytes) -> None:
    assert refusal_reason(400, body) is None


@pytest.mark.parametrize("status", [401, 403, 404, 422, 429, 500])
def test_only_a_400_is_read(status: int) -> None:
    assert refusal_reason(status, SAMPLES["vllm-0.8"]) is None
