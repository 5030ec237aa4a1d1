"""Jobs on a running cluster (issue 4) through the real `gpuctl` command on one
3-node local cluster: exec (no setup, workdir synced, file_mounts not), subset
runs, fail fast, cancel and Ctrl-C, logs after the fact and live, two gpuctl
commands at once, ssh-config / ssh, detached jobs and their background watcher.

The cluster is brought up once for the module by `gpuctl apply -d` (a setup
that counts itself, and a run in which rank 1 fails after a while, so the
detached job's watcher has a failure to record) and torn down by the last test
(and, whatever happens, by the fixture). Node processes are checked twice: in
this machine's process table (`pgrep -f`: the nodes share it) and per node,
through the processes inside each node's network namespace (`ip netns pids`).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e import (Cluster, Footprint, NodeInfo, Result, Watched, gpuctl_env, needs_local_nodes,
                 netns_names, pids_matching, queue_rows, wait_for)

pytestmark = [pytest.mark.integration, needs_local_nodes]

NAME = "jobs3"
MOD = f"jl{uuid.uuid4().hex[:10]}"  # every marker of this module starts with it

APPLY_MARKER = f"{MOD}-apply"
APPLY_FAIL_AFTER_S = 12  # rank 1 of the applied (detached) job fails after this long

TASK = f"""\
name: {NAME}
num_nodes: 3
resources:
  infra: local
workdir: ./proj
file_mounts:
  ~/jl/mounted.txt: ./mount-src/m.txt
setup: |
  mkdir -p ~/jl
  echo "$GPUCTL_TASK_ID" >> ~/jl/setup-count
run: |
  if [ "$GPUCTL_NODE_RANK" == "1" ]; then
    sleep {APPLY_FAIL_AFTER_S}; echo "worker1 gives up"; exit 3
  fi
  echo "rank $GPUCTL_NODE_RANK waits"
  (exec -a {APPLY_MARKER} sleep 120)
  echo "rank $GPUCTL_NODE_RANK survived"
"""

# `gpuctl exec NAME exec.yaml`: its setup and file_mounts must be ignored.
EXEC_TASK = """\
name: exec-file
num_nodes: 3
resources:
  infra: local
workdir: ./proj
file_mounts:
  ~/jl/mounted.txt: ./mount-src/m.txt
setup: |
  echo "$GPUCTL_TASK_ID" >> ~/jl/setup-count
run: |
  echo "exec-file rank $GPUCTL_NODE_RANK version $(cat version.txt) mount $(cat ~/jl/mounted.txt)"
"""

# The detached job whose logs are followed live and read back later.
LOG_LINES = 8
# Lines 1.2 s apart; the second half waits (at most 60 s) for FOLLOW_MARK, made once the follower
# showed the first line, so what it streams live does not depend on how late it started.
FOLLOW_MARK = Path(f"/tmp/gpuctl-follow-{uuid.uuid4().hex}")  # nodes share /tmp with this machine
LOG_JOB = ('for i in $(seq 1 %d); do if [ $i = %d ]; then for _ in $(seq 600); do [ -e %s ] && break; sleep 0.1; '
           'done; fi; echo "logline-$i rank=$GPUCTL_NODE_RANK"; sleep 1.2; done; '
           'echo "logline-err rank=$GPUCTL_NODE_RANK" >&2' % (LOG_LINES, LOG_LINES // 2 + 1, FOLLOW_MARK))


def expected_log_lines(rank: int) -> list[str]:
    return [f"logline-{i} rank={rank}" for i in range(1, LOG_LINES + 1)] + [f"logline-err rank={rank}"]


# -- helpers -----------------------------------------------------------------------


def shell(script: str) -> list[str]:
    """`exec` arguments running `script` under bash on every node. After `--` gpuctl keeps argv as
    given (no shell), and the script travels in the environment so the markers it names are not in
    any process's command line."""
    return ["--env", f"JL_SCRIPT={script}", "--", "bash", "-c", 'eval "$JL_SCRIPT"']


def job_id_of(res: Result, word: str = "running") -> int:
    m = re.search(rf"^Job (\d+) {word}\b", res.stdout, re.M)
    assert m, f"no 'Job N {word}' line\n" + res.describe()
    return int(m.group(1))


@dataclass(frozen=True)
class QueueRow:
    job_id: int
    name: str
    status: str
    nodes: int
    codes: str


def parse_queue(res: Result) -> dict[int, QueueRow]:
    res.check()
    lines = res.stdout.splitlines()
    assert lines and lines[0].split()[:3] == ["ID", "NAME", "STATUS"], res.stdout
    return {int(words[0]): QueueRow(int(words[0]), words[1], words[2], int(words[-2]), words[-1])
            for words in queue_rows(res.stdout)}


def job_paths(node_job: str) -> tuple[str, str]:
    """How a job's node-side processes name it (`node_job`: Cluster.node_job): the agent
    (`.../jobs/N-TOKEN run`) and bash (`.../jobs/N-TOKEN/run.sh`)."""
    return f"/.gpuctl/jobs/{node_job} ", f"/.gpuctl/jobs/{node_job}/"


def cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def netns_processes(ns: str) -> list[tuple[int, str]]:
    """Every process inside the node's network namespace (`ip netns pids`): the node's process table."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=True).stdout
    procs = []
    for word in out.split():
        line = cmdline(int(word))
        if line is not None:
            procs.append((int(word), line))
    return procs


def processes_by_netns(namespaces: list[str]) -> dict[str, list[tuple[int, str]]]:
    """Like `ip netns pids` for several namespaces in one pass over /proc (the same test:
    /proc/PID/ns/net is the namespace file bound at /run/netns/NS), cheap enough to poll."""
    wanted = {}
    for ns in namespaces:
        st = os.stat(f"/run/netns/{ns}")
        wanted[(st.st_dev, st.st_ino)] = ns
    found: dict[str, list[tuple[int, str]]] = {ns: [] for ns in namespaces}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")
        except OSError:
            continue
        ns = wanted.get((st.st_dev, st.st_ino))
        if ns is not None:
            line = cmdline(int(entry.name))
            if line is not None:
                found[ns].append((int(entry.name), line))
    return found


@dataclass
class JobsCluster:
    cluster: Cluster
    project: Path
    yaml: Path
    nodes: list[NodeInfo]
    netns: dict[int, str]  # rank -> the node's network namespace
    hostnames: dict[int, str]  # rank -> `hostname` on that node
    applied: Result  # `apply -d`
    queue_after_apply: Result  # `queue` right after it returned
    apply_job: int

    def gpuctl(self, *args: str, timeout: float = 300) -> Result:
        return self.cluster.gpuctl(*args, timeout=timeout)

    def queue(self) -> dict[int, QueueRow]:
        return parse_queue(self.gpuctl("queue", NAME))

    def wait_status(self, job_id: int, statuses: tuple[str, ...], timeout: float = 90) -> QueueRow:
        def ended() -> QueueRow | None:
            row = self.queue()[job_id]
            return row if row.status in statuses else None
        return wait_for(f"job {job_id} to reach {statuses}", ended, timeout, interval=1.0)

    def on_nodes(self, *texts: str) -> dict[str, list[str]]:
        """Node name -> command lines of that node's processes containing any of `texts`."""
        found: dict[str, list[str]] = {}
        tables = processes_by_netns(list(self.netns.values()))
        for node in self.nodes:
            hits = [line for _, line in tables[self.netns[node.rank]] if any(t in line for t in texts)]
            if hits:
                found[node.name] = hits
        return found

    def assert_no_process(self, marker: str, timeout: float = 5.0) -> None:
        """Within `timeout` s no process with `marker` on this machine (pgrep -f) or in any node."""
        wait_for(f"every process with {marker} to end",
                 lambda: not pids_matching(marker) and not self.on_nodes(marker), timeout)
        assert pids_matching(marker) == []
        for node in self.nodes:  # each node's own process table, read once more with `ip netns pids`
            assert not [line for _, line in netns_processes(self.netns[node.rank]) if marker in line], node.name

    def wait_running_on(self, marker: str, ranks: list[int], timeout: float = 20) -> None:
        names = {self.nodes[r].name for r in ranks}
        wait_for(f"{marker} running on {sorted(names)}", lambda: set(self.on_nodes(marker)) == names, timeout)

    def read_all(self, node: NodeInfo, *paths: str) -> list[str]:
        """The text of each file on the node, over one ssh connection."""
        out = self.cluster.ssh(node, "; ".join(f"cat {p}; printf '\\0'" for p in paths)).stdout
        texts = out.split("\0")
        assert len(texts) == len(paths) + 1, (node.name, paths, out)
        return texts[:-1]

    def exist(self, node: NodeInfo, *paths: str) -> list[bool]:
        """Whether each path exists on the node, over one ssh connection."""
        out = self.cluster.ssh(node, "; ".join(f"if test -e {p}; then echo yes; else echo no; fi"
                                               for p in paths)).stdout.split()
        assert len(out) == len(paths), (node.name, paths, out)
        return [word == "yes" for word in out]


def _write_project(root: Path) -> Path:
    (root / "proj").mkdir(parents=True)
    (root / "proj" / "version.txt").write_text("v1\n")
    (root / "mount-src").mkdir()
    (root / "mount-src" / "m.txt").write_text("mount v1\n")
    (root / "exec.yaml").write_text(EXEC_TASK)
    path = root / "cluster.yaml"
    path.write_text(TASK)
    return path


def _namespaces(cluster: Cluster, nodes: list[NodeInfo], footprint: Footprint) -> dict[int, str]:
    """rank -> netns, matched by the node's address inside the namespace (not by naming convention)."""
    by_rank = {}
    for ns in footprint.netns:
        addrs = subprocess.run(["ip", "-n", ns, "-o", "-4", "addr", "show"], capture_output=True, text=True,
                               check=True).stdout
        owners = [n.rank for n in nodes if re.search(rf"\binet {re.escape(n.address)}/", addrs)]
        assert len(owners) == 1, (ns, addrs)
        by_rank[owners[0]] = ns
    assert sorted(by_rank) == [n.rank for n in nodes], by_rank
    return by_rank


@pytest.fixture(scope="module")
def jl(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("jobs-local")
    cluster = Cluster(NAME, root / "state")
    project = root / "project"
    yaml_path = _write_project(project)
    try:
        applied = cluster.gpuctl("apply", str(yaml_path), "-d")
        queue_after = cluster.gpuctl("queue", NAME)  # at once: the job must still be running
        applied.check()
        nodes = cluster.nodes()
        assert [n.name for n in nodes] == ["head", "worker1", "worker2"]
        footprint = cluster.footprint()
        footprint.assert_present(3)
        hostnames = {n.rank: cluster.ssh(n, "hostname").stdout.strip() for n in nodes}
        netns = _namespaces(cluster, nodes, footprint)
        # The /proc scan sees what `ip netns pids` sees: each node's sshd in its own namespace only.
        scanned = processes_by_netns(list(netns.values()))
        for ns in netns.values():
            listed = {pid for pid, _ in netns_processes(ns)}
            sshd = {pid for pid, _ in footprint.sshd}
            assert len(listed & sshd) == 1 and listed & sshd <= {pid for pid, _ in scanned[ns]}, (ns, listed, sshd)
        yield JobsCluster(cluster=cluster, project=project, yaml=yaml_path, nodes=nodes, netns=netns,
                          hostnames=hostnames, applied=applied, queue_after_apply=queue_after,
                          apply_job=job_id_of(applied, "detached"))
    finally:
        leftover = cluster.footprint() if (cluster.cdir / "nodes" / "bridge.env").exists() else None
        cluster.down_quietly()
        strays = pids_matching(MOD)
        for pid in strays:  # only if a test already failed: don't leave our sleepers behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leftover is not None:
            leftover.assert_gone()
        assert strays == [], f"processes of this module outlived the cluster: {strays}"


# -- 1. exec: no setup, the workdir synced, file_mounts not ---------------------------


def test_exec_runs_no_setup_syncs_workdir_but_not_file_mounts(jl: JobsCluster):
    files = ("~/jl/setup-count", "~/jl/mounted.txt")
    before = {n.name: jl.read_all(n, *files) for n in jl.nodes}
    for name, (count, mounted) in before.items():
        assert len(count.splitlines()) == 1, f"setup ran once on {name} on apply: {count!r}"
        assert mounted == "mount v1\n", name
    (jl.project / "proj" / "version.txt").write_text("v2\n")
    (jl.project / "mount-src" / "m.txt").write_text("mount v2\n")

    res = jl.gpuctl("exec", NAME, str(jl.project / "exec.yaml")).check()
    assert "Running setup" not in res.stdout and "file_mounts" not in res.stdout, res.stdout
    for n in jl.nodes:
        assert f"({n.name}, rank={n.rank}) exec-file rank {n.rank} version v2 mount mount v1" \
            in res.stdout.splitlines(), res.describe()

    # the same size in the same second as the copy of v2: rsync's whole-second quick check would skip it
    version_file = jl.project / "proj" / "version.txt"
    synced = version_file.stat()
    version_file.write_text("v3\n")
    second, ns = divmod(synced.st_mtime_ns, 10**9)
    os.utime(version_file, ns=(synced.st_atime_ns, second * 10**9 + (ns + 1) % 10**9))
    res = jl.gpuctl("exec", NAME, *shell('echo "dashes rank $GPUCTL_NODE_RANK version $(cat version.txt)"')).check()
    assert "Running setup" not in res.stdout
    # the last apply's workdir, copied again: said only because a file changed, and naming how many
    assert "==> Copied the workdir to the head: 1 changed file(s)" in res.stdout, res.stdout
    assert "Copying the workdir" not in res.stdout, res.stdout
    for n in jl.nodes:
        assert f"({n.name}, rank={n.rank}) dashes rank {n.rank} version v3" in res.stdout.splitlines(), res.stdout

    for n in jl.nodes:
        count, mounted, version = jl.read_all(n, *files, "~/gpuctl_workdir/version.txt")
        assert count == before[n.name][0], f"exec ran setup on {n.name}: {count!r}"
        assert mounted == "mount v1\n", f"exec synced a file_mount to {n.name}"
        assert version == "v3\n", n.name


# -- 8. apply -d: returns once started; the watcher records the failure ----------------


def test_exec_file_with_more_nodes_than_the_cluster_is_refused(jl: JobsCluster):
    big = jl.project / "big.yaml"
    big.write_text("num_nodes: 5\nrun: echo never\n")
    res = jl.gpuctl("exec", NAME, str(big))
    assert res.returncode == 2, res.describe()
    assert "num_nodes 5" in res.stderr and "has 3 node(s)" in res.stderr and "Traceback" not in res.stderr


def test_apply_detached_returns_while_running_and_watcher_records_failure(jl: JobsCluster):
    job = jl.apply_job
    assert f"Job {job} detached" in jl.applied.stdout, jl.applied.stdout
    assert "worker1 gives up" not in jl.applied.stdout  # it returned before the job's end
    assert parse_queue(jl.queue_after_apply)[job].status == "RUNNING", jl.queue_after_apply.stdout

    row = jl.wait_status(job, ("SUCCEEDED", "FAILED", "CANCELLED"), timeout=APPLY_FAIL_AFTER_S + 60)
    assert row.status == "FAILED", row
    codes = row.codes.split(",")
    # rank 1 failed with 3; the watcher failed fast: the others were stopped (128 + SIGTERM/SIGKILL)
    assert codes[1] == "3" and codes[0] in ("143", "137") and codes[2] in ("143", "137"), row
    watcher_log = (jl.cluster.cdir / "jobs" / str(job) / "watcher.log").read_text()
    assert f"rank 1 ({jl.nodes[1].name}, {jl.nodes[1].address}) failed first with exit code 3" in watcher_log, \
        watcher_log
    jl.assert_no_process(APPLY_MARKER)
    status = jl.gpuctl("logs", NAME, str(job), "--status")
    assert status.returncode == 100 and f"Job {job}: FAILED" in status.stdout, status.describe()
    logs = jl.gpuctl("logs", NAME, str(job))
    assert logs.returncode == 1, logs.describe()
    assert "(worker1, rank=1) worker1 gives up" in logs.stdout.splitlines(), logs.stdout
    assert "(head, rank=0) rank 0 waits" in logs.stdout.splitlines(), logs.stdout
    assert not any("survived" in line for line in logs.stdout.splitlines())


# -- 2, 9. a subset of the nodes; the head reaches every worker by name -----------------


@dataclass(frozen=True)
class SubsetJob:
    res: Result
    job: int
    value: str  # --env JL_K=value
    touched: str  # a file each rank of the job creates


@pytest.fixture(scope="module")
def subset(jl: JobsCluster) -> SubsetJob:
    """One `exec --num-nodes 2` on the 3-node cluster (head, worker1); its head also
    SSHes by name to worker1 (in the job) and worker2 (outside it, absent from its hostfile)."""
    value = f"v-{uuid.uuid4().hex[:8]}"
    touched = f"~/jl/subset-{uuid.uuid4().hex[:8]}"
    command = ('echo "rank=$GPUCTL_NODE_RANK n=$GPUCTL_NUM_NODES sky_n=$SKYPILOT_NUM_NODES '
               'ips=$(printf "%s\\n" "$GPUCTL_NODE_IPS" | paste -sd, -) '
               'hosts=$(cut -d" " -f1 "$GPUCTL_HOSTFILE" | paste -sd, -) master=$MASTER_ADDR k=$JL_K '
               'ifname=$NCCL_SOCKET_IFNAME fi=${FI_PROVIDER-unset}"; '
               f"touch {touched}; "
               'if [ "$GPUCTL_NODE_RANK" == "0" ]; then for h in worker1 worker2; do '
               'echo "$h is $(ssh -o BatchMode=yes $h hostname)"; done; fi')
    res = jl.gpuctl("exec", NAME, "--num-nodes", "2", "--env", f"JL_K={value}", *shell(command)).check()
    return SubsetJob(res=res, job=job_id_of(res), value=value, touched=touched)


def test_subset_run_gets_its_ranks_ips_and_env(jl: JobsCluster, subset: SubsetJob):
    res, job = subset.res, subset.job
    head, w1, w2 = jl.nodes
    ips = f"{head.address},{w1.address}"
    rank_lines = [line for line in res.stdout.splitlines() if re.match(r"\(\w+, rank=\d+\) rank=", line)]
    assert sorted(rank_lines) == sorted(
        f"({n.name}, rank={n.rank}) rank={n.rank} n=2 sky_n=2 ips={ips} hosts={ips} master={head.address} "
        f"k={subset.value} ifname=eth0 fi=unset" for n in (head, w1)), res.describe()  # fabric.env: socket nodes
    assert "(worker2" not in res.stdout
    job_files = [f"~/.gpuctl/jobs/{jl.cluster.node_job(job)}/{name}" for name in ("run.sh", "run.log", "run.pid",
                                                                                 "run.exit")]
    for n in (head, w1):
        assert jl.exist(n, subset.touched, *job_files) == [True] * 5, f"{n.name} did not run the job"
    assert jl.exist(w2, subset.touched, *job_files) == [False] * 5, "the subset job ran on worker2"
    row = jl.queue()[job]
    assert (row.status, row.nodes, row.codes) == ("SUCCEEDED", 2, "0,0"), row
    assert sorted(p.name for p in jl.cluster.logs_dir(job).glob("run-rank*.log")) == \
        ["run-rank0.log", "run-rank1.log"]


def test_head_ssh_to_each_worker_by_name(jl: JobsCluster, subset: SubsetJob):
    out = subset.res.stdout.splitlines()
    for n in jl.nodes[1:]:
        assert f"(head, rank=0) {n.name} is {jl.hostnames[n.rank]}" in out, subset.res.describe()
    assert not any(line.startswith("(worker1, rank=1) worker") for line in out)


def test_prepare_detected_each_nodes_fabric(jl: JobsCluster):
    """Issue 12: the prepare play's probe found no RDMA device on the netns nodes: socket, over
    eth0 (the route to the head, the head's own address included), recorded in fabric.json
    and written to each node's fabric.env with nothing NCCL-specific but the interface."""
    doc = json.loads((jl.cluster.cdir / "fabric.json").read_text())
    assert doc["kind"] == "socket" and not (jl.cluster.cdir / "fabric.probe.json").exists()
    assert [(n["rank"], n["name"], n["kind"], n["interface"], n["active_ports"], n["env"]) for n in doc["nodes"]] \
        == [(n.rank, n.name, "socket", "eth0", [], {"NCCL_SOCKET_IFNAME": "eth0"}) for n in jl.nodes]
    assert all(n["head"] == jl.nodes[0].address and n["warnings"] == [] for n in doc["nodes"]), doc
    for n in jl.nodes:
        env, node_json = jl.read_all(n, "~/.gpuctl/fabric.env", "~/.gpuctl/fabric.json")
        exports = [line for line in env.splitlines() if not line.startswith("#")]
        assert exports == ["export NCCL_SOCKET_IFNAME=eth0"], (n.name, env)
        assert json.loads(node_json)["kind"] == "socket", n.name
    # the task's envs win over what the probe wrote
    res = jl.gpuctl("exec", NAME, "--env", "NCCL_SOCKET_IFNAME=lo", *shell('echo "ifname=$NCCL_SOCKET_IFNAME"')).check()
    assert sorted(line for line in res.stdout.splitlines() if "ifname=" in line) == \
        [f"({n.name}, rank={n.rank}) ifname=lo" for n in jl.nodes], res.describe()


# -- 7. ssh-config and ssh -------------------------------------------------------------


def test_ssh_config_hosts_and_gpuctl_ssh(jl: JobsCluster):
    res = jl.gpuctl("ssh-config", NAME).check()
    conf = Path(res.stdout.splitlines()[0])
    assert conf.is_file(), res.stdout
    assert len(set(jl.hostnames.values())) == 3, jl.hostnames
    for n in jl.nodes:
        alias = NAME if n.rank == 0 else f"{NAME}-{n.name}"
        proc = subprocess.run(["ssh", "-F", str(conf), alias, "hostname"], capture_output=True, text=True,
                              timeout=30, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (alias, proc.stderr)
        assert proc.stdout.strip() == jl.hostnames[n.rank], (alias, proc.stdout)
    res = jl.gpuctl("ssh", NAME, "--rank", "2", "--", "hostname").check()
    assert res.stdout.strip() == jl.hostnames[2], res.describe()
    # a node by name or by rank, as SkyPilot users write it
    assert jl.gpuctl("ssh", NAME, "worker1", "--", "hostname").check().stdout.strip() == jl.hostnames[1]
    assert jl.gpuctl("ssh", NAME, "2", "--", "hostname").check().stdout.strip() == jl.hostnames[2]
    bad = jl.gpuctl("ssh", NAME, "worker9", "--", "hostname")
    assert bad.returncode == 2 and bad.stderr.strip() == (f"error: node 'worker9': cluster '{NAME}' has head, worker1, "
                                                          "worker2 (a name or a rank 0..2)"), bad.describe()


def test_nodes_log_in_as_a_normal_user_with_sudo_as_cloud_images_do(jl: JobsCluster):
    """SkyPilot's examples run `sudo apt-get ...` and mpirun, which refuses root: local nodes log in
    as `gpuctl`, a normal user with passwordless sudo."""
    res = jl.gpuctl("exec", NAME, 'echo "user $(id -un) uid $(id -u) sudo $(sudo -n id -un)"').check()
    for n in jl.nodes:
        assert f"({n.name}, rank={n.rank}) user gpuctl uid {pwd.getpwnam('gpuctl').pw_uid} sudo root" in \
            res.stdout.splitlines(), res.describe()


def test_exec_takes_a_command_string_as_sky_exec_does(jl: JobsCluster):
    res = jl.gpuctl("exec", NAME, 'echo "hi from $(hostname)" | tr a-z A-Z').check()
    for n in jl.nodes:
        assert f"({n.name}, rank={n.rank}) HI FROM {jl.hostnames[n.rank].upper()}" in res.stdout.splitlines(), \
            res.describe()
    job = job_id_of(res)
    assert jl.queue()[job].name == 'echo "hi from $(hostn...', jl.gpuctl("queue", NAME).stdout  # its command
    # a job on one node: the changed workdir reaches the head, and no other node
    (jl.project / "proj" / "only-head.txt").write_text("new\n")
    one = jl.gpuctl("exec", NAME, "--num-nodes", "1", "cat only-head.txt").check()
    assert "(head, rank=0) new" in one.stdout.splitlines() and "Copying from the head" not in one.stdout, \
        one.describe()
    assert jl.cluster.ssh(jl.nodes[1], "test -e ~/gpuctl_workdir/only-head.txt", check=False).returncode == 1
    # nothing changed: no copy is said at all
    again = jl.gpuctl("exec", NAME, "--num-nodes", "1", "hostname").check()
    assert "Cop" not in again.stdout and again.stdout.count("(head, rank=0)") == 1, again.describe()
    # every node again: the workers get the file the head has, without a line about a copy nobody named
    for _ in range(2):
        everyone = jl.gpuctl("exec", NAME, "cat only-head.txt").check()
        assert "Cop" not in everyone.stdout, everyone.describe()
        assert all(f"({n.name}, rank={n.rank}) new" in everyone.stdout.splitlines() for n in jl.nodes), \
            everyone.describe()
    # a .yaml that is not there is still a missing task file, not a command
    missing = jl.gpuctl("exec", NAME, "nothere.yaml")
    assert missing.returncode == 2 and "nothere.yaml: no such file" in missing.stderr, missing.describe()


def test_a_damaged_install_on_a_node_is_prepared_again_by_itself(jl: JobsCluster):
    """Issue 36: an agent cut short on a worker, then on the head, and a probe gone from a node: each
    `exec` still runs, preparing again exactly that node, named; the files are whole afterwards."""
    def agent_hash(node) -> str:
        return jl.cluster.ssh(node, "sha256sum < ~/.gpuctl/lib/gpuctl_node.py").stdout.split()[0]

    whole = agent_hash(jl.nodes[0])
    for node, damage in ((jl.nodes[1], "truncate -s 40000 ~/.gpuctl/lib/gpuctl_node.py"),
                         (jl.nodes[0], "truncate -s 40000 ~/.gpuctl/lib/gpuctl_node.py"),
                         (jl.nodes[2], "rm ~/.gpuctl/lib/nodehealth.py")):
        jl.cluster.ssh(node, damage)
        res = jl.gpuctl("exec", NAME, "echo ran").check()
        assert all(f"({n.name}, rank={n.rank}) ran" in res.stdout.splitlines() for n in jl.nodes), res.describe()
        prepared = [line for line in res.stdout.splitlines() if "Preparing 1 of 3 node(s)" in line]
        assert prepared and f"({node.name}: " in prepared[0], res.describe()  # the node, and why
        assert agent_hash(node) == whole
        assert jl.cluster.ssh(node, "test -s ~/.gpuctl/lib/nodehealth.py", check=False).returncode == 0
    again = jl.gpuctl("exec", NAME, "echo ran").check()
    assert "Preparing" not in again.stdout, again.describe()


# -- 3. fail fast --------------------------------------------------------------------


def test_failing_rank_stops_the_others_fast(jl: JobsCluster):
    marker = f"{MOD}-failfast"
    # Rank 2 fails after the others' sleepers have had time to be seen on a
    # loaded machine (stalls of ~2.5 s were measured there).
    command = ('if [ "$GPUCTL_NODE_RANK" == "2" ]; then sleep 5; echo "rank 2 gives up"; exit 5; fi; '
               f"(exec -a {marker} sleep 300); echo survived")
    seen: list[set[str]] = []
    done = threading.Event()

    def sample() -> None:  # which nodes run the marker while the job runs
        while not done.is_set():
            seen.append(set(jl.on_nodes(marker)))
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        res = jl.gpuctl("exec", NAME, *shell(command), timeout=200)
    finally:
        done.set()
        sampler.join()
    assert res.returncode == 1, res.describe()
    assert "Traceback" not in res.stderr
    job = job_id_of(res)
    head, w1, w2 = jl.nodes
    assert {"head", "worker1"} in seen, f"the sleepers were never seen on head and worker1: {seen}"
    assert not any("worker2" in s for s in seen)
    started = res.first_time(lambda line: line.startswith(f"Job {job} running"))
    assert started is not None and res.ended - started < 20, f"{res.ended - started:.1f}s after the start"
    m = re.search(r"failed first with exit code 5; return codes: rank 0: (\d+), rank 1: (\d+), rank 2: 5$",
                  res.stderr, re.M)
    assert m and f"rank 2 ({w2.name}, {w2.address}) failed first" in res.stderr, res.describe()
    assert m.group(1) != "0" and m.group(2) != "0"
    assert "(worker2, rank=2) rank 2 gives up" in res.stdout.splitlines()
    assert "survived" not in res.stdout
    jl.assert_no_process(marker)
    row = jl.queue()[job]
    assert row.status == "FAILED" and row.codes == f"{m.group(1)},{m.group(2)},5", row
    status = jl.gpuctl("logs", NAME, str(job), "--status")
    assert status.returncode == 100, status.describe()
    assert status.stdout.strip() == f"Job {job}: FAILED; rank 2 (worker2) exit code 5", status.describe()


# -- 4. cancel and Ctrl-C ---------------------------------------------------------------


def _detach_sleeper(jl: JobsCluster, marker: str) -> Result:
    return jl.gpuctl("exec", NAME, "-d", *shell(f"echo started; (exec -a {marker} sleep 300); echo survived"))


@pytest.fixture(scope="module")
def sleepers(jl: JobsCluster) -> dict[int, str]:
    """Three detached long jobs (submitted at once), each running a sleeper with its own marker: job -> marker."""
    markers = [f"{MOD}-sleeper{i}" for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        started = list(pool.map(lambda m: _detach_sleeper(jl, m), markers))
    jobs = {job_id_of(res.check(), "detached"): m for res, m in zip(started, markers)}
    for marker in markers:
        jl.wait_running_on(marker, [0, 1, 2])
    return dict(sorted(jobs.items()))


def test_cancel_one_job_stops_it_everywhere(jl: JobsCluster, sleepers: dict[int, str]):
    job, *others = sleepers
    marker = sleepers[job]
    rows = jl.queue()
    assert [rows[j].status for j in sleepers] == ["RUNNING"] * 3, rows
    res = jl.gpuctl("cancel", NAME, str(job)).check()
    assert res.stdout.splitlines() == [f"Job {job} cancelled on 3 node(s)."], res.stdout
    jl.assert_no_process(marker)
    # nothing of the job is left on the nodes (its agents), nor its watcher here
    paths = job_paths(jl.cluster.node_job(job))
    wait_for(f"job {job}'s processes on the nodes to end", lambda: not jl.on_nodes(*paths), timeout=10)
    wait_for(f"the watcher of job {job} to exit",
             lambda: not pids_matching(f"_watch\0{NAME}\0{job}\0"), timeout=15)
    rows = jl.queue()
    assert rows[job].status == "CANCELLED", rows  # and the watcher did not overwrite it
    # only that job: the others still run on every node
    assert [rows[j].status for j in others] == ["RUNNING"] * 2, rows
    for other in others:
        assert len(jl.on_nodes(sleepers[other])) == 3, f"cancelling job {job} touched job {other}"
    status = jl.gpuctl("logs", NAME, str(job), "--status")
    assert status.returncode == 103 and f"Job {job}: CANCELLED" in status.stdout, status.describe()
    again = jl.gpuctl("cancel", NAME, str(job)).check()
    assert f"Job {job} already ended: CANCELLED" in again.stdout


def test_cancel_all_stops_every_unfinished_job(jl: JobsCluster, sleepers: dict[int, str]):
    jobs = [j for j in sleepers if jl.on_nodes(sleepers[j])]  # two, or three if run on its own
    assert len(jobs) >= 2, "at least two detached jobs should still be running"
    before = jl.queue()
    assert sorted(j for j, r in before.items() if r.status in ("PENDING", "SETTING_UP", "RUNNING")) == jobs, before
    res = jl.gpuctl("cancel", NAME, "--all").check()
    assert sorted(res.stdout.splitlines()) == [f"Job {j} cancelled on 3 node(s)." for j in jobs], res.stdout
    after = jl.queue()
    assert [after[j].status for j in jobs] == ["CANCELLED"] * len(jobs), after
    assert {j: r for j, r in after.items() if j not in jobs} == {j: r for j, r in before.items() if j not in jobs}
    for job in jobs:
        jl.assert_no_process(sleepers[job])
        paths = job_paths(jl.cluster.node_job(job))
        wait_for(f"job {job}'s processes on the nodes to end", lambda: not jl.on_nodes(*paths), timeout=10)
    none_left = jl.gpuctl("cancel", NAME, "--all").check()
    assert "No unfinished jobs" in none_left.stdout


def test_ctrl_c_stops_following_and_the_job_goes_on(jl: JobsCluster):
    """Issue 34.4: Ctrl-C while following `exec` (SIGINT to the foreground gpuctl's process group, as
    a terminal sends it) stops following, as SkyPilot's does: the job runs on, the line says how to
    follow it again and how to cancel it, a watcher records its end; `--cancel-on-interrupt` (a CI
    step's choice) ends it instead (test_jobplane_local)."""
    marker = f"{MOD}-ctrlc"
    argv = [sys.executable, "-m", "gpuctl", "exec", NAME,
            *shell(f'echo "started $GPUCTL_NODE_RANK"; (exec -a {marker} sleep 300); echo survived')]
    # Its own process group, signalled as a whole as a terminal's Ctrl-C does (its ssh children included).
    run = Watched(argv, gpuctl_env(jl.cluster.state_dir), lambda line: line.startswith("("))
    try:
        assert run.seen.wait(200), "no output from the job\n" + run.text
        jl.wait_running_on(marker, [0, 1, 2])
        took = run.interrupt(timeout=15)
    finally:
        run.close()
    proc, out, err = run.proc, run.out, run.err
    text = "\n".join(out) + "\n--- stderr\n" + "\n".join(err)
    assert proc.returncode == 130, text
    assert took < 15, took
    assert "Traceback" not in text
    m = re.search(r"^Job (\d+) running", "\n".join(out), re.M)
    assert m, text
    job = int(m.group(1))
    assert (f"stopped following job {job} (Ctrl-C); it goes on running on cluster '{NAME}'. Follow it again: "
            f"gpuctl logs {NAME} {job}; cancel it: gpuctl cancel {NAME} {job}") in err, text
    assert not any(line.startswith("error:") for line in err), text
    time.sleep(1)
    jl.wait_running_on(marker, [0, 1, 2])  # every rank still runs
    assert jl.queue()[job].status == "RUNNING"
    wait_for("the detached job's watcher", lambda: pids_matching(f"_watch\0{NAME}\0{job}\0"), timeout=15)
    jl.gpuctl("cancel", NAME, str(job)).check()
    jl.assert_no_process(marker)
    assert jl.queue()[job].status == "CANCELLED"


# -- 5, 6, 8. detached jobs submitted at once; logs live and later ----------------------


@dataclass
class Pair:
    """Two `exec -d` started at the same time from two processes, and what was seen meanwhile."""

    log_job: int
    other_job: int
    submitted: list[Result]
    queue_meanwhile: Result
    both_running_after_queue: bool
    queue_after_detach: Result  # right after the log job's `exec -d` returned
    follow: Result  # `logs NAME LOG_JOB --follow`, started while the job ran


@pytest.fixture(scope="module")
def pair(jl: JobsCluster) -> Pair:
    with ThreadPoolExecutor(3) as pool:
        log_f = pool.submit(jl.gpuctl, "exec", NAME, "-d", *shell(LOG_JOB))
        other_f = pool.submit(jl.gpuctl, "exec", NAME, "-d", *shell('echo "other rank $GPUCTL_NODE_RANK"; sleep 1'))
        time.sleep(0.2)
        meanwhile = jl.gpuctl("queue", NAME)
        log_res = log_f.result()
        log_job = job_id_of(log_res.check(), "detached")
        # Follow at once; the job's second half waits until the follower showed its first line
        follower = Watched([sys.executable, "-m", "gpuctl", "logs", NAME, str(log_job), "--follow"],
                           gpuctl_env(jl.cluster.state_dir), lambda line: "logline-1 " in line)
        try:
            queue_after = jl.gpuctl("queue", NAME)
            assert follower.seen.wait(120), follower.text
            FOLLOW_MARK.touch()
            follow = follower.result(timeout=120)
        finally:
            follower.close()
            FOLLOW_MARK.unlink(missing_ok=True)
        other_res = other_f.result()
    # queue started while both exec commands still ran (exec -d now returns in about a second)
    both_running = meanwhile.started < min(log_res.ended, other_res.ended)
    return Pair(log_job=log_job, other_job=job_id_of(other_res.check(), "detached"), submitted=[log_res, other_res],
                queue_meanwhile=meanwhile, both_running_after_queue=both_running, queue_after_detach=queue_after,
                follow=follow)


def test_exec_detached_returns_once_started_and_watcher_records_success(jl: JobsCluster, pair: Pair):
    row = parse_queue(pair.queue_after_detach)[pair.log_job]
    assert row.status == "RUNNING", pair.queue_after_detach.stdout
    for res in pair.submitted:
        assert "logline-" not in res.stdout and "other rank" not in res.stdout  # no rank output: detached
    for job in (pair.log_job, pair.other_job):
        row = jl.wait_status(job, ("SUCCEEDED", "FAILED", "CANCELLED"), timeout=60)
        assert (row.status, row.codes) == ("SUCCEEDED", "0,0,0"), row
        assert (jl.cluster.cdir / "jobs" / str(job) / "watcher.log").exists()


def test_two_gpuctl_commands_at_once(jl: JobsCluster, pair: Pair):
    assert pair.log_job != pair.other_job
    assert pair.queue_meanwhile.returncode == 0, pair.queue_meanwhile.describe()
    assert pair.both_running_after_queue, "queue did not run while both exec commands ran"
    rows = jl.queue()
    for job in (pair.log_job, pair.other_job):
        assert rows[job].status == "SUCCEEDED", rows
    db = sqlite3.connect(jl.cluster.state_dir / "state.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        ids = [r[0] for r in db.execute("SELECT job_id FROM jobs WHERE cluster=? ORDER BY job_id", (NAME,))]
    finally:
        db.close()
    assert ids == sorted(rows) == list(range(1, len(ids) + 1)), (ids, rows)


def test_logs_follow_streams_a_running_detached_job_to_its_end(jl: JobsCluster, pair: Pair):
    res = pair.follow
    assert res.returncode == 0, res.describe()
    by_rank: dict[int, list[str]] = {}
    for n in jl.nodes:
        prefix = f"({n.name}, rank={n.rank}) "
        by_rank[n.rank] = [line[len(prefix):] for line in res.stdout.splitlines() if line.startswith(prefix)]
        assert by_rank[n.rank] == expected_log_lines(n.rank), res.describe()
    first = res.first_time(lambda line: "logline-1 " in line)
    last = res.first_time(lambda line: f"logline-{LOG_LINES} " in line)
    assert first is not None and last is not None
    assert last - first >= 2.0, f"lines were not streamed as they came ({last - first:.1f}s apart)"


def test_logs_after_the_job_from_the_saved_copy(jl: JobsCluster, pair: Pair):
    job = pair.log_job
    jl.wait_status(job, ("SUCCEEDED", "FAILED", "CANCELLED"), timeout=60)
    saved = jl.cluster.logs_dir(job)
    for n in jl.nodes:
        assert (saved / f"run-rank{n.rank}.log").read_text().splitlines() == expected_log_lines(n.rank)

    def check_logs() -> None:
        res = jl.gpuctl("logs", NAME, str(job)).check()
        for n in jl.nodes:
            prefix = f"({n.name}, rank={n.rank}) "
            assert [line[len(prefix):] for line in res.stdout.splitlines() if line.startswith(prefix)] == \
                expected_log_lines(n.rank), res.describe()
        one = jl.gpuctl("logs", NAME, str(job), "--rank", "1").check()
        assert one.stdout.splitlines() == [f"(worker1, rank=1) {line}" for line in expected_log_lines(1)], \
            one.describe()
        status = jl.gpuctl("logs", NAME, str(job), "--status")
        assert status.returncode == 0 and f"Job {job}: SUCCEEDED" in status.stdout, status.describe()

    check_logs()
    # The nodes lose the job's directory: the saved copy still serves.
    node_dir = f"~/.gpuctl/jobs/{jl.cluster.node_job(job)}"
    for n in jl.nodes:
        jl.cluster.ssh(n, f"test -f {node_dir}/run.log && rm -rf {node_dir} && ! test -e {node_dir}")
    check_logs()


# -- machine-readable output --------------------------------------------------------

STATUS_KEYS = {"name", "status", "cloud", "region", "zone", "num_nodes", "nodes", "last_job", "fabric", "autostop",
               "idle_s", "age_s", "cost_so_far", "per_hour", "price_source", "no_cloud_bill"}
NODE_KEYS = {"name", "rank", "address", "ssh_user", "ssh_host", "ssh_port", "gpus", "node_id"}
JOB_KEYS = {"id", "name", "status", "num_nodes", "submitted_at", "started_at", "ended_at", "submitted_epoch",
            "started_epoch", "ended_epoch", "returncodes", "failed_rank", "detail", "user"}


def json_of(res: Result) -> dict:
    """stdout is exactly one JSON document (progress goes to stderr)."""
    doc = json.loads(res.stdout)
    assert doc["schema"] == 1, res.describe()
    return doc


def test_json_output_and_inventory_export(jl: JobsCluster, pair: Pair, tmp_path: Path):
    status = json_of(jl.gpuctl("status", NAME, "-o", "json").check())
    (cluster,) = status["clusters"]
    assert set(cluster) == STATUS_KEYS and all(set(n) == NODE_KEYS | {"fabric", "health_check"} for n in cluster["nodes"])
    assert cluster["fabric"] == "socket"  # prepare's detection: local nodes have no RDMA devices
    assert [(n["fabric"]["kind"], n["fabric"]["interface"]) for n in cluster["nodes"]] == [("socket", "eth0")] * 3
    text = jl.gpuctl("status", NAME).check().stdout
    assert text.count("fabric socket (eth0)") == 3, text
    assert [n["address"] for n in cluster["nodes"]] == [n.address for n in jl.nodes]
    assert (cluster["status"], cluster["num_nodes"], set(cluster["last_job"]) == JOB_KEYS) == ("UP", 3, True)

    queue = json_of(jl.gpuctl("queue", NAME, "--output", "json").check())
    by_id = {job["id"]: job for job in queue["jobs"]}
    assert all(set(job) == JOB_KEYS for job in queue["jobs"])
    assert by_id[jl.apply_job]["status"] == "FAILED" and by_id[jl.apply_job]["failed_rank"] == 1
    assert by_id[pair.log_job]["returncodes"] == {"0": 0, "1": 0, "2": 0}
    assert by_id[pair.log_job]["ended_at"].endswith("Z")

    ok_status = jl.gpuctl("logs", NAME, str(pair.log_job), "--status", "-o", "json")
    assert ok_status.returncode == 0 and json_of(ok_status)["exit_code"] == 0, ok_status.describe()
    assert set(json_of(ok_status)) == {"schema", "command", "ok", "cluster", "job", "exit_code"}
    failed = jl.gpuctl("logs", NAME, str(jl.apply_job), "--status", "-o", "json")
    assert failed.returncode == 100 and json_of(failed)["job"]["status"] == "FAILED", failed.describe()
    missing = jl.gpuctl("queue", "no-such-cluster", "-o", "json")
    assert missing.returncode == 2 and json_of(missing)["ok"] is False and "not found" in json_of(missing)["error"]

    # exec and cancel, as a CI script runs them: the job is the document, rank output goes to stderr
    failed_exec = jl.gpuctl("exec", NAME, "-o", "json", *shell(
        'echo "exec-json rank $GPUCTL_NODE_RANK"; exit $((GPUCTL_NODE_RANK == 2 ? 4 : 0))'))
    doc = json_of(failed_exec)
    assert failed_exec.returncode == 1 and set(doc) == {"schema", "command", "ok", "cluster", "job"}, \
        failed_exec.describe()
    assert (doc["command"], doc["ok"], doc["job"]["status"], doc["job"]["failed_rank"]) == ("exec", False, "FAILED", 2)
    # rank 2's code is its own; ranks 0 and 1 finished (0), or on a loaded machine were still running
    # when rank 2 failed and were stopped with it (fail-fast: 143)
    codes = doc["job"]["returncodes"]
    assert codes["2"] == 4 and {codes["0"], codes["1"]} <= {0, 143} and set(codes) == {"0", "1", "2"}, codes
    assert set(doc["job"]) == JOB_KEYS
    assert "exec-json rank" not in failed_exec.stdout and "exec-json rank 1" in failed_exec.stderr
    detached = json_of(jl.gpuctl("exec", NAME, "-d", "-o", "json", *shell("sleep 120")).check())
    assert (detached["ok"], detached["job"]["status"]) == (True, "RUNNING"), detached
    cancelled = json_of(jl.gpuctl("cancel", NAME, "-o", "json").check())
    assert cancelled["cancelled"] == [detached["job"]["id"]] and cancelled["jobs"][0]["status"] == "CANCELLED"
    again = json_of(jl.gpuctl("cancel", NAME, str(detached["job"]["id"]), "-o", "json").check())
    assert (again["cancelled"], again["jobs"][0]["status"]) == ([], "CANCELLED"), again

    hostfile = jl.gpuctl("inventory", NAME, "--format", "hostfile").check().stdout
    assert hostfile.splitlines() == [f"{n.address} slots=1" for n in jl.nodes]  # no GPUs: one process per node
    exported = json_of(jl.gpuctl("inventory", NAME, "--format", "json").check())
    assert set(exported) == {"schema", "command", "ok", "cluster", "cloud", "region", "zone", "nodes", "ssh_key",
                             "known_hosts"}
    assert [n["rank"] for n in exported["nodes"]] == [0, 1, 2] and exported["ssh_key"].endswith("id_ed25519")
    assert "Host " in jl.gpuctl("inventory", NAME, "--format", "ssh-config").check().stdout
    # the exported Ansible inventory works in the user's own Ansible, host keys checked as gpuctl does
    inv_file = tmp_path / "inventory.yml"
    inv_file.write_text(jl.gpuctl("inventory", NAME).check().stdout)
    ping = subprocess.run([str(Path(sys.executable).parent / "ansible"), "-i", str(inv_file), "all", "-m", "ping",
                           "-o"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, "ANSIBLE_HOST_KEY_CHECKING": "True"})
    assert ping.returncode == 0 and ping.stdout.count("SUCCESS") == 3, ping.stdout + ping.stderr


def test_nothing_prompts_with_a_terminal_but_stdin_closed(jl: JobsCluster):
    """stdin is /dev/null while the session has a controlling terminal (where ssh would ask for a
    passphrase or a host key): every ssh runs in BatchMode, so commands finish and the terminal
    shows no question. (Every other test runs gpuctl with stdin closed and no terminal.)"""
    import fcntl
    import termios

    master, slave = os.openpty()
    seen: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not chunk:
                return
            seen.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        for argv in (["exec", NAME, "--", "true"], ["status", NAME, "--refresh", "-o", "json"]):
            proc = subprocess.Popen([sys.executable, "-m", "gpuctl", *argv], env=gpuctl_env(jl.cluster.state_dir),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, text=True,
                                    start_new_session=True,  # then the pty (its stderr) becomes its terminal
                                    preexec_fn=lambda: fcntl.ioctl(2, termios.TIOCSCTTY, 0))
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, (argv, out)
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    text = b"".join(seen).decode(errors="replace").lower()
    assert not any(q in text for q in ("passphrase", "password", "yes/no", "continue connecting")), text
    assert [n["health"] for n in json.loads(out)["clusters"][0]["nodes"]] == ["reachable"] * 3, out


# -- teardown ------------------------------------------------------------------------


def test_down_leaves_nothing(jl: JobsCluster):
    footprint = jl.cluster.footprint()
    footprint.assert_present(3)
    down = jl.gpuctl("down", NAME, "-o", "json").check()
    assert json.loads(down.stdout) == {"schema": 1, "command": "down", "ok": True, "cluster": NAME, "found": True,
                                      "destroyed": True}
    assert "Tearing down cluster" in down.stderr  # progress on stderr
    footprint.assert_gone()
    # nothing of it in the state dir either: its ssh config would reach the next cluster on its addresses
    state = jl.cluster.state_dir
    assert not (state / "ssh" / f"{NAME}.conf").exists() and not (state / "locks" / f"{NAME}.lock").exists()
    assert not (state / "clusters" / NAME).exists()
    assert not set(jl.netns.values()) & netns_names()
    assert pids_matching(MOD) == []
    gone = jl.gpuctl("status", NAME)
    assert gone.returncode == 2 and "not found" in gone.stderr, gone.describe()
