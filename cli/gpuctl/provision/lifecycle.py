"""A cluster's life in the registry: bring it up, replace some of its nodes, tear it down.

One path for `gpuctl apply` / `gpuctl down` and the Python API
(gpuctl.Cluster): the cluster's lock, its registry record (INIT -> UP,
STOPPING -> gone), provisioner.provision / provisioner.destroy, the ssh config
and the host keys of replaced nodes. `replace_nodes` is the provisioning step of
the one replacement (jobplane/replacement.py) that managed jobs that lost nodes and
`gpuctl replace` share: the same lock, record and host keys around
provisioner.replace_nodes.

With shared state (gpuctl.state.remotestate) both also hold the cluster's lock in
the state bucket, start from the bucket's copy of the cluster (`Registry.adopt`)
and leave theirs there (`Registry.publish`), so the next runner, or this one
after a crash, carries on from it.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from gpuctl.common.errors import ClusterNotFound, UserError
from gpuctl.common.paths import cluster_dir, state_root
from gpuctl.providers import get_provider, price_quote
from gpuctl.provision.inventory import Inventory
from gpuctl.spec.request import ClusterRequest, check_cluster_name
from gpuctl.state.lock import HeldLock, cluster_lock
from gpuctl.state.registry import STOPPED, Registry

if TYPE_CHECKING:
    from gpuctl.common.console import Reporter
    from gpuctl.provision.provisioner import Doomed


@contextmanager
def _changing(name: str, command: str, reporter: Reporter, registry: Registry) -> Iterator[HeldLock]:
    """The cluster's lock: this machine's, and the state bucket's when state is shared."""
    with ExitStack() as stack:
        held = stack.enter_context(cluster_lock(name, reporter.info))
        if registry.remote is not None:
            from gpuctl.state.remotestate.store import cluster_lock as remote_lock

            stack.enter_context(remote_lock(registry.remote.store, name, command=command, on_wait=reporter.info))
            registry.adopt(name)
        yield held


def bring_up(req: ClusterRequest, *, reporter: Reporter, registry: Registry, workdir: Path | None = None,
             container_image: str | None = None, on_destroy: Callable[[Doomed], None] | None = None) -> Inventory:
    """Provision (or reuse: Terraform changes nothing) the cluster `req` describes; its inventory.

    Nodes of an existing cluster that the apply would destroy (a smaller num_nodes, a setting that
    replaces them) go to `on_destroy` first, which refuses by raising; by default they are refused.

    The registry's INIT row is written only once the request passed every check and
    the provider's preflight (provision's `on_start`): a refused request leaves the
    registry as it was, with no cluster that never existed.
    """
    from gpuctl.provision import provisioner

    shared = {"state": registry.remote.where(req.name)} if registry.remote is not None else {}
    provisioner.check_request(req)  # before the lock: a bad request waits for nothing
    known = registry.cluster(req.name)
    was_stopped = known is not None and known.status == STOPPED
    if was_stopped:
        reporter.info(f"Cluster '{req.name}' is stopped: starting its nodes again")
    started = False
    recorded: dict[str, Any] = {}  # the request as the provider prepared it: the one record every check reads

    def record_start(prepared: ClusterRequest) -> None:
        nonlocal started
        recorded.update(provisioner.request_to_dict(prepared))
        registry.upsert_cluster(req.name, cloud=req.cloud, region=prepared.region, zone=prepared.zone,
                                num_nodes=req.num_nodes, status="INIT", request={**recorded, **shared})
        started = True

    with _changing(req.name, "gpuctl apply", reporter, registry), \
            reporter.stage(f"Provisioning {req.num_nodes} {req.cloud} node(s) for cluster '{req.name}'",
                           phase="provision") as step:
        removed = get_provider(req.cloud).removed_itself(cluster_dir(req.name), finished=False)
        if removed is not None:
            reporter.info(f"Cluster '{req.name}' took itself down (autodown): clearing its state to make it again")
            provisioner.destroy(req.name)
            registry.close_segment(req.name, "autodown", at=removed)
            registry.end_jobs(req.name, "its cluster took itself down (autodown) before gpuctl saw the job end; "
                              "its outcome is unknown", status="LOST")
            registry.remove_cluster(req.name)  # its age starts again; its jobs and history stay
        try:
            inv = provisioner.provision(
                req, on_progress=reporter.info, on_start=record_start,
                on_destroy=on_destroy or provisioner.refuse_destroy,
                on_count=lambda done, total: step.update(f"{done} of {total} resource(s) made", done, total))
        except BaseException:
            if started:
                registry.publish(req.name)  # a half-made cluster: the next runner can still take it down
                registry.set_cluster_status(req.name, "INIT")
            raise
        (cluster_dir(req.name) / STOP_FILE).unlink(missing_ok=True)
        registry.publish(req.name)
        registry.upsert_cluster(req.name, cloud=req.cloud, region=inv.region, zone=inv.zone,
                                num_nodes=len(inv.nodes), status="UP",
                                request={**(recorded or provisioner.request_to_dict(req)), **shared,
                                         "workdir": str(workdir) if workdir else None,
                                         "container_image": container_image})
        _record_segment(registry, req, num_nodes=len(inv.nodes), region=inv.region)
    write_ssh_config(inv)
    _trust_host_keys(inv)
    for node in inv.nodes:
        reporter.info(f"  {node.name:<10} rank={node.rank:<3} {node.address:<16} ssh {node.ssh_user}@{node.ssh_host}:{node.ssh_port}")
    return inv


def _trust_host_keys(inv: Inventory) -> None:
    """Only the current nodes' host keys: those of nodes Terraform replaced go (a new node has a new
    id, so a new entry), and keys read where the nodes were made are pinned, so first contact is
    checked, not trusted."""
    from gpuctl.provision import ssh

    if not inv.head.known_hosts:
        return
    ssh.forget_host_keys(Path(inv.head.known_hosts), {n.host_key_alias for n in inv.nodes}, keep_only=True)
    boot = get_provider(inv.cloud).boot_host_keys(cluster_dir(inv.cluster), len(inv.nodes))
    ssh.pin_host_keys(Path(inv.head.known_hosts), {n.host_key_alias: boot[n.rank] for n in inv.nodes
                                                   if n.rank in boot})


def replace_nodes(name: str, ranks: Sequence[int], *, reporter: Reporter, registry: Registry) -> Inventory:
    """Make the nodes of these ranks again, and only them (provisioner.replace_nodes); the new inventory.

    Under the cluster's lock, as bring_up. Afterwards the cluster is UP in the registry, its ssh
    config rewritten, the old nodes' host keys forgotten and the new ones pinned where the provider
    read them at boot, and the old nodes' ControlMasters closed. Forgetting the old nodes' prepare
    records and preparing the new ones is the caller's, a layer above (jobplane/replacement.py,
    which every replacement goes through). UserError for a cluster that does not exist or a rank
    it does not have.
    """
    from gpuctl.provision import provisioner, ssh

    check_cluster_name(name)
    with _changing(name, "gpuctl replace", reporter, registry):
        before = provisioner.load_inventory_of(name) if provisioner.cluster_exists(name) else None
        if before is None:
            raise ClusterNotFound(name, why=" (or never came up)", hint="; apply it first")
        record = registry.cluster(name)
        if ranks and record is not None and record.status == STOPPED:
            raise UserError(f"cluster '{name}' is stopped; `gpuctl start {name}` brings its nodes back, then "
                            "replace what is still broken")
        if not ranks:
            return before  # nothing lost: nothing to change, the record included
        old = [n for n in before.nodes if n.rank in set(ranks)]
        title = f"Replacing {', '.join(n.name for n in old) or 'no node'} of cluster '{name}'"
        with reporter.stage(title, phase="provision") as step:
            try:
                inv = provisioner.replace_nodes(
                    name, ranks, on_progress=reporter.info,
                    on_count=lambda done, total: step.update(f"{done} of {total} resource(s) made", done, total))
            finally:
                registry.publish(name)  # what changed, even half-way: the next runner carries on from it
        registry.set_cluster_status(name, "UP")
    write_ssh_config(inv)
    _trust_host_keys(inv)
    ssh.close_masters(old, ssh.control_dir_for(cluster_dir(name) / "cm"))
    for node in (n for n in inv.nodes if n.rank in set(ranks)):
        reporter.info(f"  {node.name:<10} rank={node.rank:<3} {node.address:<16} made again ({node.node_id})")
    return inv


STOP_FILE = "stopped.json"  # in the cluster's directory while `gpuctl stop` keeps it stopped: {"stopped_at"}


def stopped_at(name: str) -> float | None:
    """When `gpuctl stop` stopped the cluster, or None (it runs, or it stopped itself: autostop)."""
    try:
        return float(json.loads((cluster_dir(name) / STOP_FILE).read_text())["stopped_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stop_cluster(name: str, *, reporter: Reporter, registry: Registry) -> float:
    """Stop every node of an UP cluster, its disks kept (provisioner.set_power); when it stopped.

    Under the cluster's lock. The registry says STOPPED only once Terraform stopped every node
    (a failed stop leaves it UP, billing as it may still be), the cost history stops counting,
    and the ssh masters to the nodes are told to exit. The caller ends the cluster's jobs first."""
    from gpuctl.provision import provisioner, ssh

    with _changing(name, "gpuctl stop", reporter, registry), \
            reporter.stage(f"Stopping cluster '{name}'", phase="provision") as step:
        try:
            provisioner.set_power(name, running=False, on_progress=reporter.info,
                                  on_count=lambda done, total: step.update(f"{done} of {total} node(s) stopped",
                                                                           done, total))
        finally:
            registry.publish(name)  # the Terraform state as far as it got
        when = time.time()
        marker = cluster_dir(name) / STOP_FILE
        marker.with_suffix(".tmp").write_text(json.dumps({"stopped_at": when}) + "\n")
        marker.with_suffix(".tmp").replace(marker)
        registry.set_cluster_status(name, STOPPED)
        registry.close_segment(name, "stop", at=when)
        registry.publish(name)
    ssh.exit_masters(cluster_dir(name) / "cm")  # their connections went with the nodes
    return when


def start_cluster(name: str, *, reporter: Reporter, registry: Registry) -> Inventory:
    """Start a stopped cluster's nodes again, the same instances and disks (provisioner.set_power);
    its inventory, with the nodes' new public addresses.

    Under the cluster's lock. The registry says UP, and the history counts again, before Terraform
    starts anything: a start that fails half-way leaves nodes that may bill, so they are counted
    (`gpuctl stop` stops them again). The ssh config is written again and the host keys stay those
    pinned before (same disks, same keys: a different one is refused at first contact). Whether the
    nodes answer ssh yet is the caller's to wait for."""
    from gpuctl.provision import provisioner

    with _changing(name, "gpuctl start", reporter, registry), \
            reporter.stage(f"Starting cluster '{name}'", phase="provision") as step:
        (cluster_dir(name) / STOP_FILE).unlink(missing_ok=True)
        registry.set_cluster_status(name, "UP")
        record = registry.cluster(name)
        if record is not None:
            _record_segment(registry, provisioner.request_from_dict(record.request), num_nodes=record.num_nodes,
                            region=record.region)
        try:
            inv = provisioner.set_power(name, running=True, on_progress=reporter.info,
                                        on_count=lambda done, total: step.update(
                                            f"{done} of {total} node(s) started", done, total))
        finally:
            registry.publish(name)
    write_ssh_config(inv)
    _trust_host_keys(inv)
    return inv


def _record_segment(registry: Registry, req: ClusterRequest, *, num_nodes: int, region: str | None) -> None:
    """The cluster runs at this size and price from now (its history, for status and cost-report)."""
    price, instance_type = price_quote(req)
    registry.open_segment(req.name, cloud=req.cloud, region=region, instance_type=instance_type,
                          num_nodes=num_nodes, use_spot=req.use_spot,
                          node_price=0.0 if price.free else price.per_node_hour(req.use_spot),
                          price_source=price.source)


def _absent(name: str) -> str:
    """What `down` says of a cluster with neither record nor directory (`gpuctl down`, the Python API)."""
    return f"Cluster '{name}' does not exist; nothing to tear down."


def tear_down(name: str, *, reporter: Reporter, registry: Registry) -> bool:
    """terraform destroy the cluster and forget it (its jobs too); whether there was anything to destroy.

    A record with no cluster directory behind it (an apply stopped before anything
    was made, or a row an older gpuctl left INIT or STOPPING) has nothing to
    destroy: it is forgotten, so no such row stays for good.
    """
    from gpuctl.provision import provisioner

    with _changing(name, "gpuctl down", reporter, registry) as held, \
            reporter.stage(f"Tearing down cluster '{name}'"):
        if not provisioner.cluster_exists(name):
            had_record = registry.cluster(name) is not None
            registry.forget(name)
            forget_local_files(name, held)
            reporter.info(f"Cluster '{name}' had nothing provisioned; its record is removed." if had_record else
                          _absent(name))
            return False
        registry.set_cluster_status(name, "STOPPING")
        remove_containers(name, reporter)
        provisioner.destroy(name)  # the cluster's directory: keys, known hosts, inventory, state
        registry.close_segment(name, "down")
        registry.forget(name)
        forget_local_files(name, held)
    reporter.info(f"Cluster '{name}' is gone.")
    return True


@dataclass(frozen=True)
class Teardown:
    """What `gpuctl down` did to one cluster."""

    cluster: str
    found: bool
    destroyed: bool
    error: str | None = None


def tear_down_all(names: list[str], *, reporter: Reporter, registry: Registry) -> list[Teardown]:
    """`gpuctl down A B ...`, each in turn. A cluster that does not exist is said and passed over, as
    `terraform destroy` with nothing to destroy: a CI step that always tears down must not fail when
    apply never made the cluster. With several, one that fails does not keep the others up."""
    from gpuctl.common.errors import ProvisionError, UserError
    from gpuctl.provision import provisioner

    done = []
    for name in names:
        registry.adopt(name)
        if registry.cluster(name) is None and not provisioner.cluster_exists(name):
            reporter.info(_absent(name))  # without tear_down's lock and stage: nothing is changed
            done.append(Teardown(name, found=False, destroyed=False))
            continue
        try:
            done.append(Teardown(name, found=True, destroyed=tear_down(name, reporter=reporter, registry=registry)))
        except (ProvisionError, UserError) as exc:
            if len(names) == 1:
                raise
            reporter.error(f"{name}: {exc.message}")
            done.append(Teardown(name, found=True, destroyed=False, error=exc.message))
    return done


def forget_local_files(name: str, held: HeldLock) -> None:
    """What gpuctl wrote for the cluster outside its directory: its ssh config (whose `Host` names
    would otherwise reach whatever machine gets its addresses next) and, last, its lock file."""
    (state_root() / "ssh" / f"{name}.conf").unlink(missing_ok=True)
    held.discard()


def remove_containers(name: str, reporter: Reporter) -> None:
    """The containers the cluster's jobs ran in (`image_id: docker:...`), by their exact names.

    They outlive the cluster where its nodes do not end with it: local nodes
    share this machine's container store, `infra: ssh` hosts stay. Cloud
    instances are destroyed, containers and all. A node that cannot be reached
    is named and the teardown goes on.
    """
    import subprocess  # only `down` of a cluster that ran containers needs it

    from gpuctl.provision import containers, provisioner, ssh

    cdir = cluster_dir(name)
    inv = provisioner.load_inventory_of(name) if (cdir / containers.CONTAINERS_MARK).exists() else None
    if inv is None:
        return
    provider = get_provider(inv.cloud)
    if not provider.containers_outlive_cluster:
        return
    command = containers.remove_containers_command([containers.container_name(name, n.name) for n in inv.nodes])
    results = ssh.run_on_all(inv.nodes, command, control_dir=ssh.control_dir_for(cdir / "cm"), timeout=120)
    if provider.local:  # the store the nodes share with this machine: also when a node no longer answers
        subprocess.run(["bash", "-c", command], stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
        return
    for node in inv.nodes:
        proc = results[node.rank]
        if proc.returncode != 0:
            why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            reporter.info(f"{node.name}: could not remove the container {containers.container_name(name, node.name)} "
                          f"({why}); remove it there by hand")


def write_ssh_config(inv: Inventory) -> Path:
    """`$GPUCTL_STATE_DIR/ssh/<name>.conf`, plus `ssh/config` that includes every cluster's file."""
    from gpuctl.provision import sshconfig

    ssh_dir = state_root() / "ssh"
    path = sshconfig.write(inv, ssh_dir / f"{inv.cluster}.conf")
    (ssh_dir / "config").write_text(f"# gpuctl: Include this file from ~/.ssh/config\nInclude {ssh_dir}/*.conf\n")
    return path
