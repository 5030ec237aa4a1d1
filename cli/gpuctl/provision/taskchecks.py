"""Every refusal of a task that needs neither its nodes nor a cloud call.

`gpuctl validate` runs them all; `gpuctl apply` runs the same ones first,
before the registry or the state dir is written and before any cloud call, so
validate refuses what apply would refuse, with the same line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuctl.common.errors import UserError
from gpuctl.providers import get_provider
from gpuctl.spec.request import ClusterRequest

if TYPE_CHECKING:
    from gpuctl.spec import Task


def check_task(task: Task, req: ClusterRequest) -> None:
    """UserError on the first problem: the request (name, node count, instance type, an
    existing cluster's cloud, an ssh inventory), bucket mounts, the container runtime."""
    from gpuctl.provision import containers, provisioner
    from gpuctl.spec import buckets

    provisioner.check_request(req)
    buckets.check(tuple(task.bucket_mounts.values()), task.envs)
    if task.container_image:
        containers.job_plan(task.container_image, req.name,
                            [*task.file_mounts, *(b.dest for b in task.bucket_mounts.values())])


def ssh_reach_problem(task: Task, req: ClusterRequest) -> str | None:
    """Why apply would refuse to run this task's job: the provider's check_reach (AWS: no
    ssh_ingress_cidrs), or None.

    Only apply without --provision-only refuses it, so validate prints it as a warning.
    """
    if not (task.run or task.setup):
        return None
    try:
        get_provider(req.cloud).check_reach()
    except UserError as exc:
        return exc.message
    return None
