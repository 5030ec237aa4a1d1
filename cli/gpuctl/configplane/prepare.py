"""Prepare: the one playbook between provisioning and jobs, and which nodes need it.

The prepared state of a node is what the prepare play leaves there in one module run (role
gpuctl_node, node/install.py): the bundle of gpuctl/node/ (bundle.py: the agent, its probes), the
cluster's internal key, sshd limits, the fabric env its own probe wrote (node/fabricprobe.py, in
the bundle, so a changed probe is a changed fingerprint). Its fingerprint, a hash of everything that shapes that state, is written last on
the node and kept on the controller per node (`prepared.json`, {node: fingerprint}). A job carries
the fingerprint it expects; each node compares it with its own record before running anything
(the check costs no extra call), and the controller prepares exactly the nodes whose record
differs: new and replaced nodes, or all of them after a new agent, a rotated key or a changed
fabric env. What a node knows of the others (host keys, Host entries) is not part of it: that
view travels with every job (clusterview.py), so a node added or replaced leaves the others as
they were.

Optional node features (`FEATURES`: rclone, fuse for cloud-bucket
file_mounts) are prepared only once a job needs them: the controller keeps
the set prepared so far in `clusters/<name>/features`, a job needing more
grows it, and the set is part of the fingerprint, so the first job with
buckets prepares again (role gpuctl_storage) and later jobs without them do not.

The Python API's venv (role gpuctl_python) works the same way: its Python
version and packages (`clusters/<name>/python.json`, grown by each
gpuctl.Cluster that broadcasts there) and gpuctl's runtime files are part of
the fingerprint once a function was broadcast to nodes that do not run the
controller's own Python.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from gpuctl.common.errors import UserError
from gpuctl.common.paths import ansible_dir
from gpuctl.configplane import bundle
from gpuctl.provision.inventory import Inventory, Node

if TYPE_CHECKING:
    from gpuctl.configplane import playbooks

# The parts of the Ansible tree that shape a prepared node.
_PREPARE_TREE = ("playbooks/prepare.yml", "plugins/modules", "roles/gpuctl_node", "roles/gpuctl_sshd_limits",
                 "roles/gpuctl_storage",
                 "roles/gpuctl_python")
RECORD_FILE = "prepared.json"  # {node key: fingerprint}, on the controller
INSTALL_TASK = "Install the node's prepared state (agent, node-to-node SSH, fabric env, fingerprint)"
FEATURES = ("rclone", "fuse")  # what gpuctl_storage installs (AWS) or checks (elsewhere)


def agent_files() -> dict[str, dict[str, str]]:
    """What the install step puts under ~/.gpuctl (the node bundle), read once for every node."""
    return bundle.packed_files()


def install_bundle(*, fingerprint_value: str, internal_public_key: str, view: Mapping[str, Any],
                   fabric_env: Mapping[str, Any], fabric_head: str) -> dict[str, Any]:
    """The bundle role gpuctl_node gives each node (gpuctl_node_bundle), without the private key:
    what the head hands the workers it installs (jobplane/headinstall.py)."""
    return {"files": agent_files(),
            "ssh": {"public_key": internal_public_key.strip(), "view": dict(view)},
            "fabric": {"head": fabric_head, "instance_type": str(fabric_env.get("instance_type") or ""),
                       "fallback_env": dict(fabric_env.get("fallback_env") or {})},
            "fingerprint": fingerprint_value}


def install_bootstrap() -> str:
    """How the install module starts the install step on a node (its BOOTSTRAP constant), read from
    the module's file: the module imports ansible, which neither tests nor benchmarks need."""
    text = (ansible_dir() / "plugins" / "modules" / "gpuctl_node_install.py").read_text()
    start = text.index("BOOTSTRAP = (")
    namespace: dict[str, Any] = {}
    exec(text[start:text.index("\n)\n", start) + 3], namespace)  # noqa: S102 - the repository's own constant
    return str(namespace["BOOTSTRAP"])


def _tree_bytes() -> list[tuple[str, bytes]]:
    root = ansible_dir()
    out: list[tuple[str, bytes]] = [(rel, data) for rel, (data, _) in sorted(bundle.files().items())]
    for rel in _PREPARE_TREE:
        path = root / rel
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        # roles/gpuctl_node/files holds the bundle only in a built collection: counted above
        out += [(str(f.relative_to(root)), f.read_bytes()) for f in files
                if "__pycache__" not in f.parts and not f.is_relative_to(root / "roles/gpuctl_node/files")]
    return out


def fingerprint(*, internal_public_key: str, fabric_env: Mapping[str, Any], features: Sequence[str] = (),
                python: Mapping[str, Any] | None = None) -> str:
    """sha256 of the agent, the prepare roles (the fabric probe with them), the cluster's internal key,
    the fabric settings and its features: the same for every node. `fabric_env`: what prepare passes
    the probe (fabricrecord.probe_settings: the instance type and the static fallback env)."""
    h = hashlib.sha256()
    for name, data in _tree_bytes():
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    shape: dict[str, Any] = {
        "internal_key": internal_public_key.strip(),
        "fabric": dict(sorted(fabric_env.items())),
    }
    if features:  # absent when none: the fingerprint of a cluster without features stays what it was
        shape["features"] = sorted(set(features))
    if python:  # the Python API's venv (role gpuctl_python) and the runtime it imports
        shape["python"] = {"version": python["version"], "packages": sorted(set(python["packages"]))}
        for name, path in python_runtime_files():
            h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    h.update(json.dumps(shape, sort_keys=True).encode())
    return h.hexdigest()


def node_key(node: Node) -> str:
    """What a node's record is kept under: its id (a replaced node has a new one), or for hand-written
    inventories without ids, where it is reached."""
    return node.node_id if node.node_id and node.node_id != node.name else \
        f"{node.ssh_user}@{node.ssh_host}:{node.ssh_port}"


def recorded(cluster_dir: Path) -> dict[str, str]:
    """{node key: the fingerprint this controller last prepared it with}."""
    try:
        data = json.loads((cluster_dir / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def has_old_record(cluster_dir: Path) -> bool:
    """Whether the cluster was prepared by an earlier gpuctl, which kept one record for all nodes."""
    return (cluster_dir / "prepared").is_file()


def unprepared(cluster_dir: Path, inv: Inventory, value: str) -> list[Node]:
    """The nodes of `inv` not recorded as prepared with fingerprint `value`."""
    done = recorded(cluster_dir)
    return [n for n in inv.nodes if done.get(node_key(n)) != value]


def record(cluster_dir: Path, inv: Inventory, nodes: Sequence[Node], value: str) -> None:
    """`nodes` are prepared with `value`; nodes no longer in `inv` are forgotten."""
    keys = {node_key(n) for n in inv.nodes}
    done = {k: v for k, v in recorded(cluster_dir).items() if k in keys}
    done.update({node_key(n): value for n in nodes})
    _write_records(cluster_dir, done)


def forget(cluster_dir: Path, nodes: Sequence[Node] | None = None) -> None:
    """Prepare `nodes` again before the next job (None: every node)."""
    (cluster_dir / "prepared").unlink(missing_ok=True)  # the one record earlier gpuctl versions kept
    if nodes is None:
        (cluster_dir / RECORD_FILE).unlink(missing_ok=True)
        return
    gone = {node_key(n) for n in nodes}
    before = recorded(cluster_dir)
    if gone & set(before):
        _write_records(cluster_dir, {k: v for k, v in before.items() if k not in gone})


def _write_records(cluster_dir: Path, records: Mapping[str, str]) -> None:
    (cluster_dir / "prepared").unlink(missing_ok=True)
    tmp = cluster_dir / (RECORD_FILE + ".tmp")
    tmp.write_text(json.dumps(dict(sorted(records.items())), indent=1) + "\n")
    os.replace(tmp, cluster_dir / RECORD_FILE)


def features(cluster_dir: Path, needed: Sequence[str] = ()) -> tuple[str, ...]:
    """The features to prepare: those prepared before (clusters/<name>/features) and `needed`."""
    try:
        before = (cluster_dir / "features").read_text().split()
    except FileNotFoundError:
        before = []
    unknown = sorted(set(needed) - set(FEATURES))
    if unknown:
        raise ValueError(f"unknown node feature {unknown[0]}; known: {', '.join(FEATURES)}")
    return tuple(f for f in FEATURES if f in before or f in needed)


def record_features(cluster_dir: Path, values: Sequence[str]) -> None:
    (cluster_dir / "features").write_text("".join(f + "\n" for f in values))


PYTHON_ENV_FILE = "python.json"


def python_env(cluster_dir: Path) -> dict[str, Any] | None:
    """What the nodes' venv for the Python API must hold ({version, packages}), or None:
    `clusters/<name>/python.json`, written once a function was broadcast to a cluster
    whose nodes do not run the controller's own Python."""
    try:
        data = json.loads((cluster_dir / PYTHON_ENV_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("version"), str):
        return None
    return {"version": data["version"], "packages": sorted({str(p) for p in data.get("packages") or []})}


def want_python_env(cluster_dir: Path, version: str, packages: Sequence[str]) -> dict[str, Any] | None:
    """Grow the record by `packages` (a venv only gains packages; another Python version starts
    afresh); the record as it was before, to put back if preparing with the new one fails."""
    before = python_env(cluster_dir)
    keep = before["packages"] if before and before["version"] == version else []
    want = {"version": version, "packages": sorted(set(keep) | set(packages))}
    if want != before:
        set_python_env(cluster_dir, want)
    return before


def set_python_env(cluster_dir: Path, value: Mapping[str, Any] | None) -> None:
    path = cluster_dir / PYTHON_ENV_FILE
    if value is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(json.dumps(dict(value), sort_keys=True) + "\n")


def python_runtime_files() -> list[tuple[str, Path]]:
    """gpuctl's runtime as the nodes' venv imports it: gpuctl/__init__.py and gpuctl/api/*.py."""
    package = Path(__file__).resolve().parent.parent
    files = [("__init__.py", package / "__init__.py")]
    files += [(f"api/{p.name}", p) for p in sorted((package / "api").glob("*.py"))]
    return files


WAIT_TIMEOUT_ENV = "GPUCTL_WAIT_TIMEOUT"


def wait_timeout() -> int:
    """Seconds prepare waits for a node to accept SSH (GPUCTL_WAIT_TIMEOUT, default 600)."""
    raw = os.environ.get(WAIT_TIMEOUT_ENV, "").strip() or "600"
    if not raw.isdigit() or int(raw) < 1:
        raise UserError(f"{WAIT_TIMEOUT_ENV}={raw!r}: give a number of seconds, such as 600")
    return int(raw)


def skipped_roles(*, wait: bool, manages_sshd: bool, features: Sequence[str],
                  python: Mapping[str, Any] | None) -> list[str]:
    """The tags of the prepare play's optional roles that do not apply (run_prepare skips them)."""
    return [tag for tag, applies in (("gpuctl_wait", wait), ("gpuctl_sshd_limits", manages_sshd),
                                     ("gpuctl_storage", bool(features)), ("gpuctl_python", bool(python)))
            if not applies]


def only_install_step(*, manages_sshd: bool, features: Sequence[str], python: Mapping[str, Any] | None) -> bool:
    """Whether a reachable node needs the install step alone (what the head can give its workers)."""
    return not (manages_sshd or features or python)


def run_prepare(inventory_path: Path, *, private_data_dir: Path, control_dir: Path, fingerprint_value: str,
                internal_key: Path, fabric_env: Mapping[str, Any], known_hosts: Path | None = None,
                limit: list[str] | None = None, features: Sequence[str] = (),
                python: Mapping[str, Any] | None = None, fabric_head: str = "",
                view: Mapping[str, Any] | None = None, wait: bool = True, manages_sshd: bool = True,
                on_installed: Callable[[str, Mapping[str, Any]], None] | None = None) -> playbooks.PlaybookResult:
    """The prepare play on the hosts in `limit` (None: all). `fabric_env`: fabricrecord.probe_settings;
    `fabric_head`: the address whose route names NCCL_SOCKET_IFNAME; `view`: clusterview.cluster_view
    (None: the role builds one from the inventory); `wait`: wait up to wait_timeout() for each node to
    accept SSH (False: a node that does not answer at once is unreachable); `manages_sshd`: raise the
    nodes' sshd limits (False on local nodes, whose sshd config is their own). `on_installed(host,
    result)` as each node's install step succeeds, with its probe's result and hostname."""
    from gpuctl.configplane import playbooks  # PyYAML and the Ansible driver: only when a play runs

    extravars = {
        "gpuctl_node_wait": wait,
        "gpuctl_agent_files": agent_files(),
        "gpuctl_prepare_fingerprint": fingerprint_value,
        "gpuctl_internal_key": str(internal_key),
        # the fabric probe (role gpuctl_node): static defaults only where it cannot see
        "gpuctl_fabric_env": dict(fabric_env.get("fallback_env") or {}),
        "gpuctl_fabric_instance_type": str(fabric_env.get("instance_type") or ""),
        "gpuctl_fabric_head": fabric_head,
        "gpuctl_known_hosts": str(known_hosts) if known_hosts else "",
        "gpuctl_wait_timeout": wait_timeout(),
        "gpuctl_features": list(features),
        # the Python API's venv (role gpuctl_python); {} when no function was broadcast here
        "gpuctl_python": {**python, "runtime_files": [{"src": str(p), "dest": name}
                                                      for name, p in python_runtime_files()]} if python else {},
    }
    if view is not None:
        extravars["gpuctl_cluster_view"] = dict(view)

    def on_event(event: Mapping[str, Any]) -> None:
        data = event.get("event_data") or {}
        if on_installed is not None and event.get("event") == "runner_on_ok" and data.get("task") == INSTALL_TASK:
            res = data.get("res") or {}
            on_installed(str(data.get("host")), {**(res.get("fabric") or {}), "hostname": res.get("hostname", "")})

    # What does not apply is left out by its tag: the node pays for the install step alone.
    skip = skipped_roles(wait=wait, manages_sshd=manages_sshd, features=features, python=python)
    return playbooks.run_playbook("prepare.yml", inventory=inventory_path, private_data_dir=private_data_dir,
                                  extravars=extravars, control_dir=control_dir, limit=limit, on_event=on_event,
                                  skip_tags=skip)
