"""`resources.infra` strings and the legacy cloud/region/zone triple."""

from __future__ import annotations

import pytest

from gpuctl.common.errors import UserError
from gpuctl.spec.infra import Infra, infra_from_legacy, parse_infra


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("local", Infra("local")),
        ("LOCAL", Infra("local")),
        ("local/", Infra("local")),
        ("ssh/inventories/lab.yml", Infra("ssh", path="inventories/lab.yml")),
        ("ssh//etc/gpuctl/Lab.yml", Infra("ssh", path="/etc/gpuctl/Lab.yml")),  # path case kept
        ("ssh", Infra("ssh")),
        ("aws", Infra("aws")),
        (" AWS ", Infra("aws")),
        ("aws/*", Infra("aws")),
        ("aws/us-east-1", Infra("aws", "us-east-1")),
        ("aws/us-gov-west-1", Infra("aws", "us-gov-west-1")),
        ("aws/us-east-1/us-east-1a", Infra("aws", "us-east-1", "us-east-1a")),
        ("aws/us-west-2/us-west-2-lax-1a", Infra("aws", "us-west-2", "us-west-2-lax-1a")),  # Local Zone
        ("aws/*/us-east-1b", Infra("aws", "us-east-1", "us-east-1b")),  # SkyPilot's wildcard region
    ],
)
def test_parse_infra(text: str, expected: Infra) -> None:
    assert parse_infra(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gcp", "resources.infra 'gcp': not supported by gpuctl; gpuctl provisions on aws, local"),
        ("mars", "resources.infra 'mars': unknown infra 'mars'; use one of local, ssh, aws"),
        ("", "unknown infra ''"),
        ("*", "unknown infra '*'"),
        ("k8s", "Kubernetes is not supported by gpuctl"),
        ("kubernetes/my-ctx", "Kubernetes is not supported by gpuctl"),
        ("local/us-east-1", "'local' takes no region; write infra: local"),
        ("aws/useast1", "'useast1' is not an AWS region name such as us-east-1"),
        ("aws/US-EAST-1", "is not an AWS region name"),
        ("aws/us-east-1/us-west-2a", "'us-west-2a' is not a zone of us-east-1 (e.g. us-east-1a)"),
        ("aws/us-east-1/zone-a", "is not a zone of us-east-1"),
        ("aws/*/nowhere", "'nowhere' is not an AWS zone name such as us-east-1a"),
    ],
)
def test_parse_infra_rejects(text: str, expected: str) -> None:
    with pytest.raises(UserError) as info:
        parse_infra(text)
    assert expected in info.value.message


def test_error_names_the_field_it_came_from() -> None:
    with pytest.raises(UserError) as info:
        parse_infra("azure", field="--infra")
    assert info.value.message.startswith("--infra 'azure': ")


@pytest.mark.parametrize(
    ("cloud", "region", "zone", "expected"),
    [
        (None, None, None, Infra("local")),
        ("aws", None, None, Infra("aws")),
        ("AWS", "us-west-2", None, Infra("aws", "us-west-2")),
        ("aws", "us-west-2", "us-west-2c", Infra("aws", "us-west-2", "us-west-2c")),
        ("aws", None, "us-west-2c", Infra("aws", "us-west-2", "us-west-2c")),  # SkyPilot infers the region
    ],
)
def test_infra_from_legacy(cloud: str | None, region: str | None, zone: str | None, expected: Infra) -> None:
    assert infra_from_legacy(cloud, region, zone) == expected


@pytest.mark.parametrize(
    ("cloud", "region", "zone", "expected"),
    [
        (None, "us-east-1", None, "resources.region/zone need resources.cloud"),
        (None, None, "us-east-1a", "resources.region/zone need resources.cloud"),
        ("gcp", "us-central1", None, "resources.cloud 'gcp/us-central1': gcp is not supported by gpuctl"),
        ("aws", "mars-1", None, "'mars-1' is not an AWS region name"),
        ("aws", "us-east-1", "us-west-2a", "is not a zone of us-east-1"),
    ],
)
def test_infra_from_legacy_rejects(cloud: str | None, region: str | None, zone: str | None, expected: str) -> None:
    with pytest.raises(UserError) as info:
        infra_from_legacy(cloud, region, zone)
    assert expected in info.value.message
