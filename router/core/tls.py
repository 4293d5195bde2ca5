"""A backend's TLS policy as one `ssl.SSLContext`, built once per distinct policy and shared.

Traffic, health probes and engine scrapes of a backend connect with the same context (the
`tls:` key: `ca_file`, `cert_file`/`key_file`, `verify`); `server_name` is not part of the
context, it is the name sent as SNI and checked against the certificate at connect time.
Without `tls:` every https backend shares one context over the system trust store.

Contexts are cached by the policy and the files' identity (inode, size, mtime), so 50,000
discovered endpoints from one template share one, and a backend rebuilt after its files were
replaced (an admin PUT, a restart) reads them again. The cache is bounded. Errors are `TlsError`
(a ValueError) naming the field and the file, never a file's contents.
"""

from __future__ import annotations

import os
import re
import ssl
from collections import OrderedDict

MAX_CONTEXTS = 256  # distinct policies kept; an evicted one lives on in the backends holding it

_Key = tuple[object, ...]
_cache: OrderedDict[_Key, ssl.SSLContext] = OrderedDict()


class TlsError(ValueError):
    """A TLS setting that cannot make a context; str() names the field."""


def _identity(field: str, path: str | None) -> tuple[int, int, int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError as exc:
        raise TlsError(f"{field}: cannot read {path}: {exc.strerror or exc}") from None
    return st.st_ino, st.st_size, st.st_mtime_ns


def context(
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    verify: bool = True,
) -> ssl.SSLContext:
    """The shared context for this policy; raises TlsError when a file is missing or bad."""
    key: _Key = (
        ca_file,
        cert_file,
        key_file,
        verify,
        _identity("ca_file", ca_file),
        _identity("cert_file", cert_file),
        _identity("key_file", key_file),
    )
    ctx = _cache.get(key)
    if ctx is not None:
        _cache.move_to_end(key)
        return ctx
    ctx = _build(ca_file, cert_file, key_file, verify)
    _cache[key] = ctx
    while len(_cache) > MAX_CONTEXTS:
        _cache.popitem(last=False)
    return ctx


def default_context() -> ssl.SSLContext:
    """The context of a backend without `tls:` (system trust store, hostname checked)."""
    return context()


def _build(
    ca_file: str | None, cert_file: str | None, key_file: str | None, verify: bool
) -> ssl.SSLContext:
    if verify:
        try:
            # With a CA file, only that CA is trusted for this backend (not the system store).
            ctx = ssl.create_default_context(cafile=ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise TlsError(
                f"ca_file: {ca_file}: not a PEM CA certificate ({_reason(exc)})"
            ) from None
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert_file is not None:
        try:
            # An encrypted key gets an empty password (and fails) rather than OpenSSL's prompt
            # on the terminal, which would hang a router starting in the background.
            ctx.load_cert_chain(cert_file, key_file, password=_no_password)
        except (ssl.SSLError, OSError) as exc:
            # The library's reason only: its messages never quote the key.
            if key_file is None or not _holds_certificate(cert_file):
                what = "a PEM certificate" + (" with its key" if key_file is None else "")
                raise TlsError(f"cert_file: {cert_file}: not {what} ({_reason(exc)})") from None
            raise TlsError(
                f"key_file: {key_file}: not the PEM private key of cert_file, or encrypted "
                f"({_reason(exc)})"
            ) from None
    return ctx


def _holds_certificate(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"-----BEGIN CERTIFICATE-----" in f.read(1 << 20)
    except OSError:
        return False


def _no_password() -> bytes:
    return b""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    if isinstance(exc, OSError) and exc.strerror:
        return re.sub(r"\s*\(_ssl\.c:\d+\)", "", exc.strerror)
    return type(exc).__name__
