"""The `ssh` provider (`infra: ssh/PATH`): hosts that exist already, listed in a
hand-written inventory. Nothing is provisioned and there is no Terraform root:
provision/provisioner.py checks the inventory and copies it into the cluster
directory (`provisions = False`), and `down` forgets the cluster, leaving the
hosts as they were (after removing the job containers from them, which is why
`containers_outlive_cluster` is set).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from gpuctl.common.errors import UserError
from gpuctl.providers.base import BaseProvider
from gpuctl.spec.accelerators import unknown_accelerator_message, unknown_accelerators
from gpuctl.spec.request import ClusterRequest

if TYPE_CHECKING:
    from gpuctl.spec import Task


class SshProvider(BaseProvider):
    name = "ssh"
    provisions = False
    containers_outlive_cluster = True

    def check(self, req: ClusterRequest) -> None:
        if req.inventory_path is None:
            raise UserError("resources.infra 'ssh' needs an inventory path: infra: ssh/path/to/inventory.yml")

    def stop_problem(self, request: Mapping[str, Any]) -> str | None:
        return (f"gpuctl did not make these hosts, so it does not stop them: stop them yourself; "
                f"`gpuctl down {request.get('name') or 'NAME'}` forgets the cluster")

    def task_warnings(self, task: "Task", req: ClusterRequest) -> list[str]:
        """An accelerator name not in the catalogue: likely a typo, but the hosts' GPUs may be newer
        than the list, so it is said and not refused."""
        return [f"{task.where('resources', 'accelerators')}: resources.accelerators: "
                f"{unknown_accelerator_message(name)} (the hosts' GPUs are taken as named)"
                for name in unknown_accelerators(task.resources.accelerators or {})]


PROVIDER = SshProvider()
