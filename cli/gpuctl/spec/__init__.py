"""cluster.yaml: SkyPilot's task YAML as a typed, validated model.

`load_task` composes the YAML with a loader that remembers every key's line,
validates it with the pydantic models below and turns each problem into one
`UserError` line that names the file, the line and the dotted field (several
problems: one line each, in file order, the further ones indented):

    cluster.yaml:7: resources.accelerators: 'A100:x' is not a valid accelerator; write NAME:COUNT such as A100:8

Task YAMLs written for SkyPilot (0.14) load unchanged. Where gpuctl differs, or
says what it will not do:

- Relative `workdir` and `file_mounts` sources resolve as SkyPilot does, from
  the directory gpuctl runs in, and then from the YAML file's directory; when
  neither exists the error names both paths. `~` expands to your home.
- `${VAR}` / `$VAR` in `workdir` and `file_mounts` expand from `envs` and
  `secrets`, as in SkyPilot; unknown names stay as written.
- `envs`/`secrets` values written as numbers or booleans keep their text as
  written (`VERSION: 1.10` is "1.10", `DEBUG: true` is "true"); SkyPilot would
  give "1.1" and "True".
- Bucket file_mounts (`/data: s3://bucket/prefix`, copied; or the storage
  object `{source, name, mode, store}`) become `Task.bucket_mounts`; only S3 is
  supported, other stores are named as unsupported. `name:` with a local
  directory as `source:` is a bucket made and filled from it at apply
  (`BucketMount.upload`; jobplane/bucketupload.py).
- A relative file_mounts destination is SkyPilot's: a local file's lands in the
  workdir (~/gpuctl_workdir, where run starts), a bucket's in the home
  (nodepaths.on_node); `..` out of the home, or into a reserved place, is refused.
- `image_id: docker:IMAGE` is `Task.container_image`: setup and run go inside it.
- A git `workdir: {url, ref}` is `Task.workdir_git`, cloned on the controller
  at apply (gitworkdir.py) and synced like a local workdir.
- `resources.any_of` / `ordered`: the first alternative gpuctl can provision
  (a cloud it supports; on AWS an instance type it can resolve) is merged over
  the shared fields (`Task.choice_note` says which). Of several
  `accelerators` choices, the first AWS sells is provisioned there.
- Aliases: `resources.gpus` is `accelerators`, `spot_recovery` is `job_recovery`.
- Read and not acted on, each with a warning line in `Task.warnings`:
  `resources.ports`, `labels`, `disk_tier`, `config` (except
  `config.aws.remote_identity`), and `Task.IGNORED_FIELDS` /
  `Resources.IGNORED_FIELDS` (kept verbatim in `.ignored`: `service`,
  `resources.autostop`, `resources.job_recovery`, ...).
- Refused with a "not supported by gpuctl" line: other clouds and Kubernetes,
  non-S3 buckets, a list of storage sources, managed secrets (`secrets:NAME`, `managed_secrets`), `volumes`,
  and pipelines (several YAML documents in one file).
- A key given twice in one mapping is an error (YAML would keep the last silently).

Secret values never appear in an error message or in `repr(task)`.

The package, one job a module (each imports only those listed above it):

- infra.py, nodepaths.py, buckets.py: where (`infra:`), paths on the nodes,
  bucket mounts.

- fields.py: the value parsers (accelerators, quantities, ports, variables, buckets).
- models.py: `Task`, `Resources`, `GitWorkdir`.
- compose.py: YAML composed with the line of every key.
- messages.py: a validation error as `FILE:LINE: FIELD: MESSAGE` lines, one per problem.
- loader.py: `load_task`, the command line's overrides, warnings.
- request.py: what to provision, from a task.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gpuctl.common.envargs import ENV_NAME_RE, parse_env_assignments

if TYPE_CHECKING:
    from gpuctl.spec.compose import _compose, _line_of
    from gpuctl.spec.loader import SKYPILOT_IMAGE_PREFIX, load_task
    from gpuctl.spec.models import DOCKER_PREFIX, GitWorkdir, Resources, Task

__all__ = ["DOCKER_PREFIX", "ENV_NAME_RE", "SKYPILOT_IMAGE_PREFIX", "GitWorkdir", "Resources", "Task", "_compose",
           "_line_of", "load_task", "parse_env_assignments"]

# The models (pydantic, about 0.2 s to import) load when a task does: a command that never reads a
# task (exec of a command, queue, logs, status) imports this package's small modules alone.
_LAZY = {"_compose": "compose", "_line_of": "compose", "SKYPILOT_IMAGE_PREFIX": "loader", "load_task": "loader",
         "DOCKER_PREFIX": "models", "GitWorkdir": "models", "Resources": "models", "Task": "models"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
