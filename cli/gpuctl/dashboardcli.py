"""`gpuctl dashboard`: the web UI (gpuctl/dashboard), from the command line."""

from __future__ import annotations

from typing import Optional

import typer

from gpuctl import usage


def register(app: typer.Typer) -> None:
    @app.command("dashboard", cls=usage.HelpCommand, epilog=usage.examples_of("dashboard"))
    def dashboard(port: Optional[int] = typer.Option(None, "--port", metavar="P", min=0, max=65535,
                                                     help="Port (default: 8642, or the next free one; 0: any)."),
                  host: str = typer.Option("127.0.0.1", "--host", metavar="H",
                                           help="Address to serve on (default: loopback only)."),
                  no_browser: bool = typer.Option(False, "--no-browser", help="Print the URL; open no browser."),
                  no_token: bool = typer.Option(False, "--no-token",
                                                help="Serve without a token (a loopback --host only).")) -> None:
        """Serve a web UI of clusters, jobs, managed jobs, health and cost, with live logs and actions.
        Every request needs the token in the URL it prints (or $GPUCTL_DASHBOARD_TOKEN)."""
        from gpuctl.dashboard.serve import serve  # the web stack loads for this command only

        serve(host=host, port=port, open_browser=not no_browser, no_token=no_token)
