"""Prepare: the one playbook between provisioning and jobs, and when to run it again.

The prepared state of a node is what the prepare play leaves there: the
agent, the cluster's internal key and Host entries, sshd limits, the fabric
env its own probe wrote (`fabricprobe.py`, shipped in roles/gpuctl_node, so a
changed probe is a changed fingerprint and prepares again). Its fingerprint,
a hash of everything that shapes that state, is written on every node by the
play and kept on the controller. A job carries the
fingerprint it expects; each node compares it with its own record before
running anything (the check costs no extra call), and the controller runs
prepare again when a node differs: a new agent, a rotated key, a replaced
node, a changed fabric env.

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
from typing import Any, Mapping, Sequence

from gpuctl.common.errors import UserError
from gpuctl.common.paths import ansible_dir
from gpuctl.configplane import playbooks
from gpuctl.provision.inventory import Inventory, peer_port

AGENT = Path(__file__).resolve().parent.parent / "jobplane" / "gpuctl_node.py"  # built by `make agent`
# The parts of the Ansible tree that shape a prepared node.
_PREPARE_TREE = ("playbooks/prepare.yml", "roles/gpuctl_node", "roles/gpuctl_cluster_ssh",
                 "roles/gpuctl_sshd_limits", "roles/gpuctl_storage", "roles/gpuctl_python")
FEATURES = ("rclone", "fuse")  # what gpuctl_storage installs (AWS) or checks (elsewhere)


def _tree_bytes() -> list[tuple[str, bytes]]:
    root = ansible_dir()
    out: list[tuple[str, bytes]] = [("agent", AGENT.read_bytes())]
    for rel in _PREPARE_TREE:
        path = root / rel
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            if f.name == "gpuctl_node.py":  # the agent again (a link to it); its launcher gpuctl-node counts
                continue
            out.append((str(f.relative_to(root)), f.read_bytes()))
    return out


def fingerprint(inv: Inventory, *, internal_public_key: str, fabric_env: Mapping[str, Any],
                features: Sequence[str] = (), python: Mapping[str, Any] | None = None) -> str:
    """sha256 of the agent, the prepare roles (the fabric probe with them), the cluster's SSH and
    fabric settings and its features. `fabric_env`: what prepare passes the probe
    (configplane/fabric.probe_settings: the instance type and the static fallback env)."""
    h = hashlib.sha256()
    for name, data in _tree_bytes():
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    shape = {
        # the node id: a replaced node (new id, new host key) means the others must learn its key
        "peers": [[n.name, n.node_id, n.address, peer_port(n), n.ssh_user] for n in inv.nodes],
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


def recorded(cluster_dir: Path) -> str | None:
    """The fingerprint this controller last prepared the cluster with."""
    try:
        return (cluster_dir / "prepared").read_text().strip() or None
    except FileNotFoundError:
        return None


def record(cluster_dir: Path, value: str) -> None:
    (cluster_dir / "prepared").write_text(value + "\n")


def forget(cluster_dir: Path) -> None:
    (cluster_dir / "prepared").unlink(missing_ok=True)


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


def run_prepare(inventory_path: Path, *, private_data_dir: Path, control_dir: Path, fingerprint_value: str,
                internal_key: Path, fabric_env: Mapping[str, Any], known_hosts: Path | None = None,
                limit: list[str] | None = None, features: Sequence[str] = (),
                python: Mapping[str, Any] | None = None, fabric_head: str = "",
                fabric_record: Path | None = None) -> playbooks.PlaybookResult:
    """The prepare play. `fabric_env`: configplane/fabric.probe_settings; `fabric_head`: the address
    whose route names NCCL_SOCKET_IFNAME; `fabric_record`: where the play leaves every node's probe
    JSON on the controller (fabric.record turns it into fabric.json)."""
    extravars = {
        "gpuctl_prepare_fingerprint": fingerprint_value,
        "gpuctl_internal_key": str(internal_key),
        # the fabric probe (role gpuctl_node): static defaults only where it cannot see
        "gpuctl_fabric_env": dict(fabric_env.get("fallback_env") or {}),
        "gpuctl_fabric_instance_type": str(fabric_env.get("instance_type") or ""),
        "gpuctl_fabric_head": fabric_head,
        "gpuctl_fabric_record": str(fabric_record) if fabric_record else "",
        "gpuctl_known_hosts": str(known_hosts) if known_hosts else "",
        "gpuctl_wait_timeout": wait_timeout(),
        "gpuctl_features": list(features),
        # the Python API's venv (role gpuctl_python); {} when no function was broadcast here
        "gpuctl_python": {**python, "runtime_files": [{"src": str(p), "dest": name}
                                                      for name, p in python_runtime_files()]} if python else {},
    }
    return playbooks.run_playbook("prepare.yml", inventory=inventory_path, private_data_dir=private_data_dir,
                                  extravars=extravars, control_dir=control_dir, limit=limit)
