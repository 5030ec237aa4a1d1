"""gpuctl: multi-node GPU training clusters from one cluster.yaml.

One folder per layer, each importing only from the ones before it
(docs/architecture.md, "Where code lives"; tests/unit/test_architecture.py):
common -> spec (cluster.yaml -> Task) -> providers (one package per cloud) ->
state (registry, locks, shared state) -> provision (Terraform -> inventory) ->
configplane (Ansible prepares the nodes once) -> jobplane (both ends of a job:
the runner on the controller, the node agent) -> healthcheck -> api -> cli.
The Python API (gpuctl.Cluster, @gpuctl.function, ...) lives in gpuctl/api/.
"""

from __future__ import annotations

__version__ = "0.1.0"  # pyproject.toml's (tests/unit/test_cli_start.py); what `gpuctl --version` prints

# The Python API (gpuctl/api/), loaded on first use so that `import gpuctl` stays cheap
# for the CLI and on the nodes, where only the runtime part is there: name -> (module, attribute).
_API = {
    "Cluster": ("gpuctl.api.cluster", "Cluster"),
    "RemoteError": ("gpuctl.api.cluster", "RemoteError"),
    "Compute": ("gpuctl.api.compute", "Compute"),
    "AWS": ("gpuctl.api.compute", "AWS"),
    "Local": ("gpuctl.api.compute", "Local"),
    "accelerators": ("gpuctl.api.compute", "accelerators"),
    "function": ("gpuctl.api.function", "function"),
    "instance_info": ("gpuctl.api.runtime", "instance_info"),
    "InstanceInfo": ("gpuctl.api.runtime", "InstanceInfo"),
    "shard": ("gpuctl.api.runtime", "shard"),
    "stdout": ("gpuctl.api.runtime", "stdout"),
    "stderr": ("gpuctl.api.runtime", "stderr"),
    "silent": ("gpuctl.api.runtime", "silent"),
    "plugins": ("gpuctl.api.plugins", None),
    "JobFailed": ("gpuctl.common.errors", "JobFailed"),
    "UserError": ("gpuctl.common.errors", "UserError"),
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> object:
    try:
        module_name, attr = _API[name]
    except KeyError:
        raise AttributeError(f"module 'gpuctl' has no attribute {name!r}") from None
    import importlib

    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
