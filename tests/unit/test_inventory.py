from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuctl.common.errors import UserError
from gpuctl.provision.ansibleinventory import to_ansible, write_inventory
from gpuctl.provision.inventory import inventory_from_outputs, load_inventory


def tf_outputs(ids: list[str], *, bastion: dict | None = None, public: bool = True) -> dict:
    """The shape `terraform output -json` prints (each output wrapped in {value, type, sensitive})."""
    nodes = [
        {"id": i, "private_ip": f"10.0.1.{10 + n}", "public_ip": f"3.0.0.{n}" if public else None,
         "availability_zone": "us-east-1a"}
        for n, i in enumerate(ids)
    ]
    return {
        "nodes": {"value": nodes, "type": ["list", "object"], "sensitive": False},
        "ssh_user": {"value": "ubuntu", "type": "string", "sensitive": False},
        "bastion": {"value": bastion, "type": "dynamic", "sensitive": False},
    }


def build(outputs: dict, previous=None):
    return inventory_from_outputs(outputs, cluster="c1", cloud="aws", ssh_key="/k", gpus_per_node=8,
                                  region="us-east-1", zone="us-east-1a", previous=previous)


def test_ranks_follow_module_order_head_first():
    inv = build(tf_outputs(["i-a", "i-b", "i-c"]))
    assert [(n.name, n.rank, n.node_id) for n in inv.nodes] == [
        ("head", 0, "i-a"), ("worker1", 1, "i-b"), ("worker2", 2, "i-c")]
    assert inv.head.address == "10.0.1.10"
    assert inv.head.ssh_host == "3.0.0.0" and inv.head.ssh_user == "ubuntu" and inv.head.gpus == 8


def test_ranks_stable_across_reapply_when_order_changes():
    first = build(tf_outputs(["i-a", "i-b", "i-c"]))
    again = build(tf_outputs(["i-c", "i-a", "i-b"]), previous=first)
    assert {n.node_id: n.rank for n in again.nodes} == {"i-a": 0, "i-b": 1, "i-c": 2}


def test_grown_cluster_keeps_old_ranks_and_appends():
    first = build(tf_outputs(["i-a", "i-b"]))
    grown = build(tf_outputs(["i-a", "i-b", "i-new"]), previous=first)
    assert [n.node_id for n in grown.nodes] == ["i-a", "i-b", "i-new"]
    assert grown.nodes[2].rank == 2


def test_bastion_makes_nodes_reached_by_private_ip_through_proxyjump():
    inv = build(tf_outputs(["i-a", "i-b"], bastion={"public_ip": "54.1.1.1", "ssh_user": "ec2-user"}, public=False))
    assert all(n.proxy_jump == "ec2-user@54.1.1.1" for n in inv.nodes)
    assert inv.nodes[1].ssh_host == "10.0.1.11"
    hosts = to_ansible(inv)["all"]["children"]["gpuctl_nodes"]["hosts"]
    # ProxyCommand, not ProxyJump: the jump host gets the same no-prompt options as the node, and
    # its host key is pinned in the cluster's known_hosts like theirs
    common = hosts["worker1"]["ansible_ssh_common_args"]
    assert common.startswith("-o StrictHostKeyChecking=accept-new") and "ProxyCommand=ssh " in common
    assert "HostKeyAlias=gpuctl-i-b" in common and "HostKeyAlias=gpuctl-bastion-54.1.1.1" in common
    assert "StrictHostKeyChecking=no" not in common
    assert "-W %h:%p -- ec2-user@54.1.1.1" in common and "-i /k" in common


def test_local_outputs_with_explicit_ssh_host_and_port():
    out = {"nodes": [{"id": "n0", "private_ip": "127.0.0.1", "public_ip": None, "ssh_host": "127.0.0.1", "ssh_port": 2201}],
           "ssh_user": "root", "bastion": None}
    inv = inventory_from_outputs(out, cluster="c", cloud="local", ssh_key="/k", gpus_per_node=0)
    assert (inv.head.ssh_host, inv.head.ssh_port) == ("127.0.0.1", 2201)


def test_missing_nodes_output_is_an_error():
    with pytest.raises(ValueError, match="nodes"):
        inventory_from_outputs({"nodes": {"value": []}}, cluster="c", cloud="aws", ssh_key=None, gpus_per_node=0)


def test_written_inventory_round_trips(tmp_path: Path):
    inv = build(tf_outputs(["i-a", "i-b"]))
    path = write_inventory(inv, tmp_path / "inventory.yml")
    data = yaml.safe_load(path.read_text())
    head = data["all"]["children"]["gpuctl_nodes"]["hosts"]["head"]
    assert head["gpuctl_rank"] == 0 and head["gpuctl_address"] == "10.0.1.10" and head["ansible_port"] == 22
    back = load_inventory(path)
    assert back.nodes == inv.nodes and back.cluster == "c1" and back.zone == "us-east-1a"


def test_hand_written_inventory_defaults(tmp_path: Path):
    repo_example = Path(__file__).resolve().parents[2] / "inventories" / "example-existing-nodes.yml"
    inv = load_inventory(repo_example, cluster="mine")
    assert [(n.name, n.address, n.ssh_user, n.gpus) for n in inv.nodes] == [
        ("head", "192.0.2.10", "ubuntu", 8), ("worker1", "192.0.2.11", "ubuntu", 8)]
    assert inv.head.ssh_key == str(Path("~/.ssh/id_ed25519").expanduser())


@pytest.mark.parametrize(
    "text, message",
    [
        ("all: [", "YAML syntax error at line 1"),
        ("hosts: {}", "top-level 'all:'"),
        ("all: {hosts: {}}", "lists no hosts"),
        ("all: {hosts: {a: {ansible_host: gpu-a.example}}}", "host 'a' needs an IP address"),
        ("all: {hosts: {a: {ansible_host: 10.0.0.1, gpuctl_rank: 0}, b: {ansible_host: 10.0.0.2, gpuctl_rank: 5}}}",
         "gpuctl_rank values must be 0..1"),
    ],
)
def test_bad_hand_written_inventory(tmp_path: Path, text: str, message: str):
    path = tmp_path / "inv.yml"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        load_inventory(path)


def test_missing_inventory_file(tmp_path: Path):
    with pytest.raises(UserError, match="inventory file not found"):
        load_inventory(tmp_path / "nope.yml")
