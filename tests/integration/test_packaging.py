"""The wheel carries the Terraform and Ansible trees, so an installed gpuctl
works from any directory (not only from a source checkout)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_installed_wheel_finds_its_terraform_and_ansible_trees(tmp_path: Path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)],
                   check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = dist.glob("gpuctl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ("gpuctl/cli.py", "gpuctl/terraform/modules/local-nodes/main.tf",
                     "gpuctl/terraform/modules/local-nodes/scripts/node.sh",
                     "gpuctl/terraform/modules/aws-gpu-instance-group/compute.tf",
                     "gpuctl/ansible/ansible.cfg", "gpuctl/ansible/playbooks/run.yml",
                     "gpuctl/node/launcher.py", "gpuctl/node/fabricprobe.py", "gpuctl/node/relay.py",
                     # the dashboard's pages and assets: no build step, nothing fetched at run time
                     "gpuctl/dashboard/templates/clusters.html", "gpuctl/dashboard/static/dashboard.js",
                     "gpuctl/dashboard/static/dashboard.css"):
        assert expected in names, expected
    assert not any("/.terraform/" in n or n.endswith(".tfstate") for n in names)

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = ("import gpuctl.common.paths as p; print(p.terraform_dir()); print(p.ansible_dir())")
    out = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(target)}).stdout.split()
    assert out == [str(target / "gpuctl" / "terraform"), str(target / "gpuctl" / "ansible")]
    # The node bundle is built from the installed package's node/ (nothing built ships in the wheel).
    assert not any(n.endswith("gpuctl_node.py") for n in names)
    built = ("from gpuctl.configplane import bundle; print(len(bundle.agent_text()) > 100000, bundle.NODE)")
    out = subprocess.run([sys.executable, "-c", built], cwd=elsewhere, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(target), "GPUCTL_CACHE_DIR": str(tmp_path / "cache")})
    assert out.stdout.split() == ["True", str(target / "gpuctl" / "node")], out.stderr
