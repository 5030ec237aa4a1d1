"""Inventory: Terraform's outputs (or a hand-written file) -> ranked nodes.

`inventory_from_outputs` is pure: it reads only the module output contract
(`nodes`, `ssh_user`, `bastion`; see docs/architecture.md) so any provider
module that honours the contract plugs in. Ranks are assigned here, explicitly,
because Ansible's host order is not play order; a node keeps its rank across
re-applies (matched by Terraform's node id).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from gpuctl.common.errors import UserError
from gpuctl.common.yamlfile import load_yaml

# What may reach ssh's argv or an ssh config file from an inventory: host names
# (RFC 1123 labels) or IP addresses, POSIX user names, ports. Nothing that
# starts with '-' (ssh would read an option) or holds spaces or control bytes
# (a newline would add a line to a generated config file).
_DNS_RE = re.compile(r"(?=.{1,253}\.?\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                     r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")
_USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9._-]{0,31}")


def check_host(value: Any, where: str) -> str:
    """An IP address or a DNS name, else one clear error naming `where`."""
    text = str(value)
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    if not _DNS_RE.fullmatch(text):
        raise UserError(f"{where} {text!r}: not an IP address or host name; give one such as 10.0.0.5 or "
                        "node1.example.com")
    return text


def check_port(value: Any, where: str) -> int:
    try:
        port = int(str(value).strip())
    except ValueError:
        port = 0
    if isinstance(value, bool) or not 1 <= port <= 65535 or str(value).strip() != str(port):
        raise UserError(f"{where} {str(value)!r}: not a port number (1-65535)")
    return port


def check_user(value: Any, where: str) -> str:
    text = str(value)
    if not _USER_RE.fullmatch(text):
        raise UserError(f"{where} {text!r}: not a user name (letters, digits, '.', '_', '-'; not starting with '-')")
    return text


def check_proxy(value: Any, where: str) -> str:
    """A bastion as `[user@]host[:port]`, each part checked."""
    text = str(value)
    user, _, rest = text.rpartition("@")
    host, port = rest, None
    if rest.count(":") == 1:
        host, port = rest.split(":")
    if user:
        check_user(user, f"{where} (user)")
    check_host(host, f"{where} (host)")
    if port is not None:
        check_port(port, f"{where} (port)")
    return text


@dataclass(frozen=True)
class Node:
    """One machine of a cluster, as the controller and the other nodes see it."""

    name: str  # "head", "worker1", ...
    rank: int
    node_id: str
    address: str  # the IP other nodes use (private)
    ssh_host: str  # where the controller connects
    ssh_port: int = 22
    ssh_user: str = "root"
    ssh_key: str | None = None
    gpus: int = 0
    proxy_jump: str | None = None  # "user@host[:port]" of a bastion
    peer_ssh_port: int | None = None  # where other nodes reach its sshd, when not derivable
    known_hosts: str | None = None  # the cluster's known_hosts file on the controller (None: no pinning)

    @property
    def host_key_alias(self) -> str:
        """The name its host key is kept under: its Terraform id, so a replaced node (a new id)
        is a new entry, and a changed key on the same node is refused."""
        return "gpuctl-" + re.sub(r"[^A-Za-z0-9._-]", "_", self.node_id)


@dataclass(frozen=True)
class Inventory:
    cluster: str
    cloud: str
    nodes: tuple[Node, ...]
    region: str | None = None
    zone: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def head(self) -> Node:
        return self.nodes[0]

    def first(self, count: int) -> tuple[Node, ...]:
        """The nodes of a job that uses the first `count` nodes (ranks 0..count-1)."""
        return self.nodes[:count]


def known_hosts_path(cluster: str) -> Path:
    """`clusters/<name>/known_hosts`: every node's host key, learned at first contact."""
    from gpuctl.common.paths import cluster_dir

    return cluster_dir(cluster) / "known_hosts"


def node_name(rank: int) -> str:
    return "head" if rank == 0 else f"worker{rank}"


def is_loopback(address: str) -> bool:
    """A node on the controller's own loopback: an sshd process of the controller's user (local nodes
    without root), whose home is the controller's."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def peer_port(node: Node) -> int:
    """The port other nodes reach the node's sshd on (the cluster view: configplane/clusterview.py)."""
    if node.peer_ssh_port is not None:
        return node.peer_ssh_port
    return node.ssh_port if node.ssh_host == node.address else 22


def hostfile_lines(nodes: Iterable[Node]) -> list[str]:
    """`IP slots=N` per node, head first (DeepSpeed / MPI hostfile format): N is the node's GPU
    count, or 1 on a node without GPUs (one process per node; `slots=0` would give mpirun and
    deepspeed nowhere to start a rank)."""
    return [f"{n.address} slots={n.gpus or 1}" for n in sorted(nodes, key=lambda n: n.rank)]


def inventory_from_outputs(
    outputs: Mapping[str, Any],
    *,
    cluster: str,
    cloud: str,
    ssh_key: str | None,
    gpus_per_node: int,
    region: str | None = None,
    zone: str | None = None,
    previous: Inventory | None = None,
) -> Inventory:
    """Build the inventory from `terraform output -json` values.

    `outputs` maps output name to value (the `value` field already unwrapped
    or not: both shapes are accepted). Nodes whose id was in `previous` keep
    their rank; new nodes take the lowest free ranks in module order.
    """
    values = {k: (v["value"] if isinstance(v, Mapping) and "value" in v else v) for k, v in outputs.items()}
    raw_nodes = values.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ValueError("terraform output 'nodes' is missing or empty")
    ssh_user = values.get("ssh_user") or "root"
    bastion = values.get("bastion")
    proxy = None
    if isinstance(bastion, Mapping) and bastion.get("public_ip"):
        proxy = check_proxy(f"{bastion.get('ssh_user') or ssh_user}@{bastion['public_ip']}", "terraform output bastion")

    old_ranks = {n.node_id: n.rank for n in previous.nodes} if previous else {}
    ids = [str(n["id"]) for n in raw_nodes]
    taken = {old_ranks[i] for i in ids if i in old_ranks}
    free = (r for r in range(len(ids) + len(taken)) if r not in taken)
    ranks = {i: old_ranks[i] if i in old_ranks else next(free) for i in ids}
    if sorted(ranks.values()) != list(range(len(ids))):
        # Nodes were removed from the middle: fall back to module order.
        ranks = {i: r for r, i in enumerate(ids)}

    nodes = []
    for raw in raw_nodes:
        node_id = str(raw["id"])
        rank = ranks[node_id]
        private_ip = check_host(raw.get("private_ip"), f"terraform output nodes[{node_id}].private_ip")
        public_ip = raw.get("public_ip") or None
        ssh_host = check_host(raw.get("ssh_host") or (None if proxy else public_ip) or private_ip,
                              f"terraform output nodes[{node_id}].ssh_host")
        nodes.append(
            Node(
                name=node_name(rank),
                rank=rank,
                node_id=node_id,
                address=str(private_ip),
                ssh_host=str(ssh_host),
                ssh_port=check_port(raw.get("ssh_port") or 22, f"terraform output nodes[{node_id}].ssh_port"),
                ssh_user=check_user(ssh_user, "terraform output ssh_user"),
                ssh_key=ssh_key,
                gpus=gpus_per_node,
                proxy_jump=proxy,
                known_hosts=str(known_hosts_path(cluster)),
            )
        )
    nodes.sort(key=lambda n: n.rank)
    return Inventory(cluster=cluster, cloud=cloud, region=region, zone=zone, nodes=tuple(nodes))


def _walk_hosts(group: Mapping[str, Any], inherited: Mapping[str, Any]) -> Iterable[tuple[str, dict[str, Any]]]:
    group_vars = {**inherited, **(group.get("vars") or {})}
    for name, hostvars in (group.get("hosts") or {}).items():
        yield str(name), {**group_vars, **(hostvars or {})}
    for child in (group.get("children") or {}).values():
        yield from _walk_hosts(child or {}, group_vars)


def load_inventory(path: Path, *, cluster: str | None = None, default_key: str | None = None) -> Inventory:
    """Read an inventory gpuctl wrote, or a hand-written one of existing machines.

    Hand-written files need only `ansible_host` per host; rank defaults to file
    order (head first), `gpuctl_address` to `ansible_host`, `gpuctl_gpus` to 0.
    """
    where = str(path)
    if not path.is_file():
        raise UserError(f"{where}: inventory file not found; write one as shown in inventories/README.md")
    data = load_yaml(path, what="inventory file") or {}
    if not isinstance(data, Mapping) or not isinstance(data.get("all"), Mapping):
        raise UserError(f"{where}: an inventory needs a top-level 'all:' group (see inventories/README.md)")
    top = data["all"]
    hosts = list(_walk_hosts(top, {}))
    if not hosts:
        raise UserError(f"{where}: the inventory lists no hosts; add them under all.hosts or all.children")
    seen: dict[str, dict[str, Any]] = {}
    for name, hv in hosts:
        seen.setdefault(name, {}).update(hv)
    explicit = [hv.get("gpuctl_rank") for hv in seen.values()]
    nodes = []
    for order, (name, hv) in enumerate(seen.items()):
        here = f"{where}: host '{name}':"
        host = check_host(hv.get("ansible_host") or name, f"{here} ansible_host")
        rank = hv.get("gpuctl_rank", order) if all(r is not None for r in explicit) else order
        try:
            addr = str(hv.get("gpuctl_address") or host)
            ipaddress.ip_address(addr)
        except ValueError:
            raise UserError(
                f"{where}: host '{name}' needs an IP address in gpuctl_address or ansible_host (got '{addr}')"
            ) from None
        proxy = hv.get("gpuctl_proxy_jump")
        common = str(hv.get("ansible_ssh_common_args") or "")
        if not proxy and "ProxyJump=" in common:
            proxy = common.split("ProxyJump=", 1)[1].split()[0]
        if proxy:
            proxy = check_proxy(proxy, f"{here} gpuctl_proxy_jump")
        nodes.append(
            Node(
                name=node_name(int(rank)),
                rank=int(rank),
                node_id=str(hv.get("gpuctl_node_id") or name),
                address=addr,
                ssh_host=str(host),
                ssh_port=check_port(hv.get("ansible_port") or 22, f"{here} ansible_port"),
                ssh_user=check_user(hv.get("ansible_user") or "root", f"{here} ansible_user"),
                ssh_key=_expand(hv.get("ansible_ssh_private_key_file")) or default_key,
                gpus=int(hv.get("gpuctl_gpus") or 0),
                proxy_jump=proxy,
                peer_ssh_port=(check_port(hv["gpuctl_peer_ssh_port"], f"{here} gpuctl_peer_ssh_port")
                               if hv.get("gpuctl_peer_ssh_port") else None),
            )
        )
    cluster_name = cluster or str((top.get("vars") or {}).get("gpuctl_cluster") or path.stem)
    nodes = [replace(n, known_hosts=str(known_hosts_path(cluster_name))) for n in nodes]
    ranks = sorted(n.rank for n in nodes)
    if ranks != list(range(len(nodes))):
        raise UserError(f"{where}: gpuctl_rank values must be 0..{len(nodes) - 1}, each once (got {ranks})")
    nodes.sort(key=lambda n: n.rank)
    tv = top.get("vars") or {}
    return Inventory(
        cluster=cluster_name,
        cloud=str(tv.get("gpuctl_cloud") or "ssh"),
        region=tv.get("gpuctl_region"),
        zone=tv.get("gpuctl_zone"),
        nodes=tuple(nodes),
    )


def _expand(path: Any) -> str | None:
    if path and any(ord(c) < 32 or ord(c) == 127 for c in str(path)):
        raise UserError(f"key path {str(path)!r}: control characters are not allowed in a file name here")
    return str(Path(str(path)).expanduser()) if path else None
