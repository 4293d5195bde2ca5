"""Checks on what a backend definition may put on the wire: header names and values, keys, URLs.

One place, used by `BackendConfig`'s validators, so every source (the YAML file, the
environment, the admin API, records read back from Redis) is held to the same rules before a
`Backend` is built from it:

- header names are RFC 9110 tokens;
- header values (and keys) are Latin-1 text without control characters (CR, LF, NUL, ...):
  what HTTP/1.1 can carry and nothing that could start another header;
- hop-by-hop and framing headers (`content-length`, `transfer-encoding`, `host`, `connection`,
  ...) are the router's to write, never a backend's configured `headers`;
- URLs are ASCII without control characters or spaces, with a port in 1-65535 and without
  credentials (`user:pass@`): a key goes in `api_key`, where it is kept secret.

Each check raises `ValueError` with a message that never quotes the value (it may be a secret).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

# RFC 9110 5.6.2: token = 1*tchar.
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
# Visible ASCII, space, tab and obs-text (0x80-0xFF); no other control characters.
_FIELD_VALUE = re.compile(r"^[\t\x20-\x7e\x80-\xff]*$")
_URL_CHARS = re.compile(r"^[\x21-\x7e]+$")  # ASCII, no space, no control characters

# Written by the router or the transport, never by configuration: a configured value would
# frame the body wrongly (content-length, transfer-encoding), address another host, or change
# the connection's fate.
RESERVED_HEADERS = frozenset(
    {
        "connection",
        "content-length",
        "expect",
        "host",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "x-sluicegate-hop",  # the router's loop marker (router/request/admit/hops.py)
    }
)


def check_header_name(name: str) -> str:
    if not _TOKEN.match(name):
        raise ValueError("header names must be tokens (letters, digits, !#$%&'*+-.^_`|~)")
    if name.lower() in RESERVED_HEADERS:
        raise ValueError(f"`{name.lower()}` is set by the router and cannot be configured")
    return name


def check_header_value(value: str) -> str:
    if not _FIELD_VALUE.match(value):
        raise ValueError(
            "header values must be Latin-1 text without control characters (CR, LF, NUL)"
        )
    return value


def check_url(url: str) -> str:
    """An http(s) URL the transport can send as written; the message never quotes it."""
    if not _URL_CHARS.match(url):
        raise ValueError("must be ASCII without spaces or control characters")
    parsed = urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError("must be an http:// or https:// URL with a host")
    if "@" in parsed.netloc:
        raise ValueError("must not carry credentials (user:password@); give the key as api_key")
    try:
        port = parsed.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError("port must be a number from 1 to 65535")
    if parsed.query or parsed.fragment:
        raise ValueError("must not carry a query or fragment (use `query:`)")
    return url
