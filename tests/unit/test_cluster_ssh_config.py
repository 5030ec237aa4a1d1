"""The cluster view: what every node knows of the others (host keys, one ssh Host entry each).

Two builders make it: the role gpuctl_node's template (playbooks run without gpuctl), rendered here
by the real ansible-playbook (connection local, nothing is contacted), and gpuctl's own
(configplane/clusterview.py, which every job carries). Both must agree, and the agent renders
either into ~/.ssh/config (agent/install.py). Inventories shaped like gpuctl's: loopback local
nodes (one address, a port each), cloud nodes (public address for the controller, private
address and port 22 between nodes, own hostnames), a per-host port override and a hand-written
host without ansible_user. The role's install step then runs for real (connection local, HOME
in tmp_path) to show that loopback nodes get nothing in ~/.ssh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuctl.configplane import bundle, clusterview, prepare
from gpuctl.node import install as agent
from gpuctl.provision.inventory import Inventory, Node

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "ansible" / "roles" / "gpuctl_node"

INVENTORY = {
    "all": {
        "vars": {"ansible_python_interpreter": sys.executable},
        "children": {
            "loopback": {"hosts": {
                "head": {"ansible_host": "127.0.0.1", "ansible_port": 22200, "ansible_user": "alice",
                         "gpuctl_address": "127.0.0.1", "gpuctl_hostname": "laptop"},
                "worker1": {"ansible_host": "127.0.0.1", "ansible_port": 22201, "ansible_user": "alice",
                            "gpuctl_address": "127.0.0.1", "gpuctl_hostname": "laptop"},
            }},
            "cloud": {"hosts": {
                "c-head": {"ansible_host": "3.3.3.3", "ansible_port": 22, "ansible_user": "ubuntu",
                           "gpuctl_address": "10.0.0.5", "gpuctl_hostname": "ip-10-0-0-5"},
                "c-worker1": {"ansible_host": "3.3.3.4", "ansible_port": 2222, "ansible_user": "ubuntu",
                              "gpuctl_address": "10.0.0.6", "gpuctl_hostname": "ip-10-0-0-6"},
                "c-worker2": {"ansible_host": "10.0.0.7", "ansible_port": 22, "ansible_user": "ubuntu",
                              "gpuctl_address": "10.0.0.7", "gpuctl_peer_ssh_port": 2200,
                              "gpuctl_hostname": "ip-10-0-0-7"},
                "c-worker3": {"ansible_host": "10.0.0.8", "gpuctl_address": "10.0.0.8",
                              "gpuctl_hostname": "ip-10-0-0-8"},
            }},
        },
    },
}


def _playbook(tmp_path: Path, play: dict, inventory: dict, extravars: dict, *, limit: str | None = None,
              env: dict | None = None) -> None:
    ansible_playbook = Path(sys.executable).parent / "ansible-playbook"
    if not ansible_playbook.exists():
        pytest.skip("ansible-playbook is not installed next to this interpreter")
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(inventory))
    (tmp_path / "play.yml").write_text(yaml.safe_dump([play]))
    argv = [str(ansible_playbook), "-i", str(tmp_path / "inventory.yml"), "-e", json.dumps(extravars),
            str(tmp_path / "play.yml")] + (["--limit", limit] if limit else [])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"), **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def role_view(tmp_path: Path, group: str, inventory: dict | None = None, **extra: object) -> dict:
    """The view the role builds for `group` without gpuctl (templates/view.json.j2)."""
    out = tmp_path / f"{group}.json"
    play = {"name": "Render", "hosts": group, "gather_facts": False, "connection": "local",
            "vars_files": [str(ROLE / "defaults" / "main.yml")],
            "tasks": [{"name": "Render the view", "run_once": True, "ansible.builtin.copy": {
                "content": "{{ lookup('ansible.builtin.template', '%s') }}" % (ROLE / "templates" / "view.json.j2"),
                "dest": str(out), "mode": "0600"}}]}
    _playbook(tmp_path, play, inventory or INVENTORY, {"gpuctl_node_group": group, **extra})
    return json.loads(out.read_text())


def entries(view: dict) -> dict[str, dict[str, str]]:
    """`Host` line -> {option: value} of the block the agent writes for `view`."""
    found: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in agent.render_hosts(view).splitlines():
        if line.startswith("Host "):
            current = found.setdefault(line[5:], {})
        elif line.startswith("  "):
            k, v = line.split(None, 1)
            current[k] = v
    return found


def gpuctl_inventory(group: str, known_hosts: Path | None = None) -> tuple[Inventory, dict[str, str]]:
    """INVENTORY's `group` as gpuctl's Inventory, and the hostnames its install steps would report."""
    nodes, hostnames = [], {}
    for rank, (name, hv) in enumerate(INVENTORY["all"]["children"][group]["hosts"].items()):
        nodes.append(Node(name=name, rank=rank, address=hv["gpuctl_address"], ssh_host=hv["ansible_host"],
                          ssh_port=hv.get("ansible_port", 22), ssh_user=hv.get("ansible_user", "ubuntu"),
                          peer_ssh_port=hv.get("gpuctl_peer_ssh_port"), node_id=f"i-{name}",
                          known_hosts=str(known_hosts) if known_hosts else None))
        hostnames[name] = hv["gpuctl_hostname"]
    return Inventory(cluster="c", cloud="aws", nodes=tuple(nodes)), hostnames


def test_loopback_nodes_keep_their_ports_and_share_no_address_alias(tmp_path: Path) -> None:
    found = entries(role_view(tmp_path, "loopback"))
    assert list(found) == ["head 127.0.0.1", "worker1", "*"]  # same hostname everywhere: no hostname alias
    assert found["head 127.0.0.1"]["Port"] == "22200"
    assert found["worker1"] == {
        "HostName": "127.0.0.1", "Port": "22201", "User": "alice", "IdentityFile": "~/.ssh/gpuctl_cluster",
        "IdentitiesOnly": "yes", "StrictHostKeyChecking": "accept-new",
        "LogLevel": "ERROR", "BatchMode": "yes", "ConnectTimeout": "10"}
    assert found["*"] == {}  # the trailing `Host *` that ends the block's last entry
    # gpuctl gives loopback local nodes no view at all: their ~/.ssh is the controller's
    assert clusterview.cluster_view(gpuctl_inventory("loopback")[0]) is None


def test_cloud_nodes_use_the_private_address_and_port_22(tmp_path: Path) -> None:
    found = entries(role_view(tmp_path, "cloud"))
    assert list(found) == ["c-head 10.0.0.5 ip-10-0-0-5", "c-worker1 10.0.0.6 ip-10-0-0-6",
                           "c-worker2 10.0.0.7 ip-10-0-0-7", "c-worker3 10.0.0.8 ip-10-0-0-8", "*"]
    head, w1, w2, w3 = (found[k] for k in list(found)[:4])
    assert (head["HostName"], head["Port"], head["User"]) == ("10.0.0.5", "22", "ubuntu")
    assert w1["Port"] == "22"  # the controller's port 2222 is a forward on the public address
    assert w2["Port"] == "2200"  # gpuctl_peer_ssh_port wins
    assert w3["Port"] == "22" and "User" not in w3  # hand-written host: no ansible_port/ansible_user


def test_gpuctl_and_the_role_build_the_same_view(tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text("".join(f"gpuctl-i-{n} ssh-ed25519 AAAA{n}\n" for n in ("c-head", "c-worker1", "c-worker2"))
                     + "gpuctl-i-c-worker3 ssh-ed25519 AAAAw3\n")
    inventory = json.loads(json.dumps(INVENTORY))
    for name, hv in inventory["all"]["children"]["cloud"]["hosts"].items():
        hv["gpuctl_host_key_alias"] = f"gpuctl-i-{name}"
        hv.setdefault("ansible_user", "ubuntu")
    ours = clusterview.cluster_view(*gpuctl_inventory("cloud", known))
    theirs = role_view(tmp_path, "cloud", inventory, gpuctl_known_hosts=str(known))
    assert ours is not None and ours["known_hosts"] == theirs["known_hosts"]
    assert [{**h, "port": int(h["port"])} for h in theirs["hosts"]] == ours["hosts"]
    w1 = entries(ours)["c-worker1 10.0.0.6 ip-10-0-0-6"]
    assert (w1["HostKeyAlias"], w1["StrictHostKeyChecking"]) == ("gpuctl-i-c-worker1", "yes")
    assert w1["UserKnownHostsFile"] == "~/.ssh/gpuctl_known_hosts"
    # Without the controller's known_hosts: learned at first contact, never ignored.
    bare = clusterview.cluster_view(gpuctl_inventory("cloud")[0])
    assert entries(bare)["c-worker1 10.0.0.6"]["StrictHostKeyChecking"] == "accept-new"  # no hostnames: no alias
    # Hostnames come from the nodes: one that could not stand in a config drops them all.
    inv, hostnames = gpuctl_inventory("cloud", known)
    odd = clusterview.cluster_view(inv, {**hostnames, "c-worker2": "ip-10-0-0-7\n  ProxyCommand x"})
    assert odd is not None and [h["names"] for h in odd["hosts"]][:2] == [["c-head", "10.0.0.5"],
                                                                         ["c-worker1", "10.0.0.6"]]
    # A name that would add options of its own never reaches the config.
    with pytest.raises(agent.InstallError, match="cannot stand in an ssh config"):
        agent.render_hosts({"hosts": [{"names": ["a\n  ProxyCommand x"], "address": "10.0.0.1", "port": 22}]})


def test_the_block_replaces_the_old_one_and_keeps_the_users_config() -> None:
    user = "ConnectionAttempts 3\n\nHost userhost\n  User someone\n"
    once = agent.with_block(user, "Host a\n")
    assert once.startswith(agent.CONFIG_MARK % "BEGIN") and once.endswith(user)  # first: ssh takes the first value
    assert agent.with_block(once, "Host b\n") == agent.with_block(user, "Host b\n")


def run_install(tmp_path: Path, limit: str) -> Path:
    """The role's install step with connection local for one host of INVENTORY, HOME in tmp_path/home."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    key = tmp_path / "internal_ed25519"
    if not key.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpuctl-internal-t", "-f", str(key)],
                       check=True)
    play = {"name": "Role", "hosts": "all", "gather_facts": False, "connection": "local",
            "roles": [{"role": "gpuctl_node"}]}
    # the node's files as gpuctl passes them (the repository's role has no files/: `make collection`
    # builds them in, tests/integration/test_ansible_collection.py runs the role that way)
    _playbook(tmp_path, play, INVENTORY, {"gpuctl_internal_key": str(key), "gpuctl_node_group": "cloud",
                                          "gpuctl_prepare_fingerprint": "fp1", "gpuctl_agent_files": prepare.agent_files()},
              limit=limit, env={"HOME": str(home)})
    return home


def test_loopback_nodes_get_nothing_in_ssh_and_others_get_key_and_config(tmp_path: Path) -> None:
    home = run_install(tmp_path, "head")
    assert not (home / ".ssh").exists() and (home / ".gpuctl" / "prepared").read_text() == "fp1\n"
    assert (home / ".gpuctl" / "lib" / "gpuctl_node.py").read_text() == bundle.agent_text()
    home = run_install(tmp_path, "c-head")
    ssh_dir = home / ".ssh"
    assert sorted(p.name for p in ssh_dir.iterdir()) == ["authorized_keys", "config", "gpuctl_cluster"]
    assert (ssh_dir / "authorized_keys").read_text().endswith(" gpuctl-internal-t\n")
    assert "Host c-worker1 10.0.0.6" in (ssh_dir / "config").read_text()
    assert oct((ssh_dir / "gpuctl_cluster").stat().st_mode & 0o777) == "0o600"
