"""The user's gpuctl config: `$GPUCTL_STATE_DIR/config.yaml` (optional).

```yaml
aws:
  profile: training            # AWS profile for boto3 and Terraform (default: the usual chain)
  ssh_ingress_cidrs: [203.0.113.7/32]   # who may SSH in; default: nobody
  ssh_open_to_world: false     # must be true for a /0 in ssh_ingress_cidrs (the whole internet)
  endpoint_url: http://127.0.0.1:5000   # an EC2 emulator (moto); unset for real AWS
  placement: auto              # auto | cluster | none
  efa: true                    # false only for emulators without EFA
  max_retries: 8               # AWS API retries per call in Terraform (see below)
  remote_identity: data-reader # the nodes' IAM instance profile (SkyPilot's aws.remote_identity)
```

Environment variables override the file, key by key:
`GPUCTL_AWS_ENDPOINT_URL`, `GPUCTL_SSH_INGRESS_CIDRS` (comma-separated),
`GPUCTL_AWS_PROFILE`, `GPUCTL_AWS_PLACEMENT`, `GPUCTL_AWS_EFA`, `GPUCTL_AWS_MAX_RETRIES`,
`GPUCTL_SSH_OPEN_TO_WORLD`, `GPUCTL_AWS_REMOTE_IDENTITY`.

`remote_identity` is SkyPilot's setting of the same name, also read from a
task's `config: {aws: {remote_identity: ...}}` (which wins) and, when gpuctl's
own config and environment do not set it, from SkyPilot's `~/.sky/config.yaml`
(or the file `SKYPILOT_GLOBAL_CONFIG` names). gpuctl takes the name of an
existing IAM instance profile, or SkyPilot's list form `[{CLUSTER_GLOB: NAME}]`
(the first glob matching the cluster's name); the nodes then reach AWS (the
S3 buckets of file_mounts) as that profile. `LOCAL_CREDENTIALS` and
`NO_UPLOAD` mean no profile: gpuctl never copies your own credentials to
nodes (give bucket credentials under the task's `secrets:`), and
`SERVICE_ACCOUNT` is refused: gpuctl creates no IAM roles.

`max_retries` goes to the Terraform provider block. hashicorp/aws 5.x retries
`InsufficientInstanceCapacity` like a throttle, up to `max_retries` times with
backoff (25 by default: minutes per zone), so gpuctl's default of 8 lets a
capacity shortage surface in well under a minute and the zone failover act.

The endpoint override exists for emulators and is used only when set. It does
not switch anything else off by itself: placement groups and EFA stay as the
task asks unless `placement: none` / `efa: false` say otherwise, so a real-AWS
setup that routes EC2 through a private endpoint keeps its EFA fabric.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from gpuctl.common.errors import UserError
from gpuctl.common.paths import state_root

CONFIG_NAME = "config.yaml"
ENDPOINT_ENV = "GPUCTL_AWS_ENDPOINT_URL"
CIDRS_ENV = "GPUCTL_SSH_INGRESS_CIDRS"
PROFILE_ENV = "GPUCTL_AWS_PROFILE"
PLACEMENT_ENV = "GPUCTL_AWS_PLACEMENT"
EFA_ENV = "GPUCTL_AWS_EFA"
RETRIES_ENV = "GPUCTL_AWS_MAX_RETRIES"
DEFAULT_MAX_RETRIES = 8
PLACEMENT_CHOICES = ("auto", "cluster", "none")
_AWS_KEYS = ("profile", "ssh_ingress_cidrs", "ssh_open_to_world", "endpoint_url", "placement", "efa", "max_retries",
             "remote_identity")
OPEN_WORLD_ENV = "GPUCTL_SSH_OPEN_TO_WORLD"
REMOTE_IDENTITY_ENV = "GPUCTL_AWS_REMOTE_IDENTITY"
SKY_CONFIG_ENV = "SKYPILOT_GLOBAL_CONFIG"  # SkyPilot's own override of ~/.sky/config.yaml
# SkyPilot's remote_identity values that name no instance profile (gpuctl uploads no credentials either way).
NO_PROFILE = ("LOCAL_CREDENTIALS", "NO_UPLOAD")
_PROFILE_RE = re.compile(r"[A-Za-z0-9+=,.@_-]{1,128}")


@dataclass(frozen=True)
class AwsSettings:
    """AWS settings after merging the config file and the environment.

    `source` maps each key that was set to where it came from (for messages).
    """

    endpoint_url: str | None = None
    profile: str | None = None
    ssh_ingress_cidrs: tuple[str, ...] = ()
    placement: str = "auto"  # auto: a cluster placement group when EFA is on
    efa: bool = True  # False: never attach EFA (emulators only)
    max_retries: int = DEFAULT_MAX_RETRIES  # Terraform provider's AWS API retries
    remote_identity: Any = None  # SkyPilot's aws.remote_identity as given (see instance_profile)
    source: Mapping[str, str] = None  # type: ignore[assignment]

    def origin(self, key: str) -> str:
        return (self.source or {}).get(key, "default")


def config_path() -> Path:
    return state_root() / CONFIG_NAME


def load_config(path: Path | None = None) -> dict[str, Any]:
    """The parsed config file, `{}` when there is none."""
    path = path or config_path()
    if not path.is_file():
        return {}
    from gpuctl.common.yamlfile import load_yaml  # PyYAML only where a config file exists

    data = load_yaml(path, what="gpuctl config file") or {}
    if not isinstance(data, Mapping):
        raise UserError(f"{path}: the gpuctl config must be a mapping such as 'aws: {{profile: NAME}}'")
    return dict(data)


def _bool(value: Any, *, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise UserError(f"{where} '{value}': use true or false")


def _count(value: Any, *, where: str) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        number = -1
    # hashicorp/aws reads max_retries = 0 as "unset" (its default, 25), so 1 is the floor
    if number < 1 or isinstance(value, bool):
        raise UserError(f"{where} '{value}': use a whole number of at least 1, such as {DEFAULT_MAX_RETRIES}")
    return number


def _cidrs(value: Any, *, where: str) -> tuple[str, ...]:
    if value is None or value == "":
        return ()
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise UserError(f"{where}: give a list of CIDR blocks such as [203.0.113.7/32]")
    out = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        try:
            out.append(str(ipaddress.ip_network(text, strict=False)))
        except ValueError:
            raise UserError(f"{where} '{text}': not a CIDR block such as 203.0.113.7/32") from None
    return tuple(out)


def config_block(raw: Any, name: str, keys: Sequence[str], *, path: Path, example: str) -> Mapping[str, Any]:
    """One top-level block of the config file (absent = empty), refusing keys gpuctl would silently ignore."""
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise UserError(f"{path}: '{name}' must be a mapping such as {example} (keys: {', '.join(keys)})")
    unknown = sorted(set(raw) - set(keys))
    if unknown:
        raise UserError(f"{path}: unknown key {name}.{unknown[0]}; known keys: {', '.join(keys)}")
    return raw


def aws_settings(env: Mapping[str, str] | None = None, *, path: Path | None = None) -> AwsSettings:
    """Merge `aws:` from the config file with the GPUCTL_* environment variables."""
    env = os.environ if env is None else env
    path = path or config_path()
    raw = config_block(load_config(path).get("aws"), "aws", _AWS_KEYS, path=path, example="{profile: NAME}")
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for key in _AWS_KEYS:
        if raw.get(key) is not None:
            values[key] = raw[key]
            source[key] = f"aws.{key} in {path}"
    for key, var in (("endpoint_url", ENDPOINT_ENV), ("ssh_ingress_cidrs", CIDRS_ENV), ("profile", PROFILE_ENV),
                     ("placement", PLACEMENT_ENV), ("efa", EFA_ENV), ("max_retries", RETRIES_ENV),
                     ("remote_identity", REMOTE_IDENTITY_ENV)):
        if env.get(var):
            values[key] = env[var]
            source[key] = var
    if "remote_identity" not in values:
        sky_path, sky_value = sky_remote_identity(env)
        if sky_value is not None:
            values["remote_identity"], source["remote_identity"] = sky_value, f"aws.remote_identity in {sky_path}"
    placement = str(values.get("placement", "auto")).strip().lower()
    if placement not in PLACEMENT_CHOICES:
        raise UserError(f"{source['placement']} '{placement}': use one of {', '.join(PLACEMENT_CHOICES)}")
    cidrs = _cidrs(values.get("ssh_ingress_cidrs"), where=source.get("ssh_ingress_cidrs", ""))
    if env.get(OPEN_WORLD_ENV):
        values["ssh_open_to_world"], source["ssh_open_to_world"] = env[OPEN_WORLD_ENV], OPEN_WORLD_ENV
    acknowledged = (_bool(values["ssh_open_to_world"], where=source["ssh_open_to_world"])
                    if "ssh_open_to_world" in values else False)
    world = [c for c in cidrs if ipaddress.ip_network(c).prefixlen == 0]
    if world and not acknowledged:
        raise UserError(f"{source['ssh_ingress_cidrs']} '{world[0]}': opens SSH (port 22) of every node to the whole "
                        f"internet; give your own address (e.g. 203.0.113.7/32), or, if you mean it, also set "
                        f"aws.ssh_open_to_world: true in {path} or {OPEN_WORLD_ENV}=1")
    endpoint = str(values["endpoint_url"]).strip() if values.get("endpoint_url") else None
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise UserError(f"{source['endpoint_url']} '{endpoint}': give a URL such as http://127.0.0.1:5000")
    return AwsSettings(
        endpoint_url=endpoint.rstrip("/") if endpoint else None,
        profile=str(values["profile"]) if values.get("profile") else None,
        ssh_ingress_cidrs=cidrs,
        placement=placement,
        efa=_bool(values["efa"], where=source["efa"]) if "efa" in values else True,
        max_retries=(_count(values["max_retries"], where=source["max_retries"]) if "max_retries" in values
                     else DEFAULT_MAX_RETRIES),
        remote_identity=values.get("remote_identity"),
        source=source,
    )


def sky_remote_identity(env: Mapping[str, str]) -> tuple[Path, Any]:
    """SkyPilot's own `aws.remote_identity` (~/.sky/config.yaml, or $SKYPILOT_GLOBAL_CONFIG): (file, value or None)."""
    path = Path(env.get(SKY_CONFIG_ENV) or Path.home() / ".sky" / "config.yaml").expanduser()
    if not path.is_file():
        return path, None
    from gpuctl.common.yamlfile import load_yaml

    data = load_yaml(path, what="SkyPilot config file") or {}
    aws = data.get("aws") if isinstance(data, Mapping) else None
    return path, (aws.get("remote_identity") if isinstance(aws, Mapping) else None)


def instance_profile(value: Any, cluster: str, *, where: str) -> str | None:
    """SkyPilot's `remote_identity` as the instance profile of `cluster`'s nodes; None for none.

    A name; or `[{CLUSTER_GLOB: NAME}, ...]`, the first glob matching the cluster's name
    (none matching: no profile); LOCAL_CREDENTIALS / NO_UPLOAD: none. UserError otherwise.
    """
    if value is None or value == "":
        return None
    if isinstance(value, Sequence) and not isinstance(value, str):
        for item in value:
            if not isinstance(item, Mapping) or len(item) != 1:
                raise UserError(f"{where}: a list of remote identities holds one-key mappings such as "
                                "[{my-cluster-*: data-reader}]")
            ((pattern, name),) = item.items()
            if fnmatch.fnmatchcase(cluster, str(pattern)):
                return instance_profile(name, cluster, where=f"{where}[{pattern}]")
        return None
    if isinstance(value, Mapping):
        raise UserError(f"{where}: give an instance profile name, or a list such as [{{my-cluster-*: data-reader}}]")
    text = str(value).strip()
    if text.upper() in NO_PROFILE:
        return None
    if text.upper() == "SERVICE_ACCOUNT":
        raise UserError(f"{where} SERVICE_ACCOUNT: gpuctl creates no IAM roles; create an instance profile that may "
                        "use your buckets and give its name")
    if not _PROFILE_RE.fullmatch(text):
        raise UserError(f"{where} '{text}': give the name of an IAM instance profile (1-128 letters, digits and "
                        "+=,.@_-), such as data-reader, not its ARN")
    return text
