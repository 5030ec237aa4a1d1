"""A lost node made again, and only it, on real local nodes (netns): what a managed job does
when a machine dies (provider.lost_nodes, then lifecycle.replace_nodes).

worker1's machine dies (every process in its namespace killed, the namespace deleted): the
platform names rank 1 alone as lost, without ssh; replacing it makes a new node at the same
rank, name and address, with a new sshd and host key, while the head's and worker2's sshd
never restart; the next job logs in everywhere with verified host keys and prepares only the
new node; `gpuctl down` leaves nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from e2e import LOST_NODES_PY, REPLACE_NODES_PY, Cluster, gpuctl_env, gpuctl_python, netns_names, needs_local_nodes, \
    running, wait_for

pytestmark = [pytest.mark.integration, needs_local_nodes]

NAME = "rpl3"


def lost_nodes(cluster: Cluster) -> dict[str, str]:
    res = gpuctl_python(LOST_NODES_PY, NAME, env=gpuctl_env(cluster.state_dir), timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def kill_machine(netns: str) -> None:
    """The machine dies: every process in its namespace, then the namespace itself."""
    def pids() -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    for pid in pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(f"the processes of {netns} to end", lambda: not pids(), 10)
    subprocess.run(["ip", "netns", "del", netns], check=True)


def test_a_lost_worker_is_made_again_and_only_it(tmp_path: Path) -> None:
    cluster = Cluster(NAME, tmp_path / "state")
    task = tmp_path / "c.yaml"
    task.write_text(f'name: {NAME}\nnum_nodes: 3\nresources:\n  infra: local\nrun: "true"\n')
    try:
        cluster.gpuctl("apply", str(task)).check()  # runs the job: every node prepared
        before = cluster.footprint()
        before.assert_present(3)
        head, w1, w2 = cluster.nodes()
        old_id = yaml_node_ids(cluster)[1]
        netns = cluster.node_env(w1)["LN_NETNS"]
        assert lost_nodes(cluster) == {}

        kill_machine(netns)
        assert lost_nodes(cluster) == {"1": f"its network namespace {netns} is gone"}

        res = gpuctl_python(REPLACE_NODES_PY, NAME, "1", env=gpuctl_env(cluster.state_dir))
        assert res.returncode == 0, res.stdout + res.stderr
        assert "==> Replacing worker1 of cluster 'rpl3'" in res.stdout, res.stdout

        after = cluster.footprint()
        after.assert_present(3)
        assert netns in netns_names() and lost_nodes(cluster) == {}
        assert after.sshd[0] == before.sshd[0] and after.sshd[2] == before.sshd[2]  # never restarted
        assert after.sshd[1] != before.sshd[1] and running(*after.sshd[1])
        assert [(n.name, n.rank, n.address) for n in cluster.nodes()] == \
            [(n.name, n.rank, n.address) for n in (head, w1, w2)]
        assert yaml_node_ids(cluster)[1] != old_id
        known = (cluster.cdir / "known_hosts").read_text()
        assert f"gpuctl-{old_id}" not in known  # the lost node's key is forgotten, the new one pinned

        job = cluster.gpuctl("exec", NAME, "--", "hostname").check()  # strict host keys: the pinned ones
        assert "Preparing 1 of 3 node(s) (worker1 not prepared yet)" in job.stdout, job.describe()
        for node in (head, w1, w2):
            assert f"({node.name}, rank={node.rank}) {NAME}-{node.rank}" in job.stdout.splitlines(), job.describe()

        cluster.gpuctl("down", NAME).check()
        before.assert_gone()
        after.assert_gone()
    finally:
        cluster.down_quietly()


def yaml_node_ids(cluster: Cluster) -> list[str]:
    """The node ids of inventory.yml in rank order."""
    hosts = yaml.safe_load((cluster.cdir / "inventory.yml").read_text())["all"]["children"]["gpuctl_nodes"]["hosts"]
    return [h["gpuctl_node_id"] for h in sorted(hosts.values(), key=lambda h: h["gpuctl_rank"])]


def test_replace_under_a_running_job_is_refused_unless_forced(tmp_path: Path) -> None:
    """Replacing one node ends a distributed job everywhere: refused in one line naming the job, the
    nodes untouched; with --force the job is cancelled first (its record says why), then the node
    made again. No terminal here, so nothing is asked."""
    name = "rplj"
    cluster = Cluster(name, tmp_path / "state")
    task = tmp_path / "c.yaml"
    task.write_text(f'name: {name}\nnum_nodes: 2\nresources:\n  infra: local\nrun: "sleep 120"\n')
    try:
        cluster.gpuctl("apply", str(task), "-d").check()
        before = cluster.footprint()
        refused = cluster.gpuctl("replace", name, "worker1", "--no-health-check")
        assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
            f"error: job(s) 1 still run on cluster '{name}' and replacing worker1 (rank 1) ends them; wait for them "
            f"(`gpuctl queue {name}`), cancel them (`gpuctl cancel {name} --all`), or replace anyway with --force; "
            "nothing was replaced"), refused.describe()
        assert cluster.footprint().sshd == before.sshd
        forced = cluster.gpuctl("replace", name, "worker1", "--force", "--no-health-check", "-o", "json").check()
        assert [r["name"] for r in json.loads(forced.stdout)["replaced"]] == ["worker1"], forced.describe()
        assert "Job 1 cancelled: replacing worker1 (rank 1) would have ended it" in forced.stderr, forced.describe()
        job = json.loads(cluster.gpuctl("queue", name, "-o", "json").check().stdout)["jobs"][0]
        assert job["status"] == "CANCELLED" and "gpuctl replace --force" in job["detail"], job
        after = cluster.footprint()
        assert after.sshd[0] == before.sshd[0] and after.sshd[1] != before.sshd[1]
    finally:
        cluster.down_quietly()
