"""preflight's pure rules (zones, failover, EFA, region) and the user config.

The boto3 side of preflight runs against a real moto server in
tests/integration/test_aws_moto.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuctl.common.config import aws_settings, config_path
from gpuctl.common.errors import UserError
from gpuctl.providers.aws.preflight import (
    InstanceTypeInfo,
    check_accelerators,
    check_efa,
    choose_zone,
    failover_line,
    next_zone,
    parse_instance_type,
    resolve_region,
)

ZONES = ("us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d")


# ---- zones ------------------------------------------------------------------------------


def test_choose_zone_prefers_first_sorted_zone() -> None:
    assert choose_zone(["us-east-1c", "us-east-1b", "us-east-1f"], None, instance_type="p5.48xlarge",
                       region="us-east-1") == "us-east-1b"


def test_choose_zone_keeps_wanted_zone() -> None:
    assert choose_zone(ZONES, "us-east-1c", instance_type="p5.48xlarge", region="us-east-1") == "us-east-1c"


def test_choose_zone_wanted_not_offered_lists_offering_zones() -> None:
    with pytest.raises(UserError) as err:
        choose_zone(["us-east-1b", "us-east-1c"], "us-east-1a", instance_type="p4de.24xlarge", region="us-east-1")
    assert err.value.message == (
        "resources.infra: p4de.24xlarge is not offered in us-east-1a; zones of us-east-1 that offer it: "
        "us-east-1b, us-east-1c"
    )


def test_choose_zone_none_offered() -> None:
    with pytest.raises(UserError, match="resources.instance_type 'p5e.48xlarge': not offered in any zone of us-east-1"):
        choose_zone([], None, instance_type="p5e.48xlarge", region="us-east-1")


# ---- capacity failover ---------------------------------------------------------------------


def test_next_zone_walks_sorted_zones_after_the_last_tried() -> None:
    assert next_zone(ZONES, ["us-east-1a"], 3) == "us-east-1b"
    assert next_zone(ZONES, ["us-east-1a", "us-east-1b"], 3) == "us-east-1c"


def test_next_zone_wraps_around_and_skips_tried() -> None:
    assert next_zone(ZONES, ["us-east-1d"], 3) == "us-east-1a"
    assert next_zone(ZONES, ["us-east-1c", "us-east-1d"], 3) == "us-east-1a"
    assert next_zone(reversed(ZONES), ["us-east-1b", "us-east-1a"], 4) == "us-east-1c"


def test_next_zone_is_bounded_by_max_attempts() -> None:
    assert next_zone(ZONES, ["us-east-1a", "us-east-1b", "us-east-1c"], 3) is None
    assert next_zone(ZONES, ["us-east-1a"], 1) is None


def test_next_zone_stops_when_every_zone_was_tried() -> None:
    assert next_zone(["us-east-1a", "us-east-1b"], ["us-east-1a", "us-east-1b"], 5) is None
    assert next_zone([], ["us-east-1a"], 3) is None


def test_next_zone_starts_at_first_zone_when_nothing_tried() -> None:
    assert next_zone(["us-east-1c", "us-east-1b"], [], 3) == "us-east-1b"


def test_failover_line_wording() -> None:
    assert failover_line("us-east-1a", "p5.48xlarge", "us-east-1b", 2, 3) == (
        "us-east-1a has no p5.48xlarge capacity; trying us-east-1b (attempt 2 of 3)"
    )
    assert failover_line("us-east-1c", "p5.48xlarge", None, 4, 3) == (
        "us-east-1c has no p5.48xlarge capacity; no zone left to try"
    )


# ---- instance types --------------------------------------------------------------------------

P5 = {
    "InstanceType": "p5.48xlarge",
    "GpuInfo": {"Gpus": [{"Name": "H100", "Manufacturer": "NVIDIA", "Count": 8}]},
    "NetworkInfo": {"EfaSupported": True, "EfaInfo": {"MaximumEfaInterfaces": 32}, "MaximumNetworkCards": 32},
}
G4DN = {
    "InstanceType": "g4dn.xlarge",
    "GpuInfo": {"Gpus": [{"Name": "T4", "Count": 1}]},
    "NetworkInfo": {"EfaSupported": False, "MaximumNetworkCards": 1},
}
TRN1 = {
    "InstanceType": "trn1.32xlarge",
    "NeuronInfo": {"NeuronDevices": [{"Name": "Trainium", "Count": 16}]},
    "NetworkInfo": {"EfaSupported": True, "EfaInfo": {"MaximumEfaInterfaces": 8}, "MaximumNetworkCards": 8},
}


def test_parse_instance_type_reads_efa_and_gpus() -> None:
    info = parse_instance_type(P5)
    assert info == InstanceTypeInfo(name="p5.48xlarge", efa_supported=True, efa_interfaces=32,
                                    network_cards=32, accelerator="H100", accelerator_count=8)
    assert parse_instance_type(G4DN).efa_interfaces == 0
    assert parse_instance_type(TRN1).accelerator == "Trainium"
    cpu = parse_instance_type({"InstanceType": "t3.micro", "NetworkInfo": {"EfaSupported": False}})
    assert (cpu.accelerator, cpu.accelerator_count, cpu.efa_supported) == (None, 0, False)


def test_efa_required_for_network_tier_best() -> None:
    with pytest.raises(UserError) as err:
        check_efa(parse_instance_type(G4DN), "best")
    assert err.value.message.endswith(
        "instance type g4dn.xlarge does not support EFA; use network_tier: standard or an EFA type such as p5.48xlarge"
    )
    check_efa(parse_instance_type(G4DN), "standard")
    check_efa(parse_instance_type(P5), "best")


def test_accelerators_must_agree_with_explicit_type() -> None:
    check_accelerators(parse_instance_type(P5), "H100", 8)
    check_accelerators(parse_instance_type(P5), None, 0)
    with pytest.raises(UserError, match=r"'H100:8': instance type g4dn.xlarge has 1 x T4"):
        check_accelerators(parse_instance_type(G4DN), "H100", 8)
    with pytest.raises(UserError, match="has 8 x H100"):
        check_accelerators(parse_instance_type(P5), "H100", 4)
    with pytest.raises(UserError, match="has no accelerators"):
        check_accelerators(parse_instance_type({"InstanceType": "t3.micro"}), "A10G", 1)


def test_a100_80gb_matches_a100_type() -> None:
    p4de = {"InstanceType": "p4de.24xlarge", "GpuInfo": {"Gpus": [{"Name": "A100", "Count": 8}]}}
    check_accelerators(parse_instance_type(p4de), "A100-80GB", 8)


def test_a100_memory_in_the_name_must_match_the_type() -> None:
    """A100-40GB is p4d's A100, A100-80GB p4de's: a name that says the memory is held to it."""
    p4d = {"InstanceType": "p4d.24xlarge",
           "GpuInfo": {"Gpus": [{"Name": "A100", "Count": 8, "MemoryInfo": {"SizeInMiB": 40960}}]}}
    p4de = {"InstanceType": "p4de.24xlarge",
            "GpuInfo": {"Gpus": [{"Name": "A100", "Count": 8, "MemoryInfo": {"SizeInMiB": 81920}}]}}
    for name in ("A100", "A100-40GB", "a100-40gb"):
        check_accelerators(parse_instance_type(p4d), name, 8)
    check_accelerators(parse_instance_type(p4de), "A100-80GB", 8)
    with pytest.raises(UserError, match=r"'A100-40GB:8': instance type p4de.24xlarge has 8 x A100 \(80 GB each\)"):
        check_accelerators(parse_instance_type(p4de), "A100-40GB", 8)
    with pytest.raises(UserError, match=r"instance type p4d.24xlarge has 8 x A100 \(40 GB each\)"):
        check_accelerators(parse_instance_type(p4d), "A100-80GB", 8)


# ---- region ------------------------------------------------------------------------------------


def test_region_order_infra_env_profile() -> None:
    env = {"AWS_REGION": "eu-west-1", "AWS_DEFAULT_REGION": "eu-west-2"}
    assert resolve_region("us-east-2", "ap-south-1", env) == "us-east-2"
    assert resolve_region(None, "ap-south-1", env) == "eu-west-1"
    assert resolve_region(None, "ap-south-1", {"AWS_DEFAULT_REGION": "eu-west-2"}) == "eu-west-2"
    assert resolve_region(None, "ap-south-1", {}) == "ap-south-1"


def test_missing_region_says_how_to_set_it() -> None:
    with pytest.raises(UserError) as err:
        resolve_region(None, None, {})
    assert "infra: aws/us-east-1" in err.value.message and "AWS_REGION" in err.value.message


# ---- config ----------------------------------------------------------------------------------------


def test_config_defaults_without_file() -> None:
    s = aws_settings({})
    assert (s.endpoint_url, s.profile, s.ssh_ingress_cidrs, s.placement, s.efa) == (None, None, (), "auto", True)
    assert s.max_retries == 8


def test_config_file_and_env_override(tmp_path: Path) -> None:
    config_path().write_text(
        "aws:\n  endpoint_url: http://127.0.0.1:5000/\n  ssh_ingress_cidrs: [203.0.113.7/32, 10.1.2.3/8]\n"
        "  profile: train\n  placement: none\n  efa: false\n  max_retries: 3\n"
    )
    s = aws_settings({})
    assert s.endpoint_url == "http://127.0.0.1:5000"
    assert s.ssh_ingress_cidrs == ("203.0.113.7/32", "10.0.0.0/8")
    assert (s.profile, s.placement, s.efa, s.max_retries) == ("train", "none", False, 3)
    assert s.origin("placement") == f"aws.placement in {config_path()}"
    s = aws_settings({"GPUCTL_AWS_ENDPOINT_URL": "http://127.0.0.1:6000", "GPUCTL_SSH_INGRESS_CIDRS": "198.51.100.0/24",
                      "GPUCTL_AWS_PLACEMENT": "cluster", "GPUCTL_AWS_EFA": "1", "GPUCTL_AWS_MAX_RETRIES": "1"})
    assert s.endpoint_url == "http://127.0.0.1:6000"
    assert s.ssh_ingress_cidrs == ("198.51.100.0/24",)
    assert (s.placement, s.efa, s.max_retries) == ("cluster", True, 1)
    assert s.origin("endpoint_url") == "GPUCTL_AWS_ENDPOINT_URL"


@pytest.mark.parametrize(
    ("text", "env", "match"),
    [
        ("aws: [1, 2]\n", {}, "'aws' must be a mapping"),
        ("aws:\n  endpoint: x\n", {}, "unknown key aws.endpoint;"),
        ("aws: {placement: spread}\n", {}, "aws.placement in .*'spread': use one of auto, cluster, none"),
        ("aws: {ssh_ingress_cidrs: [my-laptop]}\n", {}, "'my-laptop': not a CIDR block"),
        ("aws: {efa: maybe}\n", {}, "'maybe': use true or false"),
        ("aws: {max_retries: -1}\n", {}, "aws.max_retries in .*'-1': use a whole number"),
        ("aws: {max_retries: 0}\n", {}, "'0': use a whole number of at least 1"),
        ("", {"GPUCTL_AWS_MAX_RETRIES": "many"}, "GPUCTL_AWS_MAX_RETRIES 'many': use a whole number"),
        ("aws: {\n", {}, "YAML syntax error at line"),
        ("", {"GPUCTL_AWS_ENDPOINT_URL": "localhost:5000"}, "GPUCTL_AWS_ENDPOINT_URL 'localhost:5000': give a URL"),
    ],
)
def test_config_errors_are_one_line(text: str, env: dict, match: str) -> None:
    config_path().write_text(text)
    with pytest.raises(UserError, match=match) as err:
        aws_settings(env)
    assert "\n" not in err.value.message
