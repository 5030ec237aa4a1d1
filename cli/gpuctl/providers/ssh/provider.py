"""The `ssh` provider (`infra: ssh/PATH`): hosts that exist already, listed in a
hand-written inventory. Nothing is provisioned and there is no Terraform root:
provision/provisioner.py checks the inventory and copies it into the cluster
directory (`provisions = False`), and `down` forgets the cluster, leaving the
hosts as they were (after removing the job containers from them, which is why
`containers_outlive_cluster` is set).
"""

from __future__ import annotations

from gpuctl.common.errors import UserError
from gpuctl.providers.base import BaseProvider
from gpuctl.spec.request import ClusterRequest


class SshProvider(BaseProvider):
    name = "ssh"
    provisions = False
    containers_outlive_cluster = True

    def check(self, req: ClusterRequest) -> None:
        if req.inventory_path is None:
            raise UserError("resources.infra 'ssh' needs an inventory path: infra: ssh/path/to/inventory.yml")


PROVIDER = SshProvider()
