"""AWS provider: a ClusterRequest -> a Terraform JSON root calling aws-gpu-instance-group.

`prepare(req)` runs the boto3 preflight (gpuctl.providers.aws.preflight) and records what it
learnt in `req.extra` (keys `aws.*`, strings), so `root_config` stays a pure
function of the request and the user's AWS settings:

- EFA: on when `network_tier: best` (and not switched off by `aws.efa: false`,
  which exists for emulators); the module then attaches every EFA interface
  the type has (32 on p5.48xlarge).
- Placement: `aws.placement: auto` (default) gives a `cluster` placement group
  exactly when EFA is on; `cluster` always; `none` never (emulators, or types
  that cannot join one, such as T3).
- Reachability: nodes with one network interface get a public IP; nodes with
  several (EFA types) cannot, so they are reached through a bastion (ProxyJump).
  SSH is open only to `aws.ssh_ingress_cidrs` / `GPUCTL_SSH_INGRESS_CIDRS`;
  with none, gpuctl opens nothing and says so.
- The endpoint override (`GPUCTL_AWS_ENDPOINT_URL`) adds the `skip_*` flags to
  the provider block and gives terraform AWS_ENDPOINT_URL_<SERVICE> for the
  services the module calls (`terraform_env`), and nothing else. Not an
  `endpoints` block: the provider validates every one of its ~300 service
  attributes on each configure, which made each plan and apply 2.5x the CPU.
- Identity: SkyPilot's `remote_identity` (the task's `config.aws.remote_identity`,
  else `aws.remote_identity` of gpuctl's config or ~/.sky/config.yaml) names the
  nodes' IAM instance profile (module input `iam_instance_profile`), which is
  how jobs reach S3 buckets without credentials of their own.

Zones: a new cluster without a zone in `infra` goes to the first zone (sorted)
offering the type, and on InsufficientInstanceCapacity moves to the next one
(at most 3): the failed attempt is destroyed first, so the retry starts clean
(EFA cannot span zones; half a cluster in the old zone is of no use). A cluster
that already has nodes stays in their zone -- a re-apply never moves running
nodes -- and so does one whose zone `infra` names.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar

from gpuctl.common.config import CIDRS_ENV, AwsSettings, aws_settings, config_path, instance_profile
from gpuctl.common.errors import ProvisionError, UserError
from gpuctl.common.paths import cluster_terraform_dir, readable_state_file, terraform_dir
from gpuctl.providers.aws import hostkeys, instances, prices
from gpuctl.providers.aws.catalog import (default_cpu_instance_type, default_instance_type, first_available,
                                          gpudirect_rdma, resolve_instance_type)
from gpuctl.providers.aws.preflight import (
    BASTION_SSM_PARAMETER,
    DLAMI_SSM_PARAMETER,
    MAX_ZONE_ATTEMPTS,
    check_aws,
    check_bastion_image,
    failover_line,
    next_zone,
)
from gpuctl.providers.base import MODULE_NAME as ROOT_MODULE_NAME
from gpuctl.providers.base import SPOT_NOTICE_URL_ENV, BaseProvider, ClusterRef, PowerOff, Price
from gpuctl.spec.request import ClusterRequest, remote_identity_key

if TYPE_CHECKING:
    from gpuctl.spec import Resources

MODULE_NAME = "aws-gpu-instance-group"
MODULE_KEY = ROOT_MODULE_NAME  # module "cluster" { ... } in the rendered root
IMDS_URL = "http://169.254.169.254"  # the instance metadata service, as every EC2 instance sees it
PROVIDER_VERSION = ">= 5.74, < 7"  # 5.74: first release that accepts efa-only interfaces
MODULE_NAME_MAX = 32  # the module prefixes resource names with the cluster name
ENDPOINT_SERVICES = ("ec2", "sts", "iam", "ssm")
# ansible_inventory: for users of the cluster's root (`terraform output -raw ansible_inventory`)
PASSED_OUTPUTS = ("nodes", "ssh_user", "bastion", "efa_interfaces_per_node", "placement_group_name",
                  "availability_zone", "ansible_inventory")

# req.extra: the task's config.aws.remote_identity as JSON (spec/request.py puts it there)
X_REMOTE_IDENTITY = remote_identity_key("aws")
# req.extra keys written by prepare()
X_EFA_INTERFACES = "aws.efa_interfaces"
X_OFFERED_ZONES = "aws.offered_zones"
X_ZONE_PINNED = "aws.zone_pinned"
X_TRIED_ZONES = "aws.tried_zones"
PINNED_BY_INFRA = "infra"  # X_ZONE_PINNED values; "0": gpuctl chose the zone
PINNED_BY_NODES = "nodes"

T = TypeVar("T")


def module_source() -> Path:
    return terraform_dir() / "modules" / MODULE_NAME


def efa_enabled(req: ClusterRequest, settings: AwsSettings) -> bool:
    return req.network_tier == "best" and settings.efa


def placement_mode(req: ClusterRequest, settings: AwsSettings) -> str:
    """"create" or "none" for the module's placement_group.mode."""
    if settings.placement == "cluster":
        return "create"
    if settings.placement == "none":
        return "none"
    return "create" if efa_enabled(req, settings) else "none"


def placement_group_name(req: ClusterRequest) -> str:
    """Named after cluster and zone: a group once used in one zone cannot take nodes in
    another, so a capacity failover to a new zone gets a new group."""
    return f"{req.name}-{req.zone}" if req.zone else req.name


def interfaces_per_node(req: ClusterRequest, settings: AwsSettings) -> int:
    if not efa_enabled(req, settings):
        return 1
    return max(1, int(req.extra.get(X_EFA_INTERFACES, "1") or 1))


def access_mode(req: ClusterRequest, settings: AwsSettings) -> str:
    """How the controller reaches the nodes: "public", "bastion" or "closed"."""
    if not settings.ssh_ingress_cidrs:
        return "closed"
    return "bastion" if interfaces_per_node(req, settings) > 1 else "public"


def provider_block(region: str, settings: AwsSettings) -> dict[str, Any]:
    # max_retries bounds how long the provider retries InsufficientInstanceCapacity
    # before failing, i.e. how soon the zone failover can act (gpuctl.common.config).
    block: dict[str, Any] = {"region": region, "max_retries": settings.max_retries}
    if settings.profile:
        block["profile"] = settings.profile
    if settings.endpoint_url:  # the endpoints themselves: endpoint_env
        block.update(
            skip_credentials_validation=True,
            skip_requesting_account_id=True,
            skip_metadata_api_check=True,
            skip_region_validation=True,
        )
    return block


def endpoint_env(url: str) -> dict[str, str]:
    """The provider's environment that sends the module's AWS calls to `url` (an emulator)."""
    return {f"AWS_ENDPOINT_URL_{svc.upper()}": url for svc in ENDPOINT_SERVICES}


def node_identity(req: ClusterRequest, settings: AwsSettings) -> tuple[str | None, str]:
    """(the nodes' IAM instance profile or None, where that was said): the task's
    config.aws.remote_identity, else the user's aws.remote_identity; UserError for a bad value."""
    if X_REMOTE_IDENTITY in req.extra:
        where = "config.aws.remote_identity"
        return instance_profile(json.loads(req.extra[X_REMOTE_IDENTITY]), req.name, where=where), f"the task's {where}"
    if settings.remote_identity is not None:
        where = settings.origin("remote_identity")
        return instance_profile(settings.remote_identity, req.name, where=where), where
    return None, ""


def module_inputs(req: ClusterRequest, settings: AwsSettings, *, ssh_public_key: str) -> dict[str, Any]:
    if not req.instance_type:
        raise ValueError("ClusterRequest.instance_type is unset; run prepare() first")
    efa = efa_enabled(req, settings)
    mode = placement_mode(req, settings)
    inputs: dict[str, Any] = {
        "source": str(module_source()),
        "name": req.name,
        "instance_type": req.instance_type,
        "node_count": req.num_nodes,
        "availability_zone": req.zone,
        "ssh_public_key": ssh_public_key.strip(),
        "ssh_ingress_cidrs": list(settings.ssh_ingress_cidrs),
        "efa": efa,
        "placement_group": {"mode": mode, "name": placement_group_name(req)} if mode == "create" else {"mode": "none"},
        "market": "spot" if req.use_spot else "on-demand",
        **({"shutdown_behavior": "terminate"} if req.autodown else {}),
        "bastion": ({"enabled": True, "ami_ssm_parameter": BASTION_SSM_PARAMETER}
                    if access_mode(req, settings) == "bastion" else {"enabled": False}),
        "tags": {"gpuctl-managed": "true"},
    }
    if req.image_id:
        inputs["ami_id"] = req.image_id
    else:
        inputs["ami_ssm_parameter"] = DLAMI_SSM_PARAMETER
    if req.disk_size:
        inputs["root_volume_size"] = int(req.disk_size)
    profile, _ = node_identity(req, settings)
    if profile:
        inputs["iam_instance_profile"] = profile
    if req.gpus_per_node:
        inputs["gpus_per_node"] = req.gpus_per_node
    return inputs


def render_root(req: ClusterRequest, settings: AwsSettings, *, ssh_public_key: str) -> dict[str, Any]:
    """The cluster's Terraform root as JSON-ready dict (main.tf.json)."""
    if not req.region:
        raise ValueError("ClusterRequest.region is unset; run prepare() first")
    return {
        "terraform": {"required_providers": {"aws": {"source": "hashicorp/aws", "version": PROVIDER_VERSION}}},
        "provider": {"aws": provider_block(req.region, settings)},
        "module": {MODULE_KEY: module_inputs(req, settings, ssh_public_key=ssh_public_key)},
        "output": {name: {"value": f"${{module.{MODULE_KEY}.{name}}}"} for name in PASSED_OUTPUTS},
    }


def describe(req: ClusterRequest, settings: AwsSettings, outputs: Mapping[str, Any] | None = None) -> list[str]:
    """Lines for the plan/apply summary: fabric, placement, and how nodes are reached.

    `outputs` (planned or applied output values) win over what preflight learnt,
    so the EFA count shown is the one Terraform computed from the instance type.
    """
    values = {k: (v.get("value") if isinstance(v, Mapping) and "value" in v else v) for k, v in (outputs or {}).items()}
    efa = efa_enabled(req, settings)
    lines = []
    accel = f" ({req.gpus_per_node} x {req.accelerator} each)" if req.accelerator and req.gpus_per_node else ""
    market = "spot" if req.use_spot else "on-demand"
    lines.append(f"AWS {req.region}/{req.zone}: {req.num_nodes} x {req.instance_type}{accel}, {market}")
    efa_count = values.get("efa_interfaces_per_node")
    if efa_count is None:
        efa_count = interfaces_per_node(req, settings) if efa else 0
    if efa:
        lines.append(f"EFA: {efa_count} interfaces per node")
    elif req.network_tier == "best":
        lines.append(f"EFA: off ({settings.origin('efa')} says efa: false; network_tier: best asked for it)")
    else:
        lines.append("EFA: off (network_tier: standard)")
    mode = placement_mode(req, settings)
    if mode == "create":
        name = values.get("placement_group_name") or placement_group_name(req)
        lines.append(f"Placement group: {name} (strategy cluster)")
    elif settings.placement == "none":
        lines.append(f"Placement group: none ({settings.origin('placement')} says none)")
    else:
        lines.append("Placement group: none (only with network_tier: best, or aws.placement: cluster)")
    access = access_mode(req, settings)
    cidrs = ", ".join(settings.ssh_ingress_cidrs)
    if access == "public":
        lines.append(f"SSH: to each node's public IP, open to {cidrs}")
    elif access == "bastion":
        lines.append(f"SSH: nodes have no public IP ({interfaces_per_node(req, settings)} network interfaces); "
                     f"ProxyJump through a bastion open to {cidrs}")
    else:
        lines.append(f"SSH: closed (no ssh_ingress_cidrs); open it with aws.ssh_ingress_cidrs in {config_path()} "
                     f"or {CIDRS_ENV}=YOUR.IP/32")
    profile, where = node_identity(req, settings)
    if profile:
        lines.append(f"IAM instance profile: {profile} ({where})")
    return lines


def retry_zone(req: ClusterRequest, error: BaseException, *,
               max_attempts: int = MAX_ZONE_ATTEMPTS) -> tuple[ClusterRequest | None, str | None]:
    """After a failed apply: the request for the next zone, and the line to print.

    Returns (None, None) when the failure is not a capacity shortage; (None, line)
    when capacity ran out but no zone is left (or the task pinned its zone).
    """
    if not (isinstance(error, ProvisionError) and error.insufficient_capacity):
        return None, None
    zone = req.zone or "?"
    tried = [z for z in req.extra.get(X_TRIED_ZONES, "").split(",") if z] or [zone]
    pinned = req.extra.get(X_ZONE_PINNED)
    if pinned == PINNED_BY_INFRA:
        return None, f"{zone} has no {req.instance_type} capacity; resources.infra pins that zone, so no failover"
    if pinned == PINNED_BY_NODES:
        return None, f"{zone} has no {req.instance_type} capacity; the cluster's nodes are in that zone, so no failover"
    offered = [z for z in req.extra.get(X_OFFERED_ZONES, "").split(",") if z]
    nxt = next_zone(offered, tried, max_attempts)
    line = failover_line(zone, req.instance_type or "", nxt, len(tried) + 1, max_attempts)
    if nxt is None:
        return None, line
    extra = {**req.extra, X_TRIED_ZONES: ",".join([*tried, nxt])}
    return replace(req, zone=nxt, extra=extra), line


def with_capacity_failover(req: ClusterRequest, attempt: Callable[[ClusterRequest], T], *,
                           on_progress: Callable[[str], None] = lambda _: None,
                           max_attempts: int = MAX_ZONE_ATTEMPTS) -> tuple[ClusterRequest, T]:
    """Run `attempt(req)`; on InsufficientInstanceCapacity, re-run it in the next zone.

    Returns the request that succeeded (its zone is where the nodes are) and the
    attempt's result; re-raises the last error when no zone is left.
    """
    while True:
        try:
            return req, attempt(req)
        except ProvisionError as exc:
            nxt, line = retry_zone(req, exc, max_attempts=max_attempts)
            if line:
                on_progress(line)
            if nxt is None:
                raise
            req = nxt


def node_zones_in_state(state_file: Path) -> set[str]:
    """Zones of the node instances recorded in a cluster's Terraform state (empty if none)."""
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return set()
    zones = set()
    for res in state.get("resources") or []:
        if res.get("mode") == "managed" and res.get("type") == "aws_instance" and res.get("name") == "node":
            for inst in res.get("instances") or []:
                zone = (inst.get("attributes") or {}).get("availability_zone")
                if zone:
                    zones.add(str(zone))
    return zones


def state_file_of(name: str) -> Path:
    """The cluster's Terraform state file, or the snapshot of its remote state (shared state)."""
    return readable_state_file(cluster_terraform_dir(name))


def efa_requested(request: Mapping[str, Any] | None) -> bool:
    """The rule "AWS + network_tier: best means EFA", for a recorded request (cluster.json)."""
    return (request or {}).get("network_tier") == "best"


def efa_fabric_env(*, efa: bool, instance_type: str | None = None) -> dict[str, str]:
    """The static NCCL/libfabric defaults of EFA: what a node's fabric.env gets only where
    detection cannot see (its RDMA devices could not be read; node/fabricprobe.py
    decides everywhere else, from the node itself). The task's envs override them either way.

    On EFA nodes NCCL must load aws-ofi-nccl (`NET/OFI`) or it silently falls
    back to sockets; these are the awsome-distributed-training defaults.
    """
    if not efa:
        return {}
    env = {"FI_PROVIDER": "efa", "NCCL_SOCKET_IFNAME": "^lo,docker", "FI_EFA_FORK_SAFE": "1"}
    if gpudirect_rdma(instance_type):
        env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return env


class AwsProvider(BaseProvider):
    """The provider-registry object for `infra: aws` (`PROVIDER` below)."""

    name = "aws"
    module_name = MODULE_NAME
    checks_console_host_keys = True  # instances print their host keys to the EC2 console
    # Replacing the instance redoes what hangs on its id (aws_ec2_instance_state, aws_eip) by
    # Terraform's own graph; the launch template, subnet and groups stay.
    node_resource = "aws_instance.node"
    power_resource = "aws_ec2_instance_state.node"

    def __init__(self, settings: AwsSettings | None = None) -> None:
        self._settings = settings

    @property
    def settings(self) -> AwsSettings:
        """Given settings, else the config file and environment as they are now."""
        return self._settings if self._settings is not None else aws_settings()

    def check(self, req: ClusterRequest) -> None:
        """What is wrong before any AWS call: the name's length, remote_identity, the instance type."""
        if len(req.name) > MODULE_NAME_MAX:
            raise UserError(
                f"cluster name '{req.name}': AWS clusters take at most {MODULE_NAME_MAX} characters; pass a shorter -c NAME"
            )
        node_identity(req, self.settings)
        resolve_instance_type(req.instance_type, req.accelerator, req.gpus_per_node, req.cpus, req.memory)

    def prepare(self, req: ClusterRequest) -> ClusterRequest:
        """Preflight (credentials, region, type, zone, EFA); UserError on the first problem."""
        self.check(req)
        pinned = PINNED_BY_INFRA if req.zone else "0"
        zones = node_zones_in_state(state_file_of(req.name))
        if zones:
            here = sorted(zones)[0]
            if req.zone and req.zone not in zones:
                raise UserError(
                    f"resources.infra: cluster '{req.name}' has nodes in {here}, not {req.zone}; "
                    f"keep the zone, or tear it down first (gpuctl down {req.name})"
                )
            req, pinned = replace(req, zone=here), PINNED_BY_NODES
        new, pre = check_aws(req, settings=self.settings)
        extra = {
            **new.extra,
            # as the module counts them: one EFA per network card, at most EfaInfo's maximum
            X_EFA_INTERFACES: str(min(pre.instance.efa_interfaces, max(pre.instance.network_cards, 1))),
            X_OFFERED_ZONES: ",".join(pre.offered_zones),
            X_ZONE_PINNED: pinned,
            X_TRIED_ZONES: pre.zone,
        }
        new = replace(new, extra=extra)
        if access_mode(new, self.settings) == "bastion":
            check_bastion_image(pre.region, self.settings)
        return new

    def root_config(self, req: ClusterRequest, *, cluster_dir: Path, ssh_public_key: str,
                    internal_public_key: str = "") -> dict[str, Any]:
        # Not authorized at boot: a worker's host key is known only at first contact (its console
        # prints fingerprints minutes later), so each node is prepared from the controller.
        return render_root(req, self.settings, ssh_public_key=ssh_public_key)

    def terraform_env(self) -> dict[str, str]:
        url = self.settings.endpoint_url
        return endpoint_env(url) if url else {}

    def describe(self, req: ClusterRequest, outputs: Mapping[str, Any] | None = None) -> list[str]:
        return describe(req, self.settings, outputs)

    def price(self, request: Mapping[str, Any]) -> Price:
        return prices.price_of(request.get("instance_type"), request.get("region"))

    def node_states(self, node_ids: list[str], region: str | None) -> dict[str, tuple[str, float | None]]:
        """EC2's state of each instance (one DescribeInstances call); an instance EC2 no longer lists is
        terminated. {} when EC2 cannot be asked (no credentials, no network): nothing is concluded."""
        return instances.instance_states(node_ids, region)

    def spot_notice(self, request: Mapping[str, Any]) -> dict[str, Any] | None:
        """Spot nodes poll the instance metadata every 5 s, as SkyPilot does: EC2 gives about two
        minutes' notice, time for the ranks to checkpoint after their SIGTERM."""
        if not request.get("use_spot"):
            return super().spot_notice(request)
        return {"url": os.environ.get(SPOT_NOTICE_URL_ENV) or IMDS_URL, "interval_s": 5.0}

    def lost_nodes(self, cluster_dir: Path, inv: ClusterRef, request: Mapping[str, Any] | None) -> dict[int, str]:
        """Nodes whose instance is not running (stopped, stopping, shutting-down, terminated, or no
        longer listed), with "preempted (spot)" where the spot market took it back; one
        DescribeInstances with short timeouts, {} when EC2 cannot be asked (the caller probes)."""
        ranks = {n.node_id: n.rank for n in inv.nodes}
        region = inv.region or (request or {}).get("region")
        return {ranks[i]: why for i, why in instances.lost_instances(list(ranks), region).items()}

    def autostop_problem(self, request: Mapping[str, Any], *, down: bool) -> str | None:
        if not down and request.get("use_spot"):
            return ("spot nodes cannot be stopped (a one-time request ends when stopped); use autodown: --down, "
                    "or autostop.down: true")
        return None

    def stop_problem(self, request: Mapping[str, Any]) -> str | None:
        if request.get("use_spot"):
            return ("spot nodes cannot be stopped (a one-time spot request ends when its instance stops); "
                    f"`gpuctl down {request.get('name') or 'NAME'}` removes the cluster")
        return None

    def power_inputs(self, running: bool) -> dict[str, Any]:
        """The module's instance_state: the instances stop (EBS volumes, private addresses and host keys
        kept) and start again as the same nodes."""
        return {"instance_state": "running" if running else "stopped"}

    def power_off(self, cluster_dir: Path, ranks: list[int], ssh_user: str, request: Mapping[str, Any],
                  *, down: bool) -> PowerOff:
        """Each node shuts itself down; the instance's shutdown behaviour (the module's
        shutdown_behavior, "terminate" for a cluster applied to autodown) makes that a stop or a
        termination. The head needs no AWS credentials for it."""
        problem = self.autostop_problem(request, down=down)
        if problem:
            raise UserError(problem)
        if down and not request.get("autodown"):
            raise UserError("this cluster's nodes stop, not terminate, when shut down: apply its task with --down "
                            "(or resources.autostop.down: true) to make them terminate, then set autodown")
        off = (["sudo", "-n"] if ssh_user != "root" else []) + ["shutdown", "-h", "now"]
        notes = [] if down else ["stopped nodes keep their EBS volumes, which bill until `gpuctl down`"]
        return PowerOff(workers={r: off for r in ranks if r != 0}, head=[off], removes=down, notes=notes)

    def retry_zone(self, req: ClusterRequest, error: BaseException) -> tuple[ClusterRequest | None, str | None]:
        """provision()'s hook after a failed apply: the request for the next zone, if any.

        provision() destroys what the failed attempt made (a subnet, perhaps some
        nodes in the zone without capacity) before applying it, so the next apply
        starts clean; only ever for a cluster that had no nodes before (see prepare).
        """
        return retry_zone(req, error)

    def resources_problem(self, resources: "Resources") -> tuple[str, str] | None:
        """No AWS instance type for the accelerators / cpus / memory asked for (an instance_type given
        is taken as it is; preflight asks EC2 about it)."""
        if resources.instance_type:
            return None
        try:
            if resources.accelerators:
                default_instance_type(*first_available(resources.accelerators))
            else:
                default_cpu_instance_type(resources.cpus, resources.memory)
        except UserError as err:
            field = "accelerators" if resources.accelerators else "cpus" if resources.cpus else "memory"
            return field, err.message.removeprefix("resources.accelerators ").removeprefix("resources: ")
        return None

    def pick_accelerator(self, req: ClusterRequest, accelerators: Mapping[str, float]) -> tuple[str, float]:
        """Of several choices, the first AWS sells (an instance_type given decides by itself)."""
        return next(iter(accelerators.items())) if req.instance_type else first_available(accelerators)

    def instance_type(self, req: ClusterRequest) -> str | None:
        return resolve_instance_type(req.instance_type, req.accelerator, req.gpus_per_node, req.cpus, req.memory)

    def check_reach(self) -> None:
        require_ssh_reach()

    def expected_fabric(self, request: Mapping[str, Any] | None) -> str | None:
        return "efa" if efa_requested(request) else None

    def fabric_env(self, request: Mapping[str, Any] | None) -> dict[str, str]:
        itype = (request or {}).get("instance_type") or None
        return efa_fabric_env(efa=efa_requested(request), instance_type=itype)

    def expected_efa(self, request: Mapping[str, Any] | None) -> int | None:
        """The interfaces preflight chose for the instance type (p5 32, p5en 16, p4d 4), where EFA was asked for."""
        if not efa_requested(request):
            return None
        extra = (request or {}).get("extra") or {}
        try:
            return max(1, int(extra.get(X_EFA_INTERFACES) or 1))
        except (TypeError, ValueError):
            return None

    def bucket_region(self, region: str | None) -> str | None:
        return region  # S3 in the cluster's own region

    def console_host_keys(self, node_id: str, region: str | None, known_hosts: Path,
                          alias: str) -> tuple[set[str], list[str]]:
        """The fingerprints cloud-init printed to the EC2 console, and the learned ones it did not."""
        printed = hostkeys.console_fingerprints(hostkeys.console_output(node_id, region))
        return printed, hostkeys.mismatched(hostkeys.learned_fingerprints(known_hosts, alias), printed)


PROVIDER = AwsProvider()


def require_ssh_reach(env: Mapping[str, str] | None = None) -> None:
    """Refuse, before anything is created, a job gpuctl could not reach: with no
    ssh_ingress_cidrs nothing opens port 22, so sync, setup and run would fail."""
    if not aws_settings(env).ssh_ingress_cidrs:
        raise UserError(f"aws: SSH to the nodes is closed (no ssh_ingress_cidrs), so gpuctl could not run the job; "
                        f"set aws.ssh_ingress_cidrs in {config_path()} or {CIDRS_ENV}=YOUR.IP/32, "
                        f"or use --provision-only")
