"""ansible-lint (production profile) and yamllint pass on ansible/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def tool(name: str) -> str:
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed")
    return found


def test_ansible_lint() -> None:
    r = subprocess.run([tool("ansible-lint"), "--nocolor", "ansible/"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_yamllint() -> None:
    r = subprocess.run([tool("yamllint"), "--strict", "ansible/", ".ansible-lint", ".yamllint"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
