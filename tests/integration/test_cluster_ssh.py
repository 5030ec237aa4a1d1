"""Node-to-node SSH with the cluster's internal key (role gpuctl_node's install step, in wait.yml).

Part 1 runs wait.yml on three real sshd test hosts (tests/testhosts.py: own
network namespace and home each) and checks, from inside the nodes, that every
node reaches every other one by address and by inventory name, with no prompt;
that the key is private and never lands in ansible-runner's artifacts; that a
re-run changes nothing; that a user's own ~/.ssh/config keeps working; and that
a new key replaces the old one. Part 2 runs examples/head-launcher through the
real CLI on local nodes: the head alone starts a gloo all_reduce on every node
over SSH.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import gpuctlfork
import pytest
import testhosts

from gpuctl.configplane import playbooks
from gpuctl.provision import ssh
from gpuctl.provision.ansibleinventory import write_inventory
from gpuctl.provision.inventory import Node
from gpuctl.provision.sshkeys import ensure_internal_key

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ROLE_TASKS = {  # the role's task that writes node state, as ansible-runner events report it
    "Install the node's prepared state (agent, node-to-node SSH, fabric env, fingerprint)",
}
USER_CONFIG = "ConnectionAttempts 3\n\nHost userhost\n  User someone\n  Port 2222\n"


@dataclass
class Cluster:
    hosts: testhosts.HostSet
    inventory: Path
    base: Path
    pdd: Path
    control: Path
    cdir: Path

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.hosts.inventory.nodes

    def wait(self) -> playbooks.PlaybookResult:
        key, _ = ensure_internal_key(self.cdir)
        return playbooks.run_playbook("wait.yml", inventory=self.inventory, private_data_dir=self.pdd,
                                      extravars={"gpuctl_internal_key": str(key)}, control_dir=self.control)


def on_node(node: Node, script: str, *, timeout: int = 60) -> subprocess.CompletedProcess[str]:
    """Run `script` on `node`, logged in from the controller with the test's access key."""
    argv = ["ssh", "-i", str(node.ssh_key), "-p", str(node.ssh_port), "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
            f"{node.ssh_user}@{node.ssh_host}", script]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def peer_script(targets: list[str]) -> str:
    """From a node: `TARGET SSH_CONNECTION` per target over the cluster config; stops at the first failure."""
    lines = ["set -e"]
    for t in targets:
        q = shlex.quote(t)
        lines.append(f"echo {q} \"$(ssh {q} 'echo $SSH_CONNECTION' </dev/null)\"")
    return "\n".join(lines)


def role_changes(artifact_dir: str) -> list[str]:
    """(host: task) of every task of the role that reported a change in this run."""
    changed = []
    for f in sorted(Path(artifact_dir, "job_events").glob("*.json")):
        ev = json.loads(f.read_text())
        data = ev.get("event_data") or {}
        if ev.get("event") == "runner_on_ok" and data.get("task") in ROLE_TASKS and (data.get("res") or {}).get("changed"):
            changed.append(f"{data.get('host')}: {data.get('task')}")
    return changed


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = testhosts.missing_requirements()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp("clusterssh")
    hosts = testhosts.start_hosts(3, base)
    try:
        yield Cluster(hosts=hosts, inventory=write_inventory(hosts.inventory, base / "inventory.yml"), base=base,
                      pdd=base / "runner", control=base / "cm", cdir=base / "cluster")
    finally:
        testhosts.stop_hosts(hosts)
        ssh.remove_control_dir(base / "cm")  # its socket dir may lie under /tmp (short path)


def test_nodes_reach_each_other_with_the_cluster_key(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    # A user's setting that would copy every task's arguments (the private key among them) into the events.
    monkeypatch.setenv("ANSIBLE_DISPLAY_ARGS_TO_STDOUT", "True")
    head, *workers = cluster.nodes
    # Before: nothing lets a node in to another one.
    before = on_node(head, f"ssh -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o ConnectTimeout=5 "
                           f"{workers[0].address} true")
    assert before.returncode == 255, before
    # A user's own client config, with a global option before its Host entries.
    user_cfg = cluster.hosts.home(head.rank) / ".ssh" / "config"
    user_cfg.parent.mkdir(mode=0o700, exist_ok=True)
    user_cfg.write_text(USER_CONFIG)

    t = time.monotonic()
    r = cluster.wait()
    print(f"wait.yml with cluster ssh, 3 nodes: {time.monotonic() - t:.1f}s")
    assert r.ok, r

    key, public = ensure_internal_key(cluster.cdir)
    for n in cluster.nodes:
        home = cluster.hosts.home(n.rank)
        node_key = home / ".ssh" / "gpuctl_cluster"
        assert stat.S_IMODE(node_key.stat().st_mode) == 0o600
        assert stat.S_IMODE(node_key.parent.stat().st_mode) == 0o700
        assert node_key.read_bytes() == key.read_bytes()
        assert (home / ".ssh" / "authorized_keys").read_text().splitlines().count(public) == 1
        config = (home / ".ssh" / "config").read_text()
        assert config.startswith("# BEGIN gpuctl cluster hosts")
        for peer in cluster.nodes:
            assert f"Host {peer.name} {peer.address}\n  HostName {peer.address}\n  Port 22\n  User root\n" in config
        if n.rank == head.rank:
            assert config.endswith(USER_CONFIG)  # kept, after the block

    # Every node reaches every other node, by address and by inventory name,
    # non-interactively (stdin closed, BatchMode), on the other node's address.
    for src in cluster.nodes:
        targets = [t for peer in cluster.nodes if peer is not src for t in (peer.address, peer.name)]
        proc = on_node(src, peer_script(targets))
        assert proc.returncode == 0, (src.name, proc.stdout, proc.stderr)
        got = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
        for peer in cluster.nodes:
            if peer is src:
                continue
            for target in (peer.address, peer.name):
                client_ip, _, server_ip, server_port = got[target].split()
                assert (client_ip, server_ip, server_port) == (src.address, peer.address, "22"), (src.name, target)

    # The head's user config still applies: its global option to every host, its own Host entry to its host.
    resolved = on_node(head, "ssh -G userhost; echo ---; ssh -G worker1")
    assert resolved.returncode == 0, resolved.stderr
    user_part, worker_part = resolved.stdout.split("---\n")
    assert "user someone\n" in user_part and "port 2222\n" in user_part and "connectionattempts 3\n" in user_part
    assert f"hostname {workers[0].address}\n" in worker_part and "connectionattempts 3\n" in worker_part
    assert "identityfile ~/.ssh/gpuctl_cluster\n" in worker_part and "batchmode yes\n" in worker_part

    # The private key is in no artifact ansible-runner kept (events, stdout, command, ...).
    body = [ln for ln in key.read_text().splitlines() if ln and not ln.startswith("-----")]
    assert body
    for f in cluster.pdd.rglob("*"):
        if f.is_file():
            text = f.read_text(errors="replace")
            assert not any(ln in text for ln in body), f"private key material in {f}"

    # Idempotent: a second run changes nothing in the role (nor anywhere in the play).
    t = time.monotonic()
    again = cluster.wait()
    print(f"wait.yml re-run: {time.monotonic() - t:.1f}s")
    assert again.ok, again
    assert role_changes(again.artifact_dir or "") == []
    assert again.changed == [], again
    assert role_changes(r.artifact_dir or "")  # (the check above does see the first run's changes)


def test_a_new_key_replaces_the_old_one(cluster: Cluster) -> None:
    head, worker = cluster.nodes[0], cluster.nodes[1]
    assert cluster.wait().ok
    old_key, old_public = ensure_internal_key(cluster.cdir)
    old_private = old_key.read_bytes()
    old_key.unlink()
    old_key.with_name(old_key.name + ".pub").unlink()
    new_key, new_public = ensure_internal_key(cluster.cdir)
    assert new_public.split()[1] != old_public.split()[1]

    r = cluster.wait()
    assert r.ok, r
    for n in cluster.nodes:
        lines = (cluster.hosts.home(n.rank) / ".ssh" / "authorized_keys").read_text().splitlines()
        assert new_public in lines and old_public not in lines
        assert (cluster.hosts.home(n.rank) / ".ssh" / "gpuctl_cluster").read_bytes() == new_key.read_bytes()
    proc = on_node(head, peer_script([worker.name]))
    assert proc.returncode == 0, proc.stderr
    # The old key no longer opens the worker.
    stale = cluster.hosts.home(head.rank) / "old_key"
    stale.write_bytes(old_private)
    os.chmod(stale, 0o600)
    denied = on_node(head, f"ssh -F /dev/null -i ~/old_key -o IdentitiesOnly=yes -o BatchMode=yes "
                           f"-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null {worker.address} true")
    assert denied.returncode == 255 and "Permission denied" in denied.stderr, denied


def gpuctl(*args: str, timeout: int = 300, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return gpuctlfork.run([*args], cwd=cwd,
                          timeout=timeout, env=dict(os.environ))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("terraform"),
                    reason="netns local nodes need root, iproute2 and terraform")
def test_head_launcher_example_reaches_every_worker(_isolated_state: Path) -> None:
    from gpuctl.provision import provisioner

    name = "head-launcher"
    t = time.monotonic()
    try:
        proc = gpuctl("apply", "cluster.yaml", cwd=REPO / "examples" / "head-launcher")  # workdir: . is the cwd
        print(f"gpuctl apply examples/head-launcher: {time.monotonic() - t:.1f}s")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        inv = provisioner.load_inventory_of(name)
        assert inv is not None and len(inv.nodes) == 2
        out = proc.stdout + proc.stderr
        world = len(inv.nodes)
        # Only the head ran the launcher; every node's process reported over SSH, and the sum is right.
        for node in inv.nodes:
            line = (f"(head, rank=0) [{node.address} rank {node.rank}] rank {node.rank}/{world} on {name}-{node.rank}: "
                    f"all_reduce sum 3 (expected 3) ok")
            assert line in out, out
        assert "launcher: all 2 process(es) succeeded" in out, out
        assert "Job 1 succeeded on 2 node(s)" in out, out

        # The config on real local nodes also names each node by its own hostname.
        head, worker = inv.nodes
        proc = on_node(head, f"ssh {name}-1 'hostname; echo $SSH_CONNECTION'; ssh worker1 hostname")
        assert proc.returncode == 0, proc.stderr
        hostname, connection, again = proc.stdout.splitlines()
        assert (hostname, again) == (f"{name}-1", f"{name}-1")
        assert connection.split()[0::2] == [head.address, worker.address]
    finally:
        down = gpuctl("down", name)
        assert down.returncode == 0, down.stdout + down.stderr
