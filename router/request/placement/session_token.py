"""`x-session-token`: an opaque value naming the engine that served a session, for the client to
echo so that its next turn goes back there (llm-d's and inference-perf's convention).

The token is the first 16 bytes of HMAC-SHA256(key, backend name), base64url: it names no
address and cannot be turned back into a name without the key; the router reads it back by
minting the token of each backend it may route to and comparing. The key is
`affinity.session_token_key` (replicas that share it read each other's tokens), else a random
one per process (a token then means nothing to another replica: the request is routed as
without it). Costs one HMAC per answer (~1 us) and, for an echoed token not yet seen, one per
candidate.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Iterable

HEADER = b"x-session-token"
MAX_TOKEN_CHARS = 64


class SessionTokens:
    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or os.urandom(32)
        self._minted: dict[str, bytes] = {}  # backend -> its token
        self._named: dict[bytes, str] = {}  # token -> backend

    def token(self, backend: str) -> bytes:
        got = self._minted.get(backend)
        if got is None:
            if len(self._minted) >= 4096:  # backends come and go
                self._minted.clear()
                self._named.clear()
            mac = hmac.new(self._key, backend.encode(), hashlib.sha256).digest()[:16]
            got = self._minted[backend] = base64.urlsafe_b64encode(mac).rstrip(b"=")
            self._named[got] = backend
        return got

    def backend(self, token: bytes, among: Iterable[str]) -> str | None:
        """The backend of `among` that `token` names; None for a token of none of them."""
        if not token or len(token) > MAX_TOKEN_CHARS:
            return None
        name = self._named.get(token)
        if name is not None:
            return name
        for b in among:
            if hmac.compare_digest(self.token(b), token):
                return b
        return None
