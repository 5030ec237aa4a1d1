"""The stage playbooks, the node agent and log following against two real sshd nodes.

Nodes come from tests/testhosts.py (network namespaces on a private bridge,
each with its own home), so this tests the Ansible layer on its own: wait ->
sync -> setup -> env -> run, live output, failure reporting, kill, resume
after a dropped connection, and that secrets stay out of every artifact.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import pytest
import testhosts

from gpuctl.configplane import playbooks
from gpuctl.jobplane import agentcall, gitignore, payload, stream
from gpuctl.node import protocol
from gpuctl.provision import ssh
from gpuctl.provision.ansibleinventory import write_inventory
from gpuctl.provision.inventory import Node

pytestmark = pytest.mark.integration

TRICKY = "it's \"quoted\" $HOME `id` \\ back {{ 1 + 1 }} {% raw %} ;& | <>\nsecond line\ttab"
CLUSTER_INFO = json.dumps({"cluster_name": "t", "ips": ["10.0.0.1", "10.0.0.2"], "zone": None})


@dataclass
class Cluster:
    hosts: testhosts.HostSet
    inventory: Path
    base: Path
    pdd: Path
    control: Path
    secret: str
    secrets_file: Path

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.hosts.inventory.nodes

    def play(self, name: str, extravars: dict[str, Any], **kw: Any) -> playbooks.PlaybookResult:
        return playbooks.run_playbook(name, inventory=self.inventory, private_data_dir=self.pdd,
                                      extravars=extravars, control_dir=self.control, **kw)

    def jobdir(self, rank: int, job: str) -> Path:
        return self.hosts.home(rank) / ".gpuctl" / "jobs" / job


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = testhosts.missing_requirements()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp("playbooks")
    hosts = testhosts.start_hosts(2, base)
    try:
        secret = "s3cr3t-" + secrets.token_hex(12)
        secrets_file = base / "secrets.sh"
        fd = os.open(secrets_file, os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"export API_TOKEN='{secret}'\n")
        yield Cluster(hosts=hosts, inventory=write_inventory(hosts.inventory, base / "inventory.yml"), base=base,
                      pdd=base / "runner", control=base / "cm", secret=secret, secrets_file=secrets_file)
    finally:
        testhosts.stop_hosts(hosts)
        ssh.remove_control_dir(base / "cm")  # its socket dir may lie under /tmp (short path)


def extravars(cluster: Cluster, job: str, **over: Any) -> dict[str, Any]:
    ips = "\n".join(n.address for n in cluster.nodes)
    common = {"GPUCTL_NODE_IPS": ips, "GPUCTL_NUM_NODES": "2", "GPUCTL_CLUSTER_INFO": CLUSTER_INFO,
              "MASTER_ADDR": cluster.nodes[0].address, "MASTER_PORT": "29500", "TRICKY": TRICKY, "EMPTY": ""}
    ev: dict[str, Any] = {
        "gpuctl_job_id": job,
        "gpuctl_workdir_src": None,
        "gpuctl_file_mounts": [],
        "gpuctl_setup_env": {**common, "SKYPILOT_SETUP_NODE_IPS": ips},
        "gpuctl_setup_rank_vars": ["GPUCTL_NODE_RANK", "SKYPILOT_SETUP_NODE_RANK"],
        "gpuctl_run_env": {**common, "SKYPILOT_NODE_IPS": ips},
        "gpuctl_run_rank_vars": ["GPUCTL_NODE_RANK", "SKYPILOT_NODE_RANK"],
        "gpuctl_secrets_file": str(cluster.secrets_file),
        "gpuctl_setup_script": None,
        "gpuctl_run_script": None,
        "gpuctl_hostfile_lines": [f"{n.address} slots=1" for n in cluster.nodes],
        "gpuctl_run_hosts": [n.name for n in cluster.nodes],
    }
    ev.update(over)
    return ev


def follow_while(cluster: Cluster, name: str, ev: dict[str, Any], stage: str, nodes: tuple[Node, ...] | None = None,
                 **follow_kw: Any) -> tuple[playbooks.PlaybookResult, dict[int, int | None], list[tuple[float, int, str]]]:
    """Run a stage's playbook in a thread while following its log (as jobplane/runner.py does)."""
    nodes = nodes or cluster.nodes
    done = threading.Event()
    box: dict[str, playbooks.PlaybookResult] = {}
    lines: list[tuple[float, int, str]] = []

    def play() -> None:
        try:
            box["r"] = cluster.play(name, ev)
        finally:
            done.set()

    worker = threading.Thread(target=play)
    worker.start()
    codes = stream.follow(nodes, job_id=ev["gpuctl_job_id"], stage=stage, control_dir=cluster.control, stop=done,
                          on_line=lambda n, line: lines.append((time.monotonic(), n.rank, line)), **follow_kw)
    worker.join()
    return box["r"], codes, lines


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_stages_end_to_end(cluster: Cluster, capfd: pytest.CaptureFixture[str]) -> None:
    src = cluster.base / "workdir"
    _write_tree(src, {
        ".gitignore": "ignored.txt\nbuild/\n",
        "ignored.txt": "must not arrive",
        "build/out.bin": "must not arrive",
        "kept.txt": "kept",
        "sub/.gitignore": "*.tmp\n",
        "sub/a.tmp": "must not arrive",
        "sub/b.txt": "b",
        ".git/HEAD": "ref: refs/heads/main\n",
    })
    mounts = cluster.base / "mounts"
    _write_tree(mounts, {"data.txt": "data", "dir/inner/f.txt": "f", "dir/g.txt": "g"})
    job = "e2e"
    rsync_args = payload.workdir_rsync_args(gitignore.workdir_filter(src))
    ev = extravars(cluster, job, gpuctl_workdir_src=str(src), gpuctl_workdir_rsync_args=rsync_args,
                   gpuctl_file_mounts=[
        {"src": str(mounts / "data.txt"), "dest": "~/mnt/deep/data.txt"},
        {"src": str(mounts / "dir"), "dest": "/root/abs/dir"},
    ])

    t = time.monotonic()
    r = cluster.play("wait.yml", ev)
    print(f"wait {time.monotonic() - t:.1f}s")
    assert r.ok, r
    for n in cluster.nodes:
        agent = cluster.hosts.home(n.rank) / ".gpuctl/bin/gpuctl-node"
        assert agent.stat().st_mode & 0o111

    # A stale file is deleted by --delete; an ignored file made on the node stays (rsync protects excluded files).
    for n in cluster.nodes:
        _write_tree(cluster.hosts.home(n.rank) / "gpuctl_workdir", {"stale.txt": "x", "ignored.txt": "node's own"})
    t = time.monotonic()
    r = cluster.play("sync", ev)
    print(f"sync {time.monotonic() - t:.1f}s")
    assert r.ok, r
    for n in cluster.nodes:
        home = cluster.hosts.home(n.rank)
        wd = home / "gpuctl_workdir"
        assert (wd / "kept.txt").read_text() == "kept"
        assert (wd / "sub/b.txt").read_text() == "b"
        assert (wd / ".gitignore").exists()
        for absent in ("build", "sub/a.tmp", ".git", "stale.txt"):
            assert not (wd / absent).exists(), absent
        assert (wd / "ignored.txt").read_text() == "node's own"
        assert (home / "mnt/deep/data.txt").read_text() == "data"
        assert (home / "abs/dir/inner/f.txt").read_text() == "f"
        assert (home / "abs/dir/g.txt").read_text() == "g"
    r = cluster.play("sync", ev)
    assert r.ok and r.changed == [], r  # idempotent: nothing to transfer the second time

    setup = (
        'date +%s.%N > ~/setup_ts\n'
        'echo "setup rank=$GPUCTL_NODE_RANK skypilot=$SKYPILOT_SETUP_NODE_RANK pwd=$(pwd)"\n'
        '[ "$GPUCTL_NODE_RANK" = 1 ] && sleep 1\n'
        'echo "token length ${#API_TOKEN}"\n'
    )
    ev["gpuctl_setup_script"] = setup
    t = time.monotonic()
    r, codes, lines = follow_while(cluster, "setup", ev, "setup")
    setup_done = time.time()
    print(f"setup {time.monotonic() - t:.1f}s")
    assert r.ok, r
    assert codes == {0: 0, 1: 0}
    for n in cluster.nodes:
        assert (n.rank, f"setup rank={n.rank} skypilot={n.rank} pwd=/root/gpuctl_workdir") in [(rk, ln) for _, rk, ln in lines]
        assert (n.rank, f"token length {len(cluster.secret)}") in [(rk, ln) for _, rk, ln in lines]
        ts = float((cluster.hosts.home(n.rank) / "setup_ts").read_text())
        assert ts < setup_done  # the playbook returned only after every node's setup ended
        assert (cluster.jobdir(n.rank, job) / "setup.exit").read_text() == "0"

    t = time.monotonic()
    r = cluster.play("env", ev)
    print(f"env {time.monotonic() - t:.1f}s")
    assert r.ok, r

    ev["gpuctl_run_script"] = (
        "python3 -c 'import json, os; json.dump({\"env\": dict(os.environ), \"cwd\": os.getcwd()}, "
        "open(os.path.expanduser(\"~/run_env.json\"), \"w\"))'\n"
        "echo before\n"
        "sleep 2\n"
        "echo after\n"
        "exit $((GPUCTL_NODE_RANK * 3))\n"
    )
    t = time.monotonic()
    r, codes, lines = follow_while(cluster, "run", ev, "run")
    print(f"run+follow {time.monotonic() - t:.1f}s")
    assert r.ok, r
    assert codes == {0: 0, 1: 3}
    for n in cluster.nodes:
        mine = [(ts, ln) for ts, rk, ln in lines if rk == n.rank]
        assert [ln for _, ln in mine] == ["before", "after"]
        assert mine[1][0] - mine[0][0] > 1.5, "'before' must arrive while the rank still sleeps"

        data = json.loads((cluster.hosts.home(n.rank) / "run_env.json").read_text())
        env = data["env"]
        assert data["cwd"] == "/root/gpuctl_workdir"
        assert env["GPUCTL_NODE_RANK"] == env["SKYPILOT_NODE_RANK"] == str(n.rank)
        assert "SKYPILOT_SETUP_NODE_RANK" not in env  # the run env replaced the setup env
        assert env["TRICKY"] == TRICKY
        assert env["EMPTY"] == ""
        assert env["GPUCTL_NODE_IPS"] == "\n".join(x.address for x in cluster.nodes)
        assert json.loads(env["GPUCTL_CLUSTER_INFO"]) == json.loads(CLUSTER_INFO)
        assert env["API_TOKEN"] == cluster.secret
        assert env["PYTHONUNBUFFERED"] == "1"
        hostfile = env["GPUCTL_HOSTFILE"]
        assert hostfile == f"/root/.gpuctl/jobs/{job}/hostfile"
        assert (cluster.jobdir(n.rank, job) / "hostfile").read_text() == "".join(
            f"{x.address} slots=1\n" for x in cluster.nodes)

        secrets_sh = cluster.jobdir(n.rank, job) / "secrets.sh"
        assert stat.S_IMODE(secrets_sh.stat().st_mode) == 0o600
        assert cluster.secret in secrets_sh.read_text()

    # The secret reaches the nodes only: not the runner's artifacts, not our output.
    leaks = [p for p in cluster.pdd.rglob("*") if p.is_file() and cluster.secret.encode() in p.read_bytes()]
    assert leaks == []
    assert list((cluster.pdd / "artifacts").glob("*/job_events/*.json")), "artifacts were written"
    out, err = capfd.readouterr()
    assert cluster.secret not in out + err
    assert all(cluster.secret not in ln for _, _, ln in lines)


def test_failing_setup_names_host_and_exit_code(cluster: Cluster) -> None:
    job = "badsetup"
    ev = extravars(cluster, job, gpuctl_setup_script=(
        'echo "setup on $GPUCTL_NODE_RANK"\n'
        'if [ "$GPUCTL_NODE_RANK" = 1 ]; then exit 3; fi\n'
        'sleep 1\n'
        'date +%s.%N > "$HOME/.gpuctl/jobs/badsetup/head_done"\n'
    ), gpuctl_run_script="touch ~/run_started")
    assert cluster.play("wait", ev).ok
    r, codes, lines = follow_while(cluster, "setup", ev, "setup")
    assert not r.ok
    assert codes == {0: 0, 1: 3}
    assert [(f.host, f.rank, f.rc) for f in r.failures] == [("worker1", 1, 3)]
    assert "worker1" in r.failures[0].message and "exit code 3" in r.failures[0].message
    # A barrier: the playbook waited for the head's slower, successful setup.
    assert (cluster.jobdir(0, job) / "head_done").exists()
    # The job layer runs env/run only when setup succeeded everywhere.
    if r.ok:
        cluster.play("env", ev)
        cluster.play("run", ev)
    for n in cluster.nodes:
        assert not (cluster.jobdir(n.rank, job) / "run.pid").exists()
        assert not (cluster.hosts.home(n.rank) / "run_started").exists()


def _remote_follow_pid(cluster: Cluster, rank: int) -> int | None:
    ns = cluster.hosts.namespaces[rank]
    for pid in testhosts._netns_pids(ns):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(c.endswith(b"gpuctl-node") for c in cmd) and b"follow" in cmd:
            return pid
    return None


def test_kill_and_resume_after_dropped_connection(cluster: Cluster) -> None:
    job = "killme"
    ev = extravars(cluster, job, gpuctl_run_script=(
        "for i in $(seq 1 40); do echo line$i; sleep 0.05; done\n"
        "echo waiting\n"
        "sleep 1000\n"
    ))
    assert cluster.play("wait", ev).ok
    assert cluster.play("env", ev).ok
    assert cluster.play("run", ev).ok

    dropped: list[int] = []
    killer: list[threading.Thread] = []
    waiting: set[int] = set()

    def on_line(node: Node, line: str) -> None:
        seen.setdefault(node.rank, []).append(line)
        if node.rank == 0 and line == "line5" and not dropped:
            pid = _remote_follow_pid(cluster, 0)
            assert pid is not None
            os.kill(pid, 9)  # the connection drops mid-stream; follow resumes from its offset
            dropped.append(pid)
        if line == "waiting":
            waiting.add(node.rank)
            if waiting == {0, 1} and not killer:
                t = threading.Thread(target=lambda: box.setdefault("kill", cluster.play(
                    "kill", {**ev, "gpuctl_grace": 2})))
                t.start()
                killer.append(t)

    seen: dict[int, list[str]] = {}
    box: dict[str, playbooks.PlaybookResult] = {}
    codes = stream.follow(cluster.nodes, job_id=job, stage="run", on_line=on_line, control_dir=cluster.control)
    killer[0].join()
    assert box["kill"].ok, box["kill"]
    assert dropped
    assert codes == {0: 143, 1: 143}  # 128 + SIGTERM, recorded as killed
    expected = [f"line{i}" for i in range(1, 41)] + ["waiting"]
    assert seen == {0: expected, 1: expected}  # nothing lost, nothing repeated
    status = agentcall.call_all(cluster.nodes, agentcall.stage_command(protocol.CMD_STATUS, job, protocol.STAGE_RUN),
                                control_dir=ssh.control_dir_for(cluster.control))
    for reply in status.values():
        answer = reply.answer()
        assert answer == {**answer, "running": False, "exit": 143, "killed": True}


def test_unreachable_node(cluster: Cluster) -> None:
    ghost = replace(cluster.nodes[1], name="worker2", rank=2, node_id="ghost",
                    address=cluster.nodes[1].address.rsplit(".", 1)[0] + ".250",
                    ssh_host=cluster.nodes[1].address.rsplit(".", 1)[0] + ".250")
    inv = write_inventory(replace(cluster.hosts.inventory, nodes=(*cluster.nodes, ghost)), cluster.base / "ghost.yml")
    ev = extravars(cluster, "ghost", gpuctl_run_hosts=["head", "worker1", "worker2"])
    r = playbooks.run_playbook("env", inventory=inv, private_data_dir=cluster.pdd, extravars=ev,
                               control_dir=cluster.control)
    assert not r.ok
    assert r.unreachable == ["worker2"] and r.failures == []
    assert "port 22" in r.unreachable_reasons["worker2"]

    t = time.monotonic()
    codes = stream.follow((ghost,), job_id="ghost", stage="run", on_line=lambda n, line: None,
                          control_dir=cluster.control, retries=1)
    assert codes == {2: None}
    assert time.monotonic() - t < 60
