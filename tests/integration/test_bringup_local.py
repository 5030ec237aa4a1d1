"""Bring-up on real local nodes (issue 23): a node is prepared in one install step, only the nodes
that need it are prepared, and the others are left exactly as they were.

One cluster, in order: a cold apply (phases and their controller CPU in `-o json`), a re-apply
that prepares nothing, growing by one node, replacing one node (Terraform makes a new one in its
place), and an install step that fails on one node. "Left as they were" is checked where it
shows: each node's ~/.gpuctl/prepared keeps its mtime. Node-to-node SSH to the new and the
replaced node works from the old nodes, whose view came with the job (configplane/clusterview.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from e2e import Cluster, NodeInfo, gpuctl_env, needs_local_nodes

pytestmark = [pytest.mark.integration, needs_local_nodes]

NAME = "bup"


class Bringup:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.cluster = Cluster(NAME, root / "state")

    def task(self, num_nodes: int) -> str:
        path = self.root / f"c{num_nodes}.yaml"
        path.write_text(f"name: {NAME}\nnum_nodes: {num_nodes}\nresources:\n  infra: local\nrun: hostname\n")
        return str(path)

    def prepared_mtimes(self, nodes: list[NodeInfo]) -> dict[str, str]:
        """Each node's ~/.gpuctl/prepared: its mtime in nanoseconds and content."""
        return {n.name: self.cluster.ssh(n, "stat -c %.9Y ~/.gpuctl/prepared; cat ~/.gpuctl/prepared").stdout
                for n in nodes}

    def prepared_state(self, node: NodeInfo) -> str:
        """What the install step leaves on a node: each file's mode and hash, and the internal key's
        authorization."""
        files = ("~/.gpuctl/lib/gpuctl_node.py ~/.gpuctl/bin/gpuctl-node ~/.gpuctl/lib/gpuctl-fabric-probe "
                 "~/.gpuctl/lib/nodehealth.py ~/.gpuctl/installed.json ~/.gpuctl/prepared ~/.gpuctl/fabric.env ~/.ssh/gpuctl_cluster ~/.ssh/gpuctl_known_hosts ~/.ssh/config")
        return self.cluster.ssh(node, f"for f in {files}; do stat -c '%a %n' $f; sha256sum < $f; done; "
                                      "grep -c gpuctl-internal- ~/.ssh/authorized_keys").stdout

    def node_ids(self) -> list[str]:
        """The nodes' ids in rank order, as the inventory records them."""
        hosts = yaml.safe_load((self.cluster.cdir / "inventory.yml").read_text())["all"]["children"]["gpuctl_nodes"]["hosts"]
        return [h["gpuctl_node_id"] for h in sorted(hosts.values(), key=lambda h: h["gpuctl_rank"])]

    def records(self) -> dict[str, str]:
        return json.loads((self.cluster.cdir / "prepared.json").read_text())


@pytest.fixture(scope="module")
def bu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bringup]:
    b = Bringup(tmp_path_factory.mktemp("bringup"))
    try:
        yield b
    finally:
        b.cluster.down_quietly()


def test_cold_apply_reports_its_phases_and_a_reapply_prepares_nothing(bu: Bringup):
    res = bu.cluster.gpuctl("apply", bu.task(2), "-o", "json").check()
    doc = json.loads(res.stdout)
    phases = {p["phase"]: p for p in doc["phases"]}
    # the head by the prepare play, then worker1 by the head (a phase within prepare, listed first)
    assert list(phases) == ["provision", "head_install", "prepare", "job"], doc["phases"]
    assert all(p["seconds"] > 0 and p["controller_cpu_s"] >= 0 for p in phases.values())
    assert "Preparing 2 node(s) (first job on this cluster)" in res.stderr, res.describe()
    assert "    3 of 3 resource(s) made" in res.stderr.splitlines(), res.describe()  # the bridge and 2 nodes
    assert len(bu.records()) == 2 and len(set(bu.records().values())) == 1
    # the head by the prepare play, worker1 by the head: the same prepared state, file for file
    head, w1 = bu.cluster.nodes()
    assert bu.prepared_state(head) == bu.prepared_state(w1)
    before = bu.prepared_mtimes(bu.cluster.nodes())
    again = bu.cluster.gpuctl("apply", bu.task(2), "-o", "json").check()
    assert "Preparing" not in again.stderr, again.describe()
    assert [p["phase"] for p in json.loads(again.stdout)["phases"]] == ["provision", "job"]
    assert bu.prepared_mtimes(bu.cluster.nodes()) == before


def test_growing_prepares_only_the_new_node(bu: Bringup):
    old = bu.cluster.nodes()
    before = bu.prepared_mtimes(old)
    plays = set((bu.cluster.cdir / "runner" / "artifacts").iterdir())
    res = bu.cluster.gpuctl("apply", bu.task(3), "-o", "json").check()
    assert "Preparing 1 of 3 node(s) (worker2 not prepared yet)" in res.stderr, res.describe()
    # the head installed it: one call, no prepare play at all
    assert [p["phase"] for p in json.loads(res.stdout)["phases"]] == ["provision", "head_install", "prepare", "job"]
    assert set((bu.cluster.cdir / "runner" / "artifacts").iterdir()) == plays, res.describe()
    assert bu.prepared_mtimes(old) == before  # the old nodes' prepared state was not touched
    head, _, w2 = bu.cluster.nodes()
    assert f"(worker2, rank=2) {NAME}-2" in res.stderr.splitlines(), res.describe()
    # the head learned the new node (address, host key) from the job, not from a prepare
    assert bu.cluster.ssh(head, "ssh worker2 hostname").stdout.strip() == f"{NAME}-2"
    assert len(bu.records()) == 3


def test_replacing_one_node_prepares_it_alone(bu: Bringup):
    head, w1, w2 = bu.cluster.nodes()
    before = bu.prepared_mtimes([head, w2])
    old_records = bu.records()
    tf = bu.cluster.cdir / "terraform"
    subprocess.run(["terraform", f"-chdir={tf}", "apply", "-auto-approve", "-input=false", "-no-color",
                    "-replace=module.cluster.terraform_data.node[1]"], check=True, capture_output=True,
                   env=os.environ, timeout=300)
    res = bu.cluster.gpuctl("apply", bu.task(3)).check()
    assert "Preparing 1 of 3 node(s) (worker1 not prepared yet)" in res.stdout, res.describe()
    assert bu.prepared_mtimes([head, w2]) == before
    records = bu.records()
    assert len(records) == 3 and set(records) != set(old_records)  # worker1 is a new node (new id)
    head, w1, w2 = bu.cluster.nodes()
    # its new host key reached the other nodes with the job: checked strictly, no prompt
    assert bu.cluster.ssh(w2, "ssh worker1 hostname").stdout.strip() == f"{NAME}-1"


def test_a_failed_install_names_the_node_and_keeps_the_others(bu: Bringup):
    head, w1, w2 = bu.cluster.nodes()
    before = bu.prepared_mtimes([head, w1])
    # A file where the agent's directory goes: the install step cannot write there.
    bu.cluster.ssh(w2, "rm -rf ~/.gpuctl && echo in-the-way > ~/.gpuctl")
    res = bu.cluster.gpuctl("exec", NAME, "--", "true")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.describe()
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "worker2" in errors[0] and "gpuctl-node install" in errors[0], res.describe()
    assert "Preparing 1 of 3 node(s) (worker2: " in res.stdout, res.describe()
    assert bu.prepared_mtimes([head, w1]) == before
    records = bu.records()
    assert len(records) == 2  # worker2 is not recorded as prepared: the next job prepares it, and only it
    bu.cluster.ssh(w2, "rm -f ~/.gpuctl")
    again = bu.cluster.gpuctl("exec", NAME, "--", "hostname").check()
    assert "Preparing 1 of 3 node(s) (worker2 not prepared yet)" in again.stdout, again.describe()
    assert f"(worker2, rank=2) {NAME}-2" in again.stdout.splitlines()
    assert bu.prepared_mtimes([head, w1]) == before


def test_a_worker_the_head_cannot_log_in_to_is_prepared_directly(bu: Bringup):
    """A node made before nodes trusted the internal key at boot: the head is refused, the prepare
    play (which logs in with the access key) prepares it, and the job runs there."""
    head, w1, w2 = bu.cluster.nodes()
    public = (bu.cluster.cdir / "ssh" / "internal_ed25519.pub").read_text().split()[1]
    bu.cluster.ssh(w1, f"sed -i '/{public.replace('/', '.')}/d' ~/.ssh/authorized_keys; rm -rf ~/.gpuctl")
    bu.cluster.ssh(head, "rm -f ~/.gpuctl/cm/*")  # no ControlMaster to worker1 left from earlier jobs
    assert bu.cluster.ssh(head, "ssh worker1 true", check=False).returncode == 255  # the head is refused
    # as for a node gpuctl has not prepared yet
    records = bu.records()
    hosts = yaml.safe_load((bu.cluster.cdir / "inventory.yml").read_text())["all"]["children"]["gpuctl_nodes"]["hosts"]
    w1_id = hosts["worker1"]["gpuctl_node_id"]
    (bu.cluster.cdir / "prepared.json").write_text(json.dumps({k: v for k, v in records.items() if k != w1_id}))
    before = set((bu.cluster.cdir / "runner" / "artifacts").iterdir())
    res = bu.cluster.gpuctl("exec", NAME, "--", "hostname").check()
    assert "Preparing 1 of 3 node(s) (worker1 not prepared yet)" in res.stdout, res.describe()
    assert "    0 of 1 node(s) prepared; the head installs the other 1" in res.stdout, res.describe()  # tried
    played = [json.loads(p.read_text()).get("event_data", {}).get("host") for d in
              set((bu.cluster.cdir / "runner" / "artifacts").iterdir()) - before for p in d.glob("job_events/*.json")]
    assert "worker1" in played and "head" not in played, played  # then the prepare play, on worker1 alone
    assert f"(worker1, rank=1) {NAME}-1" in res.stdout.splitlines(), res.describe()
    assert bu.cluster.ssh(head, "ssh worker1 hostname").stdout.strip() == f"{NAME}-1"  # authorized again


def test_a_smaller_apply_never_removes_a_node_unasked(bu: Bringup):
    """Issue 34.3: re-applying the YAML (num_nodes 2) on the grown cluster (3) is refused in one line,
    exit 2, nothing changed, and never under a running job, even with -y; on a terminal it asks; -y
    removes worker2 alone."""
    nodes = bu.node_ids()
    assert len(nodes) == 3
    cluster_json = (bu.cluster.cdir / "cluster.json").read_text()
    job = bu.cluster.gpuctl("exec", NAME, "-d", "--", "sleep", "300").check()
    job_id = job.stderr.split("Job ")[1].split()[0] if "Job " in job.stderr else job.stdout.split("Job ")[1].split()[0]
    under_job = bu.cluster.gpuctl("apply", bu.task(2), "-y")
    assert under_job.returncode == 2, under_job.describe()
    assert (f"error: this apply would remove worker2 (rank 2) of cluster '{NAME}', which has 3 node(s) where the "
            f"task asks for 2, where job {job_id} (RUNNING) runs: it would be killed; wait for it to end or cancel "
            f"it (gpuctl cancel {NAME} {job_id}), then apply again; nothing was changed") in under_job.stderr
    assert "Traceback" not in under_job.stderr
    bu.cluster.gpuctl("cancel", NAME, job_id).check()
    refused = bu.cluster.gpuctl("apply", bu.task(2))  # no terminal: nobody to ask
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(
        "keep them with --num-nodes 3, agree with -y, or give the task another cluster name (-c NAME); nothing was "
        "changed"), refused.describe()
    assert (bu.cluster.cdir / "cluster.json").read_text() == cluster_json
    assert bu.node_ids() == nodes
    # at a terminal it asks, and no (the default) changes nothing
    asked = _at_a_terminal(bu, ["apply", bu.task(2)], answer=b"\n")
    assert "Go on? [y/N]" in asked and "not confirmed; nothing was changed" in asked, asked
    assert bu.node_ids() == nodes
    shrunk = bu.cluster.gpuctl("apply", bu.task(2), "-y").check()
    assert bu.node_ids() == nodes[:2], shrunk.describe()


def _at_a_terminal(bu: Bringup, argv: list[str], answer: bytes) -> str:
    """gpuctl with a terminal for stdin and stderr, `answer` typed at it; what the terminal showed."""
    import sys

    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "gpuctl", *argv], env=gpuctl_env(bu.cluster.state_dir),
                            stdin=slave, stdout=subprocess.PIPE, stderr=slave, start_new_session=True)
    os.close(slave)
    seen = b""
    try:
        while b"[y/N]" not in seen:
            chunk = os.read(master, 65536)
            if not chunk:
                break
            seen += chunk
        os.write(master, answer)
        proc.wait(timeout=120)
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return seen.decode(errors="replace")
