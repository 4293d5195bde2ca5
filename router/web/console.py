"""The web console (`console: {enabled: true}`): one page served by the router, docs/console.md.

    GET <path>                    the page (console_static/index.html, the prefix filled in)
    GET <path>/static/<file>      its script and style sheet, from the package
    GET <path>/api/live           the live view (router/web/live_state.py), read-only JSON

The assets are plain files shipped in the package (no build step, nothing fetched from outside)
and read once at start. Every answer carries a Content-Security-Policy that allows only this
router's own script, style and JSON: no inline script, no other origin, no framing. The live view
is an admin read (the admin token when one is configured); the page's actions call the admin API
itself, with the token the operator typed in, kept in the tab's session storage.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from router.core.errors import error_response
from router.core.settings import ConsoleConfig
from router.web.auth import AdminAuth
from router.web.live_state import LiveState

ASSETS = Path(__file__).resolve().parent / "console_static"
_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_SAFE = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}


def _load() -> tuple[dict[str, bytes], str]:
    """The static files by name, and a version (their hash) for cache-busting URLs."""
    files = {p.name: p.read_bytes() for p in sorted(ASSETS.iterdir()) if p.suffix in _TYPES}
    digest = hashlib.sha256(b"".join(files[n] for n in sorted(files))).hexdigest()[:12]
    return files, digest


def console_routes(cfg: ConsoleConfig, auth: AdminAuth, state: LiveState) -> APIRouter:
    router = APIRouter(prefix=cfg.path)
    files, version = _load()
    page = (
        (ASSETS / "index.html")
        .read_text("utf-8")
        .replace("{{prefix}}", cfg.path)
        .replace("{{version}}", version)
        .encode()
    )

    @router.get("")
    async def index() -> Response:
        return Response(
            page,
            media_type="text/html; charset=utf-8",
            headers={**_SAFE, "cache-control": "no-store"},
        )

    @router.get("/static/{name}")
    async def static(name: str) -> Response:
        body = files.get(name)
        if body is None:
            return error_response(404, "Not Found", "not_found_error")
        # The page names each file with the assets' hash: a new version is a new URL.
        return Response(
            body,
            media_type=_TYPES[Path(name).suffix],
            headers={**_SAFE, "cache-control": "public, max-age=86400, immutable"},
        )

    @router.get("/api/live")
    async def live(request: Request) -> Response:
        if denied := auth.check(request, mutating=False):
            return denied
        return JSONResponse(await state.view(), headers={**_SAFE, "cache-control": "no-store"})

    return router
