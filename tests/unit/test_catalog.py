"""catalog: accelerators -> default AWS instance type."""

from __future__ import annotations

import pytest

from gpuctl.common.errors import UserError
from gpuctl.providers.aws.catalog import (AWS_DEFAULT_TYPES, canonical_accelerator, default_instance_type, first_available,
                            resolve_instance_type)


@pytest.mark.parametrize(
    ("accel", "count", "expected"),
    [
        ("H100", 8, "p5.48xlarge"),
        ("H200", 8, "p5e.48xlarge"),
        ("A100", 8, "p4d.24xlarge"),
        ("A100-40GB", 8, "p4d.24xlarge"),  # SkyPilot users' name for the 40 GB A100
        ("A100-80GB", 8, "p4de.24xlarge"),
        ("B200", 8, "p6-b200.48xlarge"),
        ("A10G", 1, "g5.xlarge"),
        ("A10G", 4, "g5.12xlarge"),
        ("A10G", 8, "g5.48xlarge"),
        ("L4", 1, "g6.xlarge"),
        ("L40S", 8, "g6e.48xlarge"),
        ("Trainium", 16, "trn1.32xlarge"),
        ("V100", 1, "p3.2xlarge"),
        ("V100", 8, "p3.16xlarge"),
        ("V100-32GB", 8, "p3dn.24xlarge"),
        ("T4", 1, "g4dn.xlarge"),
        ("H200", 8, "p5e.48xlarge"),
        ("B300", 8, "p6-b300.48xlarge"),
    ],
)
def test_default_types(accel: str, count: int, expected: str) -> None:
    assert default_instance_type(accel, count) == expected


def test_names_match_case_insensitively() -> None:
    assert default_instance_type("h100", 8) == "p5.48xlarge"
    assert canonical_accelerator("a100-80gb") == "A100-80GB"
    assert canonical_accelerator("a100-40GB") == "A100-40GB"
    assert canonical_accelerator("H800") is None


def test_fractional_count_rounds_up() -> None:
    assert default_instance_type("A10G", 0.5) == "g5.xlarge"


def test_count_without_type_lists_valid_counts() -> None:
    with pytest.raises(UserError) as err:
        default_instance_type("H100", 4)
    msg = err.value.message
    assert msg.startswith("resources.accelerators 'H100:4'")
    assert "valid counts: 1, 8" in msg
    assert "\n" not in msg


def test_unknown_accelerator_names_field_and_known_names() -> None:
    with pytest.raises(UserError) as err:
        default_instance_type("TPU-v5", 8)
    assert "resources.accelerators 'TPU-v5'" in err.value.message
    assert "H100" in err.value.message and "resources.instance_type" in err.value.message


def test_explicit_instance_type_wins() -> None:
    assert resolve_instance_type("g5.2xlarge", "H100", 8) == "g5.2xlarge"
    assert resolve_instance_type(None, "H100", 8) == "p5.48xlarge"


@pytest.mark.parametrize(("cpus", "memory", "expected"), [
    (None, None, "m6i.2xlarge"),  # SkyPilot's default: 8+ vCPUs, 4 GiB each
    ("16", None, "m6i.4xlarge"),
    ("2+", "64", "r6i.2xlarge"),  # exactly 64 GiB: r6i.2xlarge is cheaper than m6i.4xlarge
    ("4+", "32+", "r6i.xlarge"),
    ("2", "8x", "r6i.large"),
    (None, "128+", "r6i.4xlarge"),
    ("2", "4", "c6i.large"),
])
def test_cpu_only_tasks_get_the_cheapest_type_that_fits(cpus: str | None, memory: str | None, expected: str) -> None:
    assert resolve_instance_type(None, None, 0, cpus, memory) == expected


def test_cpus_no_type_has_is_a_user_error() -> None:
    with pytest.raises(UserError, match=r"no AWS c6i/m6i/r6i instance type has cpus 3.*resources.instance_type"):
        resolve_instance_type(None, None, 0, "3", None)


def test_first_available_skips_choices_aws_does_not_sell() -> None:
    assert first_available({"H800": 8, "A100": 4, "H100": 8}) == ("H100", 8)
    assert first_available({"H800": 8}) == ("H800", 8)  # none: the first, so its error is the one shown


def _ec2_instance_types() -> dict:
    """EC2's describe-instance-types data as moto ships it (a snapshot of real AWS)."""
    import gzip
    import json
    from pathlib import Path

    moto = pytest.importorskip("moto")
    path = Path(moto.__file__).parent / "ec2/resources/instance_types.json.gz"
    with gzip.open(path) as fh:
        return json.load(fh)


# p3 (V100) types AWS still sells in some regions; moto's snapshot no longer lists them.
_NOT_IN_SNAPSHOT = {"p3.2xlarge", "p3.8xlarge", "p3.16xlarge"}


def test_table_agrees_with_ec2_instance_type_data() -> None:
    """Every default type exists and carries exactly the accelerators the table claims."""
    types = _ec2_instance_types()
    for name, counts in AWS_DEFAULT_TYPES.items():
        for count, itype in counts.items():
            if itype in _NOT_IN_SNAPSHOT:
                assert itype not in types, f"{itype} is in moto's data now: check it there"
                continue
            assert itype in types, itype
            raw = types[itype]
            devices = (raw.get("GpuInfo") or {}).get("Gpus") or (raw.get("NeuronInfo") or {}).get("NeuronDevices")
            assert devices, itype
            assert sum(d["Count"] for d in devices) == count, itype
            # "A100-80GB" is sold as A100 with 80 GiB per GPU
            base, _, mem = name.partition("-")
            assert devices[0]["Name"] == base, (itype, devices[0]["Name"])
            if mem:
                assert devices[0]["MemoryInfo"]["SizeInMiB"] == int(mem.rstrip("GB")) * 1024, itype
