"""A real moto server on loopback for tests: start, wait, reset, stop.

`MotoServer` runs `python -m moto.server` as a subprocess on 127.0.0.1 at a
free port and waits until it answers HTTP. `fake_aws_env(url)` is the
environment a gpuctl subprocess needs to talk to it and to nothing else:
fake credentials, no shared config files, no instance metadata lookups, and
`GPUCTL_AWS_ENDPOINT_URL` pointing at the server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping

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
    "GPUCTL_SSH_INGRESS_CIDRS",
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
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
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
