"""`resources.image_id: docker:IMAGE` on a real 2-node local cluster with real
containers (podman; no registry here, so the image is built from this
machine's bash and a few tools and imported), through the real `gpuctl`:

- setup and run go inside one container per node that persists: what setup
  writes there, run sees, and so does the next job; nothing of it is on the node;
- ranks, SkyPilot/gpuctl variables and envs are right inside; the workdir is
  the directory the stage runs in, a file_mount is at its path, the network is
  the node's own; a secret is in the stage's environment and on no command line
  of any process on the machine while the job runs;
- a rank's exit code ends the job (fail-fast stops the other rank's processes
  inside its container), the containers are reused, not re-created;
- a node without the runtime asked for: one line naming the nodes and what to
  install, and nothing runs.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e import Cluster, NodeInfo, Result, Watched, gpuctl_env, needs_local_nodes, pids_matching, pids_with_env

pytestmark = [pytest.mark.integration, needs_local_nodes,
              pytest.mark.skipif(shutil.which("podman") is None,
                                 reason="podman is not installed (make system-deps installs it)")]

MOD = f"ctr{uuid.uuid4().hex[:8]}"  # cluster name, image tag and process markers: podman's store is machine-wide
IMAGE = f"localhost/gpuctl-test-{MOD}:1"
TOOLS = ("bash", "cat", "ls", "sleep", "mkdir", "rm", "touch", "grep", "sed", "printenv", "env", "tr")
SECRET = f"{MOD}-secret-value"

TASK = f"""\
name: {MOD}
num_nodes: 2
resources:
  infra: local
  image_id: docker:{IMAGE}
workdir: ./proj
file_mounts:
  ~/fm/data: ./data
envs:
  MYENV: hello world
secrets:
  MYSECRET: null
setup: |
  echo "made by setup on $SKYPILOT_SETUP_NODE_RANK" > /opt/setup-marker
  echo "setup $GPUCTL_NODE_RANK of $SKYPILOT_NUM_NODES"
run: |
  echo "rank=$GPUCTL_NODE_RANK sky=$SKYPILOT_NODE_RANK n=$SKYPILOT_NUM_NODES env=$MYENV home=$HOME"
  echo "marker: $(cat /opt/setup-marker)"
  echo "pwd=$PWD code: $(cat code.txt) data: $(cat ~/fm/data/blob.txt)"
  test -e /run/.containerenv && echo "in a container"
  addr=$(printf '%s\\n' "$GPUCTL_NODE_IPS" | sed -n "$((GPUCTL_NODE_RANK + 1))p")
  grep -q " $addr\\$" /proc/net/fib_trie && echo "node network $addr"
  test "$MYSECRET" = "{SECRET}" && echo "secret in env"
  echo "ready to scan"
  sleep 3
"""

FAIL_TASK = f"""\
name: {MOD}-fail
num_nodes: 2
resources:
  infra: local
  image_id: docker:{IMAGE}
workdir: ./proj
file_mounts:
  ~/fm/data: ./data
run: |
  echo "still there: $(cat /opt/setup-marker)"
  if [ "$GPUCTL_NODE_RANK" = 1 ]; then sleep 1; exit 7; fi
  (exec -a {MOD}-survivor sleep 60)
"""


def build_image(root: Path) -> None:
    """A rootfs of this machine's bash and a few tools with their libraries, imported as IMAGE."""
    fs = root / "rootfs"
    for d in ("bin", "etc", "opt", "tmp", "root", "run", "proc", "sys", "dev"):
        (fs / d).mkdir(parents=True, exist_ok=True)
    (fs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    for tool in TOOLS:
        path = shutil.which(tool)
        assert path, f"{tool} is not on PATH"
        shutil.copy(path, fs / "bin" / tool)
        libs = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
        for lib in re.findall(r"(/\S+)", libs):
            dest = fs / lib.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(lib, dest)  # follows links: the file itself, under the name the binary asks for
    (fs / "usr").mkdir(exist_ok=True)
    (fs / "usr" / "bin").symlink_to("/bin")
    tar = root / "rootfs.tar"
    subprocess.run(["tar", "-C", str(fs), "-cf", str(tar), "."], check=True)
    subprocess.run(["podman", "import", "--quiet", str(tar), IMAGE], check=True, capture_output=True)
    probe = subprocess.run(["podman", "run", "--rm", "--network=host", IMAGE, "bash", "-c", "echo ok"],
                           capture_output=True, text=True, timeout=60)
    if probe.stdout.strip() != "ok":
        pytest.fail("podman cannot run a container on this machine (make system-deps sets it up): "
                    + probe.stderr.strip())


@dataclass
class Ctr:
    cluster: Cluster
    project: Path
    nodes: list[NodeInfo]
    first: Result
    argv_hits: list[int]  # processes with the secret on their command line while the job ran
    env_hits: list[int]  # processes with it in their environment (the stages)

    def gpuctl(self, *args: str, env: dict[str, str] | None = None) -> Result:
        saved = dict(os.environ)
        os.environ.update(env or {})
        try:
            return self.cluster.gpuctl(*args)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def container_ids(self) -> dict[str, str]:
        out = subprocess.run(["podman", "ps", "--all", "--filter", f"name=gpuctl-{MOD}-", "--format",
                              "{{.Names}} {{.ID}}"], capture_output=True, text=True, check=True).stdout
        return dict(line.split() for line in out.splitlines())


@pytest.fixture(scope="module")
def ctr(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("containers")
    project = root / "project"
    (project / "proj").mkdir(parents=True)
    (project / "proj" / "code.txt").write_text("code v1\n")
    (project / "data").mkdir()
    (project / "data" / "blob.txt").write_text("blob v1\n")
    (project / "task.yaml").write_text(TASK)
    (project / "fail.yaml").write_text(FAIL_TASK)
    build_image(root)
    cluster = Cluster(MOD, root / "state")
    try:
        run = Watched([sys.executable, "-m", "gpuctl", "apply", str(project / "task.yaml"), "--secret", "MYSECRET"],
                      {**gpuctl_env(cluster.state_dir), "MYSECRET": SECRET}, lambda line: "ready to scan" in line)
        try:
            assert run.seen.wait(300), "the job never got to its scan\n" + run.text
            argv_hits = pids_matching(SECRET)
            env_hits = pids_with_env(f"MYSECRET={SECRET}")
            run.proc.wait(timeout=120)
        finally:
            run.close()
        first = Result(run.proc.args, run.proc.returncode, [(0.0, line) for line in run.out],
                       [(0.0, line) for line in run.err], 0.0, 0.0)
        yield Ctr(cluster, project, cluster.nodes(), first, argv_hits, env_hits)
    finally:
        if (cluster.cdir / "inventory.yml").exists():
            for node in cluster.nodes():  # the containers live in the nodes' mount namespaces
                cluster.ssh(node, f"podman rm --force --ignore gpuctl-{MOD}-{node.name}", check=False, timeout=60)
        cluster.down_quietly()
        subprocess.run(["podman", "rm", "--force", "--ignore", f"gpuctl-{MOD}-head", f"gpuctl-{MOD}-worker1"],
                       capture_output=True, check=False)
        subprocess.run(["podman", "rmi", "--force", IMAGE], capture_output=True, check=False)
        for pid in pids_matching(MOD):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_setup_and_run_share_the_nodes_container(ctr: Ctr):
    res = ctr.first.check()
    lines = res.stdout.splitlines()
    home = pwd.getpwnam(ctr.nodes[0].user).pw_dir  # the nodes' login user's: the container runs in its paths
    for n in ctr.nodes:
        p = f"({n.name}, rank={n.rank}) "
        expected = [f"setup {n.rank} of 2", f"rank={n.rank} sky={n.rank} n=2 env=hello world home={home}",
                    f"marker: made by setup on {n.rank}",
                    f"pwd={home}/gpuctl_workdir code: code v1 data: blob v1", "in a container",
                    f"node network {n.address}", "secret in env"]
        for line in expected:
            assert p + line in lines, res.describe()
        # The container's filesystem is its own: setup's file is not on the node.
        assert not ctr.cluster.exists_on(n, "/opt/setup-marker")
    assert set(ctr.container_ids()) == {f"gpuctl-{MOD}-head", f"gpuctl-{MOD}-worker1"}


def test_secret_is_in_the_environment_and_on_no_command_line(ctr: Ctr):
    assert ctr.env_hits, "no process had the secret in its environment while the job ran"
    assert ctr.argv_hits == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in ctr.argv_hits]
    assert SECRET not in ctr.first.stdout + ctr.first.stderr


def test_exit_code_fails_fast_inside_reused_containers(ctr: Ctr):
    before = ctr.container_ids()
    res = ctr.gpuctl("apply", str(ctr.project / "fail.yaml"), "-c", MOD)
    assert res.returncode == 1, res.describe()
    for n in ctr.nodes:
        assert f"({n.name}, rank={n.rank}) still there: made by setup on {n.rank}" in res.stdout.splitlines()
    assert re.search(r"rank 1 \(worker1, [0-9.]+\) failed first with exit code 7; "
                     r"return codes: rank 0: (?:143|137), rank 1: 7$", res.stderr, re.M), res.describe()
    assert not pids_matching(f"{MOD}-survivor"), "rank 0's process lives on in its container"
    assert ctr.container_ids() == before  # the same containers, not new ones


def test_exec_runs_in_the_clusters_container(ctr: Ctr):
    res = ctr.gpuctl("exec", MOD, "--", "cat", "/opt/setup-marker")
    assert res.returncode == 0, res.describe()
    for n in ctr.nodes:
        assert f"({n.name}, rank={n.rank}) made by setup on {n.rank}" in res.stdout.splitlines(), res.describe()


def test_missing_runtime_is_one_line_and_nothing_runs(ctr: Ctr):
    res = ctr.gpuctl("apply", str(ctr.project / "fail.yaml"), "-c", MOD,
                     env={"GPUCTL_CONTAINER_RUNTIME": "/nonexistent/podman"})
    assert res.returncode == 1, res.describe()
    assert len(res.stderr.strip().splitlines()) == 1, res.describe()
    m = re.fullmatch(r"error: job (\d+): head, worker1: GPUCTL_CONTAINER_RUNTIME=/nonexistent/podman: "
                     r"/nonexistent/podman is not installed; install it on the node or unset "
                     r"GPUCTL_CONTAINER_RUNTIME", res.stderr.strip())
    assert m, res.describe()
    assert "still there" not in res.stdout and "Running setup" not in res.stdout, res.describe()
    for n in ctr.nodes:
        assert not ctr.cluster.exists_on(n, f"~/.gpuctl/jobs/{ctr.cluster.node_job(m.group(1))}/run.log")


def test_down_removes_the_clusters_containers_and_no_other(ctr: Ctr):
    """Last: `down` takes the cluster's containers out of the store the local nodes share, by their
    names: another cluster's container whose name starts the same (cluster `MOD-b`) stays."""
    assert set(ctr.container_ids()) == {f"gpuctl-{MOD}-head", f"gpuctl-{MOD}-worker1"}
    decoy = f"gpuctl-{MOD}-b-head"
    subprocess.run(["podman", "create", "--name", decoy, IMAGE, "true"], capture_output=True, check=True)
    try:
        ctr.gpuctl("down", MOD).check()
        assert set(ctr.container_ids()) == {decoy}
    finally:
        subprocess.run(["podman", "rm", "--force", "--ignore", decoy], capture_output=True, check=False)
