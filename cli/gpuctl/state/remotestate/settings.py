"""Where a team's clusters live when they are shared: the `state:` block of config.yaml.

```yaml
state:
  backend: s3                 # local (default): everything in $GPUCTL_STATE_DIR only
  bucket: acme-gpuctl-state   # an existing bucket; versioning on is recommended
  prefix: gpuctl              # key prefix inside the bucket (default gpuctl)
  region: us-east-1           # default: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1
  endpoint_url: http://127.0.0.1:5000   # an S3-compatible store or emulator; unset for AWS
  kms_key_id: alias/gpuctl-state        # SSE-KMS for every object (default: SSE-S3, AES256)
  profile: ci                 # AWS profile for the state bucket (default: the usual chain)
  lock_timeout: 600           # seconds a second runner waits for a cluster's lock; 0: fail at once
```

Each key has an environment override, which CI runners use since their state
dir is fresh: GPUCTL_STATE_BACKEND, GPUCTL_STATE_BUCKET (alone it means
backend s3), GPUCTL_STATE_PREFIX, GPUCTL_STATE_REGION,
GPUCTL_STATE_ENDPOINT_URL, GPUCTL_STATE_KMS_KEY_ID, GPUCTL_STATE_PROFILE,
GPUCTL_STATE_LOCK_TIMEOUT.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from gpuctl.common.config import config_block
from gpuctl.common.errors import UserError
from gpuctl.spec.infra import is_aws_region

BACKENDS = ("local", "s3")
KEYS = ("backend", "bucket", "prefix", "region", "endpoint_url", "kms_key_id", "profile", "lock_timeout")
ENV = {key: f"GPUCTL_STATE_{key.upper()}" for key in KEYS}
DEFAULT_PREFIX = "gpuctl"
DEFAULT_LOCK_TIMEOUT = 600
# S3's rules for general purpose bucket names (lowercase, digits, dots, hyphens; 3-63).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*$")


@dataclass(frozen=True)
class StateSettings:
    """The S3 location of shared state; `bucket` is None for local state."""

    bucket: str | None = None
    prefix: str = DEFAULT_PREFIX
    region: str = "us-east-1"
    endpoint_url: str | None = None
    kms_key_id: str | None = None
    profile: str | None = None
    lock_timeout: int = DEFAULT_LOCK_TIMEOUT

    @property
    def remote(self) -> bool:
        return self.bucket is not None

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}/{key}".rstrip("/")


def state_settings(raw: Mapping[str, Any] | None, *, path: Path,
                   env: Mapping[str, str] | None = None) -> StateSettings:
    """`state:` from the config file (`raw`, may be None) merged with GPUCTL_STATE_* (which win)."""
    env = os.environ if env is None else env
    raw = config_block(raw, "state", KEYS, path=path, example="{backend: s3, bucket: NAME}")
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    for key in KEYS:
        if raw.get(key) not in (None, ""):
            values[key], where[key] = raw[key], f"{path}: state.{key}"
        if env.get(ENV[key]):
            values[key], where[key] = env[ENV[key]], ENV[key]
    backend = str(values.get("backend") or ("s3" if values.get("bucket") else "local")).strip().lower()
    if backend not in BACKENDS:
        raise UserError(f"{where['backend']} '{backend}': use local or s3")
    if backend == "local":
        return StateSettings()
    bucket = str(values.get("bucket") or "").strip()
    if not bucket:
        raise UserError(f"{where['backend']} s3: also give the bucket (state.bucket in {path} or {ENV['bucket']})")
    if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
        raise UserError(f"{where['bucket']} '{bucket}': not an S3 bucket name (3-63 lowercase letters, digits, "
                        "dots and hyphens)")
    prefix = str(values.get("prefix") or DEFAULT_PREFIX).strip().strip("/")
    if not _PREFIX_RE.fullmatch(prefix):
        raise UserError(f"{where['prefix']} '{prefix}': use letters, digits and - _ . separated by /, "
                        "such as teams/ml")
    region = str(values.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
                 or "us-east-1").strip()
    if not is_aws_region(region):
        raise UserError(f"{where.get('region', 'AWS_REGION')} '{region}': not an AWS region such as us-east-1")
    endpoint = str(values["endpoint_url"]).strip().rstrip("/") if values.get("endpoint_url") else None
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise UserError(f"{where['endpoint_url']} '{endpoint}': give a URL such as http://127.0.0.1:9000")
    timeout = values.get("lock_timeout", DEFAULT_LOCK_TIMEOUT)
    try:
        lock_timeout = int(str(timeout).strip())
    except ValueError:
        lock_timeout = -1
    if lock_timeout < 0 or isinstance(timeout, bool):
        raise UserError(f"{where['lock_timeout']} '{timeout}': give whole seconds, 0 to fail at once")
    return StateSettings(bucket=bucket, prefix=prefix, region=region, endpoint_url=endpoint,
                         kms_key_id=str(values["kms_key_id"]).strip() if values.get("kms_key_id") else None,
                         profile=str(values["profile"]).strip() if values.get("profile") else None,
                         lock_timeout=lock_timeout)
