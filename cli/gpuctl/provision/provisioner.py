"""The provision layer: a ClusterRequest in, a ranked Inventory out.

For providers that provision (`local`, `aws`): render the cluster's root module
(providers.*), `terraform init` + `apply`, read the outputs, and turn them into
`clusters/<name>/inventory.yml`, keeping every surviving node's rank.

The provider's hooks (providers/base.py) say the rest: `describe(req)` (lines
shown before apply and in the plan), `retry_zone(req, error)` (after a failed
apply: the request to try next, e.g. another AWS zone on
InsufficientInstanceCapacity, and a line to show; what the failed attempt made
is destroyed first) and `cleanup(cluster_dir)` (after destroy). For a provider
that provisions nothing (`infra: ssh/PATH`) the hand-written inventory is
checked and copied into the cluster directory.

`clusters/<name>/cluster.json` records the (prepared) request; it is written
before `terraform apply`, so a cluster whose apply failed half-way is still
known and `destroy(name)` can remove what was made.

`replace_nodes(name, ranks)` makes some nodes again (a lost node of a managed
job, `gpuctl replace`): the same provision() with `terraform apply -replace`
for the provider's node_addresses, the root as last written, every node
keeping its rank and name.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from gpuctl.common.errors import ClusterNotFound, ProvisionError, UserError
from gpuctl.common.paths import cluster_dir
from gpuctl.providers import MODULE_NAME, Provider, get_provider
from gpuctl.provision import ssh
from gpuctl.provision.ansibleinventory import write_inventory
from gpuctl.provision.inventory import Inventory, inventory_from_outputs, load_inventory
from gpuctl.provision.sshkeys import KEY_NAME, ensure_cluster_key, ensure_internal_key
from gpuctl.provision.terraform import PlanSummary, TerraformRoot
from gpuctl.spec.request import ClusterRequest, check_cluster_name
from gpuctl.state import remotestate

Progress = Callable[[str], None]

REQUEST_FILE = "cluster.json"
INVENTORY_FILE = "inventory.yml"


def _quiet(message: str) -> None:
    return None


def _no_start(req: ClusterRequest) -> None:
    return None


# -- where things are ----------------------------------------------------------


def inventory_path(name: str) -> Path:
    return cluster_dir(name) / INVENTORY_FILE


def cluster_exists(name: str) -> bool:
    """Whether gpuctl has a directory for `name` (possibly a half-made cluster)."""
    return cluster_dir(name).is_dir()


def load_inventory_of(name: str) -> Inventory | None:
    """The cluster's inventory, or None when it has none (yet)."""
    path = inventory_path(name)
    if not path.is_file():
        return None
    return load_inventory(path, cluster=name)


def load_cluster(name: str) -> tuple[dict[str, Any], Inventory]:
    """(request as recorded in cluster.json, inventory) of an existing cluster."""
    check_cluster_name(name)
    cdir = cluster_dir(name)
    request = _read_request(cdir)
    inv = load_inventory_of(name)
    if request is None or inv is None:
        raise ClusterNotFound(name, why=" (or never came up)")
    return request, inv


def request_to_dict(req: ClusterRequest) -> dict[str, Any]:
    data = asdict(req)
    data["inventory_path"] = str(req.inventory_path) if req.inventory_path else None
    return data


def request_from_dict(data: dict[str, Any]) -> ClusterRequest:
    known = {f.name for f in fields(ClusterRequest)}
    values = {k: v for k, v in data.items() if k in known}
    if values.get("inventory_path"):
        values["inventory_path"] = Path(values["inventory_path"])
    return ClusterRequest(**values)


def _read_request(cdir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((cdir / REQUEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_request(cdir: Path, req: ClusterRequest) -> None:
    cdir.mkdir(parents=True, exist_ok=True)
    tmp = cdir / (REQUEST_FILE + ".tmp")
    tmp.write_text(json.dumps(request_to_dict(req), indent=2, sort_keys=True) + "\n")
    tmp.replace(cdir / REQUEST_FILE)


def _check_same_cloud(cdir: Path, req: ClusterRequest) -> None:
    old = _read_request(cdir)
    if old and old.get("cloud") != req.cloud:
        raise UserError(f"cluster '{req.name}' already exists on {old.get('cloud')}; tear it down first "
                        f"(gpuctl down {req.name}) or pick another name with -c")


# -- provision -----------------------------------------------------------------


def check_request(req: ClusterRequest) -> None:
    """Every refusal of `req` that needs no cloud call and changes nothing: the name, the
    cloud of an existing cluster of that name, the provider's own checks (node count...),
    and for a provider that provisions nothing (infra ssh) the inventory. `gpuctl validate` runs it; so does apply, first."""
    check_cluster_name(req.name)
    _check_same_cloud(cluster_dir(req.name), req)
    provider = get_provider(req.cloud)
    provider.check(req)
    if not provider.provisions:
        _checked_ssh_inventory(req)


def _cluster_and_provider(req: ClusterRequest) -> tuple[Path, Provider]:
    """The cluster's directory and provider, once the name and the cloud are known to fit (a provider
    that provisions nothing is checked here: it has no preflight to do it)."""
    check_cluster_name(req.name)
    cdir = cluster_dir(req.name)
    _check_same_cloud(cdir, req)
    provider = get_provider(req.cloud)
    if not provider.provisions:
        provider.check(req)
    return cdir, provider


class DoomedNode(NamedTuple):
    """A node an apply would destroy: its rank and name (`node 5` where the inventory does not know it)."""

    rank: int
    name: str


@dataclass(frozen=True)
class Doomed:
    """Nodes of an existing cluster that an apply would destroy, known before anything changes:
    those a smaller num_nodes drops, and those a changed setting makes Terraform replace."""

    cluster: str
    have: int  # nodes the cluster has
    want: int  # nodes the request asks for
    removed: tuple[DoomedNode, ...]  # dropped by the smaller count
    replaced: tuple[DoomedNode, ...]  # made again (their disks and whatever ran there lost)

    @property
    def nodes(self) -> tuple[DoomedNode, ...]:
        return self.removed + self.replaced

    def describe(self) -> str:
        """`this apply would remove worker2 of cluster 'x' (num_nodes 2; it has 3)`, and what it replaces."""
        parts = []
        if self.removed:
            parts.append(f"remove {_names(self.removed)} of cluster '{self.cluster}', which has {self.have} "
                         f"node(s) where the task asks for {self.want}")
        if self.replaced:
            parts.append(f"replace {_names(self.replaced)} of cluster '{self.cluster}' (a changed setting that "
                         "cannot change in place: their disks and what runs there are lost)")
        return f"this apply would {' and '.join(parts)}"

    def refusal(self) -> str:
        """The line that refuses it, saying how to go on."""
        keep = f"keep them with --num-nodes {self.have}, " if self.removed and not self.replaced else ""
        return (f"{self.describe()}; {keep}agree with -y, or give the task another cluster name (-c NAME); "
                "nothing was changed")


def _names(nodes: Sequence[DoomedNode]) -> str:
    """Every node, in one line (a refusal names all it spares)."""
    return ", ".join(f"{n.name} (rank {n.rank})" for n in nodes)


def refuse_destroy(doomed: Doomed) -> None:
    """provision's default: an apply never destroys nodes unasked."""
    raise UserError(doomed.refusal())


def provision(req: ClusterRequest, *, on_progress: Progress = _quiet,
              on_start: Callable[[ClusterRequest], None] = _no_start,
              on_count: Callable[[int, int], None] | None = None,
              replace_ranks: Sequence[int] = (),
              on_destroy: Callable[[Doomed], None] = refuse_destroy) -> Inventory:
    """Create or update the cluster so it matches `req`; return its inventory.

    Re-applying the same request changes nothing; a changed num_nodes adds or
    removes nodes (ranks of the nodes that stay are kept). `on_start` is called
    with the prepared request once every check and the provider's preflight
    passed, just before the first change to the cluster: a refusal before it
    left nothing to record.

    `replace_ranks` (an existing cluster's; replace_nodes checks them): make
    those nodes again and change nothing else. The root is applied as it was
    last written, not rendered anew: settings changed since (an ingress CIDR,
    a moved endpoint) are `gpuctl apply`'s to bring, not a side effect of
    replacing one node; and a failed replacement never moves to another zone.

    An existing cluster is planned first (`terraform plan -out`): nodes the plan would destroy (a
    smaller num_nodes, a setting that forces a replacement) go to `on_destroy` before anything is
    written or changed, and it refuses by raising (the default: UserError); then exactly that plan
    is applied, or nothing when it changes nothing.
    """
    cdir, provider = _cluster_and_provider(req)
    if not provider.provisions:
        return _adopt_existing_hosts(req, cdir, on_progress, on_start)

    remote = remotestate.current()
    root = _root(cdir / "terraform", provider)
    if remote is not None and root.root_file.is_file():
        root.init()  # the providers' prepare reads the state (AWS: the zone nodes are in)
        root.snapshot_state()
    addresses: list[str] = []
    if replace_ranks:
        addresses = _replacement_addresses(provider, root, req, cdir, replace_ranks)
        key_path, public_key = ensure_cluster_key(cdir)
    plan_file: Path | None = None
    planned = False  # an existing cluster's apply: planned first, then that plan applied (or none)
    powers = False  # the plan starts nodes (stopped by autostop or `gpuctl stop`): addresses read again after
    if not replace_ranks:
        req = provider.prepare(req)
        created = not cdir.exists()
        previous_root = root.root_file.read_text() if root.root_file.is_file() else None
        try:
            cdir.mkdir(parents=True, exist_ok=True)
            key_path, public_key = ensure_cluster_key(cdir)
            root.write(root_config(provider, req, cdir, public_key, remote))
            if root.has_state():
                _init(root, on_progress)
                plan_file, powers = _checked_plan(provider, root, req, on_destroy)
                planned = True
        except BaseException:
            if created:  # nothing was provisioned: leave no half-made cluster behind
                shutil.rmtree(cdir, ignore_errors=True)
            elif previous_root is not None:  # refused or failed before any change: the root as it was
                root.root_file.write_text(previous_root)
            raise
        on_start(req)
        _write_request(cdir, req)
    if not planned:
        _init(root, on_progress)
    for line in [] if addresses else provider.describe(req):
        on_progress(line)
    while True:
        on_progress(f"terraform apply: replacing {', '.join(addresses)}" if addresses else
                    f"terraform apply: {req.num_nodes} {provider.name} node(s)")
        try:
            if planned and plan_file is None:
                changed = False  # planned, and nothing to change: no apply at all
            else:  # on_count(done, total): resources made so far
                changed = root.apply(on_count, replace=addresses, plan_file=plan_file)
            break
        except ProvisionError as exc:
            if addresses:
                raise  # the other nodes stay where they are: no other zone, and never a destroy
            # The provider's hook (AWS): on a capacity shortage, the same
            # request in the next zone, and a line saying so.
            nxt, line = provider.retry_zone(req, exc)
            if line:
                on_progress(line)
            if nxt is None:
                raise
            # What the failed attempt made (a subnet, some nodes): the retry starts clean. That apply read
            # or made every object in the state moments ago, so none is read back first.
            root.destroy(refresh=False)
            plan_file, planned, powers = None, False, False
            req = nxt
            root.write(root_config(provider, req, cdir, public_key, remote))
            _write_request(cdir, req)
    on_progress("terraform apply: done" if changed else "terraform apply: no changes, reusing the existing nodes")
    if powers:  # the apply's outputs were read while the nodes were stopped: no public address, or the old one
        on_progress("terraform apply -refresh-only: the started nodes' addresses as they are now")
        root.refresh()
    inv = _inventory_from_outputs(root, req, cdir, key_path)
    on_progress(f"inventory: {cdir / INVENTORY_FILE}")
    return inv


def _root(workdir: Path, provider: Provider | None) -> TerraformRoot:
    """A root whose terraform commands get the provider's environment (an emulator's endpoints)."""
    return TerraformRoot(workdir, env=provider.terraform_env() if provider is not None else None)


def _init(root: TerraformRoot, on_progress: Progress) -> None:
    """`terraform init`, unless it already ran on the root as it is (shared state inits it first to read it)."""
    if not root.initialised:
        on_progress(f"terraform init ({root.workdir})")
        root.init()


def _inventory_from_outputs(root: TerraformRoot, req: ClusterRequest, cdir: Path, key_path: Path) -> Inventory:
    """The root's outputs as the cluster's inventory, written; every node that was there keeps its rank."""
    outputs = root.outputs()
    inv_path = cdir / INVENTORY_FILE
    previous = None
    if inv_path.is_file():
        try:
            previous = load_inventory(inv_path, cluster=req.name)
        except UserError:
            previous = None  # unreadable: ranks fall back to module order
    try:
        inv = inventory_from_outputs(
            outputs, cluster=req.name, cloud=req.cloud, ssh_key=str(key_path),
            gpus_per_node=req.gpus_per_node, region=req.region, zone=req.zone, previous=previous,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ProvisionError(f"terraform outputs of cluster '{req.name}' break the module contract: {exc}") from None
    write_inventory(inv, inv_path)
    return inv


def set_power(name: str, *, running: bool, on_progress: Progress = _quiet,
              on_count: Callable[[int, int], None] | None = None) -> Inventory:
    """Stop every node of the cluster, its disks kept (`gpuctl stop`), or start the same nodes again
    (`gpuctl start`); the inventory.

    The root is applied as it was last written (as replace_nodes does) with the provider's
    power_inputs, so the Terraform state says what the nodes are. Once started, the state is
    refreshed (a node's public address is new after a stop) and the inventory written from it, each
    node at its rank; stopped, the inventory stays as it was. UserError for a stop of nodes gpuctl
    cannot stop and keep (provider.stop_problem), and for a cluster that never came up. The caller
    holds the cluster's lock (lifecycle.stop_cluster / start_cluster)."""
    check_cluster_name(name)
    cdir = cluster_dir(name)
    request = _read_request(cdir)
    before = load_inventory_of(name) if request is not None else None
    if request is None or before is None:
        raise ClusterNotFound(name, why=" (or never came up)")
    provider = get_provider(str(request.get("cloud")))
    problem = None if running else provider.stop_problem(request)
    if problem:
        raise UserError(f"cluster '{name}': {problem}")
    root = _root(cdir / "terraform", provider)
    if not root.root_file.is_file():
        raise ClusterNotFound(name, why=" (it has no Terraform root: it never came up)")
    _refresh_module_source(root, provider, request, cdir)
    config = root.read()
    config["module"][MODULE_NAME].update(provider.power_inputs(running))
    root.write(config)
    on_progress(f"terraform init ({root.workdir})")
    root.init()
    on_progress(f"terraform apply: {'starting' if running else 'stopping'} {len(before.nodes)} node(s)")
    root.apply(on_count)
    if not running:
        return before
    return refresh_inventory(name, on_progress=on_progress)


def refresh_inventory(name: str, *, on_progress: Progress = _quiet) -> Inventory:
    """Read the cluster's resources again (`terraform apply -refresh-only`, nothing changed) and write
    its inventory from them: after nodes started, whose public addresses changed while stopped."""
    cdir = cluster_dir(name)
    request = _read_request(cdir)
    if request is None:
        raise ClusterNotFound(name, why=" (or never came up)")
    root = _root(cdir / "terraform", get_provider(str(request.get("cloud"))))
    on_progress("terraform apply -refresh-only: the nodes' addresses as they are now")
    root.refresh()
    req = request_from_dict(request)
    inv = _inventory_from_outputs(root, req, cdir, ensure_cluster_key(cdir)[0])
    on_progress(f"inventory: {cdir / INVENTORY_FILE}")
    return inv


def _checked_plan(provider: Provider, root: TerraformRoot, req: ClusterRequest,
                  on_destroy: Callable[[Doomed], None]) -> tuple[Path | None, bool]:
    """Plan an existing cluster's apply into a file; hand the nodes it would destroy to on_destroy
    first. The plan file, or None when the plan changes nothing; and whether it changes the nodes'
    power state (provider.power_resource): nodes that autostop or `gpuctl stop` stopped start."""
    plan_file = root.workdir / "gpuctl.tfplan"
    changes = root.plan_to(plan_file)
    if not changes:
        return None, False
    powered = f".{provider.power_resource}[" if provider.power_resource else None
    powers = powered is not None and any(c.action == "update" and powered in c.address for c in changes)
    index = {a: i for i, a in enumerate(provider.node_addresses(range(MAX_NODE_INDEX)))} \
        if provider.node_resource else {}
    # Only nodes that came up are anyone's: an apply that never finished left no inventory, and a node
    # whose create failed or was cut short (tainted) is made again as the repair it needs
    inv = load_inventory_of(req.name)
    doomed = {index[c.address]: c for c in changes
              if c.destroys and c.address in index and c.reason != "tainted"} if inv is not None else {}
    if doomed:
        order = _state_node_ids(root)
        by_id = {n.node_id: n for n in inv.nodes}

        def node_at(i: int) -> DoomedNode:  # one the inventory does not know is doomed all the same
            node = by_id.get(order[i]) if i < len(order) else None
            return DoomedNode(node.rank, node.name) if node is not None else DoomedNode(i, f"node {i}")

        have = len(inv.nodes)
        removed = tuple(node_at(i) for i, c in sorted(doomed.items()) if c.action == "delete")
        replaced = tuple(node_at(i) for i, c in sorted(doomed.items()) if c.action == "replace")
        try:
            on_destroy(Doomed(req.name, have, req.num_nodes, removed, replaced))
        except BaseException:
            plan_file.unlink(missing_ok=True)
            raise
    return plan_file, powers


MAX_NODE_INDEX = 1024  # more nodes than any provider makes in one cluster


def replace_nodes(name: str, ranks: Sequence[int], *, on_progress: Progress = _quiet,
                  on_count: Callable[[int, int], None] | None = None) -> Inventory:
    """Make the nodes of these ranks again (their old machines destroyed first), nothing else;
    the new inventory, where each keeps its rank and name and gets a new node id.

    For a node that is lost (lost_nodes) or broken; the caller takes the cluster's lock
    (lifecycle.replace_nodes). UserError for a cluster that does not exist, an unknown rank or
    nodes gpuctl did not make.
    """
    check_cluster_name(name)
    cdir = cluster_dir(name)
    request = _read_request(cdir)
    before = load_inventory_of(name) if request is not None else None
    if request is None or before is None:
        raise ClusterNotFound(name, why=" (or never came up)", hint="; apply it first")
    wanted = sorted(set(ranks))
    unknown = [r for r in wanted if r not in {n.rank for n in before.nodes}]
    if unknown:
        names = ", ".join(f"{n.name} ({n.rank})" for n in before.nodes[:6]) + (", ..." if len(before.nodes) > 6 else "")
        raise UserError(f"cluster '{name}' has no node of rank {unknown[0]!r}; its nodes are {names}: "
                        "name one of them")
    if not wanted:
        return before
    get_provider(str(request.get("cloud"))).node_addresses(wanted)  # UserError: nodes gpuctl did not make
    inv = provision(request_from_dict(request), on_progress=on_progress, on_count=on_count, replace_ranks=wanted)
    old_ids = {n.rank: n.node_id for n in before.nodes}
    kept = [n.name for n in inv.nodes if n.rank in wanted and n.node_id == old_ids.get(n.rank)]
    if kept:
        raise ProvisionError(f"terraform apply did not make {', '.join(kept)} of cluster '{name}' again "
                             f"(its logs: {cdir / 'terraform' / 'logs' / 'apply.log'})")
    return inv


def _replacement_addresses(provider: Provider, root: TerraformRoot, req: ClusterRequest, cdir: Path,
                           ranks: Sequence[int]) -> list[str]:
    """The provider's node addresses of these ranks in the cluster's root as it is. A rank is the
    node's index in the module's count (inventory_from_outputs keeps them so); the state's `nodes`
    output, in count order, is asked first in case an inventory was ever written otherwise."""
    if not root.root_file.is_file():
        raise ClusterNotFound(req.name, why=" (it has no Terraform root: it never came up)")
    _refresh_module_source(root, provider, request_to_dict(req), cdir)
    inv = load_inventory_of(req.name)
    ids = {n.rank: n.node_id for n in inv.nodes} if inv is not None else {}
    order = _state_node_ids(root)
    return provider.node_addresses([order.index(ids[r]) if ids.get(r) in order else r for r in ranks])


def _state_node_ids(root: TerraformRoot) -> list[str]:
    """The node ids of the `nodes` output in the root's last state (module order); [] if unreadable."""
    try:
        nodes = json.loads(root.state_file().read_text())["outputs"]["nodes"]["value"]
        return [str(n["id"]) for n in nodes]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def root_config(provider: Provider, req: ClusterRequest, cdir: Path, public_key: str,
                remote: remotestate.Remote | None) -> dict[str, Any]:
    """The cluster's Terraform root: the provider's rendering, with the S3 backend when state is shared."""
    internal = ensure_internal_key(cdir)[1] if provider.authorizes_internal_key_at_boot else ""
    return remotestate.with_backend(provider.root_config(req, cluster_dir=cdir, ssh_public_key=public_key,
                                                         internal_public_key=internal), req.name, remote)


def _adopt_existing_hosts(req: ClusterRequest, cdir: Path, on_progress: Progress,
                          on_start: Callable[[ClusterRequest], None]) -> Inventory:
    inv = _checked_ssh_inventory(req)
    on_start(req)
    cdir.mkdir(parents=True, exist_ok=True)
    _write_request(cdir, req)
    path = write_inventory(inv, cdir / INVENTORY_FILE)
    on_progress(f"infra {req.cloud}: using {len(inv.nodes)} existing host(s); inventory: {path}")
    return inv


def _checked_ssh_inventory(req: ClusterRequest) -> Inventory:
    """The hand-written inventory of a provider that provisions nothing (its check() made
    sure there is a path), its hosts counted against num_nodes."""
    assert req.inventory_path is not None
    inv = load_inventory(Path(req.inventory_path), cluster=req.name)
    if len(inv.nodes) < req.num_nodes:
        raise UserError(f"{req.inventory_path}: lists {len(inv.nodes)} host(s) but num_nodes is {req.num_nodes}; "
                        "add hosts or lower num_nodes")
    nodes = tuple(replace(n, gpus=n.gpus or req.gpus_per_node) for n in inv.nodes)
    return replace(inv, cloud=req.cloud, nodes=nodes)


# -- plan (--dry-run) ----------------------------------------------------------


def plan(req: ClusterRequest) -> PlanSummary:
    """What provision(req) would change, creating nothing.

    Planned in a scratch directory: for an existing cluster with a copy of its
    state (so the plan is a diff against it), for a new one from scratch; the
    cluster directory is never created or modified.
    """
    cdir, provider = _cluster_and_provider(req)
    if not provider.provisions:
        inv = _checked_ssh_inventory(req)
        return PlanSummary(0, 0, 0, text=f"infra {req.cloud}: would use {len(inv.nodes)} existing host(s) from "
                                          f"{req.inventory_path}; nothing to create.")
    req = provider.prepare(req)
    existing = _read_request(cdir) is not None
    with tempfile.TemporaryDirectory(prefix=f"gpuctl-plan-{req.name}-") as tmp:
        scratch = Path(tmp)
        root = _root(scratch / "terraform", provider)
        pub_file = cdir / "ssh" / f"{KEY_NAME}.pub"
        if existing and pub_file.is_file():
            public_key = pub_file.read_text().strip()
        else:
            _, public_key = ensure_cluster_key(scratch)
        # An existing cluster keeps its recorded choices (subnet, ports...), so
        # its root renders exactly as provision() would render it.
        root.write(root_config(provider, req, cdir if existing else scratch, public_key, remotestate.current()))
        state = cdir / "terraform" / "terraform.tfstate"
        if existing and state.is_file():
            shutil.copy2(state, root.workdir / "terraform.tfstate")
        root.init()
        summary = root.plan()
    lines = provider.describe(req)  # what the plan means (AWS: fabric, placement, reach)
    if not lines:
        return summary
    return replace(summary, text="\n".join([*lines, summary.text]))


def state_drift(name: str) -> str:
    """One line comparing the cluster with its Terraform state (a refreshing plan).

    Nothing is changed; on AWS the refresh notices instances terminated behind
    Terraform's back, which `apply` would then replace.
    """
    cdir = cluster_dir(name)
    request = _read_request(cdir) or {}
    cloud = request.get("cloud")
    provider = get_provider(cloud) if cloud else None
    if provider is not None and not provider.provisions:
        return f"hand-written inventory (infra {cloud}): no Terraform state"
    root = _root(cdir / "terraform", provider)
    if not root.root_file.is_file():
        return "no Terraform root: the cluster never came up; `gpuctl down` removes what is left"
    try:
        summary = root.plan()
    except ProvisionError as exc:
        return f"could not plan: {exc.message}"
    if not summary.changed:
        return "in sync with Terraform state"
    return (f"drifted from Terraform state: apply would add {summary.add}, change {summary.change}, "
            f"destroy {summary.destroy}; re-run `gpuctl apply` to repair")


# -- destroy -------------------------------------------------------------------


def destroy(name: str, *, on_progress: Progress = _quiet) -> None:
    """`terraform destroy` the cluster, then forget it (remove clusters/<name>/).

    Safe to run again after a failure: the directory (state included) is only
    removed once everything is gone.
    """
    check_cluster_name(name)
    cdir = cluster_dir(name)
    if not cdir.is_dir():
        raise ClusterNotFound(name)
    request = _read_request(cdir) or {}
    cloud = request.get("cloud") or ("local" if (cdir / "local.json").exists() else None)
    provider = get_provider(cloud) if cloud else None
    root = _root(cdir / "terraform", provider)
    if root.root_file.is_file():
        if provider is not None and provider.provisions and request:
            _refresh_module_source(root, provider, request, cdir)
        on_progress(f"terraform destroy ({root.workdir})")
        root.init()
        root.destroy()
    if provider is not None:
        provider.cleanup(cdir)
    _refuse_mounts_under(cdir)
    shutil.rmtree(cdir)
    ssh.remove_control_dir(cdir / "cm")  # the ssh sockets' directory, when it lies outside cdir
    on_progress(f"removed {cdir}")


def _refresh_module_source(root: TerraformRoot, provider: Provider, request: dict[str, Any], cdir: Path) -> None:
    """If gpuctl moved since the cluster was made (reinstall, new checkout), point
    the root at the module's current location so `terraform init` finds it."""
    try:
        source = Path(root.read()["module"][MODULE_NAME]["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    if source.is_dir():
        return
    req = request_from_dict(request)
    pub = (cdir / "ssh" / f"{KEY_NAME}.pub").read_text().strip()
    root.write(root_config(provider, req, cdir, pub, remotestate.current()))


def _refuse_mounts_under(cdir: Path) -> None:
    """Never rm -rf through a mount point (a node home bound over a real directory)."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return
    prefix = str(cdir.resolve())
    for line in mountinfo.splitlines():
        parts = line.split()
        if len(parts) > 4:
            point = parts[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                raise ProvisionError(f"{point} is still mounted; unmount it (umount -R {point}) and run down again")
