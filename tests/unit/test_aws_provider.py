"""providers/aws: the rendered Terraform root, the summary lines, and capacity failover."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from gpuctl.common.config import AwsSettings
from gpuctl.common.errors import ProvisionError, UserError
from gpuctl.common.paths import terraform_dir
from gpuctl.providers.aws import provider as aws_provider
from gpuctl.providers.aws.provider import AwsProvider, describe, render_root, retry_zone, with_capacity_failover
from gpuctl.spec.request import ClusterRequest

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMP gpuctl\n"
OFFERED = "us-east-1a,us-east-1b,us-east-1c,us-east-1d"


def p5_request(**kw: object) -> ClusterRequest:
    base = ClusterRequest(
        name="llm", num_nodes=4, cloud="aws", region="us-east-1", zone="us-east-1a",
        instance_type="p5.48xlarge", accelerator="H100", gpus_per_node=8, network_tier="best",
        extra={aws_provider.X_EFA_INTERFACES: "32", aws_provider.X_OFFERED_ZONES: OFFERED, aws_provider.X_ZONE_PINNED: "0",
               aws_provider.X_TRIED_ZONES: "us-east-1a"},
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def module_variables() -> set[str]:
    text = "".join(p.read_text() for p in (terraform_dir() / "modules" / aws_provider.MODULE_NAME).glob("*.tf"))
    return set(re.findall(r'^variable\s+"([^"]+)"', text, flags=re.M))


def module_outputs() -> set[str]:
    text = "".join(p.read_text() for p in (terraform_dir() / "modules" / aws_provider.MODULE_NAME).glob("*.tf"))
    return set(re.findall(r'^output\s+"([^"]+)"', text, flags=re.M))


# ---- root config ---------------------------------------------------------------------------------


def test_root_for_real_aws_has_no_endpoints_or_skips() -> None:
    root = render_root(p5_request(), AwsSettings(), ssh_public_key=KEY)
    assert root["terraform"]["required_providers"]["aws"] == {"source": "hashicorp/aws", "version": ">= 5.74, < 7"}
    assert root["provider"] == {"aws": {"region": "us-east-1", "max_retries": 8}}


def test_root_module_inputs_for_p5_best() -> None:
    mod = render_root(p5_request(), AwsSettings(ssh_ingress_cidrs=("203.0.113.7/32",)), ssh_public_key=KEY)["module"]["cluster"]
    assert Path(mod["source"]).is_absolute()
    assert Path(mod["source"]) == terraform_dir() / "modules/aws-gpu-instance-group"
    assert (mod["name"], mod["instance_type"], mod["node_count"], mod["availability_zone"]) == (
        "llm", "p5.48xlarge", 4, "us-east-1a")
    assert mod["ssh_public_key"] == KEY.strip()
    assert mod["efa"] is True
    assert mod["placement_group"] == {"mode": "create", "name": "llm-us-east-1a"}
    assert mod["market"] == "on-demand"
    assert mod["ssh_ingress_cidrs"] == ["203.0.113.7/32"]
    # 32 interfaces: EC2 refuses a public IP, so nodes are reached through the bastion
    assert mod["bastion"] == {
        "enabled": True,
        "ami_ssm_parameter": "/aws/service/canonical/ubuntu/server/22.04/stable/current/amd64/hvm/ebs-gp2/ami-id",
    }
    assert "ami_id" not in mod and "root_volume_size" not in mod
    assert mod["ami_ssm_parameter"] == "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"


def test_root_inputs_are_module_variables_and_outputs_exist() -> None:
    req = p5_request(image_id="ami-0123456789abcdef0", disk_size=500, use_spot=True)
    root = render_root(req, AwsSettings(), ssh_public_key=KEY)
    mod = root["module"]["cluster"]
    assert "ami_ssm_parameter" not in mod
    assert mod["ami_id"] == "ami-0123456789abcdef0" and mod["root_volume_size"] == 500 and mod["market"] == "spot"
    assert set(mod) - {"source"} <= module_variables()
    assert set(root["output"]) <= module_outputs()
    assert root["output"]["nodes"] == {"value": "${module.cluster.nodes}"}


def test_standard_tier_has_no_efa_and_no_placement_group() -> None:
    req = p5_request(instance_type="t3.micro", network_tier="standard", accelerator=None, gpus_per_node=0,
                     extra={aws_provider.X_EFA_INTERFACES: "0"})
    mod = render_root(req, AwsSettings(ssh_ingress_cidrs=("10.0.0.0/8",)), ssh_public_key=KEY)["module"]["cluster"]
    assert mod["efa"] is False
    assert mod["placement_group"] == {"mode": "none"}
    assert mod["bastion"] == {"enabled": False}  # one interface: public IP


def test_endpoint_override_adds_skips_and_gives_terraform_the_endpoints() -> None:
    s = AwsSettings(endpoint_url="http://127.0.0.1:5000")
    root = render_root(p5_request(), s, ssh_public_key=KEY)
    # no `endpoints` block: the provider validates all ~300 of its attributes on every configure
    assert root["provider"]["aws"] == {
        "region": "us-east-1",
        "max_retries": 8,
        "skip_credentials_validation": True,
        "skip_requesting_account_id": True,
        "skip_metadata_api_check": True,
        "skip_region_validation": True,
    }
    assert AwsProvider(s).terraform_env() == {
        "AWS_ENDPOINT_URL_EC2": "http://127.0.0.1:5000", "AWS_ENDPOINT_URL_STS": "http://127.0.0.1:5000",
        "AWS_ENDPOINT_URL_IAM": "http://127.0.0.1:5000", "AWS_ENDPOINT_URL_SSM": "http://127.0.0.1:5000"}
    assert AwsProvider(AwsSettings()).terraform_env() == {}  # real AWS: the user's own environment only
    # the override alone changes nothing about the cluster itself
    assert root["module"] == render_root(p5_request(), AwsSettings(), ssh_public_key=KEY)["module"]


def test_placement_and_efa_switches() -> None:
    mod = render_root(p5_request(), AwsSettings(placement="none", efa=False), ssh_public_key=KEY)["module"]["cluster"]
    assert mod["placement_group"] == {"mode": "none"} and mod["efa"] is False
    std = p5_request(network_tier="standard")
    mod = render_root(std, AwsSettings(placement="cluster"), ssh_public_key=KEY)["module"]["cluster"]
    assert mod["placement_group"]["mode"] == "create" and mod["efa"] is False


def test_profile_goes_to_provider_block() -> None:
    assert render_root(p5_request(), AwsSettings(profile="train"), ssh_public_key=KEY)["provider"]["aws"]["profile"] == "train"


def test_long_cluster_name_is_a_user_error_before_any_aws_call() -> None:
    with pytest.raises(UserError, match="at most 32 characters"):
        AwsProvider(AwsSettings()).prepare(p5_request(name="a" * 33))


# ---- summary ---------------------------------------------------------------------------------------


def test_describe_p5_with_bastion() -> None:
    s = AwsSettings(ssh_ingress_cidrs=("203.0.113.7/32",))
    lines = describe(p5_request(), s, {"efa_interfaces_per_node": {"value": 32}, "placement_group_name": "llm-us-east-1a"})
    assert lines == [
        "AWS us-east-1/us-east-1a: 4 x p5.48xlarge (8 x H100 each), on-demand",
        "EFA: 32 interfaces per node",
        "Placement group: llm-us-east-1a (strategy cluster)",
        "SSH: nodes have no public IP (32 network interfaces); ProxyJump through a bastion open to 203.0.113.7/32",
    ]


def test_describe_says_ssh_is_closed_and_how_to_open_it() -> None:
    lines = describe(p5_request(), AwsSettings())
    assert lines[-1].startswith("SSH: closed (no ssh_ingress_cidrs); open it with aws.ssh_ingress_cidrs in ")
    assert lines[-1].endswith("or GPUCTL_SSH_INGRESS_CIDRS=YOUR.IP/32")


def test_describe_standard_public() -> None:
    req = p5_request(instance_type="t3.micro", network_tier="standard", accelerator=None, gpus_per_node=0, num_nodes=2)
    lines = describe(req, AwsSettings(ssh_ingress_cidrs=("198.51.100.0/24",)))
    assert lines[1:] == [
        "EFA: off (network_tier: standard)",
        "Placement group: none (only with network_tier: best, or aws.placement: cluster)",
        "SSH: to each node's public IP, open to 198.51.100.0/24",
    ]


def test_describe_names_the_switch_that_turned_efa_off() -> None:
    s = AwsSettings(efa=False, placement="none", source={"efa": "GPUCTL_AWS_EFA", "placement": "GPUCTL_AWS_PLACEMENT"})
    lines = describe(p5_request(), s)
    assert "EFA: off (GPUCTL_AWS_EFA says efa: false; network_tier: best asked for it)" in lines
    assert "Placement group: none (GPUCTL_AWS_PLACEMENT says none)" in lines


# ---- capacity failover --------------------------------------------------------------------------------


def capacity_error() -> ProvisionError:
    return ProvisionError("InsufficientInstanceCapacity: We currently do not have sufficient p5.48xlarge capacity",
                          insufficient_capacity=True)


def test_retry_zone_moves_to_next_zone_and_counts_attempts() -> None:
    req, line = retry_zone(p5_request(), capacity_error())
    assert req is not None and req.zone == "us-east-1b"
    assert line == "us-east-1a has no p5.48xlarge capacity; trying us-east-1b (attempt 2 of 3)"
    req2, line2 = retry_zone(req, capacity_error())
    assert req2 is not None and req2.zone == "us-east-1c"
    assert line2 == "us-east-1b has no p5.48xlarge capacity; trying us-east-1c (attempt 3 of 3)"
    req3, line3 = retry_zone(req2, capacity_error())
    assert req3 is None and line3 == "us-east-1c has no p5.48xlarge capacity; no zone left to try"


def test_retry_zone_ignores_other_failures_and_pinned_zones() -> None:
    assert retry_zone(p5_request(), ProvisionError("InvalidParameterCombination")) == (None, None)
    assert retry_zone(p5_request(), RuntimeError("boom")) == (None, None)
    pinned = p5_request(extra={**p5_request().extra, aws_provider.X_ZONE_PINNED: aws_provider.PINNED_BY_INFRA})
    req, line = retry_zone(pinned, capacity_error())
    assert req is None and line is not None and "pins that zone" in line


def test_with_capacity_failover_runs_attempts_until_one_succeeds() -> None:
    zones_seen: list[str] = []
    printed: list[str] = []

    def attempt(req: ClusterRequest) -> str:
        zones_seen.append(req.zone or "")
        if req.zone != "us-east-1c":
            raise capacity_error()
        return "outputs"

    final, result = with_capacity_failover(p5_request(), attempt, on_progress=printed.append)
    assert (final.zone, result) == ("us-east-1c", "outputs")
    assert zones_seen == ["us-east-1a", "us-east-1b", "us-east-1c"]
    assert printed == [
        "us-east-1a has no p5.48xlarge capacity; trying us-east-1b (attempt 2 of 3)",
        "us-east-1b has no p5.48xlarge capacity; trying us-east-1c (attempt 3 of 3)",
    ]


def test_with_capacity_failover_reraises_after_last_zone_and_other_errors_at_once() -> None:
    calls: list[str] = []

    def no_capacity(req: ClusterRequest) -> None:
        calls.append(req.zone or "")
        raise capacity_error()

    with pytest.raises(ProvisionError):
        with_capacity_failover(p5_request(), no_capacity)
    assert calls == ["us-east-1a", "us-east-1b", "us-east-1c"]

    calls.clear()

    def broken(req: ClusterRequest) -> None:
        calls.append(req.zone or "")
        raise ProvisionError("UnauthorizedOperation")

    with pytest.raises(ProvisionError, match="UnauthorizedOperation"):
        with_capacity_failover(p5_request(), broken)
    assert calls == ["us-east-1a"]


# ---- zone of an existing cluster -------------------------------------------------------------------


def write_state(name: str, zones: list[str]) -> Path:
    """A Terraform state as the module leaves it: node instances (plus other resources)."""
    import json

    path = aws_provider.state_file_of(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": 4, "resources": [
        {"module": "module.cluster", "mode": "managed", "type": "aws_subnet", "name": "this",
         "instances": [{"attributes": {"availability_zone": "us-east-1f"}}]},
        {"module": "module.cluster", "mode": "data", "type": "aws_instance", "name": "node", "instances": []},
        {"module": "module.cluster", "mode": "managed", "type": "aws_instance", "name": "node",
         "instances": [{"index_key": i, "attributes": {"availability_zone": z}} for i, z in enumerate(zones)]},
    ]}))
    return path


def test_node_zones_in_state_reads_only_node_instances() -> None:
    assert aws_provider.node_zones_in_state(write_state("llm", ["us-east-1b", "us-east-1b"])) == {"us-east-1b"}
    assert aws_provider.node_zones_in_state(write_state("empty", [])) == set()
    assert aws_provider.node_zones_in_state(aws_provider.state_file_of("never-made")) == set()


def test_existing_nodes_refuse_a_different_zone_before_any_aws_call() -> None:
    write_state("llm", ["us-east-1b"])
    with pytest.raises(UserError) as err:
        AwsProvider(AwsSettings()).prepare(p5_request(zone="us-east-1c"))
    assert err.value.message == (
        "resources.infra: cluster 'llm' has nodes in us-east-1b, not us-east-1c; "
        "keep the zone, or tear it down first (gpuctl down llm)"
    )


def test_no_failover_for_a_cluster_with_nodes() -> None:
    req = p5_request(extra={**p5_request().extra, aws_provider.X_ZONE_PINNED: aws_provider.PINNED_BY_NODES})
    nxt, line = retry_zone(req, capacity_error())
    assert nxt is None
    assert line == "us-east-1a has no p5.48xlarge capacity; the cluster's nodes are in that zone, so no failover"
