"""Bind the dashboard, print its URL with the token, open a browser, serve until Ctrl-C.

The socket is bound here, before anything is printed, so the URL names a port that is ours: the
default port's next ones are tried when it is taken (as Jupyter does); a port asked for with
--port is that port or an error.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import webbrowser
from typing import Callable

from gpuctl.common.errors import UserError
from gpuctl.dashboard.commands import CHILD_ENV
from gpuctl.dashboard.security import TOKEN_ENV, Guard, allowed_hosts, is_loopback, is_wildcard, new_token

DEFAULT_PORT = 8642
PORT_TRIES = 20


def check_bind(host: str, no_token: bool) -> None:
    if no_token and not is_loopback(host):
        raise UserError(f"--host {host} --no-token: a dashboard without a token is served on a loopback address "
                        "only (127.0.0.1, ::1, localhost); drop --no-token, and open the URL with the token")


def bind(host: str, port: int | None) -> socket.socket:
    """A listening socket on host:port, or on the first free port from DEFAULT_PORT when none is asked."""
    try:
        infos = socket.getaddrinfo(host or None, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    candidates = [port] if port is not None else [DEFAULT_PORT + i for i in range(PORT_TRIES)]
    for candidate in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address[0], candidate, *address[2:]))
            sock.listen(128)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRNOTAVAIL:
                raise UserError(f"--host {host}: not an address of this machine") from None
            if exc.errno != errno.EADDRINUSE or port is not None:
                raise UserError(f"--port {candidate}: {exc.strerror}; pick another port (--port 0: any free one)"
                                ) from None
    raise UserError(f"ports {candidates[0]}-{candidates[-1]} are all in use: give one with --port P (0: any free one)")


def url_for(host: str, port: int, token: str | None) -> str:
    shown = "127.0.0.1" if is_wildcard(host) else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}/clusters" + (f"?token={token}" if token else "")


def serve(*, host: str, port: int | None, open_browser: bool, no_token: bool,
          say: Callable[[str], None] = print) -> None:
    import uvicorn  # only here: no other command pays for the web stack

    from gpuctl.dashboard.app import Dashboard
    from gpuctl.state import remotestate

    check_bind(host, no_token)
    token = None if no_token else (os.environ.get(TOKEN_ENV) or new_token())
    sock = bind(host, port)
    actual = sock.getsockname()[1]
    guard = Guard(token=token, port=actual, allowed_hosts=allowed_hosts(host))
    shared = remotestate.current() is not None
    app = Dashboard(guard, shared=shared).app()
    os.environ[CHILD_ENV] = str(actual)  # its children say whose they are
    url = url_for(host, actual, token)
    say(f"gpuctl dashboard: {url}")
    say("  " + ("the shared state's clusters and jobs (every runner's)" if shared else "this machine's state")
        + "; Ctrl-C stops it" + ("" if is_loopback(host) else f"; served on {host}: anyone with the URL can use it"))
    sys.stdout.flush()
    if open_browser:
        try:
            webbrowser.open(url)
        except webbrowser.Error:
            pass
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])
