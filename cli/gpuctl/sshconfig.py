"""OpenSSH client config for a cluster: `Host NAME` (head), `Host NAME-worker1`, ...

The file works with `ssh -F FILE NAME` and through `Include` from
`~/.ssh/config` (SkyPilot users expect exactly these host names).
"""

from __future__ import annotations

from pathlib import Path

from gpuctl.inventory import Inventory, Node


def host_alias(cluster: str, node: Node) -> str:
    return cluster if node.rank == 0 else f"{cluster}-{node.name}"


def render(inv: Inventory, *, control_dir: Path | None = None) -> str:
    """The config text; host keys are not pinned because nodes are recreated often."""
    blocks = [f"# gpuctl cluster {inv.cluster}: generated, rewritten on every apply\n"]
    for node in inv.nodes:
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
        lines += [
            "  StrictHostKeyChecking no",
            "  UserKnownHostsFile /dev/null",
            "  LogLevel ERROR",
        ]
        if control_dir is not None:
            lines += ["  ControlMaster auto", f"  ControlPath {control_dir}/%C", "  ControlPersist 300"]
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def write(inv: Inventory, path: Path, *, control_dir: Path | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(render(inv, control_dir=control_dir))
    tmp.replace(path)
    return path
