"""Host keys on a real 3-node local cluster (issue 8, finding 1): the
controller learns each node's key at first contact and verifies it afterwards,
the nodes verify each other with the keys the controller learned, and a node
whose key changed is one clear line (exit 2) with nothing of the job run,
until `gpuctl forget-host-key` lets the next job learn the new key."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from e2e import Cluster, NodeInfo, control_dir_candidates, needs_local_nodes, pids_matching, wait_for

pytestmark = [pytest.mark.integration, needs_local_nodes]

NAME = "hk3"


@pytest.fixture(scope="module")
def hk(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hostkeys")
    (root / "c.yaml").write_text(f"name: {NAME}\nnum_nodes: 3\nresources:\n  infra: local\nrun: echo up\n")
    cluster = Cluster(NAME, root / "state")
    try:
        cluster.gpuctl("apply", str(root / "c.yaml")).check()
        yield cluster
    finally:
        cluster.down_quietly()


def node_dir(cluster: Cluster, node: NodeInfo) -> Path:
    return Path(cluster.node_env(node)["LN_DIR"])


def rekey(cluster: Cluster, node: NodeInfo) -> None:
    """Give the node's sshd a new host key, as a rebuilt machine would have, and drop every open
    connection to it (the controller's and the head's ControlMasters), as a rebuild does."""
    d = node_dir(cluster, node)
    key = d / "sshd" / "ssh_host_ed25519_key"
    key.unlink()
    key.with_suffix(".pub").unlink()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    pid = int((d / "sshd.pid").read_text().split()[0])
    os.kill(pid, signal.SIGHUP)  # sshd re-executes itself and reads its keys again
    new_key = key.with_suffix(".pub").read_text().split()[1]
    scan = ["ssh-keyscan", "-T", "5", "-p", str(node.port), "-t", "ed25519", node.host]
    wait_for(f"sshd of {node.name} to listen again with its new key",
             lambda: new_key in subprocess.run(scan, capture_output=True, text=True).stdout.split(), 30, interval=0.2)
    for cm in control_dir_candidates(cluster.cdir):
        for master in pids_matching(f"{cm}/"):
            os.kill(master, signal.SIGTERM)
    head = cluster.nodes()[0]
    cluster.ssh(head, "for s in ~/.gpuctl/cm/*; do [ -S \"$s\" ] && ssh -O exit -o ControlPath=\"$s\" x 2>/dev/null; "
                      "done; true", check=False)


def test_keys_are_learned_once_and_given_to_every_node(hk: Cluster):
    lines = (hk.cdir / "known_hosts").read_text().splitlines()
    aliases = {line.split()[0] for line in lines}
    assert len([a for a in aliases if a.startswith("gpuctl-")]) == 3, lines
    for node in hk.nodes():
        assert hk.read(node, "~/.ssh/gpuctl_known_hosts").splitlines() == lines
        config = hk.read(node, "~/.ssh/config")
        assert "StrictHostKeyChecking yes" in config and "StrictHostKeyChecking no" not in config
    # head -> worker2 by name, checked against the learned key
    head, _, w2 = hk.nodes()
    assert hk.ssh(head, "ssh worker2 hostname").returncode == 0


@pytest.mark.parametrize("rank", [2, 0])
def test_a_changed_key_is_refused_then_forgotten_on_request(hk: Cluster, rank: int):
    node = hk.nodes()[rank]
    marker = f"~/ran-{uuid.uuid4().hex[:8]}"
    rekey(hk, node)
    res = hk.gpuctl("exec", NAME, f"touch {marker}")  # bash expands ~: the node user's home
    assert res.returncode == 2, res.describe()
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and node.name in lines[0] and "forget-host-key" in lines[0], res.describe()
    assert "Traceback" not in res.stderr
    for n in hk.nodes():
        assert not hk.exists_on(n, marker), f"the job ran on {n.name}"
    hk.gpuctl("forget-host-key", NAME, node.name).check()
    again = hk.gpuctl("exec", NAME, f"touch {marker}").check()
    assert "Preparing 1 of 3 node(s)" in again.stdout, again.describe()  # the others learn its key from the job
    for n in hk.nodes():
        assert hk.exists_on(n, marker)
