"""A prefill engine that misbehaves on purpose: `HostileBackend` (tests/support/hostile_backend.py)
with answers for the prefill leg of a split request. The request's `model` picks how (the router
sends the backend's own model name, so a backend entry `models: {m: deep-params}` picks it):

    deep-params  200, one token, `kv_transfer_params` nested 100,000 levels deep
    far-params   200, one token, vLLM-shaped `kv_transfer_params` naming another host
                 (`FAR_HOST`) than the one the router reached it at
    drip         200 with a Content-Length of 1000, then one byte every `DRIP_SECONDS`; it stops
                 by itself after `DRIP_BYTES` (counted in `drips_done`) or when the peer drops
                 the connection first (`drips_cut`)

Any other mode is `HostileBackend`'s.
"""

from __future__ import annotations

import asyncio
import json

from tests.support.hostile_backend import HostileBackend, _response

FAR_HOST = "127.0.0.2"  # loopback, but not the address the prefill engine is reached at
DRIP_SECONDS = 0.25
DRIP_BYTES = 40  # 10 s of drip at most
DEPTH = 100_000


def _answer_with(params: bytes) -> bytes:
    head = (
        b'{"id":"cmpl-hostile","object":"chat.completion","model":"m","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"x"},"finish_reason":"length"}],'
        b'"usage":{"prompt_tokens":500,"completion_tokens":1,"total_tokens":501},'
        b'"kv_transfer_params":'
    )
    return head + params + b"}"


class HostilePrefill(HostileBackend):
    def __init__(self) -> None:
        super().__init__()
        self.drips_cut = 0  # drips the peer dropped before their end
        self.drips_done = 0  # drips sent to their end

    async def _answer(
        self, mode: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        if mode == "deep-params":
            deep = b'{"remote_host":"127.0.0.1","x":' + b"[" * DEPTH + b"]" * DEPTH + b"}"
            writer.write(_response(200, _answer_with(deep), b"application/json"))
        elif mode == "far-params":
            far = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[0, 1, 2]],
                "remote_engine_id": "hostile-engine",
                "remote_request_id": "someone-elses",
                "remote_host": FAR_HOST,
                "remote_port": self.port,
                "remote_num_tokens": 500,
                "transfer_mode": "pull",
            }
            writer.write(
                _response(200, _answer_with(json.dumps(far).encode()), b"application/json")
            )
        elif mode == "drip":
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
            )
            try:
                for _ in range(DRIP_BYTES):
                    if writer.transport.is_closing() or reader.at_eof():
                        raise ConnectionResetError
                    writer.write(b" ")
                    await writer.drain()
                    await asyncio.sleep(DRIP_SECONDS)
            except ConnectionError:
                self.drips_cut += 1
                return False
            self.drips_done += 1
            return False
        else:
            return await super()._answer(mode, reader, writer)
        await writer.drain()
        return True
