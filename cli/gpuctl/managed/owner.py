"""Which clusters a managed job made: the only ones its supervisor may run on, replace or remove.

The supervisor stamps the cluster's directory (`owner.json`: the job's id and a token drawn at
launch) before it makes anything there, so a half-made cluster is the job's too. A cluster of the
job's name without that stamp (the user's own `gpuctl apply`, made meanwhile) is never adopted,
and a stamped cluster whose directory went (`gpuctl down`) is never made again.
"""

from __future__ import annotations

import json
import os

from gpuctl.common.paths import cluster_dir
from gpuctl.managed.store import ManagedJob, Store
from gpuctl.provision import provisioner

OWNER_FILE = "owner.json"


def stamp(job: ManagedJob) -> None:
    path = cluster_dir(job.cluster)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"managed_job": job.id, "token": job.launch.get("cluster_token")}, fh)


def owns(job: ManagedJob) -> bool:
    """Whether the job's cluster is there and is the one this job made."""
    token = job.launch.get("cluster_token")
    if token is None:  # launched by a gpuctl before the stamp: its cluster is the one of its name
        return provisioner.cluster_exists(job.cluster)
    try:
        stamped = json.loads((cluster_dir(job.cluster) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(stamped, dict) and stamped.get("managed_job") == job.id and stamped.get("token") == token


def running_jobs_of(clusters: list[str], store: Store | None = None) -> dict[str, ManagedJob]:
    """cluster -> the managed job not yet ended that runs on it, for those of `clusters` that have one."""
    store = store or Store()
    if not store.path.exists():
        return {}
    wanted = set(clusters)
    return {job.cluster: job for job in store.all() if not job.terminal and job.cluster in wanted and owns(job)}
