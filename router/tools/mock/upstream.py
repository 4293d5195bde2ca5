"""A vLLM-compatible mock upstream, cheap enough to sit under a benchmark.

Serves chat/completions/embeddings/models, the other APIs of vLLM 0.32 in its shapes
(`router/tools/mock/apis.py`: Responses with stored ids, GET and cancel; Messages and count_tokens;
tokenize/detokenize; pooling, score, rerank, classify; audio multipart), `/health`, `/metrics`
(vLLM's running/waiting gauges) and `/stats` (requests, completed, aborted, tokens generated
after its client went away, and recent requests with the headers tests check). Token text is
deterministic: ``tok0 tok1 ...``. What goes on the wire is vLLM 0.32's (router/tools/mock/wire.py:
field sets, the role-only first chat event, the finish reason on the last token's event, usage
with `prompt_tokens_details`, errors), held to a real engine by tests_engine/test_conformance.py.
Behaviour can be changed while running with `POST /control` (fail_status, fail_body,
require_key (a cloud API's key check), hang, ttft_ms, itl_ms,
tokens, half_event, gzip, retry_after, health_status, max_running, role_chunk, metrics_status,
metrics_delay_ms, metrics_body, background, usage_nulls, split_tail_ms, end_gap_ms,
tokenize_count, hold; `reset_prefix_cache` empties the engine's prefix cache) so fault tests
need no second implementation. A Responses request with `background: true` is answered at once
with the stored response `queued` and `usage: null`, as vLLM's background mode answers; it
generates on, and `GET /v1/responses/{id}` returns it done, with its usage, later.
Streams end with vLLM's usage event when the request asks for it
(`stream_options.include_usage`, with `continuous_usage_stats` the counts in every event); with
`usage_nulls` every other event then also carries `"usage":null`, as OpenAI's API does (vLLM
does not).
`role_chunk` sends the role-only first event right after the headers, before the prefill wait
(vLLM sends it with the first token; sending it early lets tests tell the first byte from the
first content token).
With an `EngineConfig` (`--engine` flags) generation runs through a simulated vLLM scheduler
(`router/tools/mock/engine.py`: batch, queue, KV blocks, background load, vLLM's metric names).
With its `max_loras` > 0 (vLLM's `--enable-lora`) the mock serves LoRA adapters: listed in
`/v1/models` with `"parent"` the base model, requests for one run under it (an unknown name gets
vLLM's 404), and `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` answer as vLLM's do
(a load takes `lora_load_ms`; a path that is not a directory fails as vLLM's does; `/stats`
counts `lora_loads` (slot loads) and `lora_runtime_loads`).
A raw ASGI app: no framework on the hot path.

Not modelled (where a real vLLM differs): without `--served-model-name` any model name is served
and a body without `messages`/`prompt` is accepted (tests send `{"model": "m"}`); `created` is 0
and ids carry the request id, not a random hex; every answer stops at `max_tokens` with
`finish_reason: "length"` (no EOS, no `stop`), one event per token (vLLM may hold a token that
ends mid-character back); tokens are counted as four characters each, not tokenised, and the
chat template is not rendered (vLLM's prompt_tokens include the template's tokens); sampling
parameters, `n`, logprobs, tools (but a streamed chat request whose `tool_choice` names a
function gets its tokens as that call's arguments, as vLLM streams a named tool choice), `stop`,
`/tokenize` and the other routes are ignored or absent;
validation covers the token limits (not vLLM's earlier check of a prompt's length in
characters), the model, `messages`/`prompt` presence and JSON syntax, not
every field pydantic checks; without `--engine` the `/metrics` page has only the running and
waiting gauges, and no abort stops the (already instant) generation early.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from email.message import Message as EmailMessage
from email.parser import BytesParser
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from router.tools.mock import apis, wire
from router.tools.mock.engine import Engine, EngineConfig, block_hashes
from router.tools.mock.handoff import Handoff, HandoffConfig, HandoffStats
from router.tools.mock.kv_publish import mock_tokens

# POST paths served by `_api` (other APIs than chat/completions/embeddings), in vLLM's shapes
_API_PATHS = frozenset(
    {
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/detokenize",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    }
)
_GENERATES = frozenset(
    {"/v1/responses", "/v1/messages", "/v1/audio/transcriptions", "/v1/audio/translations"}
)
_MAX_STORED = 10_000  # stored responses kept (vLLM keeps every one: a mock must not grow)

_JSON = [(b"content-type", b"application/json")]
METRICS_TYPE = b"text/plain; version=1.0.0; charset=utf-8"
_NOT_FOUND = {"detail": "Not Found"}  # FastAPI's, as vLLM answers an unknown path
_NOT_ALLOWED = {"detail": "Method Not Allowed"}
_GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
DEFAULT_MAX_MODEL_LEN = 131072  # vLLM's is the model's; a long one, as Llama 3.1's


@dataclass
class Behaviour:
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    tokens: int = 16
    fail_status: int = 0
    fail_count: int = -1  # how many requests fail_status applies to; -1 = all
    fail_body: str | None = None  # the body fail_status answers with (a provider's own error)
    # A cloud API's key: a request without `Authorization: Bearer <it>` gets OpenAI's 401.
    require_key: str | None = None
    retry_after: float | None = None
    hang: bool = False  # accept, read the request, never answer
    half_event_after: int = -1  # send this many tokens, then half an event, then close
    die_after: int = -1  # send (or, not streaming, generate) this many tokens, then drop the conn.
    # Faults at answer positions (migration tests): before token k of the whole answer (k in
    # `fail_at`, counted across a continuation's start, never a response's first token), `close`
    # the connection, send vLLM's `error` event and [DONE], or a `finish_error` event
    # (finish_reason "error"); a non-streamed answer closes.
    fail_at: list[int] = field(default_factory=list)
    fail_how: str = "close"
    # vLLM's own ids and times: a random `chatcmpl-<hex>` and the Unix time in `created`, rather
    # than the request id and 0 (what byte-exact tests compare)
    fresh_ids: bool = False
    gzip: bool = False
    max_running: int = 0  # batch slots (vLLM's max_num_seqs); more requests queue; 0 = no limit
    pad_bytes: int = 0  # pad each token's text, to move megabytes (backpressure tests)
    health_status: int = 200  # what GET /health answers (503: a vLLM still loading weights)
    metrics_status: int = 200  # what GET /metrics answers (404: metrics turned off)
    metrics_delay_ms: float = 0.0  # a slow /metrics
    metrics_body: str | None = None  # served instead of the real metrics (malformed, NaN...)
    role_chunk: bool = False  # a role-only first event before the prefill wait
    # OpenAI's shape with include_usage: `"usage":null` in every chunk before the usage one
    usage_nulls: bool = False
    split_tail_ms: float = 0.0  # > 0: the stream's last events in three writes this far apart
    # > 0: a stream's end (the chunked terminator) this long after `[DONE]`, in a write of its
    # own: a client that leaves once it reads `[DONE]` (the openai SDK does) leaves before it.
    end_gap_ms: float = 0.0
    # >= 0: `/tokenize` answers this `count` whatever the text (an engine lying to the router)
    tokenize_count: int = -1
    # Every API request (generation, tokenize, pooling, stored responses...) waits, counted in
    # `/stats` `held`, until `hold` is set false again: keeps requests in flight on purpose.
    hold: bool = False
    # How a stream's SSE lines end: "\n" (what engines write), "\r\n" or "\r" (both allowed by
    # the SSE grammar: relays must frame events by any of them).
    line_end: str = "\n"


@dataclass
class Stats:
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    tokens_generated: int = 0
    tokens_after_disconnect: int = 0
    running: int = 0
    probes: int = 0  # GET /health and GET /v1/models
    last_probe_authorization: str | None = None
    connections: set[tuple[str, int]] = field(default_factory=set)
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=256))

    def public(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "aborted": self.aborted,
            "tokens_generated": self.tokens_generated,
            "tokens_after_disconnect": self.tokens_after_disconnect,
            "running": self.running,
            "probes": self.probes,
            "last_probe_authorization": self.last_probe_authorization,
            "connections_opened": len(self.connections),
            "recent": list(self.recent),
        }


def token_text(i: int) -> str:
    return f"tok{i} "


class MockUpstream:
    def __init__(
        self,
        name: str = "mock",
        behaviour: Behaviour | None = None,
        engine: EngineConfig | None = None,
        served_model_names: list[str] | None = None,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        handoff: HandoffConfig | None = None,
    ) -> None:
        self.name = name
        self.behaviour = behaviour or Behaviour()
        # None: any model name is served (tests route many names to one mock); a list: others
        # get vLLM's 404, as a real engine's --served-model-name does.
        self.served = served_model_names
        self.default_model = served_model_names[0] if served_model_names else "mock-model"
        self.max_model_len = max_model_len
        self.engine = Engine(engine, self.default_model) if engine is not None else None
        self.metrics_scrapes = 0
        self.metrics_active = 0  # /metrics answers in progress (a scraper must not pile up)
        self.metrics_active_max = 0
        self.stats = Stats()
        # Stored Responses (vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1): id -> response object
        self.responses: dict[str, dict[str, Any]] = {}
        # Background responses still generating: id -> their generation
        self._behind: dict[str, asyncio.Future[None]] = {}
        self._queue: deque[asyncio.Future[None]] = deque()  # requests waiting for a batch slot
        self._released = asyncio.Event()  # cleared while `hold` keeps requests waiting
        self._released.set()
        self.held = 0  # requests waiting for `hold` to be lifted
        self.lora_runtime_loads = 0  # POST /v1/load_lora_adapter that succeeded
        # Prefill/decode handoff (router/tools/mock/handoff.py); None: a plain engine.
        self.handoff = Handoff(handoff, name, self.default_model) if handoff is not None else None

    def _lora_on(self) -> bool:
        return self.engine is not None and self.engine.config.max_loras > 0

    async def _lora_admin(self, path: str, body: bytes, send: Send) -> None:
        """vLLM's load and unload endpoints (entrypoints/serve/lora, 0.32): plain-text success,
        its JSON errors otherwise."""
        engine = self.engine
        assert engine is not None
        try:
            req = json.loads(body)
        except ValueError:
            req = None
        if not isinstance(req, dict):
            await _json(send, 400, wire.error(400, "Invalid JSON", "BadRequestError", None).body)
            return
        name, where = req.get("lora_name"), req.get("lora_path")
        if path == "/v1/unload_lora_adapter":
            if not name:
                msg = "'lora_name' needs to be provided to unload a LoRA adapter."
                await _json(send, 400, wire.error(400, msg, "InvalidUserInput", None).body)
            elif name not in engine.adapters:
                msg = f"The lora adapter '{name}' cannot be found."
                await _json(send, 404, wire.error(404, msg, "NotFoundError", None).body)
            else:
                engine.unload(name)
                await _text(send, f"Success: LoRA adapter '{name}' removed successfully.")
            return
        names = self.served or [self.default_model]
        if not name or not where:
            msg = "Both 'lora_name' and 'lora_path' must be provided."
            await _json(send, 400, wire.error(400, msg, "InvalidUserInput", None).body)
        elif name in names:
            msg = f"The lora adapter '{name}' conflicts with a served base model."
            await _json(send, 400, wire.error(400, msg, "InvalidUserInput", None).body)
        elif name in engine.adapters and not req.get("load_inplace"):
            msg = (
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )
            await _json(send, 400, wire.error(400, msg, "InvalidUserInput", None).body)
        else:
            await asyncio.sleep(engine.config.lora_load_ms / 1000)
            if not await asyncio.to_thread(os.path.isdir, str(where)):
                msg = f"Loading lora {name} failed: No adapter found for {where}"
                await _json(send, 404, wire.error(404, msg, "NotFoundError", None).body)
                return
            engine.adapters[name] = str(where)
            self.lora_runtime_loads += 1
            await _text(send, f"Success: LoRA adapter '{name}' added successfully.")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    if self.engine is not None:  # hidden load runs from the start
                        self.engine.set_background(self.engine.config.background)
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        client = scope.get("client")
        if client and method == "POST" and path.startswith("/v1/"):
            # Only connections that carried generation requests: probes and test calls to
            # /stats or /control would blur what pool-reuse tests look at.
            self.stats.connections.add((client[0], client[1]))
        if path.startswith("/v1/responses/"):
            await _read_body(receive)
            await self._wait_hold()
            await self._stored(method, path, send)
            return
        if method == "GET":
            if path in ("/health", "/v1/models"):
                self.stats.probes += 1
                for k, v in scope["headers"]:
                    if k == b"authorization":
                        self.stats.last_probe_authorization = v.decode("latin-1")
            await self._get(path, send)
            return
        body = await _read_body(receive)
        if path == "/control":
            await self._control(body, send)
            return
        if path.startswith("/kv_handoff/") and self.handoff is not None:
            status, answer = await self.handoff.serve(path, body)
            await _json(send, status, answer)
            return
        if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and self._lora_on():
            await self._lora_admin(path, body, send)
            return
        if path in _GENERATION or path in _API_PATHS or path == "/tokenize":
            await self._wait_hold()
        if path in _GENERATION:
            await self._generate(scope, path, body, receive, send)
            return
        if path == "/tokenize":  # vLLM's: the prompt's (here: the mock's, as its KV events) ids
            try:
                req = json.loads(body)
            except ValueError:
                req = None
            if not isinstance(req, dict):
                await _json(send, 400, {"error": {"message": "bad body", "code": 400}})
                return
            text = req.get("prompt")
            text = text if isinstance(text, str) else prompt_text(req)
            # The mock's own answer words (`tokN `) at the end are one token each, as its
            # answers generate them and `prompt_tokens` counts them.
            found = _RUN.search(text)
            run = found.group(0) if found is not None else ""
            ids = mock_tokens(text[: len(text) - len(run)]) + list(range(run.count(" ")))
            answer = apis.tokenize(ids, self.max_model_len)
            if self.behaviour.tokenize_count >= 0:
                answer["count"] = self.behaviour.tokenize_count
            await _json(send, 200, answer)
            return
        if path in _API_PATHS:
            await self._api(scope, path, body, receive, send)
            return
        await _json(send, 404, _NOT_FOUND)

    async def _wait_hold(self) -> None:
        if self._released.is_set():
            return
        self.held += 1
        try:
            await self._released.wait()
        finally:
            self.held -= 1

    async def _get(self, path: str, send: Send) -> None:
        if path == "/health":  # vLLM: an empty body
            status = self.behaviour.health_status
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        elif path == "/kv_event_sources":
            kv = self.engine.kv if self.engine is not None else None
            await _json(send, 200, {"0": kv.source()} if kv is not None else {})
        elif path == "/v1/models":
            names = self.served or [self.default_model]
            listed = wire.models(names, self.name, self.max_model_len)
            if self.engine is not None and self._lora_on():
                listed["data"] += wire.lora_models(self.engine.adapters, self.default_model)
            await _json(send, 200, listed)
        elif path == "/stats":
            await _json(
                send,
                200,
                {
                    "name": self.name,
                    **self.stats.public(),
                    "behaviour": asdict(self.behaviour),
                    "metrics_scrapes": self.metrics_scrapes,
                    "held": self.held,
                    "metrics_active_max": self.metrics_active_max,
                    "lora_loads": self.engine.lora_loads if self.engine is not None else 0,
                    "lora_runtime_loads": self.lora_runtime_loads,
                    "handoff": self.handoff.public() if self.handoff is not None else None,
                },
            )
        elif path == "/metrics":
            bh = self.behaviour
            self.metrics_scrapes += 1
            self.metrics_active += 1
            self.metrics_active_max = max(self.metrics_active_max, self.metrics_active)
            try:
                if bh.metrics_delay_ms > 0:
                    await asyncio.sleep(bh.metrics_delay_ms / 1000)
            finally:
                self.metrics_active -= 1
            if bh.metrics_body is not None:
                text = bh.metrics_body.encode()
            elif self.engine is not None:
                text = self.engine.metrics_text()
            else:
                lab = f'{{engine="0",model_name="{self.default_model}"}}'
                text = (
                    "# HELP vllm:num_requests_running Number of requests in model execution "
                    "batches.\n"
                    "# TYPE vllm:num_requests_running gauge\n"
                    f"vllm:num_requests_running{lab} {float(self.stats.running)}\n"
                    "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
                    "# TYPE vllm:num_requests_waiting gauge\n"
                    f"vllm:num_requests_waiting{lab} {float(len(self._queue))}\n"
                ).encode()
            if self.handoff is not None and bh.metrics_body is None:
                text += self.handoff.metrics_text().encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": bh.metrics_status,
                    "headers": [
                        (b"content-type", METRICS_TYPE),
                        (b"content-length", str(len(text)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": text})
        elif path in _GENERATION:
            await _json(send, 405, _NOT_ALLOWED)
        else:
            await _json(send, 404, _NOT_FOUND)

    async def _control(self, body: bytes, send: Send) -> None:
        try:
            changes = json.loads(body or b"{}")
            if changes.pop("reset_stats", False):
                self.stats = Stats()
                if self.handoff is not None:  # the handoff's counts too; blocks held stay held
                    self.handoff.stats = HandoffStats()
            if changes.pop("reset_prefix_cache", False):  # vLLM: POST /reset_prefix_cache
                if self.engine is None:
                    raise ValueError("reset_prefix_cache needs the engine model (--engine)")
                self.engine.reset_prefix_cache()
            background = changes.pop("background", None)
            if background is not None:
                if self.engine is None:
                    raise ValueError("background needs the engine model (--engine)")
                self.engine.set_background(int(background))
            fields = asdict(Behaviour())
            fields.update(asdict(self.behaviour))
            fields.update(changes)
            if fields["line_end"] not in ("\n", "\r\n", "\r"):
                raise ValueError("line_end must be one of LF, CRLF, CR")
            self.behaviour = Behaviour(**fields)
            if self.behaviour.hold:
                self._released.clear()
            else:
                self._released.set()
        except (ValueError, TypeError) as exc:
            await _json(send, 400, wire.error(400, str(exc), "BadRequestError", None).body)
            return
        await _json(send, 200, asdict(self.behaviour))

    async def _generate(
        self, scope: Scope, path: str, body: bytes, receive: Receive, send: Send
    ) -> None:
        st = self.stats
        bh = self.behaviour
        st.requests += 1
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        rec: dict[str, Any] = {
            "path": path,
            "request_id": headers.get("x-request-id"),
            "authorization": headers.get("authorization"),
            "headers": headers,
            "model": None,
            "tokens": 0,
            "aborted": False,
            "started_at": time.time(),
            "disconnected_at": None,
            "query": scope.get("query_string", b"").decode("latin-1"),
        }
        st.recent.append(rec)
        if await self._key_refused(headers, path, send):
            return
        chat = path == "/v1/chat/completions"
        start = 0  # where the answer begins: past a continued answer's tokens
        try:
            if path == "/v1/embeddings":
                req, asked, prompt = _embedding_request(body), None, 1
            else:
                served = self.served
                if self.engine is not None and self._lora_on():
                    served = [*(served or [self.default_model]), *self.engine.adapters]
                req, asked = wire.parse_request(chat, body, served, self.max_model_len)
                start, run = continued_from(req, chat)
                prompt = prompt_tokens(req, run) + start
                wire.check_prompt(prompt, self.max_model_len)
                if asked is not None:
                    wire.check_max_tokens(asked)
        except wire.RequestError as exc:
            await _json(send, exc.status, exc.body)
            return
        rec["model"] = model = req.get("model") or self.default_model
        rec["fields"] = list(req)  # the body's member names: what a router forwarded
        if bh.fail_status and bh.fail_count != 0:
            if bh.fail_count > 0:
                bh.fail_count -= 1
            extra = [(b"retry-after", str(bh.retry_after).encode())] if bh.retry_after else []
            failing = wire.error(
                bh.fail_status, f"{self.name} failing on purpose", "server_error", None
            )
            answer = json.loads(bh.fail_body) if bh.fail_body is not None else failing.body
            await _json(send, bh.fail_status, answer, extra)
            st.completed += 1
            return

        gone = asyncio.Event()
        watcher = asyncio.ensure_future(_watch(receive, gone, rec))
        handoff = self.handoff
        if handoff is not None and path != "/v1/embeddings":
            rec["kv_params"] = req.get("kv_transfer_params")
            rec["body"] = req  # what each leg was sent, for the tests (256 kept)
            rec["room"] = req.get("bootstrap_room")
            if not self._prefills(req):
                failed = await handoff.before_generate(req, prompt, prompt_text(req), gone)
                if failed is not None:
                    watcher.cancel()
                    if not gone.is_set():
                        await _json(send, 500, failed)
                    st.completed += 1
                    return
            else:
                handoff.stats.local_tokens += prompt
        if self.engine is not None and path != "/v1/embeddings":
            st.running += 1
            try:
                await self._engine_generate(
                    send, rec, req, asked, prompt, model, chat, gone, watcher
                )
            finally:
                st.running -= 1
                if gone.is_set():
                    rec["aborted"] = True
                    st.aborted += 1
                else:
                    st.completed += 1
                watcher.cancel()
            return
        await self._admit(gone)
        st.running += 1
        try:
            if bh.hang:
                await gone.wait()
                return
            # Without max_tokens the answer ends at `tokens` (as a model's end of text would),
            # also when it continues one begun elsewhere.
            n = asked if asked is not None else max(0, bh.tokens - start)
            if path == "/v1/embeddings":
                await self._sleep(bh.ttft_ms, gone)
                await _json(
                    send,
                    200,
                    {
                        "object": "list",
                        "model": model,
                        "data": [{"object": "embedding", "index": 0, "embedding": [0.0, 0.5, 1.0]}],
                        "usage": {"prompt_tokens": 1, "total_tokens": 1},
                    },
                )
                st.completed += 1
                return
            if req.get("stream") is True:
                await self._stream(send, rec, req, model, chat, prompt, n, gone, start)
            else:
                await self._whole(send, rec, model, chat, prompt, n, gone, start, req)
            self._room_done(rec, req, prompt, gone)
        finally:
            st.running -= 1
            self._wake_one()
            if gone.is_set():
                rec["aborted"] = True
                st.aborted += 1
            else:
                st.completed += 1
            watcher.cancel()

    async def _stored(self, method: str, path: str, send: Send) -> None:
        """GET /v1/responses/{id}, POST /v1/responses/{id}/cancel: as vLLM answers them."""
        self.stats.requests += 1
        rest = path[len("/v1/responses/") :]
        cancel = method == "POST" and rest.endswith("/cancel")
        response_id = rest[: -len("/cancel")] if cancel else rest
        self.stats.recent.append({"path": path, "method": method, "response_id": response_id})
        stored = self.responses.get(response_id)
        if (method != "GET" and not cancel) or "/" in response_id:
            await _json(send, 404, {"detail": "Not Found"})
        elif stored is None:
            await _json(send, 404, apis.not_found_response(response_id))
        elif cancel and response_id in self._behind:  # a background one still generating
            self._behind.pop(response_id).cancel()
            stored["status"] = "cancelled"
            await _raw(send, 200, apis.dumps(stored))
        elif cancel:  # done, or synchronous
            await _json(send, 400, apis.cannot_cancel())
        else:
            await _raw(send, 200, apis.dumps(stored))
        self.stats.completed += 1

    async def _key_refused(self, headers: dict[str, str], path: str, send: Send) -> bool:
        """A cloud API's key check (`require_key`): OpenAI's bearer key, or Anthropic's
        `x-api-key` with an `anthropic-version` on the Messages API. True when refused."""
        key = self.behaviour.require_key
        if key is None:
            return False
        if path.startswith("/v1/messages"):
            if headers.get("x-api-key") == key and headers.get("anthropic-version"):
                return False
            refused = apis.anthropic_error("authentication_error", "invalid x-api-key")
        else:
            if headers.get("authorization") == "Bearer " + key:
                return False
            refused = {
                "error": {
                    "message": "Incorrect API key provided.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        await _json(send, 401, refused)
        return True

    async def _failing(self, send: Send, anthropic: bool = False) -> bool:
        """Answer with the configured failure, if one applies; True when it did."""
        bh = self.behaviour
        if not bh.fail_status or bh.fail_count == 0:
            return False
        if bh.fail_count > 0:
            bh.fail_count -= 1
        extra = [(b"retry-after", str(bh.retry_after).encode())] if bh.retry_after else []
        message = f"{self.name} failing on purpose"
        body: dict[str, Any] = (
            json.loads(bh.fail_body)
            if bh.fail_body is not None
            else apis.anthropic_error("api_error", message)
            if anthropic
            else {"error": {"message": message, "type": "server_error", "code": bh.fail_status}}
        )
        await _json(send, bh.fail_status, body, extra)
        self.stats.completed += 1
        return True

    async def _api(
        self, scope: Scope, path: str, body: bytes, receive: Receive, send: Send
    ) -> None:
        """Responses, Messages, tokenize, pooling and audio, in vLLM 0.32's shapes."""
        st = self.stats
        st.requests += 1
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        rec: dict[str, Any] = {
            "path": path,
            "request_id": headers.get("x-request-id"),
            "authorization": headers.get("authorization"),
            "headers": headers,
            "model": None,
            "tokens": 0,
            "aborted": False,
            "started_at": time.time(),
            "disconnected_at": None,
            "query": scope.get("query_string", b"").decode("latin-1"),
        }
        st.recent.append(rec)
        if await self._key_refused(headers, path, send):
            return
        anthropic = path.startswith("/v1/messages")
        req = _form(body, headers.get("content-type")) if path.startswith("/v1/audio/") else None
        if req is None:
            try:
                req = json.loads(body)
                if not isinstance(req, dict):
                    raise ValueError("not an object")
            except ValueError:
                await _json(send, 400, {"error": {"message": "bad json", "type": "invalid"}})
                return
        rec["model"] = model = str(req.get("model") or "mock-model")
        rec["previous_response_id"] = req.get("previous_response_id")
        if await self._failing(send, anthropic):
            return
        prompt = _api_prompt_tokens(req)
        if path not in _GENERATES:
            await _json(send, 200, _answer(path, model, req, prompt))
            st.completed += 1
            return
        previous = req.get("previous_response_id")
        if path == "/v1/responses" and previous is not None and previous not in self.responses:
            await _json(send, 404, apis.not_found_response(str(previous)))
            st.completed += 1
            return
        field = {"/v1/responses": "max_output_tokens", "/v1/messages": "max_tokens"}.get(path)
        n = req.get(field) if field else None
        n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else self.behaviour.tokens
        if path == "/v1/responses" and req.get("background") is True and not req.get("stream"):
            await self._background(send, rec, req, model, prompt, min(n, 100_000))
            return
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(_watch(receive, gone, rec))
        await self._admit(gone)
        st.running += 1
        try:
            await self._api_generate(send, rec, path, req, model, prompt, min(n, 100_000), gone)
        finally:
            st.running -= 1
            self._wake_one()
            if gone.is_set():
                rec["aborted"] = True
                st.aborted += 1
            else:
                st.completed += 1
            watcher.cancel()

    async def _api_generate(
        self,
        send: Send,
        rec: dict[str, Any],
        path: str,
        req: dict[str, Any],
        model: str,
        prompt: int,
        n: int,
        gone: asyncio.Event,
    ) -> None:
        bh = self.behaviour
        rid = (rec["request_id"] or "0")[:64]
        stream = req.get("stream") is True
        responses = path == "/v1/responses"
        messages = path == "/v1/messages"
        obj = apis.response_object(rid, model, req, None, None, n) if responses else {}
        if stream:
            await send({"type": "http.response.start", "status": 200, "headers": list(_SSE)})
            head = (
                apis.response_head(obj, rid)
                if responses
                else apis.message_head(rid, model, prompt)
                if messages
                else b""
            )
            if head:
                await send({"type": "http.response.body", "body": head, "more_body": True})
        await self._sleep(bh.ttft_ms, gone)
        parts: list[str] = []
        for i in range(n):
            if gone.is_set():
                return
            if i and bh.itl_ms:
                await self._sleep(bh.itl_ms, gone)
                if gone.is_set():
                    return
            self._count_token(rec, gone)
            text = token_text(i)
            parts.append(text)
            if not stream:
                continue
            event = (
                apis.response_delta(rid, text, 4 + i)
                if responses
                else apis.message_delta(text)
                if messages
                else apis.transcription_chunk(rid, model, text, i == n - 1)
            )
            await send({"type": "http.response.body", "body": event, "more_body": True})
        text = "".join(parts)
        if responses:
            usage = apis.response_usage(prompt, n)
            done = apis.response_object(rid, model, req, text, usage, n)
            if req.get("store") is not False:
                self._store(done)
            if stream:
                tail = apis.response_tail(done, rid, text, 4 + n)
            else:
                await _raw(send, 200, apis.dumps(done))
                return
        elif messages:
            usage = apis.message_usage(prompt, n)
            if stream:
                tail = apis.message_tail(usage)
            else:
                await _raw(send, 200, apis.dumps(apis.message_object(rid, model, text, usage)))
                return
        else:
            if not stream:
                await _raw(send, 200, apis.dumps(apis.transcription(text, 1)))
                return
            tail = b""
            if req.get("stream_include_usage") == "true":
                tail = apis.transcription_usage(rid, model, prompt, n)
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _background(
        self,
        send: Send,
        rec: dict[str, Any],
        req: dict[str, Any],
        model: str,
        prompt: int,
        n: int,
    ) -> None:
        """vLLM's background mode: the answer is the stored response, `queued` with `usage:
        null`; it generates on after the answer, and `GET /v1/responses/{id}` returns it done,
        with its usage, once it is (`cancel` stops it)."""
        st = self.stats
        if req.get("store") is False:
            await _json(send, 400, apis.background_needs_store())
            st.completed += 1
            return
        rid = (rec["request_id"] or "0")[:64]
        queued = apis.response_object(rid, model, req, None, None, n, background=True)
        self._store(queued)
        task = asyncio.ensure_future(self._generate_behind(rec, queued, req, prompt, n))
        self._behind[queued["id"]] = task
        task.add_done_callback(lambda _: self._behind.pop(queued["id"], None))
        await _raw(send, 200, apis.dumps(queued))

    async def _generate_behind(
        self, rec: dict[str, Any], stored: dict[str, Any], req: dict[str, Any], prompt: int, n: int
    ) -> None:
        """A background response's generation, paced as a request's (no client to leave)."""
        bh = self.behaviour
        st = self.stats
        running = asyncio.Event()  # never set: nobody waits on a background response
        await self._admit(running)
        st.running += 1
        stored["status"] = "in_progress"  # the object GET answers until it is done
        try:
            await self._sleep(bh.ttft_ms, running)
            parts: list[str] = []
            for i in range(n):
                if i and bh.itl_ms:
                    await self._sleep(bh.itl_ms, running)
                self._count_token(rec, running)
                parts.append(token_text(i))
            usage = apis.response_usage(prompt, n)
            rid, model = stored["id"][len("resp_") :], stored["model"]
            done = apis.response_object(rid, model, req, "".join(parts), usage, n, True)
            self._store(done)
            st.completed += 1
        except asyncio.CancelledError:
            stored["status"] = "cancelled"
            st.aborted += 1
            raise
        finally:
            st.running -= 1
            self._wake_one()

    def _store(self, response: dict[str, Any]) -> None:
        self.responses[response["id"]] = response
        while len(self.responses) > _MAX_STORED:
            del self.responses[next(iter(self.responses))]

    async def _admit(self, gone: asyncio.Event) -> None:
        """Wait for a batch slot when `max_running` is set, so time to first token grows with
        load the way a real server's does."""
        while 0 < self.behaviour.max_running <= self.stats.running and not gone.is_set():
            slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._queue.append(slot)
            left = asyncio.ensure_future(gone.wait())
            try:
                await asyncio.wait((slot, left), return_when=asyncio.FIRST_COMPLETED)
            finally:
                left.cancel()
                if not slot.done():
                    slot.cancel()
                elif gone.is_set():
                    self._wake_one()  # pass the slot on

    def _wake_one(self) -> None:
        while self._queue:
            slot = self._queue.popleft()
            if not slot.done():
                slot.set_result(None)
                return

    async def _sleep(self, ms: float, gone: asyncio.Event) -> None:
        if ms > 0 and not gone.is_set():
            try:
                await asyncio.wait_for(gone.wait(), ms / 1000)
            except TimeoutError:
                pass

    def _count_token(self, rec: dict[str, Any], gone: asyncio.Event) -> None:
        rec["tokens"] += 1
        self.stats.tokens_generated += 1
        if gone.is_set():
            self.stats.tokens_after_disconnect += 1

    def _chunks(
        self, rec: dict[str, Any], req: dict[str, Any], model: str, chat: bool, prompt: int
    ) -> wire.Chunks:
        options = req.get("stream_options")
        usage = _wants_usage(req)
        continuous = usage and options.get("continuous_usage_stats") is True  # type: ignore[union-attr]
        rid = _fresh_id() if self.behaviour.fresh_ids else (rec["request_id"] or "0")
        created = int(time.time()) if self.behaviour.fresh_ids else 0
        tool = _named_tool(req) if chat else None
        return wire.Chunks(
            chat, rid, model, usage, continuous, self.behaviour.usage_nulls, prompt, created, tool
        )

    async def _stream(
        self,
        send: Send,
        rec: dict[str, Any],
        req: dict[str, Any],
        model: str,
        chat: bool,
        prompt: int,
        n: int,
        gone: asyncio.Event,
        start: int = 0,
    ) -> None:
        bh = self.behaviour
        chunks = self._chunks(rec, req, model, chat, prompt)
        headers = list(_SSE)
        compressor = None
        if bh.line_end != "\n" and not bh.gzip:
            send = _reframed(send, bh.line_end.encode())
        if bh.gzip:
            headers.append((b"content-encoding", b"gzip"))
            compressor = gzip.GzipFile  # marker: compress the whole stream at the end
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        parts: list[bytes] = []
        first = chunks.first()  # vLLM sends it with the first token
        if first and bh.role_chunk:  # before the prefill wait instead
            if compressor is not None:
                parts.append(first)
            else:
                await send({"type": "http.response.body", "body": first, "more_body": True})
            first = b""
        await self._sleep(bh.ttft_ms, gone)
        for i in range(n):
            if gone.is_set():
                return
            if i and bh.itl_ms:
                await self._sleep(bh.itl_ms, gone)
                if gone.is_set():
                    return
            if i and start + i in bh.fail_at:
                await self._fault(send, first, chunks, prompt, i)
                return
            self._count_token(rec, gone)
            text = token_text(start + i).encode()
            if bh.pad_bytes:
                text += b"." * bh.pad_bytes
            chunk = chunks.token(text, i == n - 1)
            if bh.half_event_after == i:
                await send(
                    {
                        "type": "http.response.body",
                        "body": first + chunk[: len(chunk) // 2],
                        "more_body": True,
                    }
                )
                raise ConnectionAbortedError("half event on purpose")
            if bh.die_after == i:
                raise ConnectionAbortedError("dying on purpose")
            if first:
                chunk, first = first + chunk, b""
            if compressor is not None:
                parts.append(chunk)
                continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        tail = first + (chunks.token(b"", True) if n == 0 else b"") + chunks.tail(prompt, n, 0)
        if compressor is not None:
            await send(
                {
                    "type": "http.response.body",
                    "body": gzip.compress(b"".join(parts) + tail),
                    "more_body": False,
                }
            )
            return
        if bh.split_tail_ms > 0:
            # Events cut across writes (and so across a proxy's reads): thirds of the tail.
            third = len(tail) // 3
            for part in (tail[:third], tail[third : 2 * third]):
                await send({"type": "http.response.body", "body": part, "more_body": True})
                await self._sleep(bh.split_tail_ms, gone)
            tail = tail[2 * third :]
        await self._end_stream(send, tail, gone)

    async def _end_stream(self, send: Send, tail: bytes, gone: asyncio.Event) -> None:
        """The stream's last bytes and its end: one write, or two `end_gap_ms` apart."""
        if self.behaviour.end_gap_ms > 0:
            await send({"type": "http.response.body", "body": tail, "more_body": True})
            await self._sleep(self.behaviour.end_gap_ms, gone)
            tail = b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _fault(
        self, send: Send, first: bytes, chunks: wire.Chunks, prompt: int, sent: int
    ) -> None:
        """End a stream the way `fail_how` says (after `sent` tokens)."""
        how = self.behaviour.fail_how
        if how == "error":  # vLLM's stream generator on an exception: an error event, [DONE]
            message = f"{self.name} failing mid-stream"
            failing = wire.error(500, message, "InternalServerError", None)
            body = first + b"data: " + wire.dumps(failing.body) + b"\n\ndata: [DONE]\n\n"
        elif how == "finish_error":
            body = first + chunks.token(b"", True, "error") + chunks.tail(prompt, sent + 1, 0)
        else:
            raise ConnectionAbortedError("dying on purpose")
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _whole(
        self,
        send: Send,
        rec: dict[str, Any],
        model: str,
        chat: bool,
        prompt: int,
        n: int,
        gone: asyncio.Event,
        start: int = 0,
        req: dict[str, Any] | None = None,
    ) -> None:
        bh = self.behaviour
        await self._sleep(bh.ttft_ms, gone)
        text = []
        for i in range(n):
            if gone.is_set():
                return
            if i and bh.itl_ms:
                await self._sleep(bh.itl_ms, gone)
                if gone.is_set():
                    return
            if bh.die_after == i or (i and start + i in bh.fail_at):
                raise ConnectionAbortedError("dying on purpose")
            self._count_token(rec, gone)
            text.append(token_text(start + i))
        rid = _fresh_id() if bh.fresh_ids else (rec["request_id"] or "0")
        payload = wire.completion(rid, model, chat, "".join(text), prompt, n, 0)
        self._held(payload, rec, req or {}, prompt, 0)
        await _json(send, 200, payload, gzip_body=bh.gzip)

    def _prefills(self, req: dict[str, Any]) -> bool:
        """A prefill engine's part of a split request (NIXL's phase 1, SGLang's P copy)."""
        handoff = self.handoff
        if handoff is None or handoff.cfg.role == "decode":
            return False
        params = req.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("do_remote_decode"):
            return True
        return handoff.cfg.connector == "sglang" and req.get("bootstrap_room") is not None

    def _held(
        self,
        payload: dict[str, Any],
        rec: dict[str, Any],
        req: dict[str, Any],
        prompt: int,
        cached: int,
    ) -> None:
        """NIXL phase 1 answered: its blocks held, and vLLM's params naming them in the answer."""
        params = rec.get("kv_params")
        if self.handoff is None or not isinstance(params, dict):
            return
        if params.get("do_remote_decode") and self.handoff.cfg.role != "decode":
            rid = rec["request_id"] or _fresh_id()
            payload["kv_transfer_params"] = self.handoff.hold(rid, prompt, cached, prompt_text(req))

    def _room_done(
        self, rec: dict[str, Any], req: dict[str, Any], prompt: int, gone: asyncio.Event
    ) -> None:
        room = rec.get("room")
        if self.handoff is not None and isinstance(room, int) and not gone.is_set():
            if self._prefills(req):
                self.handoff.room_done(room, prompt, prompt_text(req))

    async def _engine_generate(
        self,
        send: Send,
        rec: dict[str, Any],
        req: dict[str, Any],
        asked: int | None,
        prompt: int,
        model: str,
        chat: bool,
        gone: asyncio.Event,
        watcher: asyncio.Future[None],
    ) -> None:
        """Generation paced by the engine model: tokens appear as its steps produce them."""
        engine = self.engine
        assert engine is not None
        n = max(1, asked if asked is not None else self.behaviour.tokens)
        prefix: tuple[int, ...] = ()
        tokens: list[int] = []
        if engine.config.prefix_caching:
            text = prompt_text(req)
            prefix = block_hashes(text, engine.config.block_size * 4)
            if engine.kv is not None:
                tokens = mock_tokens(text)
        lora = model if model in engine.adapters else None
        seq = engine.submit(prompt, n, prefix=prefix, tokens=tokens, lora=lora)

        def left(_: object) -> None:
            if gone.is_set():
                engine.cancel(seq)
                seq.wake.set()

        watcher.add_done_callback(left)
        stream = req.get("stream") is True
        chunks = self._chunks(rec, req, model, chat, prompt)
        first = chunks.first() if stream else b""
        if stream:
            await send({"type": "http.response.start", "status": 200, "headers": list(_SSE)})
            if first and self.behaviour.role_chunk:
                await send({"type": "http.response.body", "body": first, "more_body": True})
                first = b""
        sent = 0
        try:
            while sent < n:
                if seq.generated == sent:
                    await seq.wake.wait()
                    seq.wake.clear()
                if gone.is_set():
                    return
                upto = seq.generated
                for _ in range(sent, upto):
                    self._count_token(rec, gone)
                if stream and upto > sent:
                    body = first + b"".join(
                        chunks.token(token_text(i).encode(), i == n - 1) for i in range(sent, upto)
                    )
                    first = b""
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                sent = upto
        finally:
            if not seq.done:
                engine.cancel(seq)
            else:
                engine.finished_length += 1
        if stream:
            await self._end_stream(send, chunks.tail(prompt, n, seq.cached), gone)
            self._room_done(rec, req, prompt, gone)
            return
        content = "".join(token_text(i) for i in range(n))
        payload = wire.completion(
            rec["request_id"] or "0", model, chat, content, prompt, n, seq.cached
        )
        self._held(payload, rec, req, prompt, seq.cached)
        await _json(send, 200, payload)
        self._room_done(rec, req, prompt, gone)


def prompt_tokens(req: dict[str, Any], run: str = "") -> int:
    """A prompt's length in tokens, estimated as vLLM's tokenizer would roughly count English:
    four characters a token; `run`, the continued answer at its end, is left out (its tokens
    are counted one each by the caller)."""
    chars = -len(run)
    messages = req.get("messages")
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    else:
        prompt = req.get("prompt")
        if isinstance(prompt, str):
            chars = len(prompt)
    return max(1, chars // 4)


_RUN = re.compile(r"(?:tok\d+ )+$")


def continued_from(req: dict[str, Any], chat: bool) -> tuple[int, str]:
    """Where the answer starts, and the text it continues: the mock's "model" goes on with the
    `tok0 tok1 ... tok<k-1> ` its own answers begin with, when the prompt (completions) or the
    final assistant message under `continue_final_message` (chat, as vLLM honours it) ends with
    them; else (0, "")."""
    if chat:
        messages = req.get("messages")
        if req.get("continue_final_message") is not True or not isinstance(messages, list):
            return 0, ""
        last = messages[-1] if messages else None
        if not isinstance(last, dict) or last.get("role") != "assistant":
            return 0, ""
        text = last.get("content")
    else:
        text = req.get("prompt")
    if not isinstance(text, str):
        return 0, ""
    found = _RUN.search(text)
    if found is None:
        return 0, ""
    words = found.group(0).split()
    # The longest tail that counts up from tok0.
    for begin in range(len(words)):
        if words[begin:] == [f"tok{i}" for i in range(len(words) - begin)]:
            return len(words) - begin, text[len(text) - sum(len(w) + 1 for w in words[begin:]) :]
    return 0, ""


def _named_tool(req: dict[str, Any]) -> str | None:
    """The function a request's `tool_choice` names, when it has `tools` (vLLM then streams one
    call to it: the answer's tokens are its arguments)."""
    choice = req.get("tool_choice")
    if not req.get("tools") or not isinstance(choice, dict):
        return None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def _fresh_id() -> str:
    return uuid.uuid4().hex[:16]


def prompt_text(req: dict[str, Any]) -> str:
    """The prompt as the engine's prefix cache sees it: what a chat template would render
    (roles and contents in order; non-string content as its JSON), or the completion prompt."""
    messages = req.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if not isinstance(content, str):
                content = json.dumps(content, sort_keys=True)
            parts.append(f"<|{m.get('role')}|>{content}")
        return "".join(parts)
    prompt = req.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def _wants_usage(req: dict[str, Any]) -> bool:
    opts = req.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


def _embedding_request(body: bytes) -> dict[str, Any]:
    try:
        req = json.loads(body)
    except ValueError:
        raise wire.error(400, "JSON decode error", "Bad Request", "body") from None
    if not isinstance(req, dict):
        raise wire.error(400, "Input should be an object", "Bad Request", "body")
    return req


async def _watch(receive: Receive, gone: asyncio.Event, rec: dict[str, Any]) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            rec["disconnected_at"] = time.time()
            gone.set()
            return


async def _max_tokens(req: dict[str, Any], default: int, least: int, send: Send) -> int | None:
    """The request's `max_tokens`, or None after answering 400 as vLLM does for a bad value or
    one beyond the context length."""
    n = req.get("max_tokens") or default
    if isinstance(n, int) and not isinstance(n, bool) and least <= n <= 100_000:
        return n
    message = f"max_tokens must be {least}..100000"
    await _json(send, 400, {"error": {"message": message, "type": "BadRequestError", "code": 400}})
    return None


def _form(body: bytes, content_type: str | None) -> dict[str, Any] | None:
    """A multipart upload's plain fields, or None when it is not one. Parsed with the standard
    library's `email` parser, not the router's own (`router/request/wire/multipart.py`): a fault in
    that one must not pass on both sides. Each part is named as vLLM's form parser
    (python-multipart under Starlette) names it: by its last `Content-Disposition`, whose
    parameters after the first (the type) are read by `email`'s rules, the last of a name
    winning; a field given twice keeps its last value (Starlette's `FormData.get`)."""
    if not content_type or not content_type.lower().startswith("multipart/form-data"):
        return None
    head = b"Content-Type: " + content_type.encode("latin-1", "replace") + b"\r\n\r\n"
    message = BytesParser().parsebytes(head + body)
    if not message.is_multipart():
        return None
    fields: dict[str, Any] = {}
    for part in message.get_payload():
        if not isinstance(part, EmailMessage):
            continue
        dispositions = part.get_all("content-disposition")
        if not dispositions:
            continue
        header = EmailMessage()
        header["content-disposition"] = str(dispositions[-1])
        options = {
            key: value[-1] if isinstance(value, tuple) else value
            for key, value in (header.get_params(header="content-disposition") or [])[1:]
        }
        name = options.get("name")
        if name is None or "filename" in options:
            continue
        value = part.get_payload(decode=True)
        fields[name] = value.decode("utf-8", "replace") if isinstance(value, bytes) else ""
    fields["stream"] = str(fields.get("stream", "")).strip().lower() == "true"
    return fields


def _api_prompt_tokens(req: dict[str, Any]) -> int:
    """Prompt tokens as `prompt_tokens` counts them, for the other APIs' bodies too."""
    given = req.get("input")
    if isinstance(given, str):
        return max(1, len(given) // 4)
    if isinstance(given, list):
        return max(1, len(json.dumps(given)) // 4)
    for name in ("query", "text_1", "text"):
        if isinstance(req.get(name), str):
            return max(1, len(req[name]) // 4)
    return prompt_tokens(req)


def _answer(path: str, model: str, req: dict[str, Any], prompt: int) -> dict[str, Any]:
    """The endpoints that generate nothing: answered at once."""
    if path == "/v1/messages/count_tokens":
        return apis.count_tokens(prompt)
    if path == "/detokenize":
        tokens = req.get("tokens")
        return apis.detokenize(tokens if isinstance(tokens, list) else [])
    return apis.pooling(path, model, req, prompt)


def _reframed(send: Send, line_end: bytes) -> Send:
    """`send` with each LF of a stream's bodies written as `line_end` (JSON holds no raw LF)."""

    async def reframed(message: Message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": message.get("body", b"").replace(b"\n", line_end)}
        await send(message)

    return reframed


async def _raw(send: Send, status: int, body: bytes) -> None:
    headers = [*_JSON, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _text(send: Send, text: str) -> None:
    """A plain 200 as vLLM's `Response(content=...)`: no content type."""
    body = text.encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        msg: Message = await receive()
        if msg["type"] != "http.request":
            break
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    return b"".join(parts)


async def _json(
    send: Send,
    status: int,
    obj: Any,
    extra: list[tuple[bytes, bytes]] | None = None,
    gzip_body: bool = False,
) -> None:
    body = wire.dumps(obj)
    headers = [*_JSON, *(extra or [])]
    if gzip_body:
        body = gzip.compress(body)
        headers.append((b"content-encoding", b"gzip"))
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def run(
    host: str,
    port: int,
    name: str,
    ttft_ms: float,
    itl_ms: float,
    tokens: int,
    log_level: str = "warning",
    engine: EngineConfig | None = None,
    served_model_names: list[str] | None = None,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    ssl_ca_certs: str | None = None,
    handoff: HandoffConfig | None = None,
) -> None:
    import ssl

    import uvicorn

    behaviour = Behaviour(ttft_ms=ttft_ms, itl_ms=itl_ms, tokens=tokens)
    if handoff is not None:
        handoff.port = handoff.port or port
    app = MockUpstream(name, behaviour, engine, served_model_names, max_model_len, handoff)
    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        log_level=log_level,
        access_log=False,
        lifespan="on",
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        ssl_ca_certs=ssl_ca_certs,
        # With a CA given, a client without a certificate it signed is refused (mTLS).
        ssl_cert_reqs=ssl.CERT_REQUIRED if ssl_ca_certs else ssl.CERT_NONE,
    )
