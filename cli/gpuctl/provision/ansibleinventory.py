"""The Ansible YAML inventory of a cluster: what gpuctl's playbooks and `gpuctl inventory --format ansible` read.

Why a module of its own: it joins the nodes (inventory.py) with how the
controller reaches them over ssh (ssh.py: host-key pinning, the bastion's
ProxyCommand), so it sits above both; inventory.py stays the node model that
ssh.py builds on. Format: inventories/README.md.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml

from gpuctl.providers import get_provider
from gpuctl.provision.inventory import Inventory
from gpuctl.provision.ssh import host_key_options, proxy_command

NODE_GROUP = "gpuctl_nodes"


def to_ansible(inv: Inventory) -> dict[str, Any]:
    """The Ansible YAML inventory for `inv` (format: inventories/README.md)."""
    hosts: dict[str, dict[str, Any]] = {}
    for n in inv.nodes:
        host: dict[str, Any] = {
            "ansible_host": n.ssh_host,
            "ansible_port": n.ssh_port,
            "ansible_user": n.ssh_user,
            "gpuctl_rank": n.rank,
            "gpuctl_address": n.address,
            "gpuctl_gpus": n.gpus,
            "gpuctl_node_id": n.node_id,
        }
        if n.ssh_key:
            host["ansible_ssh_private_key_file"] = n.ssh_key
        if n.peer_ssh_port is not None:
            host["gpuctl_peer_ssh_port"] = n.peer_ssh_port
        common = [shlex.quote(a) for a in host_key_options(n)]
        host["gpuctl_host_key_alias"] = n.host_key_alias
        if n.proxy_jump:
            host["gpuctl_proxy_jump"] = n.proxy_jump
            common += ["-o", shlex.quote(f"ProxyCommand={proxy_command(n)}")]
        host["ansible_ssh_common_args"] = " ".join(common)
        hosts[n.name] = host
    cluster_vars: dict[str, Any] = {"gpuctl_cluster": inv.cluster, "gpuctl_cloud": inv.cloud}
    provider = get_provider(inv.cloud)
    if provider.local:
        # Local nodes run their own sshd config, with fan-out limits already; the
        # machine's /etc/ssh belongs to the developer.
        cluster_vars["gpuctl_sshd_limits_manage"] = False
    if python := provider.node_python():
        cluster_vars["ansible_python_interpreter"] = python
    if inv.region:
        cluster_vars["gpuctl_region"] = inv.region
    if inv.zone:
        cluster_vars["gpuctl_zone"] = inv.zone
    return {"all": {"vars": cluster_vars, "children": {NODE_GROUP: {"hosts": hosts}}}}


def write_inventory(inv: Inventory, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(to_ansible(inv), sort_keys=False))
    tmp.replace(path)
    return path
