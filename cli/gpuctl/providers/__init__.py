"""Providers: how one `infra` becomes a Terraform root module.

A provider turns a ClusterRequest into the per-cluster root (`main.tf.json`):
a `module` block calling its packaged module under `terraform/modules/`, plus
`output` blocks passing the module contract (`nodes`, `ssh_user`, `bastion`;
docs/architecture.md) through to `terraform output -json`.

Providers are imported lazily by name, so a cloud's SDK (boto3 for AWS) is
only imported when that cloud is used. A provider module `gpuctl.providers.<x>`
exposes `PROVIDER`, an object satisfying `Provider` (subclassing BaseProvider
gives the defaults and the optional `cleanup(cluster_dir)` hook that
`provision.destroy` calls). `infra: ssh/...` has no provider: nothing is
provisioned.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

from gpuctl.spec.request import ClusterRequest
from gpuctl.common.errors import UserError
from gpuctl.common.paths import terraform_dir

# cloud name -> module defining PROVIDER
_PROVIDER_MODULES = {
    "local": "gpuctl.providers.local.provider",
    "aws": "gpuctl.providers.aws.provider",
}
# The root module's name for the provider's module: outputs read module.cluster.*
MODULE_NAME = "cluster"
CONTRACT_OUTPUTS = ("nodes", "ssh_user", "bastion")


@runtime_checkable
class Provider(Protocol):
    name: str

    def module_dir(self) -> Path:
        """The packaged Terraform module this provider calls."""
        ...

    def check(self, req: ClusterRequest) -> None:
        """Refuse (UserError) what needs no cloud call to know: node count, name length, type..."""
        ...

    def prepare(self, req: ClusterRequest) -> ClusterRequest:
        """Preflight before rendering (quota, zone choice...); may return an adjusted request."""
        ...

    def root_config(self, req: ClusterRequest, *, cluster_dir: Path, ssh_public_key: str) -> dict[str, Any]:
        """The cluster's root module as Terraform JSON."""
        ...


class BaseProvider:
    """Defaults for providers: no-op `check`, `prepare` that only checks, no-op `cleanup`, module dir by name."""

    name = ""
    module_name = ""  # directory under terraform/modules/

    def module_dir(self) -> Path:
        path = terraform_dir() / "modules" / self.module_name
        if not (path / "main.tf").is_file():
            raise FileNotFoundError(f"gpuctl installation is missing terraform/modules/{self.module_name}")
        return path

    def check(self, req: ClusterRequest) -> None:
        """`gpuctl validate` and `apply` run it before anything is written; prepare runs it again
        for the callers (the Python API, --dry-run) that come straight to provision."""
        return None

    def prepare(self, req: ClusterRequest) -> ClusterRequest:
        self.check(req)
        return req

    def root_config(self, req: ClusterRequest, *, cluster_dir: Path, ssh_public_key: str) -> dict[str, Any]:
        raise NotImplementedError

    def cleanup(self, cluster_dir: Path) -> None:
        """Optional hook, run after `terraform destroy` succeeded and before the
        cluster directory is removed: delete what Terraform could not know of
        (e.g. the leftovers of an interrupted apply)."""
        return None


def render_root(module_dir: Path, inputs: Mapping[str, Any], *, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A root module calling `module_dir` (absolute path) with `inputs`, passing the
    contract outputs through. `extra` adds top-level blocks (`provider`, `terraform`)."""
    module_dir = Path(module_dir).resolve()
    config: dict[str, Any] = {
        "terraform": {"required_version": ">= 1.5"},
        "module": {MODULE_NAME: {"source": str(module_dir), **inputs}},
        "output": {
            name: {"value": f"${{module.{MODULE_NAME}.{name}}}"} for name in CONTRACT_OUTPUTS
        },
    }
    for key, value in (extra or {}).items():
        if isinstance(value, Mapping) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def get_provider(cloud: str) -> Provider:
    """The provider for `cloud` (`local`, `aws`, ...); UserError for clouds without one."""
    module_name = _PROVIDER_MODULES.get(cloud)
    if module_name is None:
        known = ", ".join(sorted(_PROVIDER_MODULES))
        raise UserError(f"infra '{cloud}' has no Terraform provider in gpuctl; use one of {known} (or ssh/PATH)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise UserError(f"infra '{cloud}' is not available in this gpuctl installation") from None
        raise
    return module.PROVIDER
