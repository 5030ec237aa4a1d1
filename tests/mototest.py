"""A real moto server on loopback for tests: start, wait, reset, stop.

`MotoServer` runs `python -m moto.server` as a subprocess on 127.0.0.1 at a
free port and waits until it answers HTTP. `CapacityShortage` is a small
proxy in front of it that answers EC2 `RunInstances` in chosen zones the way
EC2 does when a zone is out of capacity (moto never is), to exercise zone
failover end to end. `fake_aws_env(url)` is the
environment a gpuctl subprocess needs to talk to it and to nothing else:
fake credentials, no shared config files (AWS's, SkyPilot's), no instance
metadata lookups, and `GPUCTL_AWS_ENDPOINT_URL` pointing at the server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterable, Mapping

STATE_BUCKET = "team-gpuctl-state"  # the shared-state bucket of the in-process tests (conftest.state_bucket)

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
}

# Variables that could lead boto3 or Terraform to real credentials or a real endpoint.
_AWS_VARS_TO_DROP = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_EC2",
    "GPUCTL_AWS_ENDPOINT_URL", "GPUCTL_AWS_PROFILE", "GPUCTL_AWS_PLACEMENT", "GPUCTL_AWS_EFA",
    "GPUCTL_SSH_INGRESS_CIDRS", "GPUCTL_AWS_REMOTE_IDENTITY",
) + tuple(FAKE_CREDENTIALS)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def isolated_aws_env(base: Mapping[str, str] | None = None, *, home: Path | None = None) -> dict[str, str]:
    """`base` (default os.environ) without AWS credentials or endpoints, and with
    shared config files and the metadata service switched off."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _AWS_VARS_TO_DROP}
    nowhere = str((home or Path("/nonexistent")) / "aws-none")
    env.update(
        AWS_CONFIG_FILE=nowhere,
        AWS_SHARED_CREDENTIALS_FILE=nowhere,
        AWS_EC2_METADATA_DISABLED="true",
        SKYPILOT_GLOBAL_CONFIG=nowhere,  # a user's ~/.sky/config.yaml (aws.remote_identity) stays out
    )
    return env


def fake_aws_env(url: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a gpuctl subprocess that must reach only the moto server at `url`."""
    env = isolated_aws_env(base)
    env.update(FAKE_CREDENTIALS)
    env["GPUCTL_AWS_ENDPOINT_URL"] = url
    return env


class MotoServer:
    """`python -m moto.server` on 127.0.0.1; use as a context manager or start()/stop()."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, *, log: Path | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "MotoServer":
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 - the server's, for its life
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**isolated_aws_env(), **FAKE_CREDENTIALS},
        )
        if self.log:
            out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode} (log: {self.log})")
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/data.json", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"moto server did not answer on {self.url} within {timeout:.0f}s")

    def reset(self) -> None:
        """Forget every resource (moto's own reset endpoint)."""
        req = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> "MotoServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


_ICE_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error><Code>InsufficientInstanceCapacity</Code>'
    "<Message>We currently do not have sufficient {itype} capacity in the Availability Zone you requested "
    "({zone}). Our system will be working on provisioning additional capacity.</Message></Error></Errors>"
    "<RequestID>gpuctl-test-capacity</RequestID></Response>"
)
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}


class CapacityShortage:
    """HTTP proxy to `upstream` (a moto server): EC2 RunInstances into a subnet of one of
    `zones` gets EC2's InsufficientInstanceCapacity answer (HTTP 500); all else passes.
    `refused` lists the zones it refused, in order."""

    def __init__(self, upstream: str, zones: Iterable[str], host: str = "127.0.0.1") -> None:
        self.upstream = upstream.rstrip("/")
        self.zones = set(zones)
        self.host = host
        self.refused: list[str] = []
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://{self.host}:{self._server.server_address[1]}"

    def _zone_of(self, params: Mapping[str, list[str]]) -> str | None:
        subnet = (params.get("SubnetId") or params.get("NetworkInterface.1.SubnetId") or [None])[0]
        if not subnet:
            return None
        body = urllib.parse.urlencode({"Action": "DescribeSubnets", "Version": "2016-11-15", "SubnetId.1": subnet})
        req = urllib.request.Request(self.upstream + "/", data=body.encode(), method="POST", headers={
            "Content-Type": "application/x-www-form-urlencoded",
            "Authorization": "AWS4-HMAC-SHA256 Credential=testing/20240101/us-east-1/ec2/aws4_request, "
                             "SignedHeaders=host, Signature=0",
        })
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
        start = text.find("<availabilityZone>")
        return text[start + 18:text.find("</availabilityZone>")] if start >= 0 else None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                return None

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.command == "POST" and body:
                    params = urllib.parse.parse_qs(body.decode(errors="replace"))
                    if params.get("Action") == ["RunInstances"]:
                        zone = proxy._zone_of(params)
                        if zone in proxy.zones:
                            proxy.refused.append(zone)
                            itype = (params.get("InstanceType") or ["(launch template type)"])[0]
                            self._reply(500, {"Content-Type": "text/xml"},
                                        _ICE_BODY.format(itype=itype, zone=zone).encode())
                            return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS | {"host"}}
                req = urllib.request.Request(proxy.upstream + self.path, data=body, method=self.command,
                                             headers=headers)
                try:
                    with urllib.request.urlopen(req, timeout=60) as resp:
                        self._reply(resp.status, dict(resp.headers.items()), resp.read())
                except urllib.error.HTTPError as err:
                    self._reply(err.code, dict(err.headers.items()), err.read())

            def _reply(self, status: int, headers: Mapping[str, str], payload: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in _HOP_HEADERS:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward

        return Handler

    def start(self) -> "CapacityShortage":
        self._server = ThreadingHTTPServer((self.host, 0), self._handler())
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="capacity-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "CapacityShortage":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
