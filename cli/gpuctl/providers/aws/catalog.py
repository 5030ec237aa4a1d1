"""Resources -> an AWS instance type, offline.

When a task gives only `resources.accelerators` (e.g. `H100:8`), gpuctl picks
one instance type per (accelerator, count) from the table below: the type AWS
sells for that many of those chips per node, as `describe-instance-types`
reports it (GpuInfo / NeuronInfo). A task without accelerators gets the
cheapest general-purpose type that fits its `cpus`/`memory` (SkyPilot's rule:
8+ vCPUs with 4 GiB each when neither is given). An explicit
`resources.instance_type` always wins. `gpuctl validate` resolves the type the
same way `apply` does, so a file that validates is not refused later for it.
"""

from __future__ import annotations

import math
import re
from typing import Mapping

from gpuctl.common.errors import UserError

# accelerator name -> {chips per node: instance type}. Names as SkyPilot spells them;
# every NVIDIA type AWS sells, and AWS's own chips.
AWS_DEFAULT_TYPES: Mapping[str, Mapping[int, str]] = {
    "V100": {1: "p3.2xlarge", 4: "p3.8xlarge", 8: "p3.16xlarge"},
    "V100-32GB": {8: "p3dn.24xlarge"},
    "T4": {1: "g4dn.xlarge", 4: "g4dn.12xlarge", 8: "g4dn.metal"},
    "T4g": {1: "g5g.xlarge", 2: "g5g.16xlarge"},
    "A10G": {1: "g5.xlarge", 4: "g5.12xlarge", 8: "g5.48xlarge"},
    "L4": {1: "g6.xlarge", 4: "g6.12xlarge", 8: "g6.48xlarge"},
    "L40S": {1: "g6e.xlarge", 4: "g6e.12xlarge", 8: "g6e.48xlarge"},
    "A100": {8: "p4d.24xlarge"},  # 40 GB each: SkyPilot's AWS catalog calls p4d's A100
    "A100-40GB": {8: "p4d.24xlarge"},  # the same, named by its memory as A100-80GB is
    "A100-80GB": {8: "p4de.24xlarge"},
    "H100": {1: "p5.4xlarge", 8: "p5.48xlarge"},
    "H200": {8: "p5e.48xlarge"},
    "B200": {8: "p6-b200.48xlarge"},
    "B300": {8: "p6-b300.48xlarge"},
    "Inferentia": {1: "inf1.xlarge", 4: "inf1.6xlarge", 16: "inf1.24xlarge"},
    "Inferentia2": {1: "inf2.xlarge", 6: "inf2.24xlarge", 12: "inf2.48xlarge"},
    "Trainium": {1: "trn1.2xlarge", 16: "trn1.32xlarge"},
    "Trainium2": {16: "trn2.48xlarge"},
}

# CPU-only tasks: SkyPilot's default families on AWS, the cheapest size that fits.
# (family, GiB per vCPU, on-demand USD per vCPU-hour in us-east-1)
_CPU_FAMILIES = (("c6i", 2, 0.0425), ("m6i", 4, 0.048), ("r6i", 8, 0.063))
_CPU_SIZES = (("large", 2), ("xlarge", 4), ("2xlarge", 8), ("4xlarge", 16), ("8xlarge", 32), ("12xlarge", 48),
              ("16xlarge", 64), ("24xlarge", 96), ("32xlarge", 128))
DEFAULT_CPUS = "8+"  # SkyPilot's default: 8+ vCPUs with 4 GiB each -> m6i.2xlarge
DEFAULT_MEMORY_RATIO = "4x"
_QUANTITY_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgtp]?)[bi]?\s*([+x]?)$", re.IGNORECASE)
_GIB_PER_UNIT = {"k": 2.0**-20, "m": 2.0**-10, "": 1.0, "g": 1.0, "t": 2.0**10, "p": 2.0**20}

_BY_LOWER = {name.lower(): name for name in AWS_DEFAULT_TYPES}

# Families whose EFA does GPUDirect RDMA (FI_EFA_USE_DEVICE_RDMA=1). The node-side probe
# (node/fabricprobe.py, standard library only) carries the same tuple as RDMA_FAMILIES;
# tests/unit/test_catalog.py keeps the two equal.
GPUDIRECT_RDMA_FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en", "p6")


def gpudirect_rdma(instance_type: str | None) -> bool:
    """Whether EFA on `instance_type` reaches GPU memory directly."""
    family = (instance_type or "").split(".", 1)[0]
    return bool(family) and family.startswith(GPUDIRECT_RDMA_FAMILIES)


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


def _quantity(text: str) -> tuple[float, str]:
    """("8+" -> (8, "+")), ("32GB" -> (32, "")), ("4x" -> (4, "x")); the spec layer checked the form."""
    match = _QUANTITY_RE.fullmatch(text.strip())
    if not match:
        raise UserError(f"resources: cannot read {text!r} as a number, N+ or Nx")
    return float(match.group(1)) * _GIB_PER_UNIT[match.group(2).lower()], match.group(3).lower()


def default_cpu_instance_type(cpus: str | None, memory: str | None) -> str:
    """The cheapest c6i/m6i/r6i type with `cpus` vCPUs ("8" exactly, "8+" at least) and
    `memory` GiB ("32", "32+", or "4x" = 4 GiB per vCPU), as SkyPilot picks one."""
    if cpus is None and memory is None:
        cpus = DEFAULT_CPUS
    want_cpus = _quantity(cpus) if cpus else None
    want_mem = _quantity(memory) if memory else _quantity(DEFAULT_MEMORY_RATIO)
    fits: list[tuple[float, str]] = []
    for family, gib_per_cpu, price in _CPU_FAMILIES:
        for size, vcpus in _CPU_SIZES:
            gib = vcpus * gib_per_cpu
            if want_cpus and not (vcpus >= want_cpus[0] if want_cpus[1] == "+" else vcpus == want_cpus[0]):
                continue
            amount, how = want_mem
            if not (gib >= amount if how == "+" else gib >= vcpus * amount if how == "x" else gib == amount):
                continue
            fits.append((vcpus * price, f"{family}.{size}"))
    if not fits:
        asked = ", ".join(f"{k} {v}" for k, v in (("cpus", cpus), ("memory", memory)) if v)
        raise UserError(f"resources: no AWS c6i/m6i/r6i instance type has {asked}; "
                        "change cpus/memory (N+ means at least N) or set resources.instance_type")
    return min(fits)[1]


def first_available(accelerators: Mapping[str, float]) -> tuple[str, float]:
    """Of several accelerator choices (`{A100:8, H100:8}`), the first AWS has a type for;
    the first one when none is (so its error is the one a user sees)."""
    for name, count in accelerators.items():
        known = canonical_accelerator(name)
        if known and max(1, math.ceil(count)) in AWS_DEFAULT_TYPES[known]:
            return name, count
    return next(iter(accelerators.items()))


def resolve_instance_type(instance_type: str | None, accelerator: str | None, count: float,
                          cpus: str | None = None, memory: str | None = None) -> str:
    """`instance_type` if given, else the default for the accelerators, else a CPU type
    that fits `cpus`/`memory` (SkyPilot's default: 8+ vCPUs, 4 GiB each)."""
    if instance_type:
        return instance_type
    if accelerator:
        return default_instance_type(accelerator, count)
    return default_cpu_instance_type(cpus, memory)
