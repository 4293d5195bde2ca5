"""Cache-aware routing's part of a request: hash the prompt and read the session key once, give
each attempt's pick context what the prefix index knows of its candidates (`hints`), record
the dispatch.

Only balancers declaring `needs_hints` (`cache_aware`) pay for it: ~0.13-0.17 ms CPU for a
32k-character prompt (hash, lookup and update, bench/oneoff/prefix.py; shared in Redis 0.2-0.3
ms).
Each backend's share of the index is bounded by its engine's KV capacity
(`vllm:cache_config_info` through the engine readings) or `affinity.capacity_tokens`.
The local index (`balancers/prefix_index.py`) is per process; with Redis the index is shared
(`router/request/placement/affinity_store.py`): `look_up()` asks it once per request for the model's
backends (one round trip that also carries earlier dispatches' records) and every attempt binds
to that answer; the local index is still updated on every dispatch, so it is warm when a lookup
falls back to it (Redis down or slower than `redis_timeout`).
With KV events (backends with `kv_events`, and the model in `affinity.tokenizers`) the request
also carries its token ids (router/request/placement/tokens.py), and each attempt's hints say how
many leading tokens each candidate holds: per its live events (router/engine/kv_index.py, keys
chained over those ids at the engine's block size, in the LoRA's namespace when the backend's
model id is an adapter its events name), or per the approximate index for a backend whose
events are not live; `cache_aware` then weighs them by the engine's own rates.
The session key is the first present of the `affinity.session_headers`, the body's
`prompt_cache_key`, the body's `user`; a key longer than MAX_SESSION_KEY_CHARS is ignored (the
request is served without session affinity, never refused: the key is a routing hint only).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from balancers.base import Balancer
from balancers.cache_aware import CHARS_PER_TOKEN
from balancers.context import Hints, KvHints
from balancers.inflight.base import Readings
from balancers.prefix_homes import PrefixHomes, least_homed, settle
from balancers.prefix_index import PrefixIndex
from balancers.session_ring import point
from router.core.backend import Backend
from router.core.settings import AffinityConfig, ConfigError
from router.engine.kv_events import Churn, Flight, KvEvents
from router.engine.kv_index import BASE, chain_keys, namespace
from router.request.placement import token_memo
from router.request.placement.prefix import prefix_hashes
from router.request.placement.tokens import (
    EngineTokenizer,
    RouterTokenizer,
    TokenizerError,
    request_tokens,
)

if TYPE_CHECKING:
    from router.request.placement.affinity_store import Shared, SharedPrefixIndex
    from router.upstream.pools import Pools

MAX_SESSION_KEY_CHARS = 256

log = logging.getLogger("sluicegate.affinity")


@dataclass(frozen=True, slots=True)
class RequestAffinity:
    hashes: list[bytes]  # the prompt's block chain (may be empty)
    session: int | None  # the session key's ring point
    # backend -> leading blocks held, as the shared index answered (None: ask the local index)
    held: dict[str, int] | None = None
    tokens: list[int] | None = None  # the prompt's token ids, when the KV-event index is used
    model: str = ""
    # The prompt's length in tokens when `tokens` are only its earlier messages' (token_memo)
    length: int | None = None
    # (block size, namespace) -> the tokens' block keys, computed once per request
    keys: dict[tuple[int, bytes], list[bytes]] = field(default_factory=dict)
    # backend -> its (block size, namespace), for the backends with live events
    groups: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    # The shared index's whole answer (its homes table's, and each candidate's room); None: ask
    # this process's own index and table
    shared: Shared | None = None

    @property
    def token_count(self) -> int:
        """The prompt's length in tokens: its ids', or the estimate beside the memo's."""
        return self.length if self.length is not None else len(self.tokens or ())


class Affinity:
    def __init__(
        self,
        config: AffinityConfig,
        index: PrefixIndex | None = None,
        shared: SharedPrefixIndex | None = None,
        on_fallback: Callable[[], None] | None = None,
        kv: KvEvents | None = None,
        pools: Pools | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self._pools = pools
        self._tokenizers: dict[str, RouterTokenizer | EngineTokenizer] = {}
        for model, tc in config.tokenizers.items():
            if tc.via == "router":
                assert tc.path is not None
                try:
                    self._tokenizers[model] = RouterTokenizer(tc.path)
                except TokenizerError as exc:
                    raise ConfigError(f"affinity.tokenizers.{model}: {exc}") from None
            else:
                self._tokenizers[model] = EngineTokenizer(pools)
        self.index = index or PrefixIndex()
        self.homes = PrefixHomes()  # where each prefix group lives, kept past evictions
        self.shared = shared  # None: the local index is all there is
        self._on_fallback = on_fallback  # a shared lookup answered locally
        self._headers = [h.lower().encode("latin-1") for h in config.session_headers]
        self._turn = 0  # which engine tokenizes next (`via: engine`)
        self.memo = token_memo.TokenMemo()  # `via: engine`: earlier messages' ids

    def prepare(
        self,
        balancer: Balancer,
        headers: Sequence[tuple[bytes, bytes]],
        payload: dict[str, Any],
        responses: bool = False,
        adapter: str | None = None,
    ) -> RequestAffinity | None:
        """What the request brings, when `balancer` routes on it (None: nothing to route on);
        `responses`: a Responses API body (its prompt is `instructions` and `input`);
        `adapter`: the LoRA adapter it names (its blocks are keyed by it)."""
        if not balancer.needs_hints:
            return None
        cfg = self.config
        hashes = prefix_hashes(
            payload, cfg.block_chars, cfg.max_prefix_chars, responses, adapter or ""
        )
        key = self.session_key(headers, payload)
        if not hashes and key is None:
            return None
        return RequestAffinity(hashes, point(key) if key is not None else None)

    def session_key(
        self, headers: Sequence[tuple[bytes, bytes]], payload: dict[str, Any]
    ) -> str | None:
        for wanted in self._headers:
            for name, value in headers:
                if name.lower() == wanted and value:
                    return _capped(value.decode("latin-1"))
        for key in ("prompt_cache_key", "user"):
            given = payload.get(key)
            if isinstance(given, str) and given:
                return _capped(given)
        return None

    async def look_up(
        self, request: RequestAffinity, backends: Sequence[Backend]
    ) -> RequestAffinity:
        """`request` with the shared index's answer for `backends` (once per request; the
        local index's when Redis does not answer in time). Without Redis: `request` as is."""
        shared = self.shared
        if shared is None or not request.hashes:
            return request
        names = [b.name for b in backends]
        found = await shared.look(request.hashes, names)
        if found is None:
            held = self.index.match(request.hashes, names)
            if self._on_fallback is not None:
                self._on_fallback()
            return RequestAffinity(request.hashes, request.session, held)
        return RequestAffinity(request.hashes, request.session, found.held, shared=found)

    def default_tokenizers(self, models: Iterable[str]) -> list[str]:
        """Models whose backends publish KV events and that `affinity.tokenizers` does not name
        get the engine's own `/tokenize` (`via: engine`): without token ids the events cannot be
        matched and the router silently routed on the approximate index (issue 52: 4 of 6
        hidden prefixes found, against 6 of 6 with a tokenizer). Logged once per model;
        returns the models it gave one."""
        added = []
        for model in models:
            if model not in self._tokenizers:
                self._tokenizers[model] = EngineTokenizer(self._pools)
                added.append(model)
                log.info(
                    "model %r: its backends publish KV events and affinity.tokenizers names no "
                    "tokenizer for it; using the engines' own /tokenize (via: engine). Name "
                    "one under affinity.tokenizers (via: router) to tokenize in the router",
                    model,
                )
        return added

    def wants_tokens(self, model: str, backends: Sequence[Backend]) -> bool:
        kv = self.kv
        if kv is None or not any(kv.configured(b.name) for b in backends):
            return False
        if model not in self._tokenizers:  # a backend with events added since the start
            self.default_tokenizers((model,))
        return True

    async def with_tokens(
        self,
        request: RequestAffinity,
        model: str,
        payload: dict[str, Any],
        backends: Sequence[Backend],
    ) -> RequestAffinity:
        """`request` with the prompt's token ids (unchanged when they cannot be had);
        `backends`: the model's eligible ones (healthy, not ejected)."""
        tk = self._tokenizers[model]
        limit = self.config.max_prefix_chars
        if isinstance(tk, RouterTokenizer):
            ids = await request_tokens(tk, payload, self.config.tokenize_inline_chars, limit)
        else:
            key = token_memo.memo_key(model, payload, limit)
            known, learn = None, False
            if key is not None:
                known, learn = self.memo.look(key, token_memo.shared_prefix(payload))
            if known:  # its earlier messages were seen: no round trip
                rest = token_memo.rest_estimate(payload)
                return replace(request, tokens=known, model=model, length=len(known) + rest)
            ids = await self._engine_tokens(tk, model, payload, backends, key if learn else None)
        if not ids:
            return request
        return replace(request, tokens=ids, model=model)

    def counts(self, model: str) -> bool:
        """Has `model` a tokenizer (`affinity.tokenizers`, or the default one of a model with
        KV events), so that its prompts can be counted rather than estimated?"""
        return model in self._tokenizers

    async def prompt_tokens(
        self, model: str, payload: dict[str, Any], backends: Sequence[Backend]
    ) -> int | None:
        """The prompt's tokens as `model`'s tokenizer counts them (a chat's template included),
        never more than the engine would: a prompt past `max_prefix_chars` is counted up to
        there. None when the model has no tokenizer or it could not count (the engine's
        `/tokenize` down, a template that fails); the context-window check uses it
        (router/request/placement/fallbacks.py)."""
        tk = self._tokenizers.get(model)
        if tk is None:
            return None
        if isinstance(tk, RouterTokenizer):
            ids = await request_tokens(
                tk, payload, self.config.tokenize_inline_chars, self.config.max_prefix_chars
            )
        elif self.kv is not None:
            ids = await self._engine_tokens(tk, model, payload, backends, None)
        else:
            return None
        return len(ids) if ids else None

    async def _engine_tokens(
        self,
        tk: EngineTokenizer,
        model: str,
        payload: dict[str, Any],
        backends: Sequence[Backend],
        learn: bytes | None,
    ) -> list[int] | None:
        """The engine's own `/tokenize`, on one that is up and whose events are live, in turn
        (the first configured one, down, refused every prompt, and precise routing with it,
        while it was away); with `learn` (a memo key), the earlier messages alone at the same
        time, for the memo."""
        kv = self.kv
        assert kv is not None
        able = [b for b in backends if kv.live(b.name)] or [
            b for b in backends if kv.configured(b.name)
        ]
        if not able:
            return None
        self._turn += 1
        limit = self.config.max_prefix_chars

        async def ask(body: dict[str, Any]) -> list[int] | None:
            ids = None
            for i in range(min(2, len(able))):  # one other when the first does not answer
                engine = able[(self._turn + i) % len(able)]
                ids = await tk.tokens(body, engine, engine.target(model), limit)
                if ids is not None:
                    break
            return ids

        if learn is None:
            return await ask(payload)
        # Both at once; the earlier messages' question cancelled with the request's own (a
        # cancel, or an error `tokens()` does not expect), not left to run to its timeout.
        asking = asyncio.ensure_future(ask(token_memo.earlier(payload)))
        try:
            ids = await ask(payload)
            alone = await asking
        finally:
            asking.cancel()
        if ids is not None:
            self.memo.learn(learn, token_memo.shared_ids(ids, alone) if alone is not None else None)
        return ids

    def _kv_hints(
        self, request: RequestAffinity, eligible: Sequence[Backend], held: dict[str, int]
    ) -> KvHints:
        kv = self.kv
        tokens = request.tokens
        assert kv is not None and tokens is not None
        n = request.token_count
        index = kv.index
        cached: dict[str, int] = {}
        pending: dict[str, int] = {}
        pending_age: dict[str, float] = {}
        stored: dict[str, int] = {}
        exact: set[str] = set()
        groups: dict[tuple[int, bytes], list[str]] = {}
        per_block = self.config.block_chars // CHARS_PER_TOKEN
        for b in eligible:
            name = b.name
            if kv.live(name):
                exact.add(name)
                bs = index.block_size(name)
                if bs is None:
                    stored[name] = 0
                    continue  # it never stored a block: holds nothing of it
                stored[name] = index.blocks(name) * bs
                target = b.target(request.model)
                ns = namespace(target) if index.has_lora(name, target) else BASE
                groups.setdefault((bs, ns), []).append(name)
                request.groups[name] = (bs, ns)
            elif held.get(name):
                cached[name] = min(n, held[name] * per_block)
            waiting, age = kv.pending(name)
            if waiting:
                pending[name] = waiting
                pending_age[name] = age
        for (bs, ns), names in groups.items():
            keys = request.keys.get((bs, ns))
            if keys is None:
                keys = request.keys[(bs, ns)] = chain_keys(tokens, bs, ns)
            matched = index.match(keys, names)
            for name in names:
                # What requests in flight there carry counts as held (router/engine/kv_events).
                blocks = max(matched.get(name, 0), kv.flying_blocks(name, keys))
                if blocks:
                    cached[name] = blocks * bs
        return KvHints(n, cached, frozenset(exact), pending, stored, pending_age, Churn(kv, stored))

    def kv_dispatched(self, request: RequestAffinity, backend: str, cached: int) -> Flight | None:
        """`backend` was sent this prompt: its Flight there (router/engine/kv_events.py), to end
        when the attempt does."""
        if self.kv is None or request.tokens is None:
            return None
        group = request.groups.get(backend)
        keys = request.keys.get(group, ()) if group is not None else ()
        return self.kv.dispatched(backend, request.token_count - cached, keys)

    def hints(self, request: RequestAffinity, eligible: Sequence[Backend]) -> Hints:
        """This attempt's hints: the index's (and KV events') view of the eligible backends."""
        known = request.held
        if known is None:
            held = self.index.match(request.hashes, [b.name for b in eligible])
        else:
            held = {b.name: known[b.name] for b in eligible if b.name in known}
        kv = self._kv_hints(request, eligible, held) if request.tokens is not None else None
        home, depth, new = None, 0, False
        if request.hashes:
            weights = {b.name: b.weight for b in eligible}
            shared = request.shared
            if shared is None:
                home, depth = self.homes.find(request.hashes, weights)
            else:  # every replica's table, as Redis answered it with the index
                home, depth = settle(shared.home, shared.depth, len(request.hashes), weights)
            if home is None:  # a new group, or its home is gone: where homes are fewest
                homed = (
                    self.homes.place(weights)
                    if shared is None
                    else least_homed(shared.counts, weights)
                )
                home, depth, new = homed, len(request.hashes), True
        n = len(request.hashes)
        roomy = self._roomy(request, eligible, n)
        return Hints(n, self.config.block_chars, held, request.session, kv, home, depth, new, roomy)

    def _roomy(
        self, request: RequestAffinity, eligible: Sequence[Backend], n: int
    ) -> frozenset[str]:
        """The backends whose share of the index takes `n` blocks more without evicting: per
        the shared index's count when it answered (this process's own index has not seen the
        other replicas' records: a backend it never sent to looked empty, and a copy there
        cost nothing), else per the local index."""
        shared = request.shared
        if shared is None:
            room = self.index.room
            return frozenset(b.name for b in eligible if (r := room(b.name)) is None or r >= n)
        block_tokens = max(1, self.config.block_chars // CHARS_PER_TOKEN)
        default = self.config.capacity_tokens // block_tokens
        limit = self.index.limit
        return frozenset(
            b.name for b in eligible if limit(b.name, default) - shared.cards.get(b.name, 0) >= n
        )

    def dispatched(self, hashes: list[bytes], backend: str, readings: Readings | None) -> None:
        """`backend` was sent this prompt: from now on it holds the prefix."""
        reading = readings.get(backend) if readings else None
        capacity = (
            reading.kv_capacity_tokens
            if reading is not None and reading.kv_capacity_tokens
            else self.config.capacity_tokens
        )
        block_tokens = max(1, self.config.block_chars // CHARS_PER_TOKEN)
        self.index.record(hashes, backend, capacity // block_tokens)
        self.homes.record(hashes, backend)  # kept warm: the fallback while Redis is away
        if self.shared is not None:  # its record carries the homes table's too
            self.shared.record(hashes, backend, capacity // block_tokens)


def _capped(key: str) -> str | None:
    return key if len(key) <= MAX_SESSION_KEY_CHARS else None
