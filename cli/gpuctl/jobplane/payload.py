"""The job as the head's agent receives it: one JSON document (pure, unit-tested).

Everything a node needs to run its part travels in it: the rank table with
how each node reaches the others (`peers`) and the cluster view (their host keys and
Host entries, configplane/clusterview.py), each stage's script and
environment, the destinations to copy from the head's copy, and the
fingerprint of the prepared state the nodes must have. Secrets travel beside
it on the same stdin, never in it (the head stores the payload for the job's
lifetime; see agent/).
"""

from __future__ import annotations

import os
import secrets as _secrets
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from gpuctl.jobplane import jobenv
from gpuctl.jobplane.gitignore import WorkdirFilter
from gpuctl.node.protocol import PROTOCOL
from gpuctl.provision.inventory import Inventory, Node, is_loopback, peer_port
from gpuctl.spec import nodepaths

DEFAULT_FANOUT = 32
FANOUT_ENV = "GPUCTL_FANOUT"
# Copies (workdir, file_mounts) from the head: each node pushes to this many others at once.
DEFAULT_COPY_FANOUT = 4
COPY_FANOUT_ENV = "GPUCTL_COPY_FANOUT"
WORKDIR_DEST = nodepaths.WORKDIR
INTERNAL_KEY_ON_NODE = "~/.ssh/gpuctl_cluster"
NODE_CONTROL_DIR = "~/.gpuctl/cm"  # made by the prepare play
# The workdir's rsync options, on every hop: files gone locally deleted once the transfer
# succeeded, no .git; then the rules of gitignore.WorkdirFilter (git's .gitignore semantics,
# destinations of other mounts inside the workdir left alone).
WORKDIR_RSYNC_BASE = ("--delete-after", "--exclude=.git")

KNOWN_HOSTS_ON_NODE = "~/.ssh/gpuctl_known_hosts"  # the controller's: given at prepare and by every job (view)
PEER_SSH_OPTIONS = (
    "BatchMode=yes",
    # Keys are known before a node connects on (the job's view): a different one is refused.
    "StrictHostKeyChecking=yes",
    "GlobalKnownHostsFile=/dev/null",
    "LogLevel=ERROR",
    "ConnectTimeout=10",
    # A peer that vanishes without a reset (power loss) is noticed in ~15 s.
    "ServerAliveInterval=5",
    "ServerAliveCountMax=3",
)


@dataclass(frozen=True)
class StagePlan:
    script: str
    env: Mapping[str, str]
    rank_vars: Sequence[str]
    hostfile: Sequence[str] | None


def fanout(env: str = FANOUT_ENV, default: int = DEFAULT_FANOUT) -> int:
    """Children per node in the fan-out tree (GPUCTL_FANOUT, default 32; copies: GPUCTL_COPY_FANOUT, 4)."""
    raw = os.environ.get(env, "").strip()
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    return default


def peer_entry(node: Node) -> dict[str, Any]:
    """How the other nodes log in to `node`: ssh options (no destination) and the host.

    Nodes on loopback (local nodes without root) are processes on the
    controller's own machine, so the controller's access key and coordinates
    serve; elsewhere the cluster's internal key, which prepare installs.
    """
    common = [a for o in PEER_SSH_OPTIONS for a in ("-o", o)] + ["-o", f"HostKeyAlias={node.host_key_alias}"]
    if is_loopback(node.address):
        known = node.known_hosts or "/dev/null"
        opts = ["-p", str(node.ssh_port), "-l", node.ssh_user] + common + ["-o", f"UserKnownHostsFile={known}"]
        if node.ssh_key:
            opts += ["-i", node.ssh_key, "-o", "IdentitiesOnly=yes"]
        host = node.ssh_host
    else:
        opts = ["-p", str(peer_port(node)), "-l", node.ssh_user, "-i", INTERNAL_KEY_ON_NODE,
                "-o", "IdentitiesOnly=yes", *common, "-o", f"UserKnownHostsFile={KNOWN_HOSTS_ON_NODE}",
                "-o", "ControlMaster=auto", "-o", f"ControlPath={NODE_CONTROL_DIR}/%C",
                "-o", "ControlPersist=60s"]
        host = node.address
    return {"rank": node.rank, "name": node.name, "host": host, "ssh": opts, "gpus": node.gpus}


def stage_plan(script: str | None, env: jobenv.StageEnv, hostfile: Sequence[str] | None) -> dict[str, Any] | None:
    if not script:
        return None
    return {"script": script if script.endswith("\n") else script + "\n", "env": dict(env.common),
            "rank_vars": list(env.rank_vars), "hostfile": list(hostfile) if hostfile is not None else None}


def build_payload(
    inv: Inventory,
    *,
    job_id: int | str,
    fingerprint: str,
    job_nodes: int,
    setup: dict[str, Any] | None,
    run: dict[str, Any] | None,
    sync: Sequence[Mapping[str, Any]] = (),
    branching: int | None = None,
    grace: float = 3.0,
    container: Mapping[str, Any] | None = None,
    buckets: Sequence[Mapping[str, Any]] = (),
    storage: Mapping[str, Any] | None = None,
    view: Mapping[str, Any] | None = None,
    epoch: Mapping[str, Any] | None = None,
    spot_notice: Mapping[str, Any] | None = None,
    gpus_per_node: int = 0,
) -> dict[str, Any]:
    """The job for the head's `submit`. A managed job's attempt adds `epoch` ({"task": id,
    "value": attempt}: a node refuses an older attempt's stages, agent/epochs.py) and, on spot
    nodes, `spot_notice` ({"url": IMDS base, "interval_s": s}: agent/spotnotice.py); both are
    in the payload only when given, so a plain job's is as before. `gpus_per_node`: what the job
    asks of each of its nodes; above 0 it waits in the head's queue for them (node/gpuqueue.py),
    whose capacity is each peer's `gpus`."""
    payload: dict[str, Any] = {
        "v": PROTOCOL,
        "job": str(job_id),
        "nonce": _secrets.token_hex(6),
        "fingerprint": fingerprint,
        "branching": branching or fanout(),
        "copy_branching": fanout(COPY_FANOUT_ENV, DEFAULT_COPY_FANOUT),
        "grace": grace,
        "connect_timeout": 120,
        "workdir": WORKDIR_DEST,
        "job_ranks": job_nodes,
        "peers": [peer_entry(n) for n in inv.nodes],
        # what each node knows of the others, written by each relay before it connects on (clusterview.py)
        "view": dict(view) if view else None,
        "stages": {"setup": setup, "run": run},
        "sync": [dict(s) for s in sync],
        "container": dict(container) if container else None,
        # cloud-bucket file_mounts (buckets.payload_entries) and how nodes reach the store (no credentials)
        "buckets": [dict(b) for b in buckets],
        "storage": dict(storage) if buckets and storage else None,
        "gpus_per_node": int(gpus_per_node),
    }
    if epoch is not None:
        payload["epoch"] = {"task": str(epoch["task"]), "value": int(epoch["value"])}
    if spot_notice is not None:
        payload["spot_notice"] = dict(spot_notice)
    return payload


def workdir_rsync_args(rules: WorkdirFilter) -> list[str]:
    """The workdir's rsync options on every hop (the controller's adds git's own list: upload.py)."""
    return [*WORKDIR_RSYNC_BASE, *rules.rsync_args()]
