"""Checking learned host keys against what the machine itself printed (AWS).

On EC2, cloud-init prints the new host keys' fingerprints to the instance's
console between `-----BEGIN SSH HOST KEY FINGERPRINTS-----` and `-----END
...`; the console is readable through the EC2 API (GetConsoleOutput), a path
an attacker on the network cannot touch. After gpuctl learned a node's key at
first contact (accept-new), the key's SHA256 fingerprint must be among them.
The console output arrives minutes after boot and some AMIs print nothing:
then there is nothing to compare, which is said, not treated as a failure.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from typing import Iterable

_BLOCK = re.compile(r"-----BEGIN SSH HOST KEY FINGERPRINTS-----(.*?)-----END SSH HOST KEY FINGERPRINTS-----", re.S)
_FP = re.compile(r"\bSHA256:([A-Za-z0-9+/]{43})\b")


def console_fingerprints(console: str) -> set[str]:
    """`SHA256:...` fingerprints cloud-init printed (empty when the console has none yet)."""
    found: set[str] = set()
    for block in _BLOCK.findall(console or ""):
        found.update(f"SHA256:{m}" for m in _FP.findall(block))
    return found


def fingerprint(key_b64: str) -> str:
    """OpenSSH's `SHA256:` fingerprint of a base64 public key blob."""
    digest = hashlib.sha256(base64.b64decode(key_b64)).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def learned_fingerprints(known_hosts: Path, alias: str) -> set[str]:
    """Fingerprints of the keys recorded for `alias` in the cluster's known_hosts."""
    out: set[str] = set()
    try:
        lines = known_hosts.read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and alias in parts[0].split(","):
            try:
                out.add(fingerprint(parts[2]))
            except ValueError:
                continue
    return out


def mismatched(learned: Iterable[str], printed: set[str]) -> list[str]:
    """Learned fingerprints the console does not list (nothing to say when it lists none)."""
    if not printed:
        return []
    return sorted(fp for fp in learned if fp not in printed)


def console_output(node_id: str, region: str | None) -> str:
    """The instance's console text through the EC2 API ("" when there is none yet, or no API)."""
    import base64 as b64

    from gpuctl.common.config import aws_settings
    from gpuctl.providers.aws.preflight import client, session

    settings = aws_settings()
    try:
        ec2 = client(session(settings), "ec2", region or "us-east-1", settings)
        raw = ec2.get_console_output(InstanceId=node_id, Latest=True).get("Output") or ""
    except Exception:  # noqa: BLE001 - no console is "not checked", never a failure of its own
        return ""
    try:
        return b64.b64decode(raw).decode("utf-8", "replace")
    except ValueError:
        return raw
