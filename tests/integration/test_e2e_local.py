"""End to end through the real `gpuctl` command on real local nodes (netns sshd
nodes through Terraform, Ansible stages, live output), no mocks.

Two clusters, each brought up once for the module by its first `gpuctl apply`
and torn down by the last test of its group (and, whatever happens, by the
fixture): a 2-node cluster (env, sync, barrier, re-apply, live output, the DDP
example) and a 3-node cluster (env, fail-fast, failing setup). The first job on
each dumps its environment in setup and in run to files in every node's home;
the tests read them back over ssh with the cluster's key.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e import (REPO, Cluster, NodeInfo, Result, Watched, files_containing, gpuctl_env, needs_local_nodes,
                 pids_matching, queue_rows)

pytestmark = [pytest.mark.integration, needs_local_nodes]

SETUP_SLEEP_RANK = 1  # this rank's setup sleeps, so the barrier has something to wait for
SETUP_SLEEP_S = 2
# The first job's run prints tick-1, sleeps this long, prints tick-2; tick-1 must
# reach gpuctl's stdout before tick-2 is printed. gpuctl starts following the
# logs only once the run playbook has returned, which on a loaded 2-core
# machine was seen up to ~2.5 s after a rank started, so 3 s would measure the
# playbook, not the streaming.
TICK_S = 6

# Both scripts dump the environment as JSON (values may hold newlines), record
# the shell and directory they run in, and stamp the time; setup counts itself.
DUMP_ENV = """python3 -c 'import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], "w"))' {path}"""
ENV_TASK = """\
name: {name}
num_nodes: {num_nodes}
resources:
  infra: local
{accelerators}
workdir: ./proj
file_mounts:
  ~/mounted/a.txt: ./mount-src/a.txt
  {dir_mount}: ./mount-src/dir
  ~/gpuctl_workdir/data: ./mount-src/dir
  ~/gpuctl_workdir/conf/settings.txt: ./mount-src/a.txt
  ./relative/skypilot.txt: ./mount-src/a.txt
  ~/.ssh/id_e2e_deploy: ./mount-src/a.txt
envs:
  E2E_FROM_YAML: from-yaml
  E2E_OVERRIDDEN: yaml-value
  E2E_TRICKY: "it's \\"quoted\\" $HOME `x` \\\\ a\\nb"
secrets:
  E2E_SECRET: null
setup: |
  set -euo pipefail
  mkdir -p ~/e2e
  {dump_setup}
  printf '%s\\n' "$BASH_VERSION" "$(pwd)" "$(readlink /proc/$$/exe)" > ~/e2e/setup-shell
  echo "$GPUCTL_TASK_ID" >> ~/e2e/setup-count
  if [ "$GPUCTL_NODE_RANK" == "{sleep_rank}" ]; then sleep {sleep_s}; fi
  date +%s.%N > ~/e2e/setup-end
  echo "setup of node $SKYPILOT_SETUP_NODE_RANK done"
run: |
  date +%s.%N > ~/e2e/run-start
  set -euo pipefail
  {dump_run}
  printf '%s\\n' "$BASH_VERSION" "$(pwd)" "$(readlink /proc/$$/exe)" > ~/e2e/run-shell
  echo "$GPUCTL_TASK_ID" >> ~/e2e/run-count
  echo "rank $GPUCTL_NODE_RANK of $GPUCTL_NUM_NODES version $(cat version.txt)"
  date +%s.%N > ~/e2e/tick-1
  echo tick-1
  sleep "${{E2E_TICK_S:-0}}"
  date +%s.%N > ~/e2e/tick-2
  echo tick-2
""".replace("{dump_setup}", DUMP_ENV.format(path="~/e2e/setup-env.json")).replace(
    "{dump_run}", DUMP_ENV.format(path="~/e2e/run-env.json"))

GITIGNORE = "ignored.txt\n*.ckpt\n!keep.ckpt\ndeep/**/creds.json\nspaced.txt   \n\\#hash\n"
IGNORED = ("ignored.txt", "sub/model.ckpt", "deep/a/b/creds.json", "spaced.txt", "#hash", "x.info")

SETUP_ONLY_NAMES = ("SKYPILOT_SETUP_NODE_RANK", "SKYPILOT_SETUP_NODE_IPS")
RUN_ONLY_SKYPILOT = ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE")


@dataclass
class EnvJob:
    """A cluster after its first job (the env-dumping task) and what that job left."""

    cluster: Cluster
    project: Path  # holds cluster.yaml, proj/ (the workdir) and mount-src/
    yaml: Path
    args: list[str]  # the apply arguments, without the file
    secret: str
    dir_mount: Path
    gpus: int
    first: Result
    nodes: list[NodeInfo]
    setup_env: list[dict[str, str]]  # by rank
    run_env: list[dict[str, str]]
    setup_shell: list[list[str]]
    run_shell: list[list[str]]
    setup_end: list[float]
    run_start: list[float]
    tick1: list[float]  # when each rank printed tick-1 / tick-2 (node clock = this machine's clock)
    tick2: list[float]

    def apply(self, *extra: str) -> Result:
        return self.cluster.gpuctl("apply", str(self.yaml), *self.args, *extra)

    def lines(self, node: NodeInfo, path: str) -> list[str]:
        return self.cluster.read(node, path).splitlines()


def _write_project(root: Path, *, name: str, num_nodes: int, gpus: int, dir_mount: Path) -> Path:
    proj = root / "proj"
    (proj / "nested" / "deep").mkdir(parents=True)
    (proj / "sub").mkdir()
    (proj / ".gitignore").write_text(GITIGNORE)
    for rel in IGNORED:
        (proj / rel).parent.mkdir(parents=True, exist_ok=True)
        (proj / rel).write_text("must not arrive\n")
    (proj / "sub" / "keep.ckpt").write_text("kept by a negation\n")
    # a git work tree: git itself says what is ignored, .git/info/exclude included
    subprocess.run(["git", "init", "-q", str(proj)], check=True)
    (proj / ".git" / "info" / "exclude").write_text("*.info\n")
    (proj / "nested" / "deep" / "file.txt").write_text("nested content\n")
    (proj / "version.txt").write_text("v1\n")
    (proj / "gone-later.txt").write_text("deleted before the re-apply\n")
    mounts = root / "mount-src"
    (mounts / "dir" / "inner").mkdir(parents=True)
    (mounts / "a.txt").write_text("single file mount\n")
    (mounts / "dir" / "top.txt").write_text("dir mount top\n")
    (mounts / "dir" / "inner" / "deeper.txt").write_text("dir mount deeper\n")
    accelerators = f"  accelerators: A100:{gpus}" if gpus else ""
    text = ENV_TASK.format(name=name, num_nodes=num_nodes, accelerators=accelerators, dir_mount=dir_mount,
                           sleep_rank=SETUP_SLEEP_RANK, sleep_s=SETUP_SLEEP_S)
    path = root / "cluster.yaml"
    path.write_text(text)
    return path


@dataclass
class Prepared:
    """A cluster's project files and names, before its first apply."""

    cluster: Cluster
    project: Path
    yaml: Path
    dir_mount: Path
    gpus: int
    secret: str
    args: list[str]

    @classmethod
    def make(cls, tmp_path_factory: pytest.TempPathFactory, name: str, num_nodes: int, gpus: int) -> "Prepared":
        root = tmp_path_factory.mktemp(name)
        # outside ~ (nodes share this machine's filesystem there), two levels that do not exist yet
        # below a directory only root may write (as /opt): the node's login user (not root) makes
        # them with sudo, as on a cloud image
        base = Path(tempfile.gettempdir()) / f"gpuctl-e2e-{uuid.uuid4().hex[:12]}"
        base.mkdir(mode=0o755)
        base.chmod(0o755)
        dir_mount = base / "opt" / "mounted-dir"
        project = root / "project"
        project.mkdir()
        yaml_path = _write_project(project, name=name, num_nodes=num_nodes, gpus=gpus, dir_mount=dir_mount)
        secret = f"e2e-secret-{uuid.uuid4().hex}"
        args = ["--env", "E2E_OVERRIDDEN=from-cli", "--env", "E2E_CLI_ONLY=cli-only",
                "--secret", f"E2E_SECRET={secret}"]
        return cls(Cluster(name, root / "state"), project, yaml_path, dir_mount, gpus, secret, args)

    def first_job(self) -> EnvJob:
        """`gpuctl apply` of the env task (creates the cluster), then read back what it left."""
        cluster = self.cluster
        first = cluster.gpuctl("apply", str(self.yaml), *self.args, "--env", f"E2E_TICK_S={TICK_S}").check()
        nodes = cluster.nodes()

        def read(node: NodeInfo, what: str) -> str:
            return cluster.read(node, f"~/e2e/{what}")

        return EnvJob(
            cluster=cluster, project=self.project, yaml=self.yaml, args=self.args, secret=self.secret,
            dir_mount=self.dir_mount, gpus=self.gpus, first=first, nodes=nodes,
            setup_env=[json.loads(read(n, "setup-env.json")) for n in nodes],
            run_env=[json.loads(read(n, "run-env.json")) for n in nodes],
            setup_shell=[read(n, "setup-shell").splitlines() for n in nodes],
            run_shell=[read(n, "run-shell").splitlines() for n in nodes],
            setup_end=[float(read(n, "setup-end")) for n in nodes],
            run_start=[float(read(n, "run-start")) for n in nodes],
            tick1=[float(read(n, "tick-1")) for n in nodes],
            tick2=[float(read(n, "tick-2")) for n in nodes],
        )

    def teardown(self) -> None:
        self.cluster.down_quietly()
        shutil.rmtree(self.dir_mount.parent.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def three_pending(tmp_path_factory: pytest.TempPathFactory):
    """The 3-node cluster's first apply, started in the background so it overlaps
    the 2-node tests (most of an apply is waiting on ssh and Ansible)."""
    prep = Prepared.make(tmp_path_factory, "e2e-three", 3, gpus=0)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="e2e-three")
    try:
        yield pool.submit(prep.first_job)
    finally:
        pool.shutdown(wait=True)  # never tear down under a running apply
        prep.teardown()


@pytest.fixture(scope="module")
def three(three_pending: Future) -> EnvJob:
    return three_pending.result()


@pytest.fixture(scope="module")
def two(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    if any("three" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("three_pending")
    prep = Prepared.make(tmp_path_factory, "e2e-two", 2, gpus=2)
    try:
        yield prep.first_job()
    finally:
        prep.teardown()


# -- shared checks -------------------------------------------------------------------


def check_environment(job: EnvJob) -> None:
    """Every variable of the table in README.md, in setup and in run, on every node."""
    nodes, n = job.nodes, len(job.nodes)
    ips = [node.address for node in nodes]
    assert len(set(ips)) == n
    head_ip = ips[0]
    task_ids = {env["GPUCTL_TASK_ID"] for env in job.setup_env + job.run_env}
    assert len(task_ids) == 1, f"one task id per job on every node and stage: {task_ids}"
    task_id = task_ids.pop()
    assert task_id

    for node in nodes:
        r = node.rank
        for stage, env in (("setup", job.setup_env[r]), ("run", job.run_env[r])):
            where = f"{stage} on {node.name}"
            assert env["GPUCTL_NODE_RANK"] == str(r), where
            assert env["GPUCTL_NODE_IPS"] == "\n".join(ips), where
            assert env["GPUCTL_NUM_NODES"] == str(n), where
            assert env["GPUCTL_NUM_GPUS_PER_NODE"] == str(job.gpus), where
            # the cluster's queue gave the job its GPUs (all of them: nothing else runs); none asked, none set
            assert env.get("CUDA_VISIBLE_DEVICES") == (",".join(map(str, range(job.gpus))) if job.gpus else None), where
            assert env["GPUCTL_TASK_ID"] == task_id, where
            info = json.loads(env["GPUCTL_CLUSTER_INFO"])
            assert info["cluster_name"] == job.cluster.name and info["cloud"] == "local", (where, info)
            assert "region" in info and "zone" in info, (where, info)
            assert info["num_nodes"] == n and info["ips"] == ips, (where, info)
            assert env["MASTER_ADDR"] == head_ip, where
            assert env["MASTER_PORT"] == "29500", where
            # SkyPilot's names, same values, in both stages
            assert env["SKYPILOT_NUM_NODES"] == str(n), where
            assert env["SKYPILOT_TASK_ID"] == task_id, where
            assert json.loads(env["SKYPILOT_CLUSTER_INFO"]) == info, where
            # envs from the YAML, --env (which wins over the YAML), secrets
            assert env["E2E_FROM_YAML"] == "from-yaml", where
            assert env["E2E_OVERRIDDEN"] == "from-cli", where
            assert env["E2E_CLI_ONLY"] == "cli-only", where
            assert env["E2E_TRICKY"] == "it's \"quoted\" $HOME `x` \\ a\nb", where
            assert env["E2E_SECRET"] == job.secret, where

        setup, run = job.setup_env[r], job.run_env[r]
        # SkyPilot's setup/run split (skypilot-compat.md)
        assert setup["SKYPILOT_SETUP_NODE_RANK"] == str(r)
        assert setup["SKYPILOT_SETUP_NODE_IPS"] == "\n".join(ips)
        for name in RUN_ONLY_SKYPILOT:
            assert name not in setup, f"{name} must not be set in setup ({node.name})"
        assert run["SKYPILOT_NODE_RANK"] == str(r)
        assert run["SKYPILOT_NODE_IPS"] == "\n".join(ips)
        assert run["SKYPILOT_NUM_GPUS_PER_NODE"] == str(job.gpus)
        for name in SETUP_ONLY_NAMES:
            assert name not in run, f"{name} must not be set in run ({node.name})"

        # The hostfile: a file on the node, `IP slots=GPUS` (1 without GPUs) per node, head first.
        hostfile = run["GPUCTL_HOSTFILE"]
        assert hostfile.startswith("/"), hostfile
        assert setup["GPUCTL_HOSTFILE"] == hostfile  # setup gets it too (then listing every cluster node)
        assert job.cluster.read(node, hostfile).splitlines() == [f"{ip} slots={job.gpus or 1}" for ip in ips]

        # bash, in the synced workdir
        for stage, (version, cwd, exe) in (("setup", job.setup_shell[r]), ("run", job.run_shell[r])):
            assert version and exe.endswith("/bash"), (stage, node.name, version, exe)
            assert cwd == setup["HOME"].rstrip("/") + "/gpuctl_workdir", (stage, node.name, cwd)

    # Output arrives prefixed with each rank's node and rank.
    for node in nodes:
        prefix = f"({node.name}, rank={node.rank})"
        assert f"{prefix} rank {node.rank} of {n} version v1" in job.first.stdout.splitlines(), job.first.stdout
        assert f"{prefix} setup of node {node.rank} done" in job.first.stdout.splitlines(), job.first.stdout
    assert [node.name for node in nodes] == ["head"] + [f"worker{i}" for i in range(1, n)]


def check_setup_before_run(job: EnvJob) -> None:
    assert max(job.setup_end) <= min(job.run_start), (
        f"a rank started before setup ended everywhere: setup ends {job.setup_end}, run starts {job.run_start}")


def check_status(job: EnvJob) -> None:
    res = job.cluster.gpuctl("status").check()
    lines = res.stdout.splitlines()
    assert f"{job.cluster.name}: UP, {len(job.nodes)} node(s) on local" in lines, res.stdout
    for node in job.nodes:
        assert re.search(rf"^\s+{node.name}\s+rank={node.rank}\s+{re.escape(node.address)}\s+ssh "
                         rf"{node.user}@{re.escape(node.host)}:{node.port}\s+fabric socket \(\S+\)$", res.stdout, re.M), res.stdout
    one = job.cluster.gpuctl("status", job.cluster.name).check()
    assert one.stdout.splitlines()[0] == f"{job.cluster.name}: UP, {len(job.nodes)} node(s) on local"


def check_secret_kept(job: EnvJob) -> None:
    """The secret reached setup and run (check_environment) and appears nowhere
    else: not in gpuctl's output, not under the state dir (registry, inventory,
    ansible-runner artifacts, copied-back logs) except inside the node
    directories, which are the nodes' own filesystems."""
    for res in job.cluster.outputs:
        assert job.secret not in res.stdout + res.stderr, res.describe()
    node_dirs = [job.cluster.cdir / "nodes"]
    assert (job.cluster.cdir / "runner").is_dir()
    hits = files_containing(job.cluster.state_dir, job.secret, skip=node_dirs)
    assert hits == [], f"secret written on the controller: {hits}"
    # On the node: the job's 0600 secrets.sh lived only while the job ran; nothing of gpuctl's keeps it.
    for node in job.nodes:
        found = job.cluster.ssh(node, f"grep -rlF {job.secret} ~/.gpuctl || true").stdout.split()
        assert found == [], (node.name, found)


def check_synced(job: EnvJob) -> None:
    for node in job.nodes:
        read = lambda path: job.cluster.read(node, path)  # noqa: E731
        assert read("~/gpuctl_workdir/nested/deep/file.txt") == "nested content\n"
        assert read("~/gpuctl_workdir/version.txt") == "v1\n"
        assert read("~/gpuctl_workdir/.gitignore") == GITIGNORE
        for name in IGNORED:
            assert not job.cluster.exists_on(node, f"~/gpuctl_workdir/{name}"), (node.name, name)
        assert not job.cluster.exists_on(node, "~/gpuctl_workdir/.git"), node.name
        assert read("~/gpuctl_workdir/sub/keep.ckpt") == "kept by a negation\n"
        assert read("~/gpuctl_workdir/data/top.txt") == "dir mount top\n"
        assert read("~/gpuctl_workdir/conf/settings.txt") == "single file mount\n"
        assert read("~/mounted/a.txt") == "single file mount\n"
        # SkyPilot's relative destination (in the directory run starts in), a deploy key of your own in ~/.ssh
        assert read("~/gpuctl_workdir/relative/skypilot.txt") == "single file mount\n"
        assert read("~/.ssh/id_e2e_deploy") == "single file mount\n"
        assert read(f"{job.dir_mount}/top.txt") == "dir mount top\n"
        assert read(f"{job.dir_mount}/inner/deeper.txt") == "dir mount deeper\n"
    # made with sudo by the login user (not root), as SkyPilot makes absolute destinations: theirs
    assert job.dir_mount.owner() == job.nodes[0].user != "root", job.dir_mount
    # and the level made above it is root's, passable by that user whatever the session's umask
    assert job.dir_mount.parent.owner() == "root" and job.dir_mount.parent.stat().st_mode & 0o777 == 0o755


def check_down(job: EnvJob) -> None:
    footprint = job.cluster.footprint()
    footprint.assert_present(len(job.nodes))
    job.cluster.gpuctl("down", job.cluster.name).check()
    footprint.assert_gone()
    status = job.cluster.gpuctl("status").check()
    assert job.cluster.name not in status.stdout, status.stdout
    gone = job.cluster.gpuctl("status", job.cluster.name)
    assert gone.returncode == 2 and "not found" in gone.stderr, gone.describe()


# -- the 2-node cluster ----------------------------------------------------------------


def test_two_nodes_environment(two: EnvJob):
    assert "terraform apply: done" in two.first.stdout
    check_environment(two)


def test_two_nodes_setup_ends_everywhere_before_any_run(two: EnvJob):
    check_setup_before_run(two)


def test_two_nodes_workdir_and_file_mounts(two: EnvJob):
    check_synced(two)


def test_two_nodes_status(two: EnvJob):
    check_status(two)


def test_two_nodes_secret_never_printed_or_stored(two: EnvJob):
    check_secret_kept(two)


def test_reapply_reuses_cluster_resyncs_and_reruns_setup(two: EnvJob):
    cluster, nodes = two.cluster, two.nodes
    before = cluster.footprint()
    tfstate = json.loads((cluster.cdir / "terraform" / "terraform.tfstate").read_text())
    setups = [len(two.lines(n, "~/e2e/setup-count")) for n in nodes]
    runs = [len(two.lines(n, "~/e2e/run-count")) for n in nodes]
    (two.project / "proj" / "version.txt").write_text("v2\n")
    (two.project / "proj" / "added.txt").write_text("added later\n")
    (two.project / "proj" / "gone-later.txt").unlink()

    again = two.apply().check()
    out = again.stdout.splitlines()
    assert "terraform apply: no changes, reusing the existing nodes" in out, again.stdout
    assert "terraform apply: done" not in out
    after = cluster.footprint()
    assert after.sshd == before.sshd, "the nodes' sshd were restarted: the cluster was rebuilt"
    assert after.netns == before.netns and after.bridge == before.bridge
    newstate = json.loads((cluster.cdir / "terraform" / "terraform.tfstate").read_text())
    assert newstate["lineage"] == tfstate["lineage"]
    assert newstate["resources"] == tfstate["resources"], "Terraform changed resources on a re-apply"
    assert cluster.nodes() == nodes
    for node in nodes:
        prefix = f"({node.name}, rank={node.rank})"
        assert f"{prefix} rank {node.rank} of 2 version v2" in out, again.stdout  # run saw the re-synced workdir
        assert cluster.read(node, "~/gpuctl_workdir/version.txt") == "v2\n"
        assert cluster.read(node, "~/gpuctl_workdir/added.txt") == "added later\n"
        assert not cluster.exists_on(node, "~/gpuctl_workdir/gone-later.txt")
    setup_ids = [two.lines(n, "~/e2e/setup-count") for n in nodes]
    assert [len(ids) for ids in setup_ids] == [s + 1 for s in setups], "setup did not run again on every node"
    assert [len(two.lines(n, "~/e2e/run-count")) for n in nodes] == [r + 1 for r in runs]
    # A new job: a new task id, the same on every node.
    assert len({ids[-1] for ids in setup_ids}) == 1
    assert setup_ids[0][-1] != two.run_env[0]["GPUCTL_TASK_ID"]

    no_setup = two.apply("--no-setup").check()
    assert "Running setup" not in no_setup.stdout
    assert "terraform apply: no changes, reusing the existing nodes" in no_setup.stdout.splitlines()
    assert [len(two.lines(n, "~/e2e/setup-count")) for n in nodes] == [s + 1 for s in setups], \
        "--no-setup ran setup"
    run_ids = [two.lines(n, "~/e2e/run-count") for n in nodes]
    assert [len(ids) for ids in run_ids] == [r + 2 for r in runs], "--no-setup did not run the job"
    assert len({ids[-1] for ids in run_ids}) == 1 and run_ids[0][-1] != run_ids[0][-2]
    assert cluster.footprint().sshd == before.sshd


def test_exec_keeps_mounts_inside_the_workdir_and_what_jobs_wrote_in_ignored_places(two: EnvJob):
    """`exec` copies the workdir again without the file_mounts: it must not delete the ones the
    apply put inside the workdir (a directory and a file in a directory of its own), nor what a job
    wrote where .gitignore ignores; a file the job left that git would copy goes (the copy mirrors)."""
    cluster, nodes = two.cluster, two.nodes
    for node in nodes:
        cluster.ssh(node, "cd ~/gpuctl_workdir && mkdir -p sub/out && echo mine > sub/out/step9.ckpt "
                          "&& echo mine > x2.info && echo stray > stray.txt")
    (two.project / "proj" / "exec-added.txt").write_text("added for exec\n")
    cluster.gpuctl("exec", cluster.name, "--", "true").check()
    for node in nodes:
        read = lambda path: cluster.read(node, path)  # noqa: E731
        assert read("~/gpuctl_workdir/exec-added.txt") == "added for exec\n"
        assert read("~/gpuctl_workdir/data/top.txt") == "dir mount top\n"
        assert read("~/gpuctl_workdir/data/inner/deeper.txt") == "dir mount deeper\n"
        assert read("~/gpuctl_workdir/conf/settings.txt") == "single file mount\n"
        assert read("~/gpuctl_workdir/relative/skypilot.txt") == "single file mount\n"  # a relative destination
        assert read("~/gpuctl_workdir/sub/out/step9.ckpt") == "mine\n"
        assert read("~/gpuctl_workdir/x2.info") == "mine\n"
        assert not cluster.exists_on(node, "~/gpuctl_workdir/stray.txt"), node.name


def test_output_streams_live(two: EnvJob):
    """The first job's run printed tick-1, slept, printed tick-2: each rank's
    tick-1 was on gpuctl's stdout before that rank had printed tick-2."""
    res = two.first
    running = res.first_time(lambda line: line.startswith("Job ") and " running " in line)
    for node in two.nodes:
        prefix = f"({node.name}, rank={node.rank})"
        t1 = res.first_time(lambda line: line == f"{prefix} tick-1")
        t2 = res.first_time(lambda line: line == f"{prefix} tick-2")
        assert t1 is not None and t2 is not None, res.stdout
        emitted2 = two.tick2[node.rank]
        assert t1 < emitted2 - 0.5, (
            f"{prefix} tick-1 reached gpuctl's stdout {t1 - emitted2:+.2f}s after the rank printed tick-2; "
            f"it was printed at {two.tick1[node.rank] - emitted2:+.2f}s, 'Job ... running' at "
            f"{(running or 0) - emitted2:+.2f}s")
        assert t2 >= emitted2 and t2 - t1 >= 1.0, (prefix, t1, t2, emitted2)


def test_ddp_example_on_two_nodes(two: EnvJob):
    example = REPO / "examples" / "ddp" / "cluster.yaml"
    # `workdir: .` is the current directory (SkyPilot's rule): run it from the example's folder
    res = two.cluster.gpuctl("apply", "cluster.yaml", "-c", two.cluster.name, cwd=example.parent, timeout=400).check()
    out = res.stdout.splitlines()
    steps = int(re.search(r"^\s*STEPS:\s*(\d+)", example.read_text(), re.M).group(1))
    for node in two.nodes:
        prefix = f"({node.name}, rank={node.rank})"
        losses = [line for line in out if re.match(rf"{re.escape(prefix)} step\s+\d+ loss \d+\.\d+", line)]
        assert len(losses) == steps, (prefix, res.stdout)
        assert any(line.startswith(f"{prefix} ") and f"rank {node.rank}: parameters identical on all 2 ranks" in line
                   for line in out), res.stdout
    assert "Job " in res.stdout and "succeeded on 2 node(s)" in res.stdout
    # the nodes' names and addresses resolve both ways, as on a VPC: torch's store finds its peers' names
    assert "hostname of the client socket cannot be retrieved" not in res.stdout + res.stderr, res.describe()


# -- SkyPilot habits: exec's words, queue of every cluster, logs in the order printed ---------------

# Each rank prints two lines a second apart, rank 1 half a second after rank 0: the order they came
# in is head, worker1, head, worker1; grouped by rank it is head, head, worker1, worker1.
ORDERED = ('if [ "$GPUCTL_NODE_RANK" = 0 ]; then echo order-1; sleep 1.6; echo order-3; '
           'else sleep 0.8; echo order-2; sleep 1.6; echo order-4; fi')
ORDERED_LINES = ["(head, rank=0) order-1", "(worker1, rank=1) order-2", "(head, rank=0) order-3",
                 "(worker1, rank=1) order-4"]


def _job_of(res: Result, word: str = "running") -> str:
    m = re.search(rf"^Job (\d+) {word}\b", res.stdout, re.M)
    assert m, f"no 'Job N {word}' line\n" + res.describe()
    return m.group(1)


@pytest.fixture(scope="module")
def ordered(two: EnvJob) -> str:
    """The job of ORDERED (run as one quoted command string); its id."""
    res = two.cluster.gpuctl("exec", two.cluster.name, ORDERED).check()
    assert [line for line in res.stdout.splitlines() if "order-" in line] == ORDERED_LINES, res.describe()
    return _job_of(res)


def test_exec_takes_unquoted_words_as_sky_exec_does(two: EnvJob):
    """`gpuctl exec NAME echo ... --lr 1e-3`: the words after the command's first are its own (joined
    with spaces, so `$VAR` expands on the node, as with `sky exec`); gpuctl's options go before."""
    name = two.cluster.name
    one = two.cluster.gpuctl("exec", name, "--num-nodes", "1", "echo", "words", "--lr", "1e-3", "on",
                             "$GPUCTL_NODE_RANK").check()
    assert [line for line in one.stdout.splitlines() if line.startswith("(")] == ["(head, rank=0) words --lr 1e-3 on 0"]
    both = two.cluster.gpuctl("exec", name, "echo", "hi", "from", "$(hostname)").check()
    lines = [line for line in both.stdout.splitlines() if line.startswith("(")]
    assert lines and sorted(line.split(")")[0] for line in lines) == ["(head, rank=0", "(worker1, rank=1"], lines
    rows = queue_rows(two.cluster.gpuctl("queue", name).check().stdout)
    assert rows[-1][1:3] == ["echo hi from $(hostname)", "SUCCEEDED"], rows


def test_logs_after_the_fact_in_the_order_printed_by_rank_and_tail(two: EnvJob, ordered: str):
    name = two.cluster.name

    def shown(*args: str) -> list[str]:
        res = two.cluster.gpuctl("logs", name, ordered, *args).check()
        return [line for line in res.stdout.splitlines() if "order-" in line]

    assert shown("--no-follow") == ORDERED_LINES
    assert shown() == ORDERED_LINES  # an ended job: its saved copy
    assert shown("--by-rank") == [ORDERED_LINES[i] for i in (0, 2, 1, 3)]
    assert shown("--tail", "2") == ORDERED_LINES[2:]
    assert shown("--rank", "1", "--tail", "1") == ORDERED_LINES[3:]
    saved = two.cluster.logs_dir(ordered)
    assert saved.stat().st_mode & 0o777 == 0o700 and (saved / "order").stat().st_mode & 0o777 == 0o600
    assert not str(saved).startswith(str(two.cluster.cdir))  # outside the cluster directory: kept after down


def test_logs_tail_of_a_running_job_then_follows_it(two: EnvJob):
    """`logs --tail 2` of a running job: its last two lines so far, then the rest as it comes (the job
    goes on only once the follower showed t-3, so following is what brings t-4 and t-5)."""
    name, head = two.cluster.name, two.nodes[0]
    script = ("for i in 1 2 3; do echo t-$i; done; for _ in $(seq 600); do [ -e ~/tail-go ] && break; sleep 0.2; "
              "done; echo t-4; echo t-5")
    job = _job_of(two.cluster.gpuctl("exec", name, "-d", "--num-nodes", "1", script).check(), "detached")
    refused = two.cluster.gpuctl("logs", name, job, "--by-rank")
    assert refused.returncode == 2 and f"--by-rank: job {job} is RUNNING" in refused.stderr, refused.describe()
    follower = Watched([sys.executable, "-m", "gpuctl", "logs", name, job, "--tail", "2"],
                       gpuctl_env(two.cluster.state_dir), lambda line: line.rstrip("\n").endswith("t-3"))
    try:
        assert follower.seen.wait(60), follower.text
        assert follower.proc.poll() is None, follower.text  # still following
        two.cluster.ssh(head, "touch ~/tail-go")
        follower.proc.wait(timeout=60)
    finally:
        follower.close()
    assert follower.proc.returncode == 0, follower.text
    assert [line for line in follower.out if line.startswith("(")] == [f"(head, rank=0) t-{i}" for i in (2, 3, 4, 5)], \
        follower.text


def test_queue_without_a_name_lists_every_clusters_jobs(two: EnvJob, ordered: str):
    name = two.cluster.name
    text = two.cluster.gpuctl("queue").check().stdout
    assert text.splitlines()[0] == f"Cluster {name} (UP, 2 node(s))", text
    assert queue_rows("\n".join(text.splitlines()[1:])) == queue_rows(two.cluster.gpuctl("queue", name).check().stdout)
    every = json.loads(two.cluster.gpuctl("queue", "-o", "json").check().stdout)
    one = json.loads(two.cluster.gpuctl("queue", name, "-o", "json").check().stdout)
    assert [c["cluster"] for c in every["clusters"]] == [name] and every["clusters"][0]["jobs"] == one["jobs"]
    assert ordered in {str(j["id"]) for j in one["jobs"]}


def test_two_nodes_down_leaves_nothing(two: EnvJob, ordered: str):
    name = two.cluster.name
    asked = two.cluster.gpuctl("down", "-a")  # no terminal here: refused, nothing torn down
    assert asked.returncode == 2 and f"down -a would tear down 1 cluster(s) ({name})" in asked.stderr, asked.describe()
    check_down(two)
    # its jobs and logs stay readable (as SkyPilot keeps ~/sky_logs) ...
    kept = two.cluster.gpuctl("queue", name).check()
    rows = {row[0]: row for row in queue_rows(kept.stdout)}
    assert rows[ordered][2] == "SUCCEEDED" and f"Cluster '{name}' is gone" in kept.stderr, kept.describe()
    logs = two.cluster.gpuctl("logs", name, ordered).check()
    assert [line for line in logs.stdout.splitlines() if "order-" in line] == ORDERED_LINES
    # ... also once a cluster of that name is made again, from a command (no YAML), whose jobs number on
    again = two.cluster.gpuctl("launch", "-c", name, "--num-nodes", "2", "--infra", "local", "echo", "again",
                               "$GPUCTL_NODE_RANK").check()
    assert f"is no task file: running it as a command on cluster '{name}'" in again.stderr, again.describe()
    assert sorted(line for line in again.stdout.splitlines() if "again" in line) == \
        ["(head, rank=0) again 0", "(worker1, rank=1) again 1"]
    assert int(_job_of(again)) == max(int(i) for i in rows) + 1
    logs = two.cluster.gpuctl("logs", name, ordered).check()
    assert [line for line in logs.stdout.splitlines() if "order-" in line] == ORDERED_LINES
    footprint = two.cluster.footprint()
    two.cluster.gpuctl("down", "-a", "-y").check()
    footprint.assert_gone()
    purged = two.cluster.gpuctl("logs", name, "--purge").check()
    assert "and its" in purged.stdout and not (two.cluster.state_dir / "logs" / name).exists(), purged.describe()
    assert two.cluster.gpuctl("queue", name).returncode == 2


# -- the 3-node cluster ----------------------------------------------------------------


def test_three_nodes_environment(three: EnvJob):
    check_environment(three)


def test_three_nodes_setup_ends_everywhere_before_any_run(three: EnvJob):
    check_setup_before_run(three)


def test_three_nodes_status_sync_and_secret(three: EnvJob):
    check_status(three)
    check_synced(three)
    check_secret_kept(three)


def test_failing_rank_fails_fast_and_is_named(three: EnvJob):
    marker = f"e2e-sleeper-{uuid.uuid4().hex[:12]}"
    task = three.project / "fail-rank.yaml"
    task.write_text(
        "name: fail-rank\nnum_nodes: 3\nresources:\n  infra: local\n"
        "run: |\n"
        '  if [ "$GPUCTL_NODE_RANK" == "1" ]; then sleep 5; echo "rank 1 gives up"; exit 7; fi\n'
        f"  (exec -a {marker} sleep 120)\n"
        "  echo survived\n")
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:  # how many of the other ranks' sleepers exist while the job runs
        while not done.is_set():
            seen.append(len(pids_matching(marker)))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        res = three.cluster.gpuctl("apply", str(task), "-c", three.cluster.name, timeout=200)
    finally:
        done.set()
        watcher.join()
    assert res.returncode != 0, res.describe()
    assert "Traceback" not in res.stderr
    assert "rank 1" in res.stderr and "worker1" in res.stderr and "exit code 7" in res.stderr, res.describe()
    assert "(worker1, rank=1) rank 1 gives up" in res.stdout.splitlines()
    assert max(seen, default=0) == 2, f"the other ranks' sleepers were never both seen running: {seen}"
    # Fail fast: the other ranks were killed, well before their sleep 120 ended.
    started = res.first_time(lambda line: line.startswith("Job ") and " running " in line)
    assert started is not None, res.stdout
    assert res.ended - started < 60, f"gpuctl took {res.ended - started:.0f}s after the job started"
    assert pids_matching(marker) == [], "a rank's process survived the failure"
    assert "survived" not in res.stdout
    status = three.cluster.gpuctl("status", three.cluster.name).check()
    assert re.search(r"last job: \d+ FAILED$", status.stdout, re.M), status.stdout


def test_failing_setup_stops_before_run(three: EnvJob):
    marker = f"~/e2e-run-started-{uuid.uuid4().hex[:8]}"
    task = three.project / "fail-setup.yaml"
    task.write_text(
        "name: fail-setup\nnum_nodes: 3\nresources:\n  infra: local\n"
        "setup: |\n"
        '  if [ "$GPUCTL_NODE_RANK" == "2" ]; then echo "setup breaks"; exit 5; fi\n'
        "  echo setup fine\n"
        f"run: touch {marker}\n")
    # as CI runs it: --output json, whose document on stdout names the failed job; progress and rank output on stderr
    res = three.cluster.gpuctl("apply", str(task), "-c", three.cluster.name, "--output", "json", timeout=200)
    assert res.returncode == 1, res.describe()
    assert "Traceback" not in res.stderr
    assert "worker2" in res.stderr and "exit code 5" in res.stderr and "rank 2" in res.stderr, res.describe()
    assert "(worker2, rank=2) setup breaks" in res.stderr.splitlines()
    assert "Starting job" not in res.stderr
    doc = json.loads(res.stdout)  # stdout is this one document and nothing else
    assert set(doc) == {"schema", "command", "ok", "cluster", "status", "cloud", "region", "zone", "num_nodes",
                        "nodes", "inventory", "job", "phases", "autostop"}, doc
    assert (doc["command"], doc["ok"], doc["cluster"], len(doc["nodes"])) == ("apply", False, three.cluster.name, 3)
    assert (doc["job"]["status"], doc["job"]["failed_rank"], doc["job"]["returncodes"]["2"]) == \
        ("FAILED_SETUP", 2, 5), doc["job"]
    for node in three.nodes:
        assert not three.cluster.exists_on(node, marker), f"run started on {node.name} after a failed setup"
    status = three.cluster.gpuctl("status", three.cluster.name).check()
    assert re.search(r"last job: \d+ FAILED_SETUP$", status.stdout, re.M), status.stdout


def test_three_nodes_down_leaves_nothing(three: EnvJob):
    check_secret_kept(three)  # also after the failed jobs
    check_down(three)
