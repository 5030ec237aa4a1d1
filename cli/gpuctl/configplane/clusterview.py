"""What every node knows of the others: their host keys and one ssh `Host` entry each.

A node gets the view when it is prepared (role gpuctl_node, as `gpuctl_cluster_view`) and again
in every job's payload, where each relay writes it before it connects on (agent/install.py,
`write_view`: only what differs). So growing a cluster or replacing a node prepares only those
nodes, and the others learn of them from the next job, with no extra call.

Each node is named by its inventory name, its address (as in the hostfile; only the first node
with an address) and its hostname (when every node's is known, distinct, and none is another
node's name or address). Host keys are pinned (HostKeyAlias, StrictHostKeyChecking yes) when
the controller knows them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from gpuctl.provision.inventory import Inventory, is_loopback, peer_port

_HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}")


def known_hosts_text(inv: Inventory) -> str:
    """The controller's known_hosts of the cluster (clusters/<name>/known_hosts: its nodes only)."""
    path = inv.head.known_hosts
    if not path:
        return ""
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cluster_view(inv: Inventory, hostnames: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """{hosts: [{names, address, port, user, alias}], known_hosts}, or None for loopback local nodes:
    they are sshd processes of the controller's own user, whose ~/.ssh is the controller's."""
    if any(is_loopback(n.address) for n in inv.nodes):
        return None
    hostnames = hostnames or {}
    names = [n.name for n in inv.nodes]
    addresses = [n.address for n in inv.nodes]
    own = [hostnames.get(n.name, "") for n in inv.nodes]
    # Reported by the nodes themselves: one that could not stand in an ssh config drops them all.
    use_hostnames = (all(_HOSTNAME.fullmatch(h) for h in own) and len(set(own)) == len(own)
                     and not set(own) & set(names + addresses))
    known = known_hosts_text(inv)
    hosts, seen = [], set()
    for node, hostname in zip(inv.nodes, own):
        aliases = [node.name]
        if node.address not in seen and node.address != node.name:
            aliases.append(node.address)
        seen.add(node.address)
        if use_hostnames:
            aliases.append(hostname)
        hosts.append({"names": aliases, "address": node.address, "port": peer_port(node), "user": node.ssh_user,
                      "alias": node.host_key_alias if known else ""})
    return {"hosts": hosts, "known_hosts": known}
