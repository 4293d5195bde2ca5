"""Who may call what: the admin token for /admin, client keys for /v1/*.

Admin: `SLUICEGATE_ADMIN_TOKEN` as `Authorization: Bearer <token>`, compared in constant time.
Without a token configured the mutating admin routes answer 403 and reads stay open (they never
show secrets). Client keys: `api_keys` (sha256 hashes) and/or `api_keys_file` (a file mounted
from a Secret, re-read when it changes); when any is configured, /v1/* needs a valid key, and a
key limited to some models gets 403 for the others. A client key comes as `Authorization: Bearer`
or as `x-api-key` (Anthropic's SDKs). Presented keys are never logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import SecretStr, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from router.core.errors import Unauthorized, error_response
from router.core.settings import ClientKeyConfig, read_api_keys_file
from router.request.admit.quota import KeyLimits
from router.request.placement.response_ids import ANONYMOUS, owner_of

log = logging.getLogger("sluicegate.auth")


def bearer(request: Request) -> str | None:
    value = request.headers.get("authorization")
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def client_key_of(request: Request) -> str | None:
    """A client key: `Authorization: Bearer <key>` (OpenAI's SDKs) or `x-api-key: <key>`
    (Anthropic's)."""
    given = bearer(request)
    if given is None:
        given = request.headers.get("x-api-key", "").strip() or None
    return given


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


class AdminAuth:
    def __init__(self, token: SecretStr | None) -> None:
        # Compare digests: equal length always, so the compare leaks nothing, not even length.
        value = token.get_secret_value() if token is not None else ""
        self._digest = _digest(value) if value else None  # an empty token is no token

    @property
    def configured(self) -> bool:
        return self._digest is not None

    def check(self, request: Request, mutating: bool) -> Response | None:
        """None when the call may proceed, else the error response to send."""
        if self._digest is None:
            if not mutating:
                return None
            return error_response(
                403,
                "Admin changes are disabled: set SLUICEGATE_ADMIN_TOKEN on the router to "
                "enable them.",
                "permission_error",
                "admin_disabled",
            )
        given = bearer(request)
        if given is None:
            return error_response(
                401,
                "Missing admin token: send `Authorization: Bearer <SLUICEGATE_ADMIN_TOKEN>`.",
                "authentication_error",
                "missing_admin_token",
                {"www-authenticate": "Bearer"},
            )
        if not hmac.compare_digest(_digest(given), self._digest):
            return error_response(
                401,
                "Invalid admin token.",
                "authentication_error",
                "invalid_admin_token",
                {"www-authenticate": "Bearer"},
            )
        return None


@dataclass(frozen=True, slots=True)
class ClientKey:
    name: str | None
    models: frozenset[str] | None  # None: every model
    priority: str = "standard"  # admission band
    weight: float = 1.0  # share within the band
    limits: KeyLimits | None = None  # rpm / tpm / max_parallel, when the entry sets any
    owner: str = ANONYMOUS  # the stored responses it may reach (response_ids.owner_of)
    fallbacks: bool = True  # False: never sent to a fallback model
    slo: tuple[float | None, float | None] = (None, None)  # default (ttft, tpot) ms objectives


class ClientKeys:
    def __init__(self, entries: Sequence[ClientKeyConfig], path: str | None = None) -> None:
        self._inline = list(entries)
        self._path = path
        self._stamp: tuple[int, int] | None = None
        self._bad_stamp: tuple[int, int] | None = None
        self._keys: dict[str, ClientKey] = {}
        self._rebuild(self._read_file() if path else [])

    @property
    def enabled(self) -> bool:
        return bool(self._inline) or self._path is not None

    def _read_file(self) -> list[ClientKeyConfig]:
        assert self._path is not None
        try:
            st = os.stat(self._path)
            self._stamp = (st.st_mtime_ns, st.st_size)
            return [ClientKeyConfig.model_validate(e) for e in read_api_keys_file(self._path)]
        except (OSError, ValueError, ValidationError) as exc:
            # Keep the keys we have: a half-written Secret update must not lock everyone out.
            log.warning(
                "cannot read api_keys_file", extra={"fields": {"error": type(exc).__name__}}
            )
            raise

    def _rebuild(self, from_file: Sequence[ClientKeyConfig]) -> None:
        keys: dict[str, ClientKey] = {}
        for e in [*self._inline, *from_file]:
            limits = None
            if e.rpm is not None or e.tpm is not None or e.max_parallel is not None:
                limits = KeyLimits(
                    e.name or e.sha256, e.rpm, e.tpm, e.max_parallel, e.name or "unnamed"
                )
            keys[e.sha256] = ClientKey(
                e.name,
                frozenset(e.models) if e.models is not None else None,
                e.priority,
                e.weight,
                limits,
                owner_of(e.sha256),
                e.fallbacks,
                (e.slo_ttft_ms, e.slo_tpot_ms),
            )
        self._keys = keys

    def by_owner(self, owner: str) -> ClientKey | None:
        """The key whose stored things carry `owner` (a batch job's key, on any replica)."""
        for key in self._keys.values():
            if key.owner == owner:
                return key
        return None

    def limited(self) -> list[KeyLimits]:
        """The limits of every named key that has some (unnamed keys have no name to show)."""
        return [k.limits for k in self._keys.values() if k.limits is not None and k.name]

    def reload_if_changed(self) -> bool:
        """Re-read the key file when it changed on disk (a rotated Secret); True if it did."""
        if self._path is None:
            return False
        try:
            st = os.stat(self._path)
        except OSError:
            return False
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp in (self._stamp, self._bad_stamp):
            return False
        try:
            if st.st_size == 0:
                # Caught between truncate and write (an editor, `>`): not an update. Revoking
                # every key takes an explicit `api_keys: []`.
                raise ValueError("empty")
            entries = self._read_file()
        except (OSError, ValueError, ValidationError) as exc:
            self._bad_stamp = stamp  # warn once per broken version, not on every check
            log.warning(
                "client key file unreadable; the keys already loaded stay in force",
                extra={"fields": {"error": type(exc).__name__}},
            )
            return False
        self._rebuild(entries)
        log.info("client keys reloaded", extra={"fields": {"keys": len(self._keys)}})
        return True

    def check(self, request: Request) -> ClientKey:
        """The request's key; raises `Unauthorized` (401) when it has none or an unknown one."""
        given = client_key_of(request)
        if given is None:
            raise Unauthorized(
                "You didn't provide an API key. Send `Authorization: Bearer <key>` or "
                "`x-api-key: <key>`.",
                code="missing_api_key",
            )
        # A lookup by sha256: timing depends on the digest, which a caller cannot steer.
        key = self._keys.get(hashlib.sha256(given.encode("utf-8", "surrogatepass")).hexdigest())
        if key is None:
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
        return key
