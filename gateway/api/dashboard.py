"""``GET /dashboard``: the operator's page.

A static page (``static/dashboard.html``, ``.js``, ``.css``, shipped as package data and read
once when the app is built) whose script polls the admin JSON (``/admin/instances``,
``/admin/queues``, ``/admin/series``, ``/admin/ratio``, ``/health``) and draws it: no build
step, no external assets, so it works on a cluster with no way out. Everything under
``/dashboard`` needs the admin token like ``/admin/*`` (Bearer, or Basic with the token as the
password: what a browser sends after its prompt).

The page's URLs are relative (``dashboard/app.js``, ``admin/instances``), so it also works
behind a proxy that serves the gateway under a path prefix.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from pdgate.gateway.admission.auth import KeyRing

__all__ = ["SECURITY_HEADERS", "dashboard_routes"]

# Only this origin's script, style and fetches; no inline script or style (the script sets
# sizes through the CSSOM, which CSP allows), no framing, no forms, no <base> rewriting.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    # The page shows live fleet state behind a token: nothing of it belongs in a cache.
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}

# URL path -> (file under static/, media type)
_ASSETS = {
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard/app.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/app.css": ("dashboard.css", "text/css; charset=utf-8"),
}


def _asset(name: str) -> bytes:
    return files("pdgate.gateway.api").joinpath("static", name).read_bytes()


def dashboard_routes(keys: KeyRing) -> list[BaseRoute]:
    """The page and its two files, each behind the admin token. Read now, so a missing file
    fails the gateway's start rather than an operator's first visit."""

    def serve(body: bytes, media_type: str) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            keys.admin(request.headers.get("authorization"))
            return Response(body, media_type=media_type, headers=SECURITY_HEADERS)

        return endpoint

    return [
        Route(path, serve(_asset(name), media_type), methods=["GET"])
        for path, (name, media_type) in _ASSETS.items()
    ]
