"""AWS checks before Terraform runs: one clear line for each thing a user can fix.

`check_aws(req)` asks EC2 (through boto3, honouring the endpoint override of
`gpuctl.common.config`) whether the request can work at all: credentials, a region,
an instance type that exists, is offered in the zone, and supports EFA when
`network_tier: best` asks for it. It returns the request with region, zone and
instance type filled in, plus what it learnt (EFA interfaces per node, the
zones that offer the type) for the plan summary and for capacity failover.

`next_zone` is the pure failover rule used when EC2 answers
`InsufficientInstanceCapacity`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

from gpuctl.common.config import AwsSettings, aws_settings
from gpuctl.common.errors import UserError
from gpuctl.providers.aws.catalog import canonical_accelerator, resolve_instance_type
from gpuctl.spec.request import ClusterRequest

MAX_ZONE_ATTEMPTS = 3
EFA_EXAMPLE_TYPE = "p5.48xlarge"
# The node AMI when the task gives no image_id: the Deep Learning AMI (EFA installer,
# libfabric and aws-ofi-nccl included). Passed to the module as ami_ssm_parameter.
DLAMI_SSM_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
# The bastion's AMI (Ubuntu 22.04, Canonical's public parameter). Passed as bastion.ami_ssm_parameter.
BASTION_SSM_PARAMETER = "/aws/service/canonical/ubuntu/server/22.04/stable/current/amd64/hvm/ebs-gp2/ami-id"


@dataclass(frozen=True)
class InstanceTypeInfo:
    """What `describe_instance_types` says about one type (only what gpuctl uses)."""

    name: str
    efa_supported: bool = False
    efa_interfaces: int = 0  # NetworkInfo.EfaInfo.MaximumEfaInterfaces
    network_cards: int = 1
    accelerator: str | None = None  # GPU / Neuron device name, e.g. "H100"
    accelerator_count: int = 0
    accelerator_gib: int = 0  # memory per device (A100: 40 on p4d, 80 on p4de); 0 when not said


@dataclass(frozen=True)
class AwsPreflight:
    """The outcome of `check_aws`: where the cluster goes, and what it gets."""

    region: str
    zone: str
    zone_pinned: bool  # True when the task named the zone (no failover out of it)
    offered_zones: tuple[str, ...]  # zones of the region offering the type, sorted
    instance: InstanceTypeInfo
    efa: bool  # EFA interfaces will be attached


def parse_instance_type(raw: Mapping[str, Any]) -> InstanceTypeInfo:
    """An `InstanceTypes[]` item of `describe_instance_types` -> InstanceTypeInfo."""
    net = raw.get("NetworkInfo") or {}
    efa_supported = bool(net.get("EfaSupported"))
    efa_max = int((net.get("EfaInfo") or {}).get("MaximumEfaInterfaces") or 0)
    accel, count, gib = None, 0, 0
    for info_key, list_key in (("GpuInfo", "Gpus"), ("NeuronInfo", "NeuronDevices"),
                               ("InferenceAcceleratorInfo", "Accelerators")):
        devices = (raw.get(info_key) or {}).get(list_key) or []
        if devices:
            accel = str(devices[0].get("Name"))
            count = sum(int(d.get("Count") or 0) for d in devices)
            gib = int((devices[0].get("MemoryInfo") or {}).get("SizeInMiB") or 0) // 1024
            break
    return InstanceTypeInfo(
        name=str(raw.get("InstanceType")),
        efa_supported=efa_supported,
        efa_interfaces=efa_max if efa_supported else 0,
        network_cards=int(net.get("MaximumNetworkCards") or 1),
        accelerator=accel,
        accelerator_count=count,
        accelerator_gib=gib,
    )


def choose_zone(offered: Sequence[str], wanted: str | None, *, instance_type: str, region: str) -> str:
    """The zone to use: `wanted` if it offers the type, else the first offering zone.

    Deterministic: zones are sorted, so `us-east-1a` is preferred over `us-east-1b`.
    """
    zones = sorted(offered)
    if not zones:
        raise UserError(
            f"resources.instance_type '{instance_type}': not offered in any zone of {region}; "
            "pick another region in resources.infra"
        )
    if wanted is None:
        return zones[0]
    if wanted not in zones:
        raise UserError(
            f"resources.infra: {instance_type} is not offered in {wanted}; "
            f"zones of {region} that offer it: {', '.join(zones)}"
        )
    return wanted


def next_zone(offered: Iterable[str], tried: Sequence[str], max_attempts: int = MAX_ZONE_ATTEMPTS) -> str | None:
    """The zone to try after capacity ran out in every zone of `tried`, or None to stop.

    Zones are taken in sorted order, cyclically after the last one tried, skipping
    those already tried; at most `max_attempts` zones are tried in all.
    """
    zones = sorted(set(offered))
    if len(tried) >= max_attempts or not zones:
        return None
    start = 0
    if tried and tried[-1] in zones:
        start = zones.index(tried[-1]) + 1
    for i in range(len(zones)):
        zone = zones[(start + i) % len(zones)]
        if zone not in tried:
            return zone
    return None


def failover_line(failed: str, instance_type: str, nxt: str | None, attempt: int, max_attempts: int) -> str:
    """The one line printed when a zone had no capacity."""
    if nxt is None:
        return f"{failed} has no {instance_type} capacity; no zone left to try"
    return f"{failed} has no {instance_type} capacity; trying {nxt} (attempt {attempt} of {max_attempts})"


def check_efa(info: InstanceTypeInfo, network_tier: str) -> None:
    if network_tier == "best" and not info.efa_supported:
        raise UserError(
            f"resources.network_tier: instance type {info.name} does not support EFA; "
            f"use network_tier: standard or an EFA type such as {EFA_EXAMPLE_TYPE}"
        )


def check_accelerators(info: InstanceTypeInfo, accelerator: str | None, count: int) -> None:
    """With both `instance_type` and `accelerators` given, they must agree."""
    if not accelerator:
        return
    have = f"{info.accelerator_count} x {info.accelerator}" if info.accelerator else "no accelerators"
    name = canonical_accelerator(accelerator) or accelerator
    name_ok = info.accelerator is not None and name.lower().startswith(info.accelerator.lower())
    memory = re.search(r"-(\d+)GB$", name, re.IGNORECASE)  # A100-40GB, A100-80GB, V100-32GB: the memory too
    if name_ok and memory and info.accelerator_gib and int(memory.group(1)) != info.accelerator_gib:
        name_ok, have = False, f"{have} ({info.accelerator_gib} GB each)"
    if not name_ok or (count and count != info.accelerator_count):
        raise UserError(
            f"resources.accelerators '{accelerator}:{count}': instance type {info.name} has {have}; "
            "drop one of resources.accelerators / resources.instance_type or make them agree"
        )


def resolve_region(region: str | None, session_region: str | None, env: Mapping[str, str]) -> str:
    """infra region, else AWS_REGION / AWS_DEFAULT_REGION, else the profile's region."""
    found = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or session_region
    if not found:
        raise UserError(
            "resources.infra: no AWS region; write infra: aws/us-east-1, "
            "or set AWS_REGION, or a region in your AWS profile"
        )
    return found


# ---- boto3 edge ---------------------------------------------------------------------------


def session(settings: AwsSettings) -> Any:
    import boto3
    import botocore.exceptions

    try:
        return boto3.Session(profile_name=settings.profile) if settings.profile else boto3.Session()
    except botocore.exceptions.ProfileNotFound:
        raise UserError(
            f"{settings.origin('profile')}: AWS profile '{settings.profile}' not found in your AWS config"
        ) from None


def client(sess: Any, service: str, region: str, settings: AwsSettings, *, read_timeout: int = 60,
           attempts: int = 3) -> Any:
    """A boto3 client; `endpoint_url` only when the override is set. A caller that must not wait
    long for an answer (a watcher deciding whether nodes are lost) asks for shorter timeouts."""
    from botocore.config import Config

    cfg = Config(retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=5,
                 read_timeout=read_timeout)
    kwargs: dict[str, Any] = {"region_name": region, "config": cfg}
    if settings.endpoint_url:
        kwargs["endpoint_url"] = settings.endpoint_url
    return sess.client(service, **kwargs)


def check_credentials(sess: Any) -> None:
    creds = sess.get_credentials()
    if creds is None:
        raise UserError(
            "no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "or AWS_PROFILE (aws configure / aws sso login)"
        )


def _call(what: str, fn: Any, settings: AwsSettings, **kwargs: Any) -> Any:
    """Run one EC2 call; credential and connection failures become one UserError line."""
    import botocore.exceptions

    try:
        return fn(**kwargs)
    except botocore.exceptions.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        msg = exc.response.get("Error", {}).get("Message", str(exc))
        if code in ("AuthFailure", "UnrecognizedClientException", "InvalidClientTokenId",
                    "SignatureDoesNotMatch", "ExpiredToken", "RequestExpired"):
            raise UserError(f"AWS rejected the credentials ({code}): {msg}") from None
        if code in ("UnauthorizedOperation", "AccessDenied", "AccessDeniedException"):
            service = "ssm" if what == "GetParameter" else "ec2"
            raise UserError(f"AWS denied {what} ({code}); the credentials need {service}:{what}") from None
        raise
    except botocore.exceptions.NoCredentialsError:
        raise UserError("no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                        "or AWS_PROFILE") from None
    except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError) as exc:
        where = settings.endpoint_url or "EC2"
        hint = f" (set by {settings.origin('endpoint_url')})" if settings.endpoint_url else ""
        raise UserError(f"cannot reach {where}{hint}: {exc}") from None


def describe_instance_type(ec2: Any, instance_type: str, settings: AwsSettings) -> InstanceTypeInfo:
    import botocore.exceptions

    try:
        resp = _call("DescribeInstanceTypes", ec2.describe_instance_types, settings, InstanceTypes=[instance_type])
    except botocore.exceptions.ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "InvalidInstanceType":
            raise UserError(
                f"resources.instance_type '{instance_type}': no such EC2 instance type "
                "(see `aws ec2 describe-instance-types`)"
            ) from None
        raise
    items = resp.get("InstanceTypes") or []
    if not items:
        raise UserError(f"resources.instance_type '{instance_type}': no such EC2 instance type")
    return parse_instance_type(items[0])


def offered_zones(ec2: Any, instance_type: str, settings: AwsSettings) -> tuple[str, ...]:
    zones: set[str] = set()
    kwargs: dict[str, Any] = {
        "LocationType": "availability-zone",
        "Filters": [{"Name": "instance-type", "Values": [instance_type]}],
    }
    while True:
        resp = _call("DescribeInstanceTypeOfferings", ec2.describe_instance_type_offerings, settings, **kwargs)
        zones.update(o["Location"] for o in resp.get("InstanceTypeOfferings") or [])
        token = resp.get("NextToken")
        if not token:
            return tuple(sorted(zones))
        kwargs["NextToken"] = token


def ssm_parameter(ssm: Any, name: str, settings: AwsSettings) -> str | None:
    """An SSM parameter's value, or None when it does not exist."""
    import botocore.exceptions

    try:
        return str(_call("GetParameter", ssm.get_parameter, settings, Name=name)["Parameter"]["Value"])
    except botocore.exceptions.ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "ParameterNotFound":
            raise
        return None


def check_bastion_image(region: str, settings: AwsSettings) -> None:
    """The bastion's AMI parameter must exist in the region (it does in AWS's commercial regions)."""
    sess = session(settings)
    if ssm_parameter(client(sess, "ssm", region, settings), BASTION_SSM_PARAMETER, settings) is None:
        raise UserError(
            f"the bastion for nodes without public IPs needs the Ubuntu AMI parameter {BASTION_SSM_PARAMETER}, "
            f"which does not exist in {region}; pick another region"
        )


def check_image(ec2: Any, ssm: Any, image_id: str | None, region: str, settings: AwsSettings) -> str:
    """The node AMI: `image_id` if it exists in the region, else the Deep Learning AMI id from SSM."""
    import botocore.exceptions

    if image_id:
        try:
            images = _call("DescribeImages", ec2.describe_images, settings, ImageIds=[image_id]).get("Images") or []
        except botocore.exceptions.ClientError as exc:
            if not exc.response.get("Error", {}).get("Code", "").startswith("InvalidAMIID"):
                raise
            images = []
        if not images:
            raise UserError(f"resources.image_id '{image_id}': no such AMI in {region} (AMIs are per region)")
        return image_id
    value = ssm_parameter(ssm, DLAMI_SSM_PARAMETER, settings)
    if value is None:
        raise UserError(
            f"resources.image_id: none given, and the Deep Learning AMI parameter {DLAMI_SSM_PARAMETER} "
            f"does not exist in {region}; set resources.image_id to an AMI id"
        )
    return value


def check_aws(
    req: ClusterRequest,
    *,
    settings: AwsSettings | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[ClusterRequest, AwsPreflight]:
    """All AWS preflight checks, in the order a user would fix them.

    Returns the request with `region`, `zone`, `instance_type` (and, when the
    task gave only an instance type, `accelerator` / `gpus_per_node`) filled in.
    """
    env = os.environ if env is None else env
    settings = settings or aws_settings(env)
    instance_type = resolve_instance_type(req.instance_type, req.accelerator, req.gpus_per_node, req.cpus, req.memory)
    sess = session(settings)
    check_credentials(sess)
    region = resolve_region(req.region, sess.region_name, env)
    ec2 = client(sess, "ec2", region, settings)
    info = describe_instance_type(ec2, instance_type, settings)
    if req.instance_type:
        check_accelerators(info, req.accelerator, req.gpus_per_node)
    check_efa(info, req.network_tier)
    zones = offered_zones(ec2, instance_type, settings)
    zone = choose_zone(zones, req.zone, instance_type=instance_type, region=region)
    check_image(ec2, client(sess, "ssm", region, settings), req.image_id, region, settings)
    efa = req.network_tier == "best" and settings.efa
    new = replace(
        req,
        region=region,
        zone=zone,
        instance_type=instance_type,
        accelerator=req.accelerator or info.accelerator,
        gpus_per_node=req.gpus_per_node or info.accelerator_count,
    )
    return new, AwsPreflight(
        region=region,
        zone=zone,
        zone_pinned=req.zone is not None,
        offered_zones=zones,
        instance=info,
        efa=efa,
    )
