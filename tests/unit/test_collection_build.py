"""`make collection` (configplane/collection.py) makes the collection gpuctl.cluster: gpuctl's
playbooks and roles, the node's files built from cli/gpuctl/node/ into role gpuctl_node, the
README, the version of pyproject.toml, nothing of gpuctl's own Ansible settings. Using it against real nodes:
tests/integration/test_ansible_collection.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from gpuctl.configplane import bundle, collection

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
GALAXY = Path(sys.executable).parent / "ansible-galaxy"
PYPROJECT = (REPO / "pyproject.toml").read_text()  # no tomllib: gpuctl supports Python 3.10
VERSION = re.search(r'^version = "([^"]+)"', PYPROJECT, re.MULTILINE).group(1)  # type: ignore[union-attr]


def build_collection(out: Path) -> Path:
    """The tarball `make collection` writes into out."""
    return collection.build(out, galaxy=str(GALAXY))


@pytest.fixture(scope="module")
def tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not GALAXY.exists():
        pytest.skip("ansible-galaxy is not installed next to this Python")
    return build_collection(tmp_path_factory.mktemp("collection"))


def test_version_and_name_follow_pyproject(tarball: Path) -> None:
    assert tarball.name == f"gpuctl-cluster-{VERSION}.tar.gz"
    with tarfile.open(tarball) as tar:
        info = json.load(tar.extractfile("MANIFEST.json"))["collection_info"]  # type: ignore[arg-type]
    assert (info["namespace"], info["name"], info["version"]) == ("gpuctl", "cluster", VERSION)
    assert info["readme"] == "README.md"


def test_playbooks_roles_agent_and_readme_inside(tarball: Path) -> None:
    with tarfile.open(tarball) as tar:
        members = {m.name: m for m in tar.getmembers()}
        shipped = {name: tar.extractfile(f"roles/gpuctl_node/files/{name}").read()  # type: ignore[union-attr]
                   for name in ("gpuctl_node.py", "gpuctl-node", "gpuctl-fabric-probe", "nodehealth.py",
                                "allreduceprobe.py", "ncclperf.py")}
        readme = tar.extractfile("README.md").read().decode()  # type: ignore[union-attr]
    for name in ("MANIFEST.json", "FILES.json", "README.md", "CHANGELOG.md", "meta/runtime.yml"):
        assert name in members, name
    for playbook in sorted(p.name for p in (ANSIBLE / "playbooks").glob("*.yml")):
        assert f"playbooks/{playbook}" in members, playbook
    for role in sorted(p.name for p in (ANSIBLE / "roles").iterdir()):
        assert f"roles/{role}/tasks/main.yml" in members, role
    assert "plugins/modules/gpuctl_node_install.py" in members  # the install step's module
    # The node's files are built from cli/gpuctl/node/ (none is in ansible/ in the repository): the
    # tarball holds them as prepare gives them to a node, the role's defaults naming each.
    tracked = subprocess.run(["git", "ls-files", "ansible/roles/gpuctl_node/files"], cwd=REPO, capture_output=True,
                             text=True, check=False).stdout
    assert tracked == ""
    defaults = (ANSIBLE / "roles/gpuctl_node/defaults/main.yml").read_text()
    for rel, (data, mode) in bundle.files().items():
        name = Path(rel).name
        member = members[f"roles/gpuctl_node/files/{name}"]
        assert member.isfile() and shipped[name] == data, name
        assert bool(member.mode & 0o111) == (mode == "0755"), name
        assert f"'{rel}'" in defaults and f"'{name}'" in defaults, f"role gpuctl_node's defaults do not name {rel}"
    assert readme == (ANSIBLE / "README.md").read_text()
    # gpuctl's own settings (roles_path, its ssh options) and lint caches are not the user's.
    assert not [n for n in members if n == "ansible.cfg" or n.startswith(".") or "/." in n]


def test_runtime_requires_the_ansible_core_gpuctl_supports() -> None:
    runtime = yaml.safe_load((ANSIBLE / "meta/runtime.yml").read_text())
    floor = re.search(r'"ansible-core>=([0-9.]+)', PYPROJECT).group(1)  # type: ignore[union-attr]
    assert runtime["requires_ansible"] == f">={floor}.0"


def test_readme_example_is_a_playbook_of_collection_plays() -> None:
    readme = (ANSIBLE / "README.md").read_text()
    site = yaml.safe_load(readme.split("```yaml\n# site.yml\n", 1)[1].split("```", 1)[0])
    imported = [p.get("ansible.builtin.import_playbook") for p in site]
    assert imported[0] == "gpuctl.cluster.prepare"
    for name in imported:
        assert (ANSIBLE / "playbooks" / f"{name.removeprefix('gpuctl.cluster.')}.yml").is_file(), name
    inventory = yaml.safe_load(readme.split("```yaml\n# inventory.yml\n", 1)[1].split("```", 1)[0])
    hosts = inventory["all"]["children"]["gpuctl_nodes"]["hosts"]
    assert sorted(h["gpuctl_rank"] for h in hosts.values()) == list(range(len(hosts)))
    assert all("gpuctl_address" in h for h in hosts.values())
    job = yaml.safe_load(readme.split("```yaml\n# job.yml:", 1)[1].split("\n", 1)[1].split("```", 1)[0])
    table = readme.split("| variable | playbooks |", 1)[1].split("\n\n", 1)[0]
    assert all(f"`{name}`" in table for name in job), [n for n in job if f"`{n}`" not in table]


def test_readme_names_every_variable_gpuctl_passes() -> None:
    """The collection's users set what gpuctl's own runs pass (the extravars contract)."""
    from gpuctl.configplane import playbooks

    contract = {w for w in (playbooks.__doc__ or "").split() if w.startswith("gpuctl_")}
    assert "gpuctl_job_id" in contract
    table = (ANSIBLE / "README.md").read_text().split("| variable | playbooks |", 1)[1].split("\n\n", 1)[0]
    assert not sorted(n for n in contract if f"`{n}`" not in table)
