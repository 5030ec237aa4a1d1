"""`resources.infra` strings: `local`, `ssh/PATH`, `aws`, `aws/REGION`, `aws/REGION/ZONE`.

The one place below providers/ that knows clouds by name: spec/ never imports
providers/, so what it must know of a cloud before any provider is loaded is
data here (which clouds take a region or a path, which `config.<cloud>` keys
gpuctl acts on, what an AWS region name looks like).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuctl.common.errors import UserError

SUPPORTED_CLOUDS = ("local", "ssh", "aws")
# Infra names SkyPilot knows that gpuctl does not provision on (yet): named, so the
# message says "not supported by gpuctl" rather than "unknown".
OTHER_CLOUDS = frozenset({
    "gcp", "azure", "oci", "nebius", "lambda", "runpod", "fluidstack", "paperspace", "cudo", "do", "vast",
    "ibm", "scp", "vsphere", "hyperbolic", "seeweb", "primeintellect", "shadeform", "mithril", "verda",
    "yotta", "coreweave", "together", "slurm", "kubernetes", "k8s",
})
WHAT_IS_SUPPORTED = "gpuctl provisions on aws, local (nodes on this machine) and ssh/PATH (your own machines)"


# Clouds whose infra names a region (CLOUD/REGION/ZONE); a per-region image_id picks one of them.
REGION_CLOUDS = frozenset({"aws"})
# Clouds whose infra names a hand-written inventory (CLOUD/PATH).
PATH_CLOUDS = frozenset({"ssh"})
# SkyPilot's `config.<cloud>.<key>` that gpuctl acts on (the rest is warned about as ignored):
# config.aws.remote_identity names the nodes' instance profile (providers/aws reads it).
CONFIG_ACTED_ON: dict[str, frozenset[str]] = {"aws": frozenset({"remote_identity"})}


class UnsupportedInfra(UserError):
    """A cloud SkyPilot supports and gpuctl does not: an any_of/ordered alternative
    naming it is skipped, anywhere else it is an error."""


# AWS region and zone names; the region rule is also the one for the shared state's bucket
# region (state/remotestate/settings.py).
AWS_REGION_RE = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d$")
_REGION_RE = AWS_REGION_RE
_ZONE_RE = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d[a-z]$|^[a-z]{2}-[a-z]+-\d-[a-z]+-\d[a-z]$")
_REGION_PREFIX_RE = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d")


def is_aws_region(name: str) -> bool:
    """Whether `name` is shaped like an AWS region (us-east-1, us-gov-west-1)."""
    return bool(AWS_REGION_RE.fullmatch(name))


@dataclass(frozen=True)
class Infra:
    cloud: str
    region: str | None = None
    zone: str | None = None
    path: str | None = None  # ssh: the hand-written inventory


def parse_infra(value: str, *, field: str = "resources.infra") -> Infra:
    """Parse an infra string; `field` names where it came from for the error line."""
    text = str(value).strip()
    cloud, _, rest = text.partition("/")
    cloud = cloud.lower()
    if cloud in OTHER_CLOUDS:
        what = "Kubernetes" if cloud in ("k8s", "kubernetes") else cloud
        what = "" if text.lower() == cloud and what == cloud else f"{what} is "
        raise UnsupportedInfra(f"{field} '{text}': {what}not supported by gpuctl; {WHAT_IS_SUPPORTED}")
    if cloud not in SUPPORTED_CLOUDS:
        raise UserError(f"{field} '{text}': unknown infra '{cloud}'; use one of {', '.join(SUPPORTED_CLOUDS)}")
    if cloud == "ssh":
        return Infra(cloud="ssh", path=rest or None)
    if cloud == "local":
        if rest:
            raise UserError(f"{field} '{text}': 'local' takes no region; write infra: local")
        return Infra(cloud="local")
    region, _, zone = rest.partition("/")
    region = region or None
    zone = zone or None
    if region in ("*",):
        region = None
    if zone and not region:
        # SkyPilot's `aws/*/ZONE` (and legacy `zone:` without `region:`): the zone names its region.
        derived = _REGION_PREFIX_RE.match(zone) if _ZONE_RE.fullmatch(zone) else None
        if not derived:
            raise UserError(f"{field} '{text}': '{zone}' is not an AWS zone name such as us-east-1a")
        region = derived.group(0)
    if region and not _REGION_RE.fullmatch(region):
        raise UserError(f"{field} '{text}': '{region}' is not an AWS region name such as us-east-1")
    if zone and not (_ZONE_RE.fullmatch(zone) and region and zone.startswith(region)):
        raise UserError(f"{field} '{text}': '{zone}' is not a zone of {region} (e.g. {region}a)")
    return Infra(cloud=cloud, region=region, zone=zone)


def infra_from_legacy(cloud: str | None, region: str | None, zone: str | None, *, field: str = "resources") -> Infra:
    """SkyPilot's older `cloud`/`region`/`zone` triple, checked the same way as `infra`."""
    parts = [p for p in (cloud, region or ("*" if zone else None), zone) if p]
    if not cloud:
        if region or zone:
            raise UserError(f"{field}.region/zone need {field}.cloud (or write {field}.infra: aws/REGION/ZONE)")
        return Infra(cloud="local")
    return parse_infra("/".join(parts), field=f"{field}.cloud")
