"""ClusterRequest: what to provision, as plain values, from a Task and CLI flags.

Providers receive only this (never the YAML model), so the Terraform side can
be read and tested without knowing SkyPilot's task format.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpuctl.common.errors import UserError
from gpuctl.common.paths import CLUSTER_NAME_RE
from gpuctl.spec.infra import CONFIG_ACTED_ON, PATH_CLOUDS, Infra, parse_infra

if TYPE_CHECKING:
    from gpuctl.spec import Task

# ClusterRequest.extra: the task's config.<cloud>.remote_identity as JSON, for the clouds that
# act on it (spec/infra.py CONFIG_ACTED_ON; providers/aws/provider.py reads "aws.remote_identity")
REMOTE_IDENTITY = "remote_identity"


def remote_identity_key(cloud: str) -> str:
    return f"{cloud}.{REMOTE_IDENTITY}"


@dataclass(frozen=True)
class ClusterRequest:
    name: str
    num_nodes: int
    cloud: str  # a provider's name (gpuctl.providers): "local" | "aws" | "ssh"
    region: str | None = None
    zone: str | None = None
    instance_type: str | None = None
    accelerator: str | None = None  # e.g. "H100"
    gpus_per_node: int = 0
    cpus: str | None = None  # "8", "8+": CPU-only tasks pick an instance type from these
    memory: str | None = None  # GiB: "32", "32+", "4x" per vCPU
    use_spot: bool = False
    disk_size: int | None = None
    image_id: str | None = None
    network_tier: str = "standard"  # "standard" | "best"
    inventory_path: Path | None = None  # infra ssh/PATH: hand-written inventory
    autodown: bool = False  # the cluster takes itself down when idle: its nodes terminate on shutdown
    extra: dict[str, str] = field(default_factory=dict)


# The longest cluster name every provider takes (AWS prefixes its resource names with it: 32,
# providers/aws/provider.py MODULE_NAME_MAX; tests/unit/test_providers.py keeps the two in step).
# A name gpuctl makes up is never longer; one given with -c may be up to 40 where the provider allows.
PORTABLE_NAME_MAX = 32
_NAME_HASH_CHARS = 6


def _cleaned(task_name: str | None) -> str:
    base = (task_name or "gpuctl").lower()
    cleaned = "".join(c if c.isascii() and c.isalnum() else "-" for c in base).strip("-") or "gpuctl"
    return cleaned if cleaned[0].isalpha() else "c-" + cleaned


def default_cluster_name(task_name: str | None) -> str:
    """The cluster a task gets without -c: its `name:` in lowercase letters, digits and '-'. One longer
    than PORTABLE_NAME_MAX becomes a readable prefix and a short hash of the whole name (SkyPilot, too,
    shortens a name for the cloud), so two long names that start alike stay two clusters, and one name
    is the same cluster on every run."""
    cleaned = _cleaned(task_name)
    if len(cleaned) <= PORTABLE_NAME_MAX:
        return cleaned
    digest = hashlib.sha256(str(task_name).encode("utf-8")).hexdigest()[:_NAME_HASH_CHARS]
    return cleaned[:PORTABLE_NAME_MAX - _NAME_HASH_CHARS - 1].rstrip("-") + "-" + digest


def describe_cluster_name(name: str, task_name: str | None) -> str:
    """`name` as validate shows it, saying so when it is the task's name shortened."""
    if len(_cleaned(task_name)) <= PORTABLE_NAME_MAX or name != default_cluster_name(task_name):
        return name
    return f"{name} (the task's name, shortened to {PORTABLE_NAME_MAX} characters; pass -c NAME for another)"


def check_cluster_name(name: str) -> str:
    if not CLUSTER_NAME_RE.fullmatch(name):
        raise UserError(
            f"cluster name '{name}': use 1-40 lowercase letters, digits and '-', starting with a letter"
        )
    return name


def request_from_task(
    task: "Task",
    *,
    name: str | None = None,
    infra: str | None = None,
    num_nodes: int | None = None,
    base_dir: Path | None = None,
) -> ClusterRequest:
    """Combine the validated task with CLI overrides (`-c`, `--infra`, `--num-nodes`).

    Of several accelerator choices the request holds the first; the provider may pick
    another (gpuctl.providers.request_for, which cli.py and the Python API call)."""
    res = task.resources
    where: Infra = parse_infra(infra, field="--infra") if infra else res.infra_spec()
    if num_nodes is not None and num_nodes < 1:
        raise UserError(f"--num-nodes {num_nodes}: num_nodes should be a positive int")
    accel, count = res.accelerator_pair()
    inventory_path = None
    if where.cloud in PATH_CLOUDS:
        if not where.path:
            raise UserError(f"resources.infra '{where.cloud}' needs an inventory path: "
                            f"infra: {where.cloud}/path/to/inventory.yml")
        inventory_path = Path(where.path)
        if not inventory_path.is_absolute():
            inventory_path = (base_dir or Path.cwd()) / inventory_path
    cloud_config = (task.config or {}).get(where.cloud)
    identity = None
    if REMOTE_IDENTITY in CONFIG_ACTED_ON.get(where.cloud, ()) and isinstance(cloud_config, dict):
        identity = cloud_config.get(REMOTE_IDENTITY)
    return ClusterRequest(
        name=check_cluster_name(name or default_cluster_name(task.name)),
        num_nodes=num_nodes if num_nodes is not None else task.num_nodes,
        cloud=where.cloud,
        region=where.region,
        zone=where.zone,
        instance_type=res.instance_type,
        accelerator=accel,
        gpus_per_node=math.ceil(count) if count else 0,
        cpus=res.cpus,
        memory=res.memory,
        use_spot=bool(res.use_spot),
        disk_size=res.disk_size,
        # docker:IMAGE runs on the default AMI; SkyPilot's own image tags are not AMIs
        image_id=None if task.container_image or (res.image_id or "").startswith("skypilot:") else res.image_id,
        network_tier=res.network_tier or "standard",
        inventory_path=inventory_path,
        autodown=bool(res.autostop and res.autostop.down),
        extra={remote_identity_key(where.cloud): json.dumps(identity)} if identity is not None else {},
    )
