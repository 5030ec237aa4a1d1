"""Accelerators -> a default AWS instance type.

When a task gives only `resources.accelerators` (e.g. `H100:8`), gpuctl picks
one instance type per (accelerator, count) from the small table below: the
type AWS sells for that many of those chips per node, as `describe-instance-types`
reports it (GpuInfo / NeuronInfo). An explicit `resources.instance_type` always
wins; the table is only consulted without one. Counts not in the table are a
`UserError` that lists the counts that are.
"""

from __future__ import annotations

import math
from typing import Mapping

from gpuctl.errors import UserError

# accelerator name -> {chips per node: instance type}. Names as SkyPilot spells them.
AWS_DEFAULT_TYPES: Mapping[str, Mapping[int, str]] = {
    "H100": {1: "p5.4xlarge", 8: "p5.48xlarge"},
    "H200": {8: "p5e.48xlarge"},
    "B200": {8: "p6-b200.48xlarge"},
    "A100": {8: "p4d.24xlarge"},
    "A100-80GB": {8: "p4de.24xlarge"},
    "A10G": {1: "g5.xlarge", 4: "g5.12xlarge", 8: "g5.48xlarge"},
    "L4": {1: "g6.xlarge", 4: "g6.12xlarge", 8: "g6.48xlarge"},
    "L40S": {1: "g6e.xlarge", 4: "g6e.12xlarge", 8: "g6e.48xlarge"},
    "T4": {1: "g4dn.xlarge", 4: "g4dn.12xlarge", 8: "g4dn.metal"},
    "Trainium": {1: "trn1.2xlarge", 16: "trn1.32xlarge"},
    "Trainium2": {16: "trn2.48xlarge"},
}

_BY_LOWER = {name.lower(): name for name in AWS_DEFAULT_TYPES}


def canonical_accelerator(name: str) -> str | None:
    """The table's spelling of `name` (case-insensitive), or None if unknown."""
    return _BY_LOWER.get(name.strip().lower())


def default_instance_type(accelerator: str, count: float) -> str:
    """The AWS instance type for `count` x `accelerator` per node.

    Fractional counts round up (a node cannot hold half a GPU). Raises a
    `UserError` naming `resources.accelerators` for an unknown accelerator or a
    count AWS has no single type for.
    """
    name = canonical_accelerator(accelerator)
    if name is None:
        known = ", ".join(AWS_DEFAULT_TYPES)
        raise UserError(
            f"resources.accelerators '{accelerator}': no AWS instance type known for it; "
            f"use one of {known}, or set resources.instance_type"
        )
    wanted = max(1, math.ceil(count))
    types = AWS_DEFAULT_TYPES[name]
    if wanted not in types:
        counts = ", ".join(str(c) for c in sorted(types))
        raise UserError(
            f"resources.accelerators '{name}:{count:g}': AWS has no {name} instance type with {wanted} per node; "
            f"valid counts: {counts} (or set resources.instance_type)"
        )
    return types[wanted]


def resolve_instance_type(instance_type: str | None, accelerator: str | None, count: float) -> str:
    """`instance_type` if given, else the default for the accelerators.

    Raises a `UserError` when neither is given: gpuctl has no CPU default.
    """
    if instance_type:
        return instance_type
    if accelerator:
        return default_instance_type(accelerator, count)
    raise UserError(
        "resources: infra aws needs resources.accelerators (e.g. H100:8) or resources.instance_type"
    )
