"""The mock's other APIs, in vLLM 0.32's shapes (field order and compact JSON as it sends them):
Responses (stored, `previous_response_id`, GET, cancel), Anthropic Messages and count_tokens,
tokenize/detokenize, pooling/score/rerank/classify, and audio transcription/translation.

Pure formatting: `router/tools/mock/upstream.py` paces the tokens and calls these for the bytes.
Seen on a real vLLM 0.32.0: a Responses stream is `event: <type>` + `data: {...}` pairs (created,
in_progress, output_item.added, content_part.added, output_text.delta per token, the .done
events, completed with `usage`); a Messages stream is message_start (input_tokens), a text
block's start / deltas / stop, message_delta (the whole usage), message_stop; errors of the
Messages API are `{"type":"error","error":{...}}`, of the others `{"error":{...,"code":404}}`.
"""

from __future__ import annotations

import json
from typing import Any


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def sse(event: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + dumps(obj) + b"\n\n"


def not_found_response(response_id: str) -> dict[str, Any]:
    return {
        "error": {
            "message": f"Response with id '{response_id}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }


def background_needs_store() -> dict[str, Any]:
    return {
        "error": {
            "message": "background can only be used when `store` is true",
            "type": "BadRequestError",
            "param": "background",
            "code": 400,
        }
    }


def cannot_cancel() -> dict[str, Any]:
    return {
        "error": {
            "message": "Cannot cancel a synchronous response.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 400,
        }
    }


def anthropic_error(type_: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type_, "message": message}}


def response_usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + completion,
    }


def response_object(
    rid: str,
    model: str,
    req: dict[str, Any],
    text: str | None,
    usage: dict[str, Any] | None,
    max_tokens: int,
    background: bool = False,
) -> dict[str, Any]:
    """A Responses `response` object (in progress while `text` is None; a background one is
    `queued` until it is done, as vLLM's are)."""
    done = text is not None
    output: list[dict[str, Any]] = (
        [
            {
                "id": f"msg_{rid}",
                "content": [
                    {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
                ],
                "role": "assistant",
                "status": "completed",
                "type": "message",
                "phase": None,
            }
        ]
        if done
        else []
    )
    return {
        "id": f"resp_{rid}",
        "created_at": 0,
        "incomplete_details": {"reason": "max_output_tokens"} if done else None,
        "instructions": req.get("instructions"),
        "metadata": None,
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": True,
        "temperature": 0.0,
        "tool_choice": "none",
        "tools": [],
        "top_p": 1.0,
        "background": background,
        "max_output_tokens": max_tokens,
        "max_tool_calls": None,
        "previous_response_id": req.get("previous_response_id"),
        "prompt": None,
        "reasoning": None,
        "service_tier": "auto",
        "status": "incomplete" if done else "queued" if background else "in_progress",
        "text": None,
        "top_logprobs": None,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def response_head(obj: dict[str, Any], rid: str) -> bytes:
    """A Responses stream up to its first delta."""
    item: dict[str, Any] = {
        "id": f"msg_{rid}",
        "content": [],
        "role": "assistant",
        "status": "in_progress",
        "type": "message",
        "phase": None,
    }
    part: dict[str, Any] = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
    return b"".join(
        (
            sse(
                "response.created",
                {"response": obj, "sequence_number": 0, "type": "response.created"},
            ),
            sse(
                "response.in_progress",
                {"response": obj, "sequence_number": 1, "type": "response.in_progress"},
            ),
            sse(
                "response.output_item.added",
                {
                    "item": item,
                    "output_index": 0,
                    "sequence_number": 2,
                    "type": "response.output_item.added",
                },
            ),
            sse(
                "response.content_part.added",
                {
                    "content_index": 0,
                    "item_id": f"msg_{rid}",
                    "output_index": 0,
                    "part": part,
                    "sequence_number": 3,
                    "type": "response.content_part.added",
                },
            ),
        )
    )


def response_delta(rid: str, text: str, seq: int) -> bytes:
    """One `response.output_text.delta` event, from a template (the mock sits under benchmarks:
    a json.dumps per token would make it the bottleneck)."""
    return b"".join(
        (
            b'event: response.output_text.delta\ndata: {"content_index":0,"delta":',
            json.dumps(text).encode(),
            b',"item_id":"msg_',
            rid.encode(),
            b'","logprobs":[],"output_index":0,"sequence_number":',
            str(seq).encode(),
            b',"type":"response.output_text.delta"}\n\n',
        )
    )


def response_tail(obj: dict[str, Any], rid: str, text: str, seq: int) -> bytes:
    part: dict[str, Any] = {
        "annotations": [],
        "text": text,
        "type": "output_text",
        "logprobs": None,
    }
    item = obj["output"][0]
    return b"".join(
        (
            sse(
                "response.output_text.done",
                {
                    "content_index": 0,
                    "item_id": f"msg_{rid}",
                    "logprobs": [],
                    "output_index": 0,
                    "sequence_number": seq,
                    "text": text,
                    "type": "response.output_text.done",
                },
            ),
            sse(
                "response.content_part.done",
                {
                    "content_index": 0,
                    "item_id": f"msg_{rid}",
                    "output_index": 0,
                    "part": part,
                    "sequence_number": seq + 1,
                    "type": "response.content_part.done",
                },
            ),
            sse(
                "response.output_item.done",
                {
                    "item": item,
                    "output_index": 0,
                    "sequence_number": seq + 2,
                    "type": "response.output_item.done",
                },
            ),
            sse(
                "response.completed",
                {"response": obj, "sequence_number": seq + 3, "type": "response.completed"},
            ),
        )
    )


def message_usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """Anthropic's usage as vLLM builds it: input_tokens leaves the cached part out."""
    return {
        "input_tokens": max(0, prompt - cached),
        "output_tokens": completion,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def message_object(rid: str, model: str, text: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{rid}",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": model,
        "stop_reason": "max_tokens",
        "usage": usage,
    }


def message_head(rid: str, model: str, prompt: int) -> bytes:
    start = {
        "type": "message_start",
        "message": {
            "id": f"chatcmpl-{rid}",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": 0},
        },
    }
    block = {"type": "content_block_start", "content_block": {"type": "text", "text": ""}}
    return sse("message_start", start) + sse("content_block_start", {**block, "index": 0})


def message_delta(text: str) -> bytes:
    return (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":'
        b'"text_delta","text":' + json.dumps(text).encode() + b'},"index":0}\n\n'
    )


def message_tail(usage: dict[str, Any]) -> bytes:
    return (
        sse("content_block_stop", {"type": "content_block_stop", "index": 0})
        + sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                "usage": usage,
            },
        )
        + sse("message_stop", {"type": "message_stop"})
    )


def count_tokens(prompt: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "context_management": {"original_input_tokens": prompt}}


def tokenize(ids: list[int], max_model_len: int) -> dict[str, Any]:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}


def detokenize(ids: list[Any]) -> dict[str, Any]:
    return {"prompt": "".join(f"t{i} " for i in ids if isinstance(i, int))}


def pooling(path: str, model: str, req: dict[str, Any], prompt: int) -> dict[str, Any]:
    """vLLM's score / rerank / classify / pooling answers, with their `usage`."""
    usage = {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0}
    if path.endswith("rerank"):
        given = req.get("documents")
        docs: list[Any] = given if isinstance(given, list) else []
        return {
            "id": "rerank-0",
            "model": model,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
            "results": [
                {"index": i, "document": {"text": str(d)}, "relevance_score": 1.0 / (i + 1)}
                for i, d in enumerate(docs)
            ],
        }
    if path.endswith("score"):
        return {
            "id": "score-0",
            "object": "list",
            "created": 0,
            "model": model,
            "data": [{"index": 0, "object": "score", "score": 0.5}],
            "usage": usage,
        }
    if path == "/classify":
        return {
            "id": "classify-0",
            "object": "list",
            "created": 0,
            "model": model,
            "data": [{"index": 0, "label": "a", "probs": [1.0], "num_classes": 1}],
            "usage": usage,
        }
    return {
        "id": "pool-0",
        "object": "list",
        "created": 0,
        "model": model,
        "data": [{"index": 0, "object": "pooling", "data": [0.0, 0.5]}],
        "usage": usage,
    }


def transcription(text: str, seconds: int) -> dict[str, Any]:
    return {"text": text, "usage": {"type": "duration", "seconds": seconds}}


def transcription_chunk(rid: str, model: str, text: str, finish: bool) -> bytes:
    choice: dict[str, Any] = {"delta": {"content": text}}
    if finish:
        choice["finish_reason"] = "length"
        choice["stop_reason"] = None
    chunk = {
        "id": f"trsc-{rid}",
        "object": "transcription.chunk",
        "created": 0,
        "model": model,
        "choices": [choice],
    }
    return b"data: " + dumps(chunk) + b"\n\n"


def transcription_usage(rid: str, model: str, prompt: int, completion: int) -> bytes:
    chunk = {
        "id": f"trsc-{rid}",
        "object": "transcription.chunk",
        "created": 0,
        "model": model,
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        },
    }
    return b"data: " + dumps(chunk) + b"\n\n"
