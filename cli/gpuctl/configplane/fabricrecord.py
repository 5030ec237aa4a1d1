"""The fabric prepare found on every node: clusters/<name>/fabric.json, and how to show it.

Each node's own probe (`fabricprobe.py`, run by the prepare play's install step) decides its
env and writes its `~/.gpuctl/fabric.env`; the install step's result carries the probe's JSON
and the node's hostname back, and `record` turns those of the nodes prepared into `fabric.json`:

    {"kind": "efa",                         the cluster's weakest kind (below)
     "nodes": [{"rank": 0, "name": "head",
                "kind": "efa" | "ib" | "roce" | "socket",
                "interface": "eth0",        the interface of the route to the head
                "devices": [...],           RDMA devices and their ports, as the probe saw them
                "active_ports": ["mlx5_0:1", ...],
                "env": {...},               what the node's fabric.env sets (PATH-like
                "path_prepend": {...},      variables prepended: path_prepend)
                "hostname": "ip-10-0-0-5",  the node's own name (the cluster view's aliases)
                "warnings": [...], ...}, ...]}

`gpuctl check` reads these keys (healthcheck/fabric.py): keep them. The
cluster's kind is the one every pair of nodes shares: the nodes' kind when
they all agree, else `socket` (a socket node, or nodes of different fabrics,
cannot do RDMA with each other, so NCCL ends up on TCP between them).

Every string a node reported is made printable where it is read (`_node_entry`, and
`load_fabric` for a file an older gpuctl wrote): `gpuctl status` and prepare's warnings
print them. Pure but for reading and writing those files; the controller's only inputs are
what it passes the probe (`probe_settings`): the instance type, which the node
may not know, and the static cloud defaults it writes only where detection
cannot see (the provider's fabric_env hook).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from gpuctl.common.safetext import clean, whole_number
from gpuctl.providers import get_provider
from gpuctl.provision.inventory import Inventory

FABRIC_FILE = "fabric.json"
KINDS = ("efa", "ib", "roce", "socket")
_LABEL = {"efa": "EFA", "ib": "InfiniBand", "roce": "RoCE", "socket": "TCP sockets"}


def probe_settings(cloud: str, request: Mapping[str, Any] | None) -> dict[str, Any]:
    """What prepare passes every node's probe (and hashes into the prepare fingerprint)."""
    req = request or {}
    itype = req.get("instance_type") or ""
    return {"instance_type": str(itype), "fallback_env": get_provider(cloud).fabric_env(req)}


def expected_kind(cloud: str, request: Mapping[str, Any] | None) -> str | None:
    """The fabric the cluster was provisioned for, when gpuctl attached one (the provider's
    expected_fabric hook; AWS: EFA for network_tier: best)."""
    return get_provider(cloud).expected_fabric(request)


def cluster_kind(kinds: list[str]) -> str:
    """The kind every pair of nodes shares: theirs when all agree, else socket."""
    distinct = set(kinds)
    return distinct.pop() if len(distinct) == 1 else "socket"


def _node_entry(node_rank: int, name: str, raw: Any) -> dict[str, Any]:
    """One node of fabric.json from the probe's stdout (text), or a socket entry saying what went wrong."""
    try:
        data = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        data = None
    if not isinstance(data, dict) or data.get("kind") not in KINDS:
        return {"rank": node_rank, "name": name, "kind": "socket", "interface": None, "devices": [],
                "active_ports": [], "env": {}, "warnings": ["the fabric probe gave no result"]}
    data = {k: v for k, v in clean(data).items() if k != "changed"}
    return {**data, "rank": node_rank, "name": name}


def build(inv: Inventory, raw: Mapping[str, Any], before: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """fabric.json from the play's {host: probe result}; nodes the play did not reach this time
    keep their entry from `before` (a limited prepare), nodes no longer in the inventory go."""
    old = {n.get("name"): n for n in (before or {}).get("nodes") or [] if isinstance(n, dict)}
    nodes = []
    for node in inv.nodes:
        if node.name in raw:
            nodes.append(_node_entry(node.rank, node.name, raw[node.name]))
        elif node.name in old:
            nodes.append({**old[node.name], "rank": node.rank, "name": node.name})
    return {"kind": cluster_kind([n["kind"] for n in nodes]) if nodes else "socket", "nodes": nodes}


def load_fabric(cluster_dir: Path) -> dict[str, Any] | None:
    """clusters/<name>/fabric.json, or None when prepare has not written one (or it is unreadable)."""
    try:
        data = json.loads((Path(cluster_dir) / FABRIC_FILE).read_text())
    except (OSError, ValueError):
        return None
    return clean(data) if isinstance(data, dict) and isinstance(data.get("nodes"), list) else None


def record(cluster_dir: Path, inv: Inventory, raw: Mapping[str, Any]) -> dict[str, Any] | None:
    """fabric.json (atomically) with the probe results of the nodes prepared now ({host: result});
    the new document, or None when no node was (nothing changes then)."""
    if not raw:
        return None
    cdir = Path(cluster_dir)
    doc = build(inv, raw, load_fabric(cdir))
    tmp = cdir / (FABRIC_FILE + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, cdir / FABRIC_FILE)
    return doc


def hostnames(cluster_dir: Path) -> dict[str, str]:
    """{node name: its hostname} as the nodes' install steps reported them."""
    doc = load_fabric(cluster_dir) or {}
    return {str(n["name"]): str(n["hostname"]) for n in doc.get("nodes") or []
            if isinstance(n, dict) and n.get("name") and n.get("hostname")}


def node_line(node: Mapping[str, Any]) -> str:
    """A node's fabric in a few words: "efa x32 (eth0)",
    "ib mlx5_0:1,mlx5_1:1,… (ib0) 7/8 ports active; 7 of 8 IB ports ACTIVE", "socket (eth0)"."""
    kind = node.get("kind") or "socket"
    iface = f" ({node['interface']})" if node.get("interface") else ""
    devices = [d for d in node.get("devices") or [] if isinstance(d, dict) and d.get("kind") == kind]
    active = [str(p) for p in node.get("active_ports") or []]
    if kind == "efa":
        text = f"efa x{len(devices)}{iface}"
        ports = sum(len(d.get("ports") or []) for d in devices)
        if len(active) < ports:
            text += f" {len(active)}/{ports} ports active"
        if node.get("gpudirect_rdma"):
            text += " gdr"
    elif kind in ("ib", "roce"):
        shown = ",".join(active[:2]) + (",…" if len(active) > 2 else "")
        ports = sum(len(d.get("ports") or []) for d in devices)
        text = f"{kind} {shown}{iface} {len(active)}/{ports} ports active"
        if kind == "roce" and whole_number(node.get("gid_index")) is not None:
            text += f" gid {whole_number(node.get('gid_index'))}"
    else:
        text = f"socket{iface}"
    warnings = [w for w in node.get("warnings") or [] if isinstance(w, str)]
    if node.get("error"):
        warnings.insert(0, f"probe: {node['error']}")
    if warnings:
        text += f"; {warnings[0]}" + (f" (+{len(warnings) - 1} more)" if len(warnings) > 1 else "")
    return text


def status_lines(cluster_dir: Path) -> dict[int, str]:
    """rank -> the node's fabric in a few words (node_line), for `gpuctl status NAME`;
    {} before the first prepare."""
    doc = load_fabric(cluster_dir)
    if doc is None:
        return {}
    out = {}
    for node in doc["nodes"]:
        if isinstance(node, dict) and isinstance(node.get("rank"), int):
            out[node["rank"]] = node_line(node)
    return out


def warnings(doc: Mapping[str, Any], expected: str | None = None) -> list[str]:
    """Lines prepare prints: nodes short of the fabric the cluster was provisioned for, nodes
    that disagree, and what each probe warned about (the first few nodes of each)."""
    nodes = [n for n in doc.get("nodes") or [] if isinstance(n, dict)]
    lines = []
    if expected:
        short = [n["name"] for n in nodes if n.get("kind") != expected]
        if short:
            lines.append(f"{_names(short)}: no {_LABEL[expected]} device found although the cluster was "
                         f"provisioned with {_LABEL[expected]}: NCCL will use TCP sockets there")
    kinds = sorted({n.get("kind") for n in nodes if n.get("kind")}, key=KINDS.index)
    if len(kinds) > 1:
        lines.append("the nodes have different fabrics (" + ", ".join(
            f"{k}: {_names([n['name'] for n in nodes if n.get('kind') == k])}" for k in kinds)
            + "): NCCL uses TCP sockets between them")
    by_text: dict[str, list[str]] = {}
    for n in nodes:
        for w in ([f"probe: {n['error']}"] if n.get("error") else []) + list(n.get("warnings") or []):
            by_text.setdefault(str(w), []).append(n["name"])
    lines += [f"{_names(names)}: {text}" for text, names in by_text.items()]
    return lines


def _names(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
