"""The mock engine's side of prefill/decode disaggregation: vLLM's NixlConnector and SGLang's
bootstrap, as the router sees them (router/request/placement/pd.py), with no KV actually moved.

NIXL (`--kv-role prefill|decode|both`, `--kv-connector nixl`):
- a prefill request (`kv_transfer_params.do_remote_decode: true`) is answered as usual (one
  token) plus a top-level `kv_transfer_params` shaped like vLLM 0.32's (`do_remote_prefill`,
  `remote_engine_id`, `remote_request_id`, `remote_block_ids`, `remote_host`, `remote_port`,
  `tp_size`, `dcp_size`, `pp_size`, `remote_num_tokens`, `remote_blocks_expiry_time`,
  `transfer_mode`, `remote_prefill_cached_tokens`; `remote_block_ids` a list per KV-cache
  group), and its
  "blocks" are held under that request id for `lease_ms` (vLLM's kv lease), then expire
  (`vllm:nixl_num_kv_expired_reqs_total`); a prefill call cancelled before it answered holds
  nothing (vLLM frees an aborted request's blocks at once);
- a decode request carrying `do_remote_prefill: true` pulls them: it asks the engine at
  `remote_host:remote_port` (the mock's own HTTP port stands for NIXL's side channel) to hand
  over `remote_request_id` of `remote_engine_id`. Held params are handed over once. An engine
  that is not there, an unknown engine id, or params already used: the decode answers 500 after
  `fail_delay_ms` with vLLM's body (`Internal server error`), counted in
  `vllm:nixl_num_failed_transfers_total` (vLLM: ~5 s for an unreachable prefill engine, 0.2-0.6 s
  for an unknown engine id at a live one; short in tests). vLLM itself answers reused params
  200 and reads freed blocks: the mock is stricter, so
  that a router reusing them fails its tests;
- `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"|"local_compute"}` counts each
  request's prompt as the decode engine got it (pulled) or computed it; a decode prompt that is
  not the one prefilled counts in `/stats` `handoff.prompt_mismatch` (vLLM would use P's KV for
  it anyway, and answer wrong).
SGLang (`--kv-connector sglang`): a prefill request with `bootstrap_room` registers the room
when its answer is done; a decode request with `bootstrap_host`/`bootstrap_port`/`bootstrap_room`
waits at that address (up to `fail_delay_ms`) for the room, then generates; else 500.
Stdlib only: claims go over a plain HTTP/1.1 connection, closed after one exchange.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

CLAIM_PATH = "/kv_handoff/claim"
BOOTSTRAP_PATH = "/kv_handoff/bootstrap"
MAX_HELD = 10_000  # held prefills (and rooms) kept at most; the oldest expire first
_MAX_ANSWER = 65536


@dataclass
class HandoffConfig:
    role: str = "both"  # prefill | decode | both
    connector: str = "nixl"  # nixl | sglang
    engine_id: str = ""  # default: derived from the mock's name
    host: str = "127.0.0.1"  # where decode engines reach this one (NIXL's side channel host)
    port: int = 0  # the mock's HTTP port, standing for the side channel's
    block_size: int = 16
    fail_delay_ms: float = 5000.0  # a failed pull's 500 comes this late (vLLM: ~5 s)
    lease_ms: float = 30000.0  # held blocks expire after this (vLLM's kv_lease_duration)


@dataclass
class _Held:
    tokens: int
    prompt: str  # the prompt's digest: a decode prompt that differs is counted
    expires: float


@dataclass
class _Room:
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    tokens: int = 0
    prompt: str = ""
    expires: float = 0.0


@dataclass
class HandoffStats:
    prefills: int = 0  # prefill answers that hold blocks
    handed_over: int = 0  # pulls this engine served
    pulled: int = 0  # pulls this engine made that succeeded
    failed_transfers: int = 0
    expired: int = 0
    prompt_mismatch: int = 0
    external_tokens: int = 0
    local_tokens: int = 0
    seen: list[dict[str, Any]] = field(default_factory=list)  # the last params pulled (tests)


class Handoff:
    def __init__(self, cfg: HandoffConfig, name: str, model: str) -> None:
        self.cfg = cfg
        self.engine_id = cfg.engine_id or f"mock-{name}-{cfg.port}"
        self.model = model
        self.stats = HandoffStats()
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._rooms: OrderedDict[int, _Room] = OrderedDict()

    # -- the prefill engine's side -------------------------------------------------------

    def hold(self, request_id: str, prompt: int, cached: int, text: str) -> dict[str, Any]:
        """A prefill answered: its blocks held for one pull; vLLM's params naming them."""
        self._expire()
        blocks = max(1, -(-prompt // self.cfg.block_size))
        self._held[request_id] = _Held(prompt, _digest(text), self._deadline())
        self.stats.prefills += 1
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            # One list per KV-cache group (a plain decoder has one), as vLLM's pull scheduler.
            "remote_block_ids": [list(range(blocks))],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.cfg.host,
            "remote_port": self.cfg.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt,
            "remote_blocks_expiry_time": None,  # set by vLLM on a decode node's readback only
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": cached,
        }

    def room_done(self, room: int, prompt: int, text: str) -> None:
        """SGLang: the prefill of `room` is done; its decode may take it."""
        self._expire()
        r = self._rooms.get(room)
        if r is None:
            r = self._rooms[room] = _Room()
        r.tokens, r.prompt, r.expires = prompt, _digest(text), self._deadline()
        r.ready.set()
        self.stats.prefills += 1

    async def serve(self, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """A decode engine's pull (NIXL) or bootstrap wait (SGLang), on this engine."""
        self._expire()
        try:
            req = json.loads(body)
        except ValueError:
            return 400, {"error": "bad body"}
        if not isinstance(req, dict):
            return 400, {"error": "bad body"}
        if path == CLAIM_PATH:
            if req.get("engine_id") != self.engine_id:
                return 404, {"error": f"unknown engine id {req.get('engine_id')!r}"}
            held = self._held.pop(str(req.get("request_id")), None)
            if held is None:
                return 404, {"error": "no blocks held for that request (used or expired)"}
            self.stats.handed_over += 1
            return 200, {"tokens": held.tokens, "prompt": held.prompt}
        if path == BOOTSTRAP_PATH:
            room_id = req.get("room")
            if not isinstance(room_id, int):
                return 400, {"error": "bad room"}
            room = self._rooms.get(room_id)
            if room is None:
                room = self._rooms[room_id] = _Room(expires=self._deadline())
            try:
                async with asyncio.timeout(self.cfg.fail_delay_ms / 1000):
                    await room.ready.wait()
            except TimeoutError:
                self._rooms.pop(room_id, None)
                return 404, {"error": "the room was never prefilled"}
            self._rooms.pop(room_id, None)
            self.stats.handed_over += 1
            return 200, {"tokens": room.tokens, "prompt": room.prompt}
        return 404, {"error": "not found"}

    # -- the decode engine's side --------------------------------------------------------

    async def before_generate(
        self, req: dict[str, Any], prompt: int, text: str, gone: asyncio.Event
    ) -> dict[str, Any] | None:
        """Run a request's handoff before it generates: None to go on, or the error body of
        a failed pull (after `fail_delay_ms`, or as soon as the client left)."""
        params = req.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            got = await self._pull(
                str(params.get("remote_host")),
                params.get("remote_port"),
                CLAIM_PATH,
                {
                    "engine_id": params.get("remote_engine_id"),
                    "request_id": params.get("remote_request_id"),
                },
            )
            self.stats.seen = [*self.stats.seen[-15:], params]
            return await self._pulled(got, prompt, text, gone)
        room = req.get("bootstrap_room")
        if self.cfg.connector == "sglang" and self.cfg.role != "prefill" and room is not None:
            got = await self._pull(
                str(req.get("bootstrap_host")),
                req.get("bootstrap_port"),
                BOOTSTRAP_PATH,
                {"room": room},
            )
            return await self._pulled(got, prompt, text, gone)
        self.stats.local_tokens += prompt
        return None

    async def _pulled(
        self, got: dict[str, Any] | None, prompt: int, text: str, gone: asyncio.Event
    ) -> dict[str, Any] | None:
        if got is None:
            self.stats.failed_transfers += 1
            try:
                async with asyncio.timeout(self.cfg.fail_delay_ms / 1000):
                    await gone.wait()
            except TimeoutError:
                pass
            return {
                "error": {
                    "message": "Internal server error",  # vLLM's words, whatever failed
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
        self.stats.pulled += 1
        if got.get("prompt") != _digest(text):
            self.stats.prompt_mismatch += 1
        external = min(prompt, int(got.get("tokens", 0)))
        self.stats.external_tokens += external
        self.stats.local_tokens += prompt - external
        return None

    async def _pull(
        self, host: str, port: object, path: str, body: dict[str, Any]
    ) -> dict[str, Any] | None:
        """One HTTP/1.1 exchange with the engine holding the KV: its answer, None if none."""
        if not isinstance(port, int) or not 0 < port < 65536:
            return None
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        ).encode()
        writer = None
        try:
            async with asyncio.timeout(self.cfg.fail_delay_ms / 1000 + 1):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(head + data)
                await writer.drain()
                answer = await reader.read(_MAX_ANSWER)
                while len(answer) < _MAX_ANSWER and (more := await reader.read(_MAX_ANSWER)):
                    answer += more
        except (OSError, TimeoutError):
            return None
        finally:
            if writer is not None:
                writer.close()
        status_line, _, rest = answer.partition(b"\r\n")
        if b" 200 " not in status_line + b" ":
            return None
        _, _, payload = rest.partition(b"\r\n\r\n")
        try:
            parsed = json.loads(payload)
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None

    # -- both ----------------------------------------------------------------------------

    def _deadline(self) -> float:
        return time.monotonic() + self.cfg.lease_ms / 1000

    def _expire(self) -> None:
        now = time.monotonic()
        held = self._held
        while held and (len(held) > MAX_HELD or next(iter(held.values())).expires < now):
            held.popitem(last=False)
            self.stats.expired += 1
        rooms = self._rooms
        while rooms and (len(rooms) > MAX_HELD or next(iter(rooms.values())).expires < now):
            rooms.popitem(last=False)

    def metrics_text(self) -> str:
        self._expire()
        lab = f'engine="0",model_name="{self.model}"'
        st = self.stats
        return (
            "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.\n"
            "# TYPE vllm:prompt_tokens_by_source_total counter\n"
            f'vllm:prompt_tokens_by_source_total{{{lab},source="external_kv_transfer"}} '
            f"{float(st.external_tokens)}\n"
            f'vllm:prompt_tokens_by_source_total{{{lab},source="local_compute"}} '
            f"{float(st.local_tokens)}\n"
            "# HELP vllm:nixl_num_failed_transfers_total Number of failed NIXL KV Cache "
            "transfers.\n"
            "# TYPE vllm:nixl_num_failed_transfers_total counter\n"
            f"vllm:nixl_num_failed_transfers_total{{{lab}}} {float(st.failed_transfers)}\n"
            "# HELP vllm:nixl_num_kv_expired_reqs_total Number of requests that had their KV "
            "expire.\n"
            "# TYPE vllm:nixl_num_kv_expired_reqs_total counter\n"
            f"vllm:nixl_num_kv_expired_reqs_total{{{lab}}} {float(st.expired)}\n"
        )

    def public(self) -> dict[str, Any]:
        st = self.stats
        return {
            "role": self.cfg.role,
            "connector": self.cfg.connector,
            "engine_id": self.engine_id,
            "held": len(self._held),
            "prefills": st.prefills,
            "handed_over": st.handed_over,
            "pulled": st.pulled,
            "failed_transfers": st.failed_transfers,
            "expired": st.expired,
            "prompt_mismatch": st.prompt_mismatch,
            "external_tokens": st.external_tokens,
            "local_tokens": st.local_tokens,
            "seen": st.seen,
        }


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
