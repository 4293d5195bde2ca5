"""Every proxied endpoint as one row of one table: the next endpoint is one more row.

A row says what the request path needs to know about an endpoint, and nothing reads a path
elsewhere:
- `body`: `json` (the model is the body's `model`), `multipart` (the `model` field of the form:
  audio uploads), `none` (no body: the response id in the path names the backend);
- `usage`: how tokens are read from the answer (`router/request/usage.py`): `chat` (content
  events, the final `usage`), `completion` (the same with `text`), `responses`
  (`response.*_text.delta` events; `input_tokens`/`output_tokens`/`cached_tokens` of
  `response.completed` or the body), `messages` (`content_block_delta` events; `message_start` /
  `message_delta` or the body's `input_tokens`/`output_tokens`), `prompt` (pooling: the
  `prompt_tokens` of the body), `none` (no tokens: tokenize, count_tokens, lookups);
- `streams`: the answer may be SSE (`"stream": true`, or the form's `stream` field);
- `limit_fields`: the body fields holding the completion budget, first present wins, for the
  quota and admission estimate (empty: the endpoint generates nothing beyond its prompt);
- `errors`: the format of the router's own errors there (`openai` or `anthropic`);
- `quota`: False for an endpoint that costs no quota at all (`count_tokens`);
- `inject_usage`: streams get `stream_options.include_usage` (`router/request/usage_stream.py`);
- `state`: `creates` (a stored response: its id is remembered with its backend, and
  `previous_response_id` routes to that backend), `follows` (`{response_id}` in the path routes
  to the backend holding it), or `none`;
- `tested`: the engine versions it was tried against (the table in docs/api.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

BodyKind = Literal["json", "multipart", "none"]
UsageShape = Literal["chat", "completion", "responses", "messages", "prompt", "none"]
ErrorFormat = Literal["openai", "anthropic"]
State = Literal["none", "creates", "follows"]

CHAT_LIMITS = ("max_completion_tokens", "max_tokens")
COMPLETION_LIMITS = ("max_tokens",)  # vLLM ignores max_completion_tokens on completions
REAL = "vLLM 0.32.0, mock"
MOCK = "mock (vLLM 0.32.0 serves it only for models of that kind)"


@dataclass(frozen=True, slots=True)
class Endpoint:
    path: str
    method: str = "POST"
    body: BodyKind = "json"
    usage: UsageShape = "chat"
    streams: bool = False
    limit_fields: tuple[str, ...] = ()
    errors: ErrorFormat = "openai"
    quota: bool = True
    inject_usage: bool = False
    state: State = "none"
    tested: str = REAL
    # Derived once (read per request): tokens are counted; a JSON body's bytes / 4 estimate
    # the prompt (an audio upload's or a lookup's do not).
    counts_tokens: bool = field(init=False)
    prompt_from_body: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts_tokens", self.usage != "none")
        object.__setattr__(self, "prompt_from_body", self.body == "json" and self.usage != "none")


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("/v1/chat/completions", streams=True, limit_fields=CHAT_LIMITS, inject_usage=True),
    Endpoint(
        "/v1/completions",
        usage="completion",
        streams=True,
        limit_fields=COMPLETION_LIMITS,
        inject_usage=True,
    ),
    Endpoint(
        "/v1/responses",
        usage="responses",
        streams=True,
        limit_fields=("max_output_tokens",),
        state="creates",
    ),
    Endpoint(
        "/v1/responses/{response_id}",
        method="GET",
        body="none",
        usage="none",
        streams=True,
        state="follows",
    ),
    Endpoint("/v1/responses/{response_id}/cancel", body="none", usage="none", state="follows"),
    Endpoint(
        "/v1/messages",
        usage="messages",
        streams=True,
        limit_fields=("max_tokens",),
        errors="anthropic",
    ),
    Endpoint("/v1/messages/count_tokens", usage="none", errors="anthropic", quota=False),
    Endpoint("/tokenize", usage="none"),
    Endpoint("/detokenize", usage="none"),
    Endpoint("/v1/embeddings", usage="prompt"),
    Endpoint("/pooling", usage="prompt", tested=MOCK),
    Endpoint("/classify", usage="prompt", tested=MOCK),
    Endpoint("/score", usage="prompt", tested=MOCK),
    Endpoint("/v1/score", usage="prompt", tested=MOCK),
    Endpoint("/rerank", usage="prompt", tested=MOCK),
    Endpoint("/v1/rerank", usage="prompt", tested=MOCK),
    Endpoint("/v2/rerank", usage="prompt", tested=MOCK),
    Endpoint("/v1/audio/transcriptions", body="multipart", streams=True, tested=MOCK),
    Endpoint("/v1/audio/translations", body="multipart", streams=True, tested=MOCK),
)

RESPONSES_PREFIX = "/v1/responses/"


def match_follow(method: str, path: str) -> tuple[Endpoint, str] | None:
    """`GET /v1/responses/{id}` or `POST /v1/responses/{id}/cancel`: the row and the id."""
    if not path.startswith(RESPONSES_PREFIX):
        return None
    rest = path[len(RESPONSES_PREFIX) :]
    if method == "POST" and rest.endswith("/cancel"):
        response_id, template = rest[: -len("/cancel")], "/v1/responses/{response_id}/cancel"
    elif method == "GET":
        response_id, template = rest, "/v1/responses/{response_id}"
    else:
        return None
    if not response_id or "/" in response_id or len(response_id) > 256:
        return None
    return BY_ROUTE[(method, template)], response_id


BY_ROUTE: dict[tuple[str, str], Endpoint] = {(e.method, e.path): e for e in ENDPOINTS}
# Paths whose errors come in Anthropic's format, also those answered before any row's handler
# runs (a body timeout at the edge, a method the path does not take).
ANTHROPIC_PATHS = frozenset(e.path for e in ENDPOINTS if e.errors == "anthropic")
# Fixed paths, looked up per request: `(method, path)` is one dict get.
FIXED: dict[str, dict[str, Endpoint]] = {}
for _e in ENDPOINTS:
    if "{" not in _e.path:
        FIXED.setdefault(_e.method, {})[_e.path] = _e
