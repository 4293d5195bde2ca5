"""Prefill/decode disaggregation: the pools of a model, and the bodies of the two legs.

A model is split when its backends include `role: prefill` ones and ones that decode (`decode`
or `both`), and `disaggregation` (or its `model_disaggregation` entry) is not null. Its
requests then pick a decode engine first (balancers/disaggregation.py says why), and only a
prompt whose uncached part there is long enough goes through a prefill engine:

nixl (vLLM's NixlConnector, as vLLM's toy proxy speaks it):
    phase 1, to P: the client's body with `stream: false`, `max_tokens: 1` (and
        `max_completion_tokens: 1` when present), no `stream_options`, `min_tokens` or
        `min_completion_tokens`, and `kv_transfer_params: {do_remote_decode: true, ...}`;
        P answers one token and a top-level `kv_transfer_params` naming its held blocks;
    phase 2, to D: the client's own body (and the usage injection) with those params copied in
        unchanged, the same `x-request-id`; the client sees D's answer only.
sglang (SGLang's bootstrap): one body with `bootstrap_host`, `bootstrap_port` (P's) and a fresh
    `bootstrap_room` goes to P and D at once; D's answer is the client's, P's is read and dropped.

A `kv_transfer_params` is used once: every phase 2 follows its own phase 1. Requests of models
that are not split never reach this module past `Disaggregation.pools` (one dict lookup).

What crosses from one party to another is checked here: a client's own handoff fields are
removed (`client_body`: they name the host a decode engine connects to), and P's params must be
shallow (`MAX_PARAMS_DEPTH`) and name P itself (`check_remote`).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from router.core.backend import Backend
from router.core.fastjson import without_members
from router.core.settings import DisaggregationConfig, Settings

# What vLLM's toy proxy asks the prefill engine for: hold the blocks for a remote decode.
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_PHASE1_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
MAX_PREFILL_ANSWER = 4 * 1024 * 1024  # block ids of a long prompt: ~10 bytes per 16 tokens
# vLLM's params nest 3 deep (an object, `remote_block_ids`, a list per KV-cache group); a
# decode engine's JSON reader recurses as the router's does.
MAX_PARAMS_DEPTH = 16
# Arrays and objects in P's params past which they are refused unmeasured (vLLM's: 2 plus one
# per KV-cache group): it bounds the depth count's Python loop.
MAX_PARAMS_NODES = 4096
# What a decode engine acts on: NIXL's params, SGLang's bootstrap address and room.
HANDOFF_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")
_MAX_CACHED = 256  # backend tuples whose pools are kept (a snapshot has one per model)


@dataclass(frozen=True, slots=True)
class RolePools:
    """A split model's backends by role, and its rule."""

    decode: tuple[Backend, ...]  # `decode` and `both`: they serve every request in the end
    prefill: tuple[Backend, ...]
    rule: DisaggregationConfig


class BadPrefillAnswer(Exception):
    """The prefill engine answered 200 without usable `kv_transfer_params`."""


def client_body(
    rule: DisaggregationConfig, key: str | None, payload: dict[str, Any], body: bytes
) -> bytes | None:
    """The body of a request to a split model without the client's own handoff fields (removed
    from `payload` too), unless its key is one of `rule.trusted_keys`; None: nothing to remove.
    A decode engine connects to the host such fields name and asks it for blocks, so only the
    router, or a key trusted to, may write them."""
    if not any(name in payload for name in HANDOFF_FIELDS):
        return None
    if key is not None and key in rule.trusted_keys:
        return None
    for name in HANDOFF_FIELDS:
        payload.pop(name, None)
    stripped = without_members(body, HANDOFF_FIELDS)
    return stripped if stripped is not None else _encode(payload)


class Disaggregation:
    def __init__(self, settings: Settings) -> None:
        self._default = settings.disaggregation
        self._per_model = settings.model_disaggregation
        # id(backends tuple) -> (the tuple, its pools): the tuple is held so its id stays its own.
        self._cache: dict[tuple[int, str], tuple[Sequence[Backend], RolePools | None]] = {}

    def pools(self, model: str, backends: Sequence[Backend]) -> RolePools | None:
        """The model's pools when its requests may be split; None (the common case) if not."""
        key = (id(backends), model)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is backends:
            return hit[1]
        pools = self._build(model, backends)
        if len(self._cache) >= _MAX_CACHED:
            self._cache.clear()
        self._cache[key] = (backends, pools)
        return pools

    def _build(self, model: str, backends: Sequence[Backend]) -> RolePools | None:
        rule = self._per_model[model] if model in self._per_model else self._default
        if rule is None:
            return None
        prefill = tuple(b for b in backends if b.role == "prefill")
        if not prefill:
            return None
        decode = tuple(b for b in backends if b.role != "prefill")
        if not decode:
            return None
        return RolePools(decode, prefill, rule)


def prefill_body(payload: dict[str, Any], target: str) -> bytes:
    """Phase 1's body: the same prompt, one token, not streamed, blocks held for a remote D."""
    body = {k: v for k, v in payload.items() if k not in _PHASE1_DROPPED}
    body["model"] = target
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["kv_transfer_params"] = PREFILL_PARAMS
    return _encode(body)


class _PrefillAnswer(msgspec.Struct):
    """The one member phase 2 needs; the rest of P's answer is skipped, not built."""

    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")


_ANSWER = msgspec.json.Decoder(_PrefillAnswer)


class _Remote(msgspec.Struct):
    """Where P's params send the decode engine (NIXL's side channel); the rest is skipped."""

    remote_host: str | None = None
    remote_port: int | None = None


_REMOTE = msgspec.json.Decoder(_Remote)
# A JSON string, or one bracket: what nesting is made of (brackets inside strings do not count).
_STRUCTURE = re.compile(rb'"(?:[^"\\]|\\.)*"|[][{}]')


def transfer_params(answer: bytes) -> bytes:
    """P's `kv_transfer_params`, as P wrote them (phase 2 carries the bytes unchanged)."""
    try:
        params = bytes(_ANSWER.decode(answer).kv_transfer_params).strip()
    except msgspec.ValidationError:
        params = b""  # JSON, but not an object
    except msgspec.DecodeError:
        raise BadPrefillAnswer("its answer is not JSON") from None
    except RecursionError:  # nested past the reader's own limit, in params or elsewhere
        raise BadPrefillAnswer("its answer is nested too deeply") from None
    if not params.startswith(b"{") or not params[1:-1].strip():
        raise BadPrefillAnswer("its answer has no kv_transfer_params (is it a kv_producer?)")
    if _too_deep(params):
        raise BadPrefillAnswer(f"its kv_transfer_params nest deeper than {MAX_PARAMS_DEPTH} levels")
    return params


def _too_deep(params: bytes) -> bool:
    """Whether `params` (valid JSON) nest past MAX_PARAMS_DEPTH; vLLM's answer at the first
    test (two byte counts), whose total bounds the depth."""
    nodes = params.count(b"[") + params.count(b"{")
    if nodes <= MAX_PARAMS_DEPTH:
        return False
    if nodes > MAX_PARAMS_NODES:
        return True
    depth = 0
    for token in _STRUCTURE.finditer(params):
        mark = token[0][:1]
        if mark in b"[{":
            depth += 1
            if depth > MAX_PARAMS_DEPTH:
                return True
        elif mark in b"]}":
            depth -= 1
    return False


def check_remote(params: bytes, host: str, peer: str | None) -> None:
    """Raise `BadPrefillAnswer` unless P's params name P as the router knows it (its URL's
    `host`, or `peer`: the address its connection reached) and a port. The decode engine
    connects there (NIXL's side channel, `VLLM_NIXL_SIDE_CHANNEL_HOST`/`_PORT`: the port is
    its own, not the HTTP port, so any valid port passes)."""
    try:
        remote = _REMOTE.decode(params)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        raise BadPrefillAnswer(
            "its kv_transfer_params name no valid remote_host/remote_port"
        ) from None
    port = remote.remote_port
    if port is None or not 0 < port < 65536:
        raise BadPrefillAnswer("its kv_transfer_params name no valid remote_port")
    named = _host_key(remote.remote_host or "")
    if not named or (named != _host_key(host) and named != _host_key(peer or "")):
        raise BadPrefillAnswer(
            "its kv_transfer_params name another host than the prefill engine's"
            " (set VLLM_NIXL_SIDE_CHANNEL_HOST to the address the router reaches it by)"
        )


@functools.lru_cache(maxsize=1024)
def _host_key(host: str) -> str:
    """A host as compared: an address in its one canonical form (IPv4 mapped into IPv6 as
    IPv4), a name lowercased."""
    host = host.strip().strip("[]").lower()
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host.rstrip(".")
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def _encode(value: Any) -> bytes:
    """JSON as msgspec writes it (~5x `json.dumps`; UTF-8, not escapes; a NaN, which only the
    standard library reads, as null); an int past 64 bits as the standard library does."""
    try:
        return msgspec.json.encode(value)
    except (TypeError, OverflowError, msgspec.EncodeError):
        return json.dumps(value, ensure_ascii=False).encode()


@functools.lru_cache(maxsize=4096)
def url_host(url: str) -> str:
    """A backend URL's host (a prefill engine's, once per request: kept)."""
    return urlsplit(url).hostname or ""


def bootstrap_fields(prefill: Backend, room: int | None = None) -> bytes:
    """SGLang's three fields, as JSON members to splice in: P's host, its bootstrap port, and a
    fresh room (63 bits, as SGLang's router draws it)."""
    host = url_host(prefill.url)
    room = random.getrandbits(63) if room is None else room
    return (
        b'"bootstrap_host":'
        + json.dumps(host).encode()
        + b',"bootstrap_port":'
        + str(prefill.bootstrap_port).encode()
        + b',"bootstrap_room":'
        + str(room).encode()
    )


def with_members(body: bytes, members: bytes) -> bytes:
    """`body` with raw JSON `members` spliced in first."""
    at = body.index(b"{") + 1
    rest = body[at:]
    comma = b"" if rest.lstrip().startswith(b"}") else b","
    return body[:at] + members + comma + rest
