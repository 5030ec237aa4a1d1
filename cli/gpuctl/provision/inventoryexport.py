"""`gpuctl inventory NAME --format F`: a cluster's nodes for the user's own tools.

ansible      the YAML inventory gpuctl's own playbooks use (key path, host-key
             pinning and bastion included), so `ansible -i FILE all -m ping` works as is
json         gpuctl's JSON document: the nodes (rank order) and the key and known_hosts paths
hostfile     `ADDRESS slots=GPUS` per node, head first: MPI / DeepSpeed (the same
             lines jobs get in $GPUCTL_HOSTFILE; private addresses, which ranks use)
ssh-config   OpenSSH config with `Host NAME` (head) and `Host NAME-workerN`, for `ssh -F FILE`
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpuctl.common.errors import UserError
from gpuctl.common.output import SCHEMA, node_doc
from gpuctl.provision import sshconfig
from gpuctl.provision.ansibleinventory import to_ansible
from gpuctl.provision.inventory import Inventory, hostfile_lines

FORMATS = ("ansible", "json", "hostfile", "ssh-config")


def export(inv: Inventory, fmt: str, *, ssh_config_path: Path | None = None) -> str:
    """The inventory in format `fmt` (one of FORMATS), as text ending in a newline."""
    value = (fmt or "").strip().lower()
    if value == "ansible":
        return "# gpuctl inventory of cluster '%s'\n%s" % (inv.cluster, yaml.safe_dump(to_ansible(inv), sort_keys=False))
    if value == "json":
        import json

        return json.dumps(document(inv), indent=2, sort_keys=True) + "\n"
    if value == "hostfile":
        return "".join(line + "\n" for line in hostfile_lines(inv.nodes))
    if value == "ssh-config":
        return sshconfig.render(inv, path=ssh_config_path or "ssh config")
    raise UserError(f"--format {fmt}: use one of {', '.join(FORMATS)}")


def document(inv: Inventory) -> dict[str, Any]:
    return {"schema": SCHEMA, "command": "inventory", "ok": True, "cluster": inv.cluster, "cloud": inv.cloud,
            "region": inv.region, "zone": inv.zone, "nodes": [node_doc(n) for n in inv.nodes],
            "ssh_key": inv.head.ssh_key, "known_hosts": inv.head.known_hosts}
