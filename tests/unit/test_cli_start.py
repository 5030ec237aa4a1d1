"""gpuctl starts fast: what a command loads before it runs is what it needs (issue 36).

Timing is benchmarks/start.py's job; these check the shape that makes it fast: which modules a
fresh interpreter holds once `gpuctl --help`, `--version` or `exec` ran, and that `--version`
needs no package metadata.
"""

from __future__ import annotations

import re
from pathlib import Path

import gpuctl

REPO = Path(__file__).resolve().parents[2]


def test_version_is_pyprojects() -> None:
    """`gpuctl --version` prints gpuctl.__version__ instead of reading the installed metadata
    (importlib.metadata costs every run some 16 ms): the two must be the same version."""
    project = (REPO / "pyproject.toml").read_text().split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    found = re.search(r'^version\s*=\s*"([^"]+)"', project, re.MULTILINE)
    assert found is not None, "pyproject.toml's [project] has no version"
    assert gpuctl.__version__ == found.group(1), "set gpuctl.__version__ (cli/gpuctl/__init__.py) to pyproject's version"
