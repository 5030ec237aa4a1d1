"""Plain OpenSSH to the nodes: argv building, one command, or one command on all nodes.

The options match what the packaged ansible.cfg gives Ansible's ssh connection
(`ControlPath=<control_dir>/%C`, `%C` being OpenSSH's hash of local host, remote
host, port and user), so direct SSH (log following, kill) rides on the
ControlMaster sockets the playbooks opened, and the other way round.

Host keys: learned at first contact into the cluster's known_hosts under the
node's Terraform id (`host_key_options`), verified strictly afterwards; a
replaced node has a new id, so only a changed key on the same node is refused.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from gpuctl.provision.inventory import Node

# A unix socket path is limited to 108 bytes; ssh first creates
# "<ControlPath>.<16 random chars>" and renames it. %C expands to 40 hex chars.
_SOCKET_PATH_MAX = 104
_CONTROL_NAME_LEN = 40 + 1 + 17
CONTROL_PERSIST = "300s"

COMMON_OPTIONS = (
    "LogLevel=ERROR",
    "BatchMode=yes",
    "ServerAliveInterval=15",
    "ServerAliveCountMax=4",
)


def _control_dir_path(preferred: Path) -> Path:
    preferred = Path(preferred).expanduser().absolute()
    if len(str(preferred)) + 1 + _CONTROL_NAME_LEN <= _SOCKET_PATH_MAX:
        return preferred
    digest = hashlib.sha1(str(preferred).encode()).hexdigest()[:12]
    chosen = Path(tempfile.gettempdir()) / f"gpuctl-{os.getuid()}-{digest}"
    if len(str(chosen)) + 1 + _CONTROL_NAME_LEN > _SOCKET_PATH_MAX:
        chosen = Path("/tmp") / f"gpuctl-{os.getuid()}-{digest}"
    return chosen


def remove_control_dir(preferred: Path) -> None:
    """Remove what control_dir_for(preferred) made (the cluster is gone): the
    fallback directory under the temp dir lies outside the cluster directory."""
    chosen = _control_dir_path(preferred)
    if chosen.is_dir() and chosen.stat().st_uid == os.getuid():
        exit_masters(preferred)
        shutil.rmtree(chosen, ignore_errors=True)


def exit_masters(preferred: Path) -> None:
    """Tell every ControlMaster under control_dir_for(preferred) to exit: a master whose node
    vanished without a reset (its namespace or machine gone) would otherwise hold every new
    session on it until its keepalives give up (a minute)."""
    chosen = _control_dir_path(preferred)
    if not chosen.is_dir() or chosen.stat().st_uid != os.getuid():
        return
    for sock in chosen.iterdir():
        if sock.is_socket():
            try:
                subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "--", "gpuctl-master"],
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=10, check=False)
            except (OSError, subprocess.SubprocessError):
                pass  # a master that does not answer ends with its keepalives


def control_dir_for(preferred: Path) -> Path:
    """A ControlPath directory short enough for the socket limit, created 0700.

    `preferred` is used when short enough; otherwise a per-`preferred` directory
    under the temp dir (stable, so every caller for one cluster shares it).
    """
    chosen = _control_dir_path(preferred)
    chosen.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = chosen.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.chmod(chosen, 0o700)
        if chosen.stat().st_uid != os.getuid():
            raise PermissionError(f"{chosen} is not owned by this user; remove it")
    return chosen


def close_masters(nodes: Sequence[Node], control_dir: Path) -> None:
    """Tell the ControlMaster of each node, if any, to exit: a node made again at the same address
    (a replaced local node) would otherwise be reached through its predecessor's dead connection
    until that master's keepalives give up."""
    for node in nodes:
        subprocess.run(["ssh", *ssh_options(node, control_dir), "-O", "exit", "--", node.ssh_host],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=10, check=False)


HOST_KEY_FAILURES = ("Host key verification failed", "HOST IDENTIFICATION HAS CHANGED",
                     "No ED25519 host key is known", "Host key for")


def host_key_options(node: Node) -> list[str]:
    """Learn a node's host key at first contact, refuse a different one afterwards.

    Keys live in the cluster's own known_hosts under the node's alias (its
    Terraform id), plain (not hashed) so gpuctl can forget one by name.
    """
    if node.known_hosts is None:  # no cluster around it (a one-off Node in a test): nothing to pin to
        return ["-o", "StrictHostKeyChecking=accept-new", "-o", "UserKnownHostsFile=/dev/null"]
    return ["-o", "StrictHostKeyChecking=accept-new", "-o", f"UserKnownHostsFile={node.known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", f"HostKeyAlias={node.host_key_alias}",
            "-o", "HashKnownHosts=no"]


def host_key_changed(text: str) -> bool:
    """Whether ssh's error output says the host key was not the one on record."""
    return any(marker in text for marker in HOST_KEY_FAILURES)


def host_key_error(node: Node) -> str:
    """One line for a node whose key changed: which node, and what to do."""
    return (f"{node.name} ({node.ssh_host}): its SSH host key is not the one gpuctl recorded at first contact, so "
            f"nothing was sent; if you rebuilt that machine, run `gpuctl forget-host-key CLUSTER {node.name}` "
            f"and retry; otherwise someone may be intercepting the connection")


def forget_host_keys(known_hosts: Path, aliases: set[str], *, keep_only: bool = False) -> int:
    """Drop the entries of `aliases` (or, with keep_only, every node entry but theirs); how many went."""
    try:
        lines = known_hosts.read_text().splitlines()
    except FileNotFoundError:
        return 0
    kept, dropped = [], 0
    for line in lines:
        names = _host_names(line)
        node_entry = any(n.startswith("gpuctl-") and not n.startswith("gpuctl-bastion-") for n in names)
        hit = bool(names & aliases)
        if (keep_only and node_entry and not hit) or (not keep_only and hit):
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        _rewrite(known_hosts, kept)
    return dropped


def _host_names(line: str) -> set[str]:
    """The host names (aliases) a known_hosts line is for; none for a comment or a blank line."""
    return set(line.split(" ", 1)[0].split(",")) if line and not line.startswith("#") else set()


def _rewrite(known_hosts: Path, lines: Sequence[str]) -> None:
    """known_hosts with exactly `lines`, replaced at once (a reader never sees half of it)."""
    tmp = known_hosts.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.chmod(tmp, 0o600)
    tmp.replace(known_hosts)


def known_aliases(known_hosts: Path) -> set[str]:
    """The host names (node aliases) `known_hosts` holds a key for."""
    try:
        lines = known_hosts.read_text().splitlines()
    except OSError:
        return set()
    return {name for line in lines for name in _host_names(line)}


def pin_host_keys(known_hosts: Path, keys: Mapping[str, str]) -> int:
    """Record `keys` ({alias: "TYPE BASE64 [comment]"}, read where the nodes were made) as the only
    keys of their aliases: first contact then checks them, by the controller and by the head alike.
    How many entries changed."""
    try:
        before = known_hosts.read_text()
    except FileNotFoundError:
        before = ""
    wanted = {alias: " ".join([alias, *line.split()[:2]]) for alias, line in keys.items() if len(line.split()) >= 2}
    lines = before.splitlines()
    kept = [line for line in lines if not _host_names(line) & set(wanted)]
    present = set(lines)
    changed = sum(1 for entry in wanted.values() if entry not in present)
    if not changed and len(kept) + len(wanted) == len(lines):
        return 0
    _rewrite(known_hosts, kept + list(wanted.values()))
    return changed


def proxy_command(node: Node) -> str:
    """ProxyCommand for the bastion, with the same no-prompt options as the node.

    ProxyJump would connect to the bastion with ssh_config defaults only, so an
    unknown bastion host key would fail under BatchMode.
    """
    assert node.proxy_jump
    jump = node.proxy_jump
    port = None
    if jump.count(":") == 1:
        jump, port = jump.split(":")
    argv = ["ssh", *[a for o in COMMON_OPTIONS for a in ("-o", o)]]
    if node.known_hosts is not None:  # the bastion's key is pinned like a node's
        argv += ["-o", "StrictHostKeyChecking=accept-new", "-o", f"UserKnownHostsFile={node.known_hosts}",
                 "-o", "GlobalKnownHostsFile=/dev/null", "-o", f"HostKeyAlias=gpuctl-bastion-{jump.split('@')[-1]}",
                 "-o", "HashKnownHosts=no"]
    else:
        argv += ["-o", "StrictHostKeyChecking=accept-new", "-o", "UserKnownHostsFile=/dev/null"]
    if node.ssh_key:
        argv += ["-i", node.ssh_key, "-o", "IdentitiesOnly=yes"]
    if port:
        argv += ["-p", port]
    argv += ["-W", "%h:%p", "--", jump]
    return " ".join(shlex.quote(a) if a != "%h:%p" else a for a in argv)


def ssh_options(node: Node, control_dir: Path | None, *, connect_timeout: int = 10) -> list[str]:
    """Every ssh option for `node`, without the destination (also used as rsync's -e)."""
    opts = ["-p", str(node.ssh_port), "-l", node.ssh_user, *host_key_options(node)]
    for o in COMMON_OPTIONS:
        opts += ["-o", o]
    opts += ["-o", f"ConnectTimeout={connect_timeout}"]
    if node.ssh_key:
        opts += ["-i", node.ssh_key, "-o", "IdentitiesOnly=yes"]
    if control_dir is not None:
        opts += ["-o", "ControlMaster=auto", "-o", f"ControlPersist={CONTROL_PERSIST}",
                 "-o", f"ControlPath={control_dir}/%C"]
    if node.proxy_jump:
        opts += ["-o", f"ProxyCommand={proxy_command(node)}"]
    return opts


def ssh_argv(node: Node, command: str | Sequence[str] | None = None, *, control_dir: Path | None = None,
             connect_timeout: int = 10) -> list[str]:
    """`ssh ... host [command]`; a sequence command is shell-quoted word by word."""
    # `--` ends ssh's options: nothing from an inventory can become one.
    argv = ["ssh", *ssh_options(node, control_dir, connect_timeout=connect_timeout), "--", node.ssh_host]
    if command is not None:
        argv += [command if isinstance(command, str) else shlex.join(command)]
    return argv


def run_ssh(node: Node, command: str | Sequence[str], control_dir: Path | None, timeout: float | None = 60,
            *, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `command` on `node`; never raises for a failed or timed-out command.

    rc 255 is ssh's own failure (unreachable, auth); a timeout gives rc 124.
    """
    argv = ssh_argv(node, command, control_dir=control_dir)
    try:
        return subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout,
                              stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return subprocess.CompletedProcess(argv, 124, out, err + f"\ntimed out after {timeout}s")


def run_on_all(nodes: Sequence[Node], command: str | Sequence[str], *, control_dir: Path | None,
               timeout: float | None = 60, max_workers: int = 64) -> dict[int, subprocess.CompletedProcess[str]]:
    """Run `command` on every node at once (a thread per node, up to `max_workers`): rank -> result."""
    if not nodes:
        return {}
    from concurrent.futures import ThreadPoolExecutor  # (with logging: 6 ms a warm exec does not need)

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(nodes))), thread_name_prefix="ssh") as pool:
        futures = {n.rank: pool.submit(run_ssh, n, command, control_dir, timeout) for n in nodes}
        return {rank: f.result() for rank, f in futures.items()}
