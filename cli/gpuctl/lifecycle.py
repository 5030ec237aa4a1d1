"""A cluster's life in the registry: bring it up, tear it down.

One path for `gpuctl apply` / `gpuctl down` and the Python API
(gpuctl.Cluster): the cluster's lock, its registry record (INIT -> UP,
STOPPING -> gone), provision.provision / provision.destroy, the ssh config
and the host keys of replaced nodes.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from gpuctl import ssh, sshconfig
from gpuctl.cluster import ClusterRequest
from gpuctl.clusterlock import cluster_lock
from gpuctl.console import Reporter
from gpuctl.inventory import Inventory
from gpuctl.paths import state_root
from gpuctl.state import Registry


def bring_up(req: ClusterRequest, *, reporter: Reporter, registry: Registry, workdir: Path | None = None,
             container_image: str | None = None) -> Inventory:
    """Provision (or reuse: Terraform changes nothing) the cluster `req` describes; its inventory."""
    from gpuctl import provision  # Terraform and the providers: only for commands that provision

    with cluster_lock(req.name, reporter.info), \
            reporter.stage(f"Provisioning {req.num_nodes} {req.cloud} node(s) for cluster '{req.name}'"):
        registry.upsert_cluster(req.name, cloud=req.cloud, region=req.region, zone=req.zone,
                                num_nodes=req.num_nodes, status="INIT", request=asdict(req))
        try:
            inv = provision.provision(req, on_progress=reporter.info)
        except BaseException:
            registry.set_cluster_status(req.name, "INIT")
            raise
        registry.upsert_cluster(req.name, cloud=req.cloud, region=inv.region, zone=inv.zone,
                                num_nodes=len(inv.nodes), status="UP",
                                request={**asdict(req), "workdir": str(workdir) if workdir else None,
                                         "container_image": container_image})
    write_ssh_config(inv)
    if inv.head.known_hosts:  # nodes Terraform replaced are new entries; their old keys go
        ssh.forget_host_keys(Path(inv.head.known_hosts), {n.host_key_alias for n in inv.nodes}, keep_only=True)
    for node in inv.nodes:
        reporter.info(f"  {node.name:<10} rank={node.rank:<3} {node.address:<16} ssh {node.ssh_user}@{node.ssh_host}:{node.ssh_port}")
    return inv


def tear_down(name: str, *, reporter: Reporter, registry: Registry) -> None:
    """terraform destroy the cluster and forget it (its jobs too)."""
    from gpuctl import provision

    with cluster_lock(name, reporter.info), reporter.stage(f"Tearing down cluster '{name}'"):
        registry.set_cluster_status(name, "STOPPING")
        provision.destroy(name)
        registry.remove_jobs(name)
        registry.remove_cluster(name)
    reporter.info(f"Cluster '{name}' is gone.")


def write_ssh_config(inv: Inventory) -> Path:
    """`$GPUCTL_STATE_DIR/ssh/<name>.conf`, plus `ssh/config` that includes every cluster's file."""
    ssh_dir = state_root() / "ssh"
    path = sshconfig.write(inv, ssh_dir / f"{inv.cluster}.conf")
    (ssh_dir / "config").write_text(f"# gpuctl: Include this file from ~/.ssh/config\nInclude {ssh_dir}/*.conf\n")
    return path
