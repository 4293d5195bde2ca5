"""A vLLM-compatible mock upstream, cheap enough to sit under a benchmark.

Serves chat/completions/embeddings/models, `/health`, `/metrics` (vLLM's running/waiting gauges)
and `/stats` (requests, completed, aborted, tokens generated after its client went away, and
recent requests with the headers tests check). Token text is deterministic: ``tok0 tok1 ...``.
Behaviour can be changed while running with `POST /control` (fail_status, hang, ttft_ms, itl_ms,
tokens, half_event, gzip, retry_after, health_status, max_running, role_chunk, metrics_status,
metrics_delay_ms, metrics_body, background, usage_nulls, split_tail_ms; `reset_prefix_cache`
empties the engine's prefix cache) so fault tests need no second implementation. Streams end
with vLLM's usage event when the request asks for it (`stream_options.include_usage`); with
`usage_nulls` every other chunk then also carries `"usage":null`, as OpenAI's API does.
`role_chunk` sends vLLM's role-only first event
(`"delta":{"role":"assistant","content":""}`) right after the headers, before the prefill wait
(vLLM sends it with the first token; sending it early lets tests tell the first byte from the
first content token).
With an `EngineConfig` (`--engine` flags) generation runs through a simulated vLLM scheduler
(`router/mock/engine.py`: batch, queue, KV blocks, background load, vLLM's metric names).
A raw ASGI app: no framework on the hot path.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from router.mock.engine import Engine, EngineConfig, block_hashes
from router.mock.kv_publish import mock_tokens

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


@dataclass
class Behaviour:
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    tokens: int = 16
    fail_status: int = 0
    fail_count: int = -1  # how many requests fail_status applies to; -1 = all
    retry_after: float | None = None
    hang: bool = False  # accept, read the request, never answer
    half_event_after: int = -1  # send this many tokens, then half an event, then close
    die_after: int = -1  # send this many tokens, then drop the connection
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
    ) -> None:
        self.name = name
        self.behaviour = behaviour or Behaviour()
        self.engine = Engine(engine) if engine is not None else None
        self.metrics_scrapes = 0
        self.metrics_active = 0  # /metrics answers in progress (a scraper must not pile up)
        self.metrics_active_max = 0
        self.stats = Stats()
        self._queue: deque[asyncio.Future[None]] = deque()  # requests waiting for a batch slot
        # Chunks differ only by the token text: pre-split templates keep per-token work small.
        self._chat_pre = (
            '{"id":"chatcmpl-%s","object":"chat.completion.chunk","created":0,"model":"%s",'
            '"choices":[{"index":0,"delta":{"content":"'
        )
        self._cmpl_pre = (
            '{"id":"cmpl-%s","object":"text_completion","created":0,"model":"%s",'
            '"choices":[{"index":0,"text":"'
        )

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
        if path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            await self._generate(scope, path, body, receive, send)
            return
        if path == "/tokenize":  # vLLM's: the prompt's (here: the mock's) token ids
            try:
                req = json.loads(body)
            except ValueError:
                req = None
            if not isinstance(req, dict):
                await _json(send, 400, {"error": {"message": "bad body", "code": 400}})
                return
            ids = mock_tokens(prompt_text(req))
            await _json(send, 200, {"count": len(ids), "max_model_len": 1 << 20, "tokens": ids})
            return
        await _json(
            send, 404, {"error": {"message": "not found", "type": "not_found", "code": 404}}
        )

    async def _get(self, path: str, send: Send) -> None:
        if path == "/health":
            await _json(send, self.behaviour.health_status, {})
        elif path == "/kv_event_sources":
            kv = self.engine.kv if self.engine is not None else None
            await _json(send, 200, {"0": kv.source()} if kv is not None else {})
        elif path == "/v1/models":
            await _json(
                send,
                200,
                {
                    "object": "list",
                    "data": [{"id": "mock-model", "object": "model", "owned_by": self.name}],
                },
            )
        elif path == "/stats":
            await _json(
                send,
                200,
                {
                    "name": self.name,
                    **self.stats.public(),
                    "behaviour": asdict(self.behaviour),
                    "metrics_scrapes": self.metrics_scrapes,
                    "metrics_active_max": self.metrics_active_max,
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
                text = (
                    "# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{model_name="mock-model"}} {self.stats.running}\n'
                    "# TYPE vllm:num_requests_waiting gauge\n"
                    f'vllm:num_requests_waiting{{model_name="mock-model"}} {len(self._queue)}\n'
                ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": bh.metrics_status,
                    "headers": [
                        (b"content-type", b"text/plain; version=0.0.4"),
                        (b"content-length", str(len(text)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": text})
        else:
            await _json(send, 404, {"error": {"message": "not found", "type": "not_found"}})

    async def _control(self, body: bytes, send: Send) -> None:
        try:
            changes = json.loads(body or b"{}")
            if changes.pop("reset_stats", False):
                self.stats = Stats()
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
            self.behaviour = Behaviour(**fields)
        except (ValueError, TypeError) as exc:
            await _json(send, 400, {"error": {"message": str(exc), "type": "invalid"}})
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
        try:
            req = json.loads(body)
        except ValueError:
            await _json(send, 400, {"error": {"message": "bad json", "type": "invalid"}})
            return
        rec["model"] = model = req.get("model", "mock-model")
        if bh.fail_status and bh.fail_count != 0:
            if bh.fail_count > 0:
                bh.fail_count -= 1
            extra = [(b"retry-after", str(bh.retry_after).encode())] if bh.retry_after else []
            await _json(
                send,
                bh.fail_status,
                {
                    "error": {
                        "message": f"{self.name} failing on purpose",
                        "type": "server_error",
                        "code": bh.fail_status,
                    }
                },
                extra,
            )
            st.completed += 1
            return

        gone = asyncio.Event()
        watcher = asyncio.ensure_future(_watch(receive, gone, rec))
        if self.engine is not None and path != "/v1/embeddings":
            st.running += 1
            try:
                await self._engine_generate(send, rec, req, model, path, gone, watcher)
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
            n = await _max_tokens(req, bh.tokens, 0, send)
            if n is None:
                return
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
            chat = path == "/v1/chat/completions"
            if req.get("stream") is True:
                options = req.get("stream_options")
                usage = isinstance(options, dict) and options.get("include_usage") is True
                await self._stream(send, rec, model, chat, n, gone, usage)
            else:
                await self._whole(send, rec, model, chat, n, gone)
        finally:
            st.running -= 1
            self._wake_one()
            if gone.is_set():
                rec["aborted"] = True
                st.aborted += 1
            else:
                st.completed += 1
            watcher.cancel()

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

    async def _stream(
        self,
        send: Send,
        rec: dict[str, Any],
        model: str,
        chat: bool,
        n: int,
        gone: asyncio.Event,
        usage: bool = False,
    ) -> None:
        bh = self.behaviour
        rid = rec["request_id"] or "0"
        pre = ((self._chat_pre if chat else self._cmpl_pre) % (rid, model)).encode()
        post = b'"}}]}\n\n' if chat else b'"}]}\n\n'
        nulls = usage and bh.usage_nulls
        if nulls:
            post = post.replace(b"]}\n\n", b'],"usage":null}\n\n')
        headers = list(_SSE)
        compressor = None
        if bh.gzip:
            headers.append((b"content-encoding", b"gzip"))
            compressor = gzip.GzipFile  # marker: compress the whole stream at the end
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        parts: list[bytes] = []
        if chat and bh.role_chunk:
            role = pre.replace(b'"delta":{"content":"', b'"delta":{"role":"assistant","content":"')
            role = b"data: " + role + post
            if compressor is not None:
                parts.append(role)
            else:
                await send({"type": "http.response.body", "body": role, "more_body": True})
        await self._sleep(bh.ttft_ms, gone)
        for i in range(n):
            if gone.is_set():
                return
            if i and bh.itl_ms:
                await self._sleep(bh.itl_ms, gone)
                if gone.is_set():
                    return
            self._count_token(rec, gone)
            text = token_text(i).encode()
            if bh.pad_bytes:
                text += b"." * bh.pad_bytes
            chunk = b"data: " + pre + text + post
            if bh.half_event_after == i:
                await send(
                    {
                        "type": "http.response.body",
                        "body": chunk[: len(chunk) // 2],
                        "more_body": True,
                    }
                )
                raise ConnectionAbortedError("half event on purpose")
            if bh.die_after == i:
                raise ConnectionAbortedError("dying on purpose")
            if compressor is not None:
                parts.append(chunk)
                continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        tail = _last_event(pre, chat)
        if nulls:
            tail = tail.replace(b"]}\n\n", b'],"usage":null}\n\n')
        if usage:
            tail += _usage_chunk(rid, model, chat, 1, n, None)
        tail += b"data: [DONE]\n\n"
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
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _whole(
        self, send: Send, rec: dict[str, Any], model: str, chat: bool, n: int, gone: asyncio.Event
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
            self._count_token(rec, gone)
            text.append(token_text(i))
        usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
        payload = _completion(rec["request_id"] or "0", model, chat, "".join(text), usage)
        await _json(send, 200, payload, gzip_body=bh.gzip)

    async def _engine_generate(
        self,
        send: Send,
        rec: dict[str, Any],
        req: dict[str, Any],
        model: str,
        path: str,
        gone: asyncio.Event,
        watcher: asyncio.Future[None],
    ) -> None:
        """Generation paced by the engine model: tokens appear as its steps produce them."""
        engine = self.engine
        assert engine is not None
        n = await _max_tokens(req, self.behaviour.tokens, 1, send)
        if n is None:
            return
        prompt = prompt_tokens(req)
        prefix: tuple[int, ...] = ()
        tokens: list[int] = []
        if engine.config.prefix_caching:
            text = prompt_text(req)
            prefix = block_hashes(text, engine.config.block_size * 4)
            if engine.kv is not None:
                tokens = mock_tokens(text)
        seq = engine.submit(prompt, n, prefix=prefix, tokens=tokens)

        def left(_: object) -> None:
            if gone.is_set():
                engine.cancel(seq)
                seq.wake.set()

        watcher.add_done_callback(left)
        chat = path == "/v1/chat/completions"
        rid = rec["request_id"] or "0"
        stream = req.get("stream") is True
        pre = ((self._chat_pre if chat else self._cmpl_pre) % (rid, model)).encode()
        post = b'"}}]}\n\n' if chat else b'"}]}\n\n'
        if stream:
            await send({"type": "http.response.start", "status": 200, "headers": list(_SSE)})
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
                    body = b"".join(
                        b"data: " + pre + token_text(i).encode() + post for i in range(sent, upto)
                    )
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                sent = upto
        finally:
            if not seq.done:
                engine.cancel(seq)
        if stream:
            tail = _last_event(pre, chat)
            if _wants_usage(req):
                tail += _usage_chunk(rid, model, chat, prompt, n, seq.cached)
            tail += b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            return
        content = "".join(token_text(i) for i in range(n))
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + n,
            "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": seq.cached},
        }
        await _json(send, 200, _completion(rid, model, chat, content, usage))


def prompt_tokens(req: dict[str, Any]) -> int:
    """A prompt's length in tokens, estimated as vLLM's tokenizer would roughly count English:
    four characters a token."""
    chars = 0
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


def _last_event(pre: bytes, chat: bool) -> bytes:
    """The stream's closing content event: an empty delta (or text) with its finish reason."""
    if chat:
        tail = b"data: " + pre + b'"},"finish_reason":"length"}]}\n\n'
        return tail.replace(b'"delta":{"content":""}', b'"delta":{}')
    return b"data: " + pre + b'","finish_reason":"length"}]}\n\n'


def _completion(
    rid: str, model: str, chat: bool, content: str, usage: dict[str, Any]
) -> dict[str, Any]:
    """A whole (non-streamed) chat or text completion in vLLM's field order."""
    choice: dict[str, Any] = (
        {
            "index": 0,
            "finish_reason": "length",
            "message": {"role": "assistant", "content": content},
        }
        if chat
        else {"index": 0, "text": content, "finish_reason": "length"}
    )
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        "object": "chat.completion" if chat else "text_completion",
        "created": 0,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def _wants_usage(req: dict[str, Any]) -> bool:
    opts = req.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


def _usage_chunk(
    rid: str, model: str, chat: bool, prompt: int, completion: int, cached: int | None = 0
) -> bytes:
    """vLLM's last chunk with `include_usage` (only then: vLLM sends no `usage` key in other
    chat chunks): no choices, the request's token counts in vLLM's field order, compact JSON.
    `cached` None leaves out `prompt_tokens_details`, as vLLM does without
    `--enable-prompt-tokens-details`; the engine model always reports it (also 0, where vLLM
    would leave it out), which is what cache-aware routing is tried with."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    event: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 0,
        "model": model,
        "choices": [],
        "usage": usage,
    }
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


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
    body = json.dumps(obj).encode()
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
) -> None:
    import uvicorn

    app = MockUpstream(name, Behaviour(ttft_ms=ttft_ms, itl_ms=itl_ms, tokens=tokens), engine)
    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        log_level=log_level,
        access_log=False,
        lifespan="on",
    )
