"""The environment every stage sees, as plain dicts (pure, unit-tested).

Values common to all nodes of a stage are computed here once; the only
per-node value is the rank, which Ansible fills in from each host's
`gpuctl_rank` for the names listed in `rank_vars`. That keeps the controller
from building one dict per node at hundreds of nodes.

SkyPilot's names follow its setup/run split (skypilot-compat.md) so its task
YAMLs run unchanged; the GPUCTL_* names are present in both stages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

from gpuctl.provision.inventory import Inventory, Node

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class StageEnv:
    common: dict[str, str]
    rank_vars: tuple[str, ...]


def task_id(cluster: str, job_id: int, started_at: str) -> str:
    """Unique per job and stable for that job (SkyPilot: sky-<time>_<cluster>_<id>)."""
    return f"gpuctl-{started_at}_{cluster}_{job_id}"


def cluster_info(inv: Inventory, nodes: Sequence[Node]) -> str:
    info = {
        "cluster_name": inv.cluster,
        "cloud": inv.cloud,
        "region": inv.region,
        "zone": inv.zone,
        "num_nodes": len(nodes),
        "ips": [n.address for n in nodes],
    }
    return json.dumps(info, separators=(",", ":"))


def _shared(
    inv: Inventory,
    nodes: Sequence[Node],
    *,
    task: str,
    gpus_per_node: int,
    envs: Mapping[str, str],
    attempt: int | None = None,
    job_vars: Mapping[str, str] | None = None,
) -> dict[str, str]:
    ips = "\n".join(n.address for n in sorted(nodes, key=lambda n: n.rank))
    info = cluster_info(inv, nodes)
    env = {
        "GPUCTL_NODE_IPS": ips,
        "GPUCTL_NUM_NODES": str(len(nodes)),
        "GPUCTL_NUM_GPUS_PER_NODE": str(gpus_per_node),
        "GPUCTL_TASK_ID": task,
        "GPUCTL_CLUSTER_INFO": info,
        "GPUCTL_CLUSTER_NAME": inv.cluster,
        "MASTER_ADDR": inv.head.address,
        "MASTER_PORT": str(DEFAULT_MASTER_PORT),
    }
    if attempt is not None:  # a managed job's attempt (1, 2, ...), as SLURM_RESTART_COUNT + 1
        env["GPUCTL_ATTEMPT"] = str(attempt)
    env.update(job_vars or {})  # gpuctl's own, of this job (a pipeline's GPUCTL_STAGE, GPUCTL_STAGE_NAME)
    # The user's envs win over ours except for the names that define the job.
    for key, value in envs.items():
        if key in ("MASTER_ADDR", "MASTER_PORT") or not key.startswith(("GPUCTL_", "SKYPILOT_")):
            env[key] = value
    return env


def setup_env(
    inv: Inventory, *, task: str, gpus_per_node: int, envs: Mapping[str, str], attempt: int | None = None,
    job_vars: Mapping[str, str] | None = None,
) -> StageEnv:
    """Setup runs on every node of the cluster."""
    nodes = inv.nodes
    env = _shared(inv, nodes, task=task, gpus_per_node=gpus_per_node, envs=envs, attempt=attempt, job_vars=job_vars)
    env.update(
        {
            "SKYPILOT_NUM_NODES": env["GPUCTL_NUM_NODES"],
            "SKYPILOT_SETUP_NODE_IPS": env["GPUCTL_NODE_IPS"],
            "SKYPILOT_TASK_ID": task,
            "SKYPILOT_CLUSTER_INFO": env["GPUCTL_CLUSTER_INFO"],
        }
    )
    return StageEnv(common=env, rank_vars=("GPUCTL_NODE_RANK", "SKYPILOT_SETUP_NODE_RANK"))


def run_env(
    inv: Inventory,
    job_nodes: Sequence[Node],
    *,
    task: str,
    gpus_per_node: int,
    envs: Mapping[str, str],
    attempt: int | None = None,
    job_vars: Mapping[str, str] | None = None,
) -> StageEnv:
    """Run uses the job's nodes (the first K of the cluster); ranks are 0..K-1."""
    env = _shared(inv, job_nodes, task=task, gpus_per_node=gpus_per_node, envs=envs, attempt=attempt,
                  job_vars=job_vars)
    env.update(
        {
            "SKYPILOT_NODE_IPS": env["GPUCTL_NODE_IPS"],
            "SKYPILOT_NUM_NODES": env["GPUCTL_NUM_NODES"],
            "SKYPILOT_NUM_GPUS_PER_NODE": env["GPUCTL_NUM_GPUS_PER_NODE"],
            "SKYPILOT_TASK_ID": task,
            "SKYPILOT_CLUSTER_INFO": env["GPUCTL_CLUSTER_INFO"],
        }
    )
    return StageEnv(common=env, rank_vars=("GPUCTL_NODE_RANK", "SKYPILOT_NODE_RANK"))


def secrets_script(secrets: Mapping[str, str]) -> str:
    """`export K='v'` lines for the node's 0600 secrets file (single-quote safe)."""
    lines = []
    for key, value in secrets.items():
        quoted = "'" + value.replace("'", "'\"'\"'") + "'"
        lines.append(f"export {key}={quoted}")
    return "\n".join(lines) + ("\n" if lines else "")
