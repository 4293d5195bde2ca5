"""Every proxied endpoint as one row of one table: the next endpoint is one more row.

A row says what the request path needs to know about an endpoint, and nothing reads a path
elsewhere:
- `body`: `json` (the model is the body's `model`), `multipart` (the `model` field of the form:
  audio uploads), `none` (no body: the response id in the path names the backend);
- `usage`: how tokens are read from the answer (`router/request/usage/parse.py`): `chat` (content
  events, the final `usage`), `completion` (the same with `text`), `responses`
  (`response.*_text.delta` events; `input_tokens`/`output_tokens`/`cached_tokens` of
  `response.completed` or the body), `messages` (`content_block_delta` events; `message_start` /
  `message_delta` or the body's `input_tokens`/`output_tokens`), `prompt` (pooling: the
  `prompt_tokens` of the body), `none` (no tokens: tokenize, count_tokens, lookups);
- `streams`: the answer may be SSE (`"stream": true`, or the form's `stream` field);
- `limit_fields`: the body fields holding the completion budget, first present wins, for the
  quota and admission estimate (empty: the endpoint generates nothing beyond its prompt);
- `errors`: the format of the router's own errors there (`openai` or `anthropic`);
- `rpm`, `parallel`, `tpm`: how the client key's limits treat it, stated by every row (no
  default, so a new row cannot leave its limits out; tests/request/admit/test_endpoint_limits.py
  walks the table and checks each row does what it states). `rpm`: the request counts against the
  key's requests per minute; `parallel`: it is checked against the key's `max_parallel` and holds
  one of its slots while it runs (False: not checked; a process without Redis still shows it in the
  key's in-flight count); `tpm`: `estimate` (admitted against its token estimate, charged what
  it used at its end: the engine's usage, or the whole estimate while the usage is unknown) or
  `none` (neither charged nor refused by tokens: it generates nothing, or what it returns was
  charged to the request that made it);
- `inject_usage`: streams get `stream_options.include_usage` (`router/request/usage/strip.py`);
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
Tpm = Literal["estimate", "none"]

CHAT_LIMITS = ("max_completion_tokens", "max_tokens")
COMPLETION_LIMITS = ("max_tokens",)  # vLLM ignores max_completion_tokens on completions
# An upload's form is read only for `model` and `stream`, so its limit field is never present:
# a row with one is estimated at the default budget (`default_max_tokens`), corrected to its
# count at the end, where a row without any would be estimated at 0 tokens.
AUDIO_LIMITS = ("max_completion_tokens",)
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
    inject_usage: bool = False
    state: State = "none"
    tested: str = REAL
    rpm: bool = field(kw_only=True)
    parallel: bool = field(kw_only=True)
    tpm: Tpm = field(kw_only=True)
    # Derived once (read per request): tokens are counted; a JSON body's bytes / 4 estimate
    # the prompt (an audio upload's or a lookup's do not); some or all of the key's limits apply.
    counts_tokens: bool = field(init=False)
    prompt_from_body: bool = field(init=False)
    limited: bool = field(init=False)
    fully_limited: bool = field(init=False)

    def __post_init__(self) -> None:
        charged = self.tpm != "none"
        object.__setattr__(self, "counts_tokens", self.usage != "none")
        object.__setattr__(self, "prompt_from_body", self.body == "json" and self.usage != "none")
        object.__setattr__(self, "limited", self.rpm or self.parallel or charged)
        object.__setattr__(self, "fully_limited", self.rpm and self.parallel and charged)


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint(
        "/v1/chat/completions",
        streams=True,
        limit_fields=CHAT_LIMITS,
        inject_usage=True,
        rpm=True,
        parallel=True,
        tpm="estimate",
    ),
    Endpoint(
        "/v1/completions",
        usage="completion",
        streams=True,
        limit_fields=COMPLETION_LIMITS,
        inject_usage=True,
        rpm=True,
        parallel=True,
        tpm="estimate",
    ),
    Endpoint(
        "/v1/responses",
        usage="responses",
        streams=True,
        limit_fields=("max_output_tokens",),
        state="creates",
        rpm=True,
        parallel=True,
        tpm="estimate",
    ),
    # What a GET returns was charged to the POST that made it: a background response's whole
    # estimate (router/request/lifecycle/account.py), so polling for it costs requests, not tokens.
    Endpoint(
        "/v1/responses/{response_id}",
        method="GET",
        body="none",
        usage="none",
        streams=True,
        state="follows",
        rpm=True,
        parallel=True,
        tpm="none",
    ),
    Endpoint(
        "/v1/responses/{response_id}/cancel",
        body="none",
        usage="none",
        state="follows",
        rpm=True,
        parallel=True,
        tpm="none",
    ),
    Endpoint(
        "/v1/messages",
        usage="messages",
        streams=True,
        limit_fields=("max_tokens",),
        errors="anthropic",
        rpm=True,
        parallel=True,
        tpm="estimate",
    ),
    # Anthropic's count_tokens is free of token limits but not of request limits.
    Endpoint(
        "/v1/messages/count_tokens",
        usage="none",
        errors="anthropic",
        rpm=True,
        parallel=True,
        tpm="none",
    ),
    Endpoint("/tokenize", usage="none", rpm=True, parallel=True, tpm="none"),
    Endpoint("/detokenize", usage="none", rpm=True, parallel=True, tpm="none"),
    Endpoint("/v1/embeddings", usage="prompt", rpm=True, parallel=True, tpm="estimate"),
    Endpoint("/pooling", usage="prompt", tested=MOCK, rpm=True, parallel=True, tpm="estimate"),
    Endpoint("/classify", usage="prompt", tested=MOCK, rpm=True, parallel=True, tpm="estimate"),
    Endpoint("/score", usage="prompt", tested=MOCK, rpm=True, parallel=True, tpm="estimate"),
    Endpoint("/v1/score", usage="prompt", tested=MOCK, rpm=True, parallel=True, tpm="estimate"),
    Endpoint("/rerank", usage="prompt", tested=MOCK, rpm=True, parallel=True, tpm="estimate"),
    Endpoint("/v1/rerank", usage="prompt", tested=MOCK, rpm=True, parallel=True, tpm="estimate"),
    Endpoint("/v2/rerank", usage="prompt", tested=MOCK, rpm=True, parallel=True, tpm="estimate"),
    Endpoint(
        "/v1/audio/transcriptions",
        body="multipart",
        streams=True,
        limit_fields=AUDIO_LIMITS,
        tested=MOCK,
        rpm=True,
        parallel=True,
        tpm="estimate",
    ),
    Endpoint(
        "/v1/audio/translations",
        body="multipart",
        streams=True,
        limit_fields=AUDIO_LIMITS,
        tested=MOCK,
        rpm=True,
        parallel=True,
        tpm="estimate",
    ),
)

# The Batch API's routes (router/web/batch_api.py, only with `batch:` configured): answered by
# the router itself, never proxied, so not in ENDPOINTS' fast path; their rows say how the
# key's limits treat them. Their lines' requests run as rows of ENDPOINTS, in the key's tpm.
_BATCH_ROUTES: tuple[tuple[str, str, BodyKind], ...] = (
    ("POST", "/v1/files", "multipart"),
    ("GET", "/v1/files", "none"),
    ("GET", "/v1/files/{file_id}", "none"),
    ("GET", "/v1/files/{file_id}/content", "none"),
    ("DELETE", "/v1/files/{file_id}", "none"),
    ("POST", "/v1/batches", "json"),
    ("GET", "/v1/batches", "none"),
    ("GET", "/v1/batches/{batch_id}", "none"),
    ("POST", "/v1/batches/{batch_id}/cancel", "none"),
)
BATCH_ENDPOINTS: tuple[Endpoint, ...] = tuple(
    Endpoint(
        path, method, body=body, usage="none", tested="mock", rpm=True, parallel=True, tpm="none"
    )
    for method, path, body in _BATCH_ROUTES
)
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")

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
