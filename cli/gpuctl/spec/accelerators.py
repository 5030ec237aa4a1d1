"""The accelerator names a task may ask for, whatever the infra: SkyPilot's catalogue names.

A misspelt name (`H1000:8`) would pass silently where nothing is provisioned by it: local nodes
refuse it with the closest known name (their GPUs are only named), and `infra: ssh` hosts warn
(their hardware may be newer than this list). A cloud refuses names its own table does not sell
(providers/aws/catalog.py), whose names are all among these (tests/unit/test_cli_pieces.py).
"""

from __future__ import annotations

import difflib
from typing import Iterable

KNOWN_ACCELERATORS = (
    # NVIDIA data-centre GPUs
    "B200", "B300", "GB200", "GB300", "H100", "H100-MEGA", "H100-NVL", "H100-NVLINK", "H100-SXM", "H200",
    "H200-SXM", "H800", "H20", "GH200", "A100", "A100-40GB", "A100-80GB", "A100-80GB-SXM", "A800", "A10", "A10G",
    "A16", "A30", "A40", "L4", "L20", "L40", "L40S", "T4", "T4g", "V100", "V100-32GB", "P100", "P4", "P40", "K80",
    "M60",
    # NVIDIA workstation and consumer GPUs
    "RTX6000", "RTX6000-Ada", "RTXPRO6000", "RTX4000-Ada", "RTXA2000", "RTXA4000", "RTXA4500", "RTXA5000",
    "RTXA6000", "A4000", "A5000", "A6000", "A2", "M4000", "P4000", "GTX1080Ti", "RTX2080", "RTX2080Ti", "RTX3060",
    "RTX3070", "RTX3080", "RTX3080Ti", "RTX3090", "RTX3090Ti", "RTX4060", "RTX4070", "RTX4080", "RTX4090",
    "RTX5060", "RTX5070", "RTX5080", "RTX5090",
    # AMD, Intel, AWS silicon, TPUs
    "MI100", "MI210", "MI250", "MI250X", "MI300X", "MI325X", "Gaudi", "Gaudi2", "Gaudi3", "Inferentia",
    "Inferentia2", "Trainium", "Trainium2", "tpu-v2-8", "tpu-v3-8", "tpu-v4-8", "tpu-v5e-8", "tpu-v5p-8",
    "tpu-v6e-8",
)
_BY_LOWER = {name.lower(): name for name in KNOWN_ACCELERATORS}


def known_accelerator(name: str) -> str | None:
    """The catalogue's spelling of `name` (case does not matter), or None."""
    return _BY_LOWER.get(name.lower())


def unknown_accelerators(accelerators: Iterable[str]) -> list[str]:
    """The names in `accelerators` that are not in the catalogue."""
    return [name for name in accelerators if known_accelerator(name) is None]


def unknown_accelerator_message(name: str) -> str:
    """Why `name` is refused, with the closest known names."""
    close = difflib.get_close_matches(name.lower(), list(_BY_LOWER), n=2, cutoff=0.7)
    hint = ("did you mean " + " or ".join(_BY_LOWER[c] for c in close) + "?" if close else
            "known: " + ", ".join(KNOWN_ACCELERATORS[:12]) + ", ...")
    return f"'{name}' is not a known accelerator; {hint}"
