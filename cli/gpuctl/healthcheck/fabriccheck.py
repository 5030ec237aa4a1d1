"""The fabric a cluster should use, and whether a transport is it (pure but for reading fabric.json).

Where the expectation comes from, first found wins:
1. `--expect-fabric efa|ib|roce|socket`;
2. the request the cluster was provisioned from: AWS with `network_tier: best`
   (EFA interfaces) -> efa, whatever a node's detection says (a node whose EFA
   devices did not show up is exactly what the check must catch);
3. `clusters/<name>/fabric.json`, written by prepare's fabric detection
   (`{"nodes": [{"rank": 0, "kind": "efa", ...}, ...]}`): the best fabric any
   node has, expected of every node (your own IB machines: one node without
   its HCAs fails the check instead of lowering the bar);
4. socket.

`socket` is a floor, not a demand: nothing faster was promised, so any
transport meets it. The others must be exactly what NCCL used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from gpuctl.common.errors import UserError
from gpuctl.providers import get_provider

FABRICS = ("efa", "ib", "roce", "socket")
FABRIC_FILE = "fabric.json"


@dataclass(frozen=True)
class Expected:
    kind: str
    source: str  # how gpuctl knows: "--expect-fabric", "detected by prepare", ...
    per_rank: Mapping[int, str] = field(default_factory=dict)  # node rank -> kind prepare detected there

    def for_rank(self, rank: int | None) -> str:
        """What the node of `rank` must use: the cluster's fabric (every node alike)."""
        return self.kind

    def doc(self) -> dict[str, Any]:
        return {"kind": self.kind, "source": self.source,
                "nodes": {str(r): k for r, k in sorted(self.per_rank.items())}}


def check_fabric_flag(value: str | None) -> str | None:
    if value is None:
        return None
    kind = value.strip().lower()
    if kind not in FABRICS:
        raise UserError(f"--expect-fabric {value}: use one of {', '.join(FABRICS)}")
    return kind


def read_fabric_file(cdir: Path) -> dict[str, Any] | None:
    """clusters/<name>/fabric.json, or None when prepare has not written one (or it is not JSON)."""
    path = cdir / FABRIC_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


_STRENGTH = {"socket": 0, "roce": 1, "ib": 2, "efa": 3}


def expected_fabric(*, override: str | None, fabric_file: Mapping[str, Any] | None, cloud: str,
                    request: Mapping[str, Any] | None) -> Expected:
    if override is not None:
        return Expected(override, "--expect-fabric")
    req = request or {}
    detected: dict[int, str] = {}
    for node in (fabric_file or {}).get("nodes") or []:
        if isinstance(node, dict) and isinstance(node.get("rank"), int) and isinstance(node.get("kind"), str) \
                and node["kind"].lower() in _STRENGTH:
            detected[node["rank"]] = node["kind"].lower()
    provider = get_provider(cloud)
    attached = provider.expected_fabric(req)
    if attached is not None:
        return Expected(attached, f"provisioned with network_tier: {req.get('network_tier')}", detected)
    if detected:
        best = max(detected.values(), key=_STRENGTH.__getitem__)
        return Expected(best, "detected by prepare", detected)
    return Expected("socket", "local nodes" if provider.local else "no fabric requested")


def satisfies(kind: str | None, expected: str) -> bool:
    """Whether a transport of `kind` is the fabric `expected` (socket: anything is)."""
    if expected == "socket":
        return True
    if kind == "ofi" and expected == "efa":  # aws-ofi-nccl loaded, its provider line not in the log
        return True
    return kind == expected


def hint(expected: str) -> str:
    """What to look at when NCCL did not use `expected`."""
    if expected == "efa":
        return ("NCCL falls back to sockets when it cannot load aws-ofi-nccl: put it and libfabric on "
                "LD_LIBRARY_PATH (Deep Learning AMI: /opt/amazon/ofi-nccl/lib and /opt/amazon/efa/lib), set "
                "FI_PROVIDER=efa, and check `fi_info -p efa` lists the EFA devices on every node")
    if expected in ("ib", "roce"):
        return ("NCCL found no usable HCA: check `ibv_devinfo` on every node, NCCL_IB_HCA (e.g. mlx5), that "
                "NCCL_IB_DISABLE is not set, and for RoCE NCCL_IB_GID_INDEX")
    return "see NCCL's NET lines in the job's log"
