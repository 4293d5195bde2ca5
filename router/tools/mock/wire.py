"""What vLLM 0.32's OpenAI server puts on the wire, for the mock: bodies, stream events, errors.

Field sets and their order are vLLM's own, as seen on a real 0.32.0 engine (the engine tier's
conformance test, tests_engine/test_conformance.py, holds the mock to it):
- chat chunks: a role-only first event (`"delta":{"role":"assistant","content":""}` and
  `prompt_token_ids`/`prompt_text` null), one event per token, and the last token's event
  carrying `finish_reason` (no separate empty finish event); completion chunks likewise, without
  the role event;
- `system_fingerprint` on the last token's event, or on the usage event when there is one;
- `stream_options.include_usage`: a last usage-only event (`"choices":[]`); chat's
  `prompt_tokens_details` has `cached_tokens` and `created_cache_tokens`, completions' only
  `cached_tokens`; with `continuous_usage_stats` too, every event carries the counts so far;
- whole bodies in compact JSON with vLLM's null fields (`logprobs`, `stop_reason`, `token_ids`,
  `kv_transfer_params`, ...);
- errors as `{"error": {"message", "type", "param", "code"}}`: `BadRequestError` for a bad value,
  `NotFoundError` (404) for an unknown model, and pydantic's "N validation error(s)" text with
  type "Bad Request" for a body that does not parse or validate.

`created` stays 0 (vLLM sends the Unix time): a stream fetched twice is then byte-equal, which
the proxy's byte-exact tests rely on.
"""

from __future__ import annotations

import json
from typing import Any

FINGERPRINT = "vllm-0.32.0-mock"
_FP = b',"system_fingerprint":"' + FINGERPRINT.encode() + b'"'
_DONE = b"data: [DONE]\n\n"
_END = b"}\n\n"
_NULL_END = b',"usage":null}\n\n'


def dumps(obj: Any) -> bytes:
    """Compact JSON, as vLLM (pydantic) writes it."""
    return json.dumps(obj, separators=(",", ":")).encode()


class Chunks:
    """The SSE events of one streamed request: `first`, `token(text, last)`, `tail(...)`.

    Built once per request from pre-split byte templates, so a token costs two concatenations.
    `nulls`: OpenAI's shape, `"usage":null` in every event before the usage one (not vLLM's).
    """

    __slots__ = (
        "_call",
        "_chat",
        "_cont",
        "_ends",
        "_head",
        "_last",
        "_mid",
        "_prompt",
        "_sent",
        "usage",
    )

    def __init__(
        self,
        chat: bool,
        rid: str,
        model: str,
        usage: bool = False,
        continuous: bool = False,
        nulls: bool = False,
        prompt: int = 0,
        created: int = 0,
        tool: str | None = None,
    ) -> None:
        self._chat = chat
        self._call = b""  # a named tool call's opening, sent with the first token's arguments
        self.usage = usage
        self._cont = usage and continuous
        self._prompt = prompt
        self._sent = 0
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (
            f'data: {{"id":"{"chatcmpl" if chat else "cmpl"}-{rid}","object":"{obj}",'
            f'"created":{created},"model":{json.dumps(model)},"choices":['
        ).encode()
        end = _NULL_END if nulls and usage else _END
        fp = b"" if usage else _FP
        if chat:
            self._mid = (
                b'{"index":0,"delta":{"content":"',
                b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]',
            )
            self._last = (
                self._mid[0],
                b'"},"logprobs":null,"finish_reason":"length","stop_reason":null,'
                b'"token_ids":null}]' + fp,
            )
            if tool is not None:
                # vLLM's named `tool_choice`: the tokens are the call's arguments; the first
                # event also carries the call's id, type and name.
                args = b'{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"'
                self._call = (
                    b'{"index":0,"delta":{"tool_calls":[{"id":"chatcmpl-tool-'
                    + rid.encode()
                    + b'","type":"function","index":0,"function":{"name":'
                    + json.dumps(tool).encode()
                    + b',"arguments":"'
                )
                self._mid = (args, b'"}}]}' + self._mid[1][2:])
                self._last = (args, b'"}}]}' + self._last[1][2:])
        else:
            self._mid = (
                b'{"index":0,"text":"',
                b'","logprobs":null,"finish_reason":null,"stop_reason":null,'
                b'"prompt_token_ids":null,"token_ids":null}]',
            )
            self._last = (
                self._mid[0],
                b'","logprobs":null,"finish_reason":"length","stop_reason":null,'
                b'"prompt_token_ids":null,"token_ids":null}]' + fp,
            )
        self._ends = end

    def _counts(self) -> bytes:
        p, c = self._prompt, self._sent
        details = ',"completion_tokens_details":null' if self._chat else ""
        return (
            f',"usage":{{"prompt_tokens":{p},"total_tokens":{p + c},"completion_tokens":{c}'
            f"{details}}}"
        ).encode()

    def first(self) -> bytes:
        """Chat's role-only event (vLLM sends it with the first token); b"" for completions."""
        if not self._chat:
            return b""
        counts = self._counts() if self._cont else b""
        end = b',"usage":null' if self._ends is _NULL_END else b""
        return (
            self._head
            + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
            + b'"finish_reason":null}]'
            + counts
            + b',"prompt_token_ids":null,"prompt_text":null'
            + end
            + b"}\n\n"
        )

    def token(self, text: bytes, last: bool, finish: str = "length") -> bytes:
        """One token's event; `last` carries the finish reason (and the fingerprint)."""
        pre, post = self._last if last else self._mid
        if self._call:
            pre, self._call = self._call, b""
        if finish != "length":
            post = post.replace(b'"finish_reason":"length"', f'"finish_reason":"{finish}"'.encode())
        if self._cont:
            self._sent += 1
            return self._head + pre + text + post + self._counts() + _END
        return self._head + pre + text + post + self._ends

    def tail(self, prompt: int, completion: int, cached: int) -> bytes:
        """The usage-only event (when asked for) and `[DONE]`."""
        if not self.usage:
            return _DONE
        details = (
            f'{{"cached_tokens":{cached},"created_cache_tokens":0}}'
            if self._chat
            else f'{{"cached_tokens":{cached}}}'
        )
        usage = (
            f'],"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
            f'"completion_tokens":{completion},"prompt_tokens_details":{details}}}'
        ).encode()
        return self._head + usage + _FP + b"}\n\n" + _DONE


def completion(
    rid: str, model: str, chat: bool, content: str, prompt: int, n: int, cached: int
) -> dict[str, Any]:
    """A whole (non-streamed) chat or text completion, vLLM's fields in vLLM's order."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + n,
        "completion_tokens": n,
        "prompt_tokens_details": {
            "cached_tokens": cached,
            "created_cache_tokens": 0 if chat else None,
            "multimodal_tokens": None,
        },
        "completion_tokens_details": None,
    }
    common = {"service_tier": None, "system_fingerprint": FINGERPRINT, "usage": usage}
    if chat:
        message = {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        return {
            "id": f"chatcmpl-{rid}",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "token_ids": None,
                    "routed_experts": None,
                }
            ],
            **common,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": content,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
        ],
        **common,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def models(names: list[str], owner: str, max_model_len: int) -> dict[str, Any]:
    """`GET /v1/models` as vLLM lists its served names."""
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": owner,
                "root": name,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{i}",
                        "object": "model_permission",
                        "created": 0,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for i, name in enumerate(names)
        ],
    }


class RequestError(Exception):
    """A request vLLM refuses: `status` and `body` are its answer."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body["error"]["message"])
        self.status = status
        self.body = body


def lora_models(adapters: dict[str, str], parent: str) -> list[dict[str, Any]]:
    """vLLM's `/v1/models` entries of LoRA adapters: `root` the path, `parent` the base model."""
    return [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "vllm",
            "root": path,
            "parent": parent,
            "max_model_len": None,
            "permission": [
                {
                    "id": f"modelperm-lora-{i}",
                    "object": "model_permission",
                    "created": 0,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        for i, (name, path) in enumerate(adapters.items())
    ]


def error(status: int, message: str, type_: str, param: str | None) -> RequestError:
    return RequestError(
        status, {"error": {"message": message, "type": type_, "param": param, "code": status}}
    )


def _bad_value(message: str, param: str, value: object) -> RequestError:
    return error(400, f"{message} (parameter={param}, value={value})", "BadRequestError", param)


def _invalid(problems: list[dict[str, Any]]) -> RequestError:
    """pydantic's validation report, as vLLM's error handler words it."""
    n = len(problems)
    head = f"{n} validation error{'s' if n > 1 else ''}:"
    text = "\n  ".join([head, *(repr(p) for p in problems)])
    return error(400, text, "Bad Request", problems[0]["loc"])


def _input(value: object) -> str:
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return str(value)


def _lax_int(value: object) -> int | None:
    """pydantic's lax int: bools, whole floats and digit strings pass; None if it fails."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def _int_problem(loc: str, value: object) -> dict[str, Any]:
    if isinstance(value, float):
        kind, msg = "int_from_float", "Input should be a valid integer, got a number with a "
        msg += "fractional part"
        shown: object = repr(value)
    elif isinstance(value, str):
        kind, msg = "int_parsing", "Input should be a valid integer, unable to parse string as an "
        msg += "integer"
        shown = value
    else:
        kind, msg, shown = "int_type", "Input should be a valid integer", _input(value)
    return {"type": kind, "loc": loc, "msg": msg, "input": shown}


def parse_request(
    chat: bool, body: bytes, served: list[str] | None, max_model_len: int
) -> tuple[dict[str, Any], int | None]:
    """The request as vLLM validates it, in vLLM's order (parsing and field types, then the
    model, then `max_tokens` against the context length): the payload and its `max_tokens`
    (`max_completion_tokens` first for chat; None when absent). Raises `RequestError`.
    `served` None accepts any model and a body without `messages` or `prompt` (the mock's
    default: most tests send `{"model": "m"}` alone); a list of names validates both as vLLM
    does."""
    try:
        req = json.loads(body) if body.strip() else None
    except ValueError as exc:
        pos = getattr(exc, "pos", 0)
        message = getattr(exc, "msg", "Expecting value")
        raise _invalid(
            [
                {
                    "type": "json_invalid",
                    "loc": f"body.{pos}",
                    "msg": "JSON decode error",
                    "input": "<dict of 0 items>",
                    "ctx": {"error": message},
                }
            ]
        ) from None
    if req is None:
        raise _invalid(
            [{"type": "missing", "loc": "body", "msg": "Field required", "input": "None"}]
        )
    if not isinstance(req, dict):
        raise _invalid(
            [
                {
                    "type": "model_attributes_type",
                    "loc": "body",
                    "msg": "Input should be a valid dictionary or object to extract fields from",
                    "input": _input(req),
                }
            ]
        )
    problems: list[dict[str, Any]] = []
    strict = served is not None
    if chat and strict:
        messages = req.get("messages")
        if messages is None:
            problems.append(
                {"type": "missing", "loc": "body.messages", "msg": "Field required",
                 "input": _input(req)}
            )  # fmt: skip
        elif not isinstance(messages, list):
            problems.append(
                {"type": "list_type", "loc": "body.messages", "msg": "Input should be a valid list",
                 "input": _input(messages)}
            )  # fmt: skip
    limits: dict[str, int | None] = {}
    for key in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        raw = req.get(key)
        value = _lax_int(raw) if raw is not None else None
        if raw is not None and value is None:
            problems.append(_int_problem(f"body.{key}", raw))
        limits[key] = value
    if problems:
        raise _invalid(problems)
    model = req.get("model")
    if served is not None and model is not None and model not in served:
        raise error(
            404,
            f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
            "NotFoundError",
            "model",
        )
    if req.get("stream_options") is not None and req.get("stream") is not True:
        raise error(
            400,
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            "BadRequestError",
            "stream_options",
        )
    if not chat and strict and not req.get("prompt"):
        raise error(
            400,
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
            "BadRequestError",
            "prompt",
        )
    n = limits.get("max_completion_tokens") or limits["max_tokens"]
    if n is not None and n > max_model_len:
        raise _bad_value(
            f"max_tokens={n} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            "max_tokens",
            n,
        )
    return req, n


def check_prompt(prompt: int, max_model_len: int) -> None:
    """A prompt longer than the context, as vLLM refuses it (before a `max_tokens` below 1)."""
    if prompt > max_model_len:
        over = max_model_len + 1
        raise _bad_value(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains at least {over} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            over,
        )


def check_max_tokens(n: int) -> None:
    if n < 1:
        raise _bad_value(f"max_tokens must be at least 1, got {n}.", "max_tokens", n)
