"""`--output json` documents and `gpuctl inventory --format`: the keys scripts rely on, pinned."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuctl.common import output
from gpuctl.common.errors import UserError
from gpuctl.provision.inventory import Inventory, Node, load_inventory
from gpuctl.provision.inventoryexport import FORMATS, export
from gpuctl.state.registry import ClusterRecord, JobRecord

NODE_KEYS = {"name", "rank", "address", "ssh_user", "ssh_host", "ssh_port", "gpus", "node_id"}
JOB_KEYS = {"id", "name", "status", "num_nodes", "submitted_at", "started_at", "ended_at", "submitted_epoch",
            "started_epoch", "ended_epoch", "returncodes", "failed_rank", "detail", "user"}
CLUSTER_KEYS = {"name", "status", "cloud", "region", "zone", "num_nodes", "nodes", "last_job"}


def inventory(tmp_path: Path) -> Inventory:
    known = str(tmp_path / "known_hosts")
    return Inventory(cluster="train", cloud="aws", region="us-east-1", zone="us-east-1b", nodes=(
        Node("head", 0, "i-0", "10.0.0.10", "3.3.3.3", 22, "ubuntu", "/keys/k", 8, known_hosts=known),
        Node("worker1", 1, "i-1", "10.0.0.11", "10.0.0.11", 22, "ubuntu", "/keys/k", 8,
             proxy_jump="ubuntu@3.3.3.3", known_hosts=known),
    ))


def test_documents_keep_their_keys() -> None:
    job = JobRecord("train", 4, "ddp", "FAILED", "t", 2, 1700000000.0, 1700000001.5, 1700000060.0,
                    {1: 3, 0: 143}, failed_rank=1)
    doc = output.job_doc(job)
    assert set(doc) == JOB_KEYS
    assert doc["returncodes"] == {"0": 143, "1": 3} and doc["ended_at"] == "2023-11-14T22:14:20Z"
    rec = ClusterRecord("train", "aws", "us-east-1", "us-east-1b", 2, "UP", {}, 1.0, 2.0)
    cluster = output.cluster_doc(rec, inventory(Path("/s")), job)
    assert set(cluster) == CLUSTER_KEYS and all(set(n) == NODE_KEYS for n in cluster["nodes"])
    assert output.cluster_doc(rec, None, None)["nodes"] == [] and output.cluster_doc(rec, None, None)["last_job"] is None


def test_json_requested_and_format_checked() -> None:
    assert output.json_requested(["status", "-o", "json"]) and output.json_requested(["down", "x", "--output=json"])
    assert not output.json_requested(["status", "--output", "text"]) and not output.json_requested(["status"])
    assert not output.json_requested(["exec", "c", "--", "jq", "-o", "json"]), "words after -- are the command's"
    assert output.wants_json("JSON") and not output.wants_json("text")
    with pytest.raises(UserError, match="--output yaml: use text or json"):
        output.wants_json("yaml")


def test_inventory_formats(tmp_path: Path) -> None:
    inv = inventory(tmp_path)
    hostfile = export(inv, "hostfile")
    assert hostfile == "10.0.0.10 slots=8\n10.0.0.11 slots=8\n"
    doc = json.loads(export(inv, "json"))
    assert (doc["command"], doc["cluster"], doc["ssh_key"], [n["rank"] for n in doc["nodes"]]) == \
        ("inventory", "train", "/keys/k", [0, 1])
    ansible = tmp_path / "inv.yml"
    ansible.write_text(export(inv, "ansible"))
    hosts = yaml.safe_load(ansible.read_text())["all"]["children"]["gpuctl_nodes"]["hosts"]
    assert hosts["worker1"]["gpuctl_proxy_jump"] == "ubuntu@3.3.3.3"
    assert "StrictHostKeyChecking" in hosts["head"]["ansible_ssh_common_args"]
    back = load_inventory(ansible, cluster="train")
    assert [(n.name, n.address, n.proxy_jump) for n in back.nodes] == \
        [(n.name, n.address, n.proxy_jump) for n in inv.nodes]
    listed = subprocess.run([str(Path(sys.executable).parent / "ansible-inventory"), "-i", str(ansible), "--list"],
                            capture_output=True, text=True, check=True)
    assert json.loads(listed.stdout)["gpuctl_nodes"]["hosts"] == ["head", "worker1"]
    config = tmp_path / "ssh.conf"
    config.write_text(export(inv, "ssh-config"))
    resolved = subprocess.run(["ssh", "-G", "-F", str(config), "train-worker1"], capture_output=True, text=True,
                              check=True).stdout
    assert "hostname 10.0.0.11" in resolved and "proxyjump ubuntu@[3.3.3.3]" in resolved
    assert set(FORMATS) == {"ansible", "json", "hostfile", "ssh-config"}
    with pytest.raises(UserError, match="--format yaml: use one of ansible, json, hostfile, ssh-config"):
        export(inv, "yaml")
