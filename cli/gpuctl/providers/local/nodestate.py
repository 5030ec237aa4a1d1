"""Is a local node still there? Read from this machine's /proc, without ssh.

A managed job that loses a node asks the platform before it waits out ssh
timeouts; for local nodes the platform is this machine. What a node is comes
from what terraform/modules/local-nodes/scripts/node.sh left in its directory:
`node.env` (LN_MODE, LN_NETNS) and `sshd.pid` ("PID STARTTIME" of its sshd).

netns mode, as node.sh's `listening` reads it: the namespace's name is still
in /run/netns, the recorded sshd runs (same start time: a reused PID is not
it), it is in that namespace (compared by the namespace's inode, since the
namespaces of PID 1 cannot be read everywhere), and a socket there listens on
the node's port. loopback mode: the recorded sshd runs.
"""

from __future__ import annotations

import os
from pathlib import Path

NETNS_DIR = Path("/run/netns")  # where `ip netns add` names a namespace
PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def why_lost(node_dir: Path, port: int) -> str | None:
    """Why the node in `node_dir` is gone, or None while it looks alive."""
    try:
        env = read_env(node_dir / "node.env")
    except OSError:
        return f"its directory {node_dir} is gone (the node was removed)"
    try:
        pid_text, start = (node_dir / "sshd.pid").read_text().split()[:2]
        pid = int(pid_text)
    except (OSError, ValueError):
        return f"it has no sshd recorded ({node_dir}/sshd.pid: the node never came up)"
    netns = env.get("LN_NETNS", "") if env.get("LN_MODE") == "netns" else ""
    if netns and not (NETNS_DIR / netns).exists():
        return f"its network namespace {netns} is gone"
    if not _running(pid, start):
        return f"its sshd (pid {pid}) has exited"
    if not netns:
        return None
    if not _same_file(PROC / str(pid) / "ns" / "net", NETNS_DIR / netns):
        return f"its sshd (pid {pid}) is no longer in network namespace {netns}"
    if not _listens(pid, port):
        return f"no sshd listens on port {port} in network namespace {netns}"
    return None


def read_env(path: Path) -> dict[str, str]:
    """A node script's KEY=VALUE file (node.env, bridge.env): its LN_* names."""
    env = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.startswith("LN_"):
            env[key] = value
    return env


def _running(pid: int, start: str) -> bool:
    """PID runs (not a zombie) and started at `start` (field 22 of /proc/PID/stat)."""
    try:
        data = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return False
    fields = data[data.rfind(")") + 2:].split()  # the command name may hold spaces and ')'
    return len(fields) > 19 and fields[0] != "Z" and fields[19] == start


def _same_file(a: Path, b: Path) -> bool:
    """Both paths are the same object (bash's -ef): for namespaces, the same namespace."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _listens(pid: int, port: int) -> bool:
    """A TCP socket listens on `port` in PID's network namespace (its /proc/PID/net/tcp{,6})."""
    want = f":{port:04X}"
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / str(pid) / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == _LISTEN and fields[1].endswith(want):
                return True
    return False
