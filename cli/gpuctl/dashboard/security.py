"""Who may use the dashboard: the token in the URL it prints, a Host header it expects, and actions
only from its own pages.

As Jupyter does: every request needs the token (`?token=` once, then a cookie that is HttpOnly and
SameSite=Strict, or `Authorization: Bearer` for scripts). A page on another site that the browser
opens cannot read the token, so it cannot use the dashboard. Two more checks close what is left:
- DNS rebinding: a foreign name that resolves to 127.0.0.1 makes the browser treat the dashboard
  as that site; the Host header then names it, and any Host but the addresses the dashboard is
  bound to (and localhost) is refused. Bound to every interface, any Host passes: the token holds.
- Cross-site requests: an action (POST) must come from a page of the dashboard itself: its Origin
  (or Sec-Fetch-Site) says same-origin, and it carries the page's CSRF token.
Without a token (`--no-token`) only a loopback address may be served.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable
from urllib.parse import urlencode, urlsplit

from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response

TOKEN_ENV = "GPUCTL_DASHBOARD_TOKEN"  # a token of the user's own (never on the command line)
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def is_loopback(host: str) -> bool:
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in ("0.0.0.0", "::", "")


def new_token() -> str:
    return secrets.token_hex(24)


def host_of(header: str) -> str:
    """The name in a Host header, without its port ("[::1]:8642" -> "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass
class Guard:
    """The checks every request passes. `token` None: served without one (loopback only);
    `allowed_hosts` None: any Host (bound to every interface)."""

    token: str | None
    port: int
    allowed_hosts: frozenset[str] | None
    _csrf_key: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    @property
    def cookie(self) -> str:
        return f"gpuctl-dashboard-{self.port}"  # cookies ignore ports: one name per dashboard

    def csrf_token(self) -> str:
        """What the dashboard's own forms carry; a page of another site cannot read it."""
        return hmac.new(self._csrf_key, (self.token or "").encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, value: str | None) -> bool:
        return bool(value) and hmac.compare_digest(str(value), self.csrf_token())

    def _token_ok(self, value: str | None) -> bool:
        return self.token is None or (bool(value) and hmac.compare_digest(str(value), self.token))

    def refusal(self, request: Request) -> Response | None:
        """The answer to a request that fails a check, or None to let it through."""
        host = host_of(request.headers.get("host", ""))
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            return PlainTextResponse(f"403: Host '{host}' is not this dashboard's address; open the URL "
                                     "`gpuctl dashboard` printed", status_code=403)
        if request.method not in SAFE_METHODS and not self._same_origin(request):
            return PlainTextResponse("403: a cross-site request: actions are taken from the dashboard's own "
                                     "pages", status_code=403)
        if self.token is None:
            return None
        bearer = request.headers.get("authorization", "")
        given = bearer[7:] if bearer.lower().startswith("bearer ") else request.cookies.get(self.cookie)
        if self._token_ok(given):
            return None
        asked = request.query_params.get("token")
        if asked is not None and self._token_ok(asked) and request.method in SAFE_METHODS:
            # the token moves into a cookie, out of the address bar and the browser's history
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = request.url.path + (f"?{urlencode(rest)}" if rest else "")
            response = RedirectResponse(target, status_code=303)
            response.set_cookie(self.cookie, self.token, httponly=True, samesite="strict", path="/")
            return response
        return PlainTextResponse("403: this dashboard needs its token: open the URL `gpuctl dashboard` printed "
                                 "(it ends in ?token=...)", status_code=403)

    def _same_origin(self, request: Request) -> bool:
        origin = request.headers.get("origin")
        if origin is not None and origin != "null":
            parts = urlsplit(origin)
            return parts.netloc.lower() == request.headers.get("host", "").strip().lower()
        site = request.headers.get("sec-fetch-site")
        if site is not None:
            return site in ("same-origin", "none")
        # neither header: not a browser (a script with the bearer token); a browser always sends one
        return origin is None and bool(request.headers.get("authorization"))


class GuardMiddleware:
    """ASGI middleware: every HTTP request through Guard.refusal first."""

    def __init__(self, app: Callable[..., Awaitable[None]], guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refused = self.guard.refusal(Request(scope))
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def allowed_hosts(bind: str) -> frozenset[str] | None:
    """The Host names a dashboard bound to `bind` answers: loopback names, and the address itself."""
    if is_wildcard(bind):
        return None
    return LOOPBACK_NAMES | {bind.strip("[]").lower()}
