"""Shared state in S3: clusters a CI runner that never saw them can status, exec, logs and down.

With `state: {backend: s3, ...}` (remotestate.settings) every cluster keeps
  - its Terraform state in Terraform's own S3 backend, locked with `use_lockfile`;
  - its cluster directory (request, inventory, SSH keys, known host keys, prepare
    records), its registry record and its job rows in the bucket (remotestate.sync);
  - a gpuctl lock per cluster while it is applied or torn down (store.cluster_lock).
The state dir stays the working copy: commands pull what the bucket has before
they act and push what they changed. Local state (no `state:`) is the default
and nothing here runs then.

The cluster's SSH private keys are stored in the bucket like Terraform stores
secrets in its state: encrypted at rest (SSE-S3, or SSE-KMS with
`state.kms_key_id`) and readable by whoever the bucket's policy lets read; that
is the same set of people who can destroy the cluster through its Terraform
state, and it needs no second secret on every runner.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from gpuctl.state.remotestate.settings import StateSettings, state_settings
from gpuctl.state.remotestate.store import S3Store


@dataclass(frozen=True)
class Remote:
    settings: StateSettings
    store: S3Store

    def where(self, name: str) -> str:
        return self.settings.url(f"clusters/{name}")

    def terraform_backend(self, name: str) -> dict[str, Any]:
        """The `terraform { backend "s3" {...} }` block of cluster `name`'s root (Terraform JSON)."""
        s = self.settings
        block: dict[str, Any] = {"bucket": s.bucket, "key": f"{s.prefix}/clusters/{name}/terraform.tfstate",
                                 "region": s.region, "encrypt": True, "use_lockfile": True}
        if s.kms_key_id:
            block["kms_key_id"] = s.kms_key_id
        if s.profile:
            block["profile"] = s.profile
        if s.endpoint_url:  # S3-compatible stores and emulators: no STS, no account lookup, path-style URLs
            block.update(endpoints={"s3": s.endpoint_url, "sts": s.endpoint_url}, use_path_style=True,
                         skip_credentials_validation=True, skip_requesting_account_id=True,
                         skip_metadata_api_check=True, skip_region_validation=True)
        return {"s3": block}


def current(env: dict[str, str] | None = None) -> Remote | None:
    """The configured remote state, or None for local state (the default)."""
    from gpuctl.common.config import config_path, load_config

    environ = dict(os.environ if env is None else env)
    path = config_path()
    raw = load_config(path).get("state") if path.is_file() else None
    if raw is None and not any(k.startswith("GPUCTL_STATE_") and k != "GPUCTL_STATE_DIR" and v
                               for k, v in environ.items()):
        return None
    settings = state_settings(raw, path=path, env=environ)
    return _remote(settings) if settings.remote else None


@functools.lru_cache(maxsize=4)
def _remote(settings: StateSettings) -> Remote:
    return Remote(settings, S3Store(settings))


def with_backend(config: dict[str, Any], name: str, remote: Remote | None) -> dict[str, Any]:
    """A rendered root with the S3 backend added when state is remote (unchanged otherwise)."""
    if remote is None:
        return config
    terraform = dict(config.get("terraform") or {})
    terraform["backend"] = remote.terraform_backend(name)
    return {**config, "terraform": terraform}


__all__ = ["Remote", "StateSettings", "current", "with_backend"]
