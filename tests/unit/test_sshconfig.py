from __future__ import annotations

import subprocess
from pathlib import Path

from gpuctl.provision import sshconfig
from gpuctl.provision.inventory import Inventory, Node


def test_ssh_resolves_every_alias_to_its_node(tmp_path: Path):
    nodes = (
        Node("head", 0, "i-0", "10.0.0.10", "3.3.3.3", 22, "ubuntu", "/keys/k", 8,
             known_hosts=str(tmp_path / "known_hosts")),
        Node("worker1", 1, "i-1", "10.0.0.11", "10.0.0.11", 2222, "ubuntu", "/keys/k", 8, proxy_jump="ubuntu@3.3.3.3",
             known_hosts=str(tmp_path / "known_hosts")),
    )
    inv = Inventory(cluster="train", cloud="aws", nodes=nodes)
    path = sshconfig.write(inv, tmp_path / "train.conf")

    def resolved(alias: str) -> dict[str, str]:
        out = subprocess.run(["ssh", "-G", "-F", str(path), alias], capture_output=True, text=True, check=True).stdout
        return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)

    head = resolved("train")
    assert (head["hostname"], head["port"], head["user"]) == ("3.3.3.3", "22", "ubuntu")
    assert head["identityfile"] == "/keys/k"
    worker = resolved("train-worker1")
    assert (worker["hostname"], worker["port"], worker["proxyjump"]) == ("10.0.0.11", "2222", "ubuntu@[3.3.3.3]")
    # learned at first contact into the cluster's known_hosts under the node's id, then verified
    assert worker["stricthostkeychecking"] == "accept-new" and worker["hostkeyalias"] == "gpuctl-i-1"
    assert worker["userknownhostsfile"] == str(tmp_path / "known_hosts")
