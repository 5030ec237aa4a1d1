"""The containers a cluster's jobs run in (`image_id: docker:IMAGE`): one per node.

Why a module of its own, in provision: three places need the same rules and
sit at different layers: `validate`/`apply` refuse a bad image or runtime
setting before anything exists (taskchecks.py), the job runner hands the plan
to the agent (jobplane/runner.py, payload.py), and `down` removes the nodes'
containers by the names the agent gave them (lifecycle.py). The agent
(node/containers.py) runs them on the node.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Any, Sequence

from gpuctl.common.errors import UserError
from gpuctl.spec.nodepaths import WORKDIR

CONTAINER_RUNTIME_ENV = "GPUCTL_CONTAINER_RUNTIME"  # docker | podman | an absolute path to one; unset: either
CONTAINER_RUNTIMES = ("docker", "podman")
_IMAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,511}")  # never an option: no leading '-'
_RUNTIME_PATH_RE = re.compile(r"(/[A-Za-z0-9._+@-]+)+")


def container_runtime(value: str | None = None) -> str | None:
    """GPUCTL_CONTAINER_RUNTIME (or `value`): docker, podman or the absolute path of one of them;
    None lets each node take whichever answers (docker first). ValueError for anything else."""
    raw = (os.environ.get(CONTAINER_RUNTIME_ENV, "") if value is None else value).strip()
    if not raw:
        return None
    if raw in CONTAINER_RUNTIMES or (_RUNTIME_PATH_RE.fullmatch(raw) and os.path.basename(raw) in CONTAINER_RUNTIMES):
        return raw
    raise ValueError(f"{CONTAINER_RUNTIME_ENV}={raw}: use docker, podman, or the absolute path of one of them")


def container_plan(image: str, cluster: str, mounts: Sequence[str], runtime: str | None = None) -> dict[str, Any]:
    """What the nodes need to run the job in `image`: the container's name (each node adds its own
    name), the runtime asked for, and the destinations to bind (the workdir, file_mounts, buckets)."""
    if not _IMAGE_RE.fullmatch(image):
        raise ValueError(f"{image!r} is not a container image name (registry/name:tag, not starting with '-')")
    return {"image": image, "name": f"gpuctl-{cluster}", "runtime": runtime, "mounts": list(dict.fromkeys(mounts))}


def job_plan(image: str, cluster: str, dests: Sequence[str]) -> dict[str, Any]:
    """container_plan for a job's container: the workdir and every destination in `dests` (file_mounts and
    buckets, copied this time or not: the container a job with fewer needs is the same one) bound into it,
    with GPUCTL_CONTAINER_RUNTIME's runtime. A bad image or runtime setting is a UserError."""
    try:
        return container_plan(image, cluster, [WORKDIR, *dests], container_runtime())
    except ValueError as exc:
        raise UserError(str(exc)) from None


CONTAINERS_MARK = "containers"  # clusters/<name>/containers: a job of the cluster ran in containers


def container_name(cluster: str, node_name: str) -> str:
    """The node's container for the cluster's jobs, as the agent names it (container_config)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", f"gpuctl-{cluster}-{node_name}")
    return name if name[:1].isalnum() else "gpuctl-" + name


def remove_containers_command(names: Sequence[str]) -> str:
    """Shell that removes exactly the containers `names` (no prefix or pattern: `gpuctl-a-head` must
    not take `gpuctl-a-b-head` with it) with whichever runtime the node has; exit 1 if one failed."""
    words = " ".join(shlex.quote(n) for n in names)
    return (f"rc=0; if command -v docker >/dev/null 2>&1; then for c in {words}; do "
            f"if docker container inspect -- \"$c\" >/dev/null 2>&1; then docker rm --force -- \"$c\" >/dev/null "
            f"|| rc=1; fi; done; fi; if command -v podman >/dev/null 2>&1; then "
            f"podman rm --force --ignore -- {words} >/dev/null || rc=1; fi; exit $rc")
