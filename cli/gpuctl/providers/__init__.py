"""Providers: how one `infra` becomes a Terraform root module.

A provider turns a ClusterRequest into the per-cluster root (`main.tf.json`):
a `module` block calling its packaged module under `terraform/modules/`, plus
`output` blocks passing the module contract (`nodes`, `ssh_user`, `bastion`;
docs/architecture.md) through to `terraform output -json`.

Providers are imported lazily by name, so a cloud's SDK (boto3 for AWS) is
only imported when that cloud is used. A provider module `gpuctl.providers.<x>`
exposes `PROVIDER`, an instance of a BaseProvider subclass (providers/base.py:
the `Provider` protocol, every hook with its default). A new cloud is a folder
`providers/<x>/`, its `provider.py` and one line in `_PROVIDER_MODULES`.
`infra: ssh/...` is the provider that provisions nothing (providers/ssh).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from gpuctl.common.errors import UserError
from gpuctl.providers.base import MODULE_NAME, BaseProvider, Price, Provider
from gpuctl.spec.request import ClusterRequest, request_from_task

if TYPE_CHECKING:
    from gpuctl.spec import Resources, Task

__all__ = ["BaseProvider", "Provider", "get_provider", "render_root", "request_for", "resources_problem",
           "MODULE_NAME", "CONTRACT_OUTPUTS"]

# cloud name -> module defining PROVIDER (the registration line of a new cloud)
_PROVIDER_MODULES = {
    "local": "gpuctl.providers.local.provider",
    "aws": "gpuctl.providers.aws.provider",
    "ssh": "gpuctl.providers.ssh.provider",
}
CONTRACT_OUTPUTS = ("nodes", "ssh_user", "bastion")


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
    """The provider for `cloud` (`local`, `aws`, `ssh`, ...); UserError for clouds without one."""
    module_name = _PROVIDER_MODULES.get(cloud)
    if module_name is None:
        known = ", ".join(sorted(set(_PROVIDER_MODULES) - {"ssh"}))  # ssh is named as ssh/PATH
        raise UserError(f"infra '{cloud}' has no Terraform provider in gpuctl; use one of {known} (or ssh/PATH)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise UserError(f"infra '{cloud}' is not available in this gpuctl installation") from None
        raise
    return module.PROVIDER


def resources_problem(cloud: str, resources: "Resources") -> tuple[str, str] | None:
    """spec.load_task's `resources_check`: the provider's offline word on `resources` (the cloud
    is one spec/infra.py parsed, so it has a provider)."""
    return get_provider(cloud).resources_problem(resources)


def request_for(task: "Task", *, name: str | None = None, infra: str | None = None,
                num_nodes: int | None = None, base_dir: Path | None = None) -> ClusterRequest:
    """spec.request.request_from_task, then the provider's choice among the task's accelerators
    (AWS: of `{A100: 8, H100: 8}` the first it sells). What cli.py and api/cluster.py call."""
    req = request_from_task(task, name=name, infra=infra, num_nodes=num_nodes, base_dir=base_dir)
    accelerators = task.resources.accelerators
    if not accelerators or len(accelerators) < 2:
        return req
    accel, count = get_provider(req.cloud).pick_accelerator(req, accelerators)
    return replace(req, accelerator=accel, gpus_per_node=math.ceil(count) if count else 0)


def price_quote(req: ClusterRequest) -> tuple["Price", str | None]:
    """(the price of one node, its instance type) for a request, its type resolved as apply would."""
    from dataclasses import asdict

    provider = get_provider(req.cloud)
    instance_type = provider.instance_type(req)
    return provider.price({**asdict(req), "instance_type": instance_type}), instance_type
