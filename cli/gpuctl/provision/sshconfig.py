"""OpenSSH client config for a cluster: `Host NAME` (head), `Host NAME-worker1`, ...

The file works with `ssh -F FILE NAME` and through `Include` from
`~/.ssh/config` (SkyPilot users expect exactly these host names).
"""

from __future__ import annotations

import os
from pathlib import Path

from gpuctl.common.errors import UserError
from gpuctl.provision.inventory import Inventory, Node


def host_alias(cluster: str, node: Node) -> str:
    return cluster if node.rank == 0 else f"{cluster}-{node.name}"


def render(inv: Inventory, *, control_dir: Path | None = None, path: Path | str = "ssh config") -> str:
    """The config text; every value is checked for control characters first."""
    blocks = [f"# gpuctl cluster {inv.cluster}: generated, rewritten on every apply\n"]
    for node in inv.nodes:
        for value in (node.ssh_host, node.ssh_port, node.ssh_user, node.ssh_key or "", node.proxy_jump or "",
                      control_dir or "", node.known_hosts or "", node.host_key_alias):
            check_value(value, path)
        lines = [
            f"Host {host_alias(inv.cluster, node)}",
            f"  HostName {node.ssh_host}",
            f"  Port {node.ssh_port}",
            f"  User {node.ssh_user}",
        ]
        if node.ssh_key:
            lines += [f"  IdentityFile {node.ssh_key}", "  IdentitiesOnly yes"]
        if node.proxy_jump:
            lines.append(f"  ProxyJump {node.proxy_jump}")
        if node.known_hosts:
            lines += [
                "  StrictHostKeyChecking accept-new",
                f"  UserKnownHostsFile {node.known_hosts}",
                "  GlobalKnownHostsFile /dev/null",
                f"  HostKeyAlias {node.host_key_alias}",
                "  HashKnownHosts no",
            ]
        # a node that is gone fails a login in seconds, and a session to one that vanished ends
        lines += ["  LogLevel ERROR", "  ConnectTimeout 10", "  ServerAliveInterval 15", "  ServerAliveCountMax 4"]
        if control_dir is not None:
            lines += ["  ControlMaster auto", f"  ControlPath {control_dir}/%C", "  ControlPersist 300"]
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def check_value(value: object, path: Path | str) -> str:
    """A config file gets exactly the lines gpuctl writes: a value holding a newline
    (or another control byte) would add a line of its own (a `Match exec`...)."""
    text = str(value)
    bad = next((c for c in text if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise UserError(f"{path}: value {text!r} holds control character U+{ord(bad):04X}; fix the inventory")
    return text


def write(inv: Inventory, path: Path, *, control_dir: Path | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = render(inv, control_dir=control_dir, path=path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


INCLUDE_ASKED = ".include-asked"  # in the state dir's ssh/: the user was asked once, whatever the answer


def include_line(gpuctl_config: Path) -> str:
    return f"Include {gpuctl_config}"


def includes(user_config: Path, gpuctl_config: Path) -> bool:
    """Whether the user's ssh config already has gpuctl's Include line."""
    try:
        lines = user_config.read_text().splitlines()
    except OSError:
        return False
    home = str(Path.home())
    # ~/.gpuctl/ssh/config as users write it, or the *.conf files it includes
    targets = {str(gpuctl_config), str(gpuctl_config.parent / "*.conf")}

    def expanded(word: str) -> str:
        return home + word[1:] if word.startswith("~/") else word

    return any(len(words) >= 2 and words[0].lower() == "include" and any(expanded(w) in targets for w in words[1:])
               for words in (line.split() for line in lines))


def add_include(user_config: Path, gpuctl_config: Path) -> None:
    """Put the Include line first in the user's ssh config: after a `Host` line it would apply to
    that host only. The file is created (0600, ~/.ssh 0700) when missing."""
    if user_config.is_symlink():  # a dotfiles manager's link: edit what it points to
        user_config = user_config.resolve()
    user_config.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        before = user_config.read_text()
    except FileNotFoundError:
        before = ""
    text = f"# added by gpuctl: `ssh CLUSTER` for gpuctl's clusters\n{include_line(gpuctl_config)}\n\n{before}"
    tmp = user_config.with_name(user_config.name + ".gpuctl-tmp")
    tmp.write_text(text)
    os.chmod(tmp, user_config.stat().st_mode & 0o777 if user_config.exists() else 0o600)
    tmp.replace(user_config)
