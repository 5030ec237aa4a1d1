"""The last bring-up's phases (provision, prepare, wait, job), kept in the cluster's directory.

`apply -o json` reports them once; the dashboard draws them as the cluster's timeline, so they
are written where a later reader finds them (bringup.json, private, replaced whole).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

from gpuctl.common.paths import cluster_dir

RECORD_FILE = "bringup.json"


def save(name: str, phases: Sequence[dict[str, Any]]) -> None:
    """Record an apply's phases (Reporter.phases); nothing when it timed none (it failed early)."""
    directory = cluster_dir(name)
    if not phases or not directory.is_dir():
        return
    path = directory / RECORD_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"recorded_at": time.time(), "phases": list(phases)}, fh)
    os.replace(tmp, path)


def load(directory: Path) -> list[dict[str, Any]]:
    """The phases last recorded, each with `phase`, `started_at` and `seconds`; [] when none are."""
    try:
        doc = json.loads((Path(directory) / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return []
    phases = doc.get("phases") if isinstance(doc, dict) else None
    return [p for p in phases or [] if isinstance(p, dict) and isinstance(p.get("phase"), str)
            and isinstance(p.get("started_at"), (int, float)) and isinstance(p.get("seconds"), (int, float))]
