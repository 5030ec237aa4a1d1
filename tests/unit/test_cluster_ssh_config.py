"""The Host entries role gpuctl_cluster_ssh writes to every node's ~/.ssh/config.

Rendered by the real ansible-playbook (connection local, nothing is contacted)
from inventories shaped like gpuctl's: loopback local nodes (one address,
a port each), cloud nodes (public address for the controller, private address
and port 22 between nodes, own hostnames), a per-host port override and a
hand-written host without ansible_user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "ansible" / "roles" / "gpuctl_cluster_ssh"

INVENTORY = {
    "all": {
        "vars": {"ansible_python_interpreter": sys.executable},
        "children": {
            "loopback": {"hosts": {
                "head": {"ansible_host": "127.0.0.1", "ansible_port": 22200, "ansible_user": "alice",
                         "gpuctl_address": "127.0.0.1", "gpuctl_cluster_ssh_uname": {"stdout": "laptop"}},
                "worker1": {"ansible_host": "127.0.0.1", "ansible_port": 22201, "ansible_user": "alice",
                            "gpuctl_address": "127.0.0.1", "gpuctl_cluster_ssh_uname": {"stdout": "laptop"}},
            }},
            "cloud": {"hosts": {
                "c-head": {"ansible_host": "3.3.3.3", "ansible_port": 22, "ansible_user": "ubuntu",
                           "gpuctl_address": "10.0.0.5", "gpuctl_cluster_ssh_uname": {"stdout": "ip-10-0-0-5\n"}},
                "c-worker1": {"ansible_host": "3.3.3.4", "ansible_port": 2222, "ansible_user": "ubuntu",
                              "gpuctl_address": "10.0.0.6", "gpuctl_cluster_ssh_uname": {"stdout": "ip-10-0-0-6"}},
                "c-worker2": {"ansible_host": "10.0.0.7", "ansible_port": 22, "ansible_user": "ubuntu",
                              "gpuctl_address": "10.0.0.7", "gpuctl_peer_ssh_port": 2200,
                              "gpuctl_cluster_ssh_uname": {"stdout": "ip-10-0-0-7"}},
                "c-worker3": {"ansible_host": "10.0.0.8", "gpuctl_address": "10.0.0.8",
                              "gpuctl_cluster_ssh_uname": {"stdout": "ip-10-0-0-8"}},
            }},
        },
    },
}


def render(tmp_path: Path, group: str, inventory: dict | None = None, **extra: object) -> dict[str, dict[str, str]]:
    """`Host` line -> {option: value} of the block rendered for `group`."""
    out = tmp_path / f"{group}.conf"
    playbook = [{
        "name": "Render", "hosts": group, "gather_facts": False, "connection": "local",
        "vars_files": [str(ROLE / "defaults" / "main.yml")],
        "tasks": [{"name": "Render the block", "run_once": True, "ansible.builtin.copy": {
            "content": "{{ lookup('ansible.builtin.template', '%s') }}" % (ROLE / "templates" / "ssh_config.j2"),
            "dest": str(out), "mode": "0600"}}],
    }]
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(inventory or INVENTORY))
    (tmp_path / "play.yml").write_text(yaml.safe_dump(playbook))
    ansible_playbook = Path(sys.executable).parent / "ansible-playbook"
    if not ansible_playbook.exists():
        pytest.skip("ansible-playbook is not installed next to this interpreter")
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg")}
    extravars = json.dumps({"gpuctl_cluster_ssh_group": group, **extra})  # above the role defaults
    proc = subprocess.run([str(ansible_playbook), "-i", str(tmp_path / "inventory.yml"), "-e", extravars,
                           str(tmp_path / "play.yml")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entries: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in out.read_text().splitlines():
        if line.startswith("Host "):
            current = entries.setdefault(line[5:], {})
        elif line.startswith("  "):
            k, v = line.split(None, 1)
            current[k] = v
    return entries


def test_loopback_nodes_keep_their_ports_and_share_no_address_alias(tmp_path: Path) -> None:
    entries = render(tmp_path, "loopback")
    assert list(entries) == ["head 127.0.0.1", "worker1", "*"]  # same hostname everywhere: no hostname alias
    assert entries["head 127.0.0.1"]["Port"] == "22200"
    assert entries["worker1"] == {
        "HostName": "127.0.0.1", "Port": "22201", "User": "alice", "IdentityFile": "~/.ssh/gpuctl_cluster",
        "IdentitiesOnly": "yes", "StrictHostKeyChecking": "accept-new",
        "LogLevel": "ERROR", "BatchMode": "yes", "ConnectTimeout": "10"}
    assert entries["*"] == {}  # the trailing `Host *` that ends the block's last entry


def test_cloud_nodes_use_the_private_address_and_port_22(tmp_path: Path) -> None:
    entries = render(tmp_path, "cloud")
    assert list(entries) == ["c-head 10.0.0.5 ip-10-0-0-5", "c-worker1 10.0.0.6 ip-10-0-0-6",
                             "c-worker2 10.0.0.7 ip-10-0-0-7", "c-worker3 10.0.0.8 ip-10-0-0-8", "*"]
    head, w1, w2, w3 = (entries[k] for k in list(entries)[:4])
    assert (head["HostName"], head["Port"], head["User"]) == ("10.0.0.5", "22", "ubuntu")
    assert w1["Port"] == "22"  # the controller's port 2222 is a forward on the public address
    assert w2["Port"] == "2200"  # gpuctl_peer_ssh_port wins
    assert w3["Port"] == "22" and "User" not in w3  # hand-written host: no ansible_port/ansible_user
    assert list(render(tmp_path, "cloud", gpuctl_cluster_ssh_hostname_aliases=False))[0] == "c-head 10.0.0.5"


def test_host_keys_are_checked_strictly_when_the_controller_gives_them(tmp_path: Path) -> None:
    import copy

    inventory = copy.deepcopy(INVENTORY)
    hosts = inventory["all"]["children"]["cloud"]["hosts"]
    for name, hv in hosts.items():
        hv["gpuctl_host_key_alias"] = f"gpuctl-{name}"
    entries = render(tmp_path, "cloud", inventory, gpuctl_known_hosts=str(tmp_path / "known_hosts"))
    w1 = entries["c-worker1 10.0.0.6 ip-10-0-0-6"]
    assert (w1["HostKeyAlias"], w1["StrictHostKeyChecking"]) == ("gpuctl-c-worker1", "yes")
    assert w1["UserKnownHostsFile"] == "~/.ssh/gpuctl_known_hosts"
    # Without the controller's known_hosts: learned at first contact, never ignored.
    assert render(tmp_path, "cloud", inventory)["c-worker1 10.0.0.6 ip-10-0-0-6"]["StrictHostKeyChecking"] == \
        "accept-new"


def run_role(tmp_path: Path, limit: str) -> Path:
    """Apply the role with connection local to one host of INVENTORY; its files go to tmp_path/ssh."""
    key = tmp_path / "internal_ed25519"
    if not key.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpuctl-internal-t", "-f", str(key)],
                       check=True)
    play = [{"name": "Role", "hosts": "all", "gather_facts": False, "connection": "local",
             "roles": [{"role": "gpuctl_cluster_ssh"}]}]
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(INVENTORY))
    (tmp_path / "role.yml").write_text(yaml.safe_dump(play))
    extravars = json.dumps({"gpuctl_internal_key": str(key), "gpuctl_cluster_ssh_dir": str(tmp_path / "ssh"),
                            "gpuctl_cluster_ssh_group": "cloud"})
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg")}
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "inventory.yml"),
                           "-e", extravars, "--limit", limit, str(tmp_path / "role.yml")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp_path / "ssh"


def test_loopback_nodes_are_left_alone(tmp_path: Path) -> None:
    """Loopback nodes share the controller's home: the role must write nothing there."""
    assert not run_role(tmp_path, "head").exists()
    # Control: the same run for a node with its own address does write the files.
    ssh_dir = run_role(tmp_path, "c-head")
    assert sorted(p.name for p in ssh_dir.iterdir()) == ["authorized_keys", "config", "gpuctl_cluster"]
    assert (ssh_dir / "authorized_keys").read_text().endswith(" gpuctl-internal-t\n")
    assert "Host c-worker1 10.0.0.6" in (ssh_dir / "config").read_text()
