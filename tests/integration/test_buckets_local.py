"""Cloud-bucket file_mounts on a real 2-node local cluster, through the real `gpuctl`,
against moto's S3 listening on the cluster's own bridge (the nodes reach it as nodes
reach S3; nothing leaves this machine):

- a node without rclone stops the first bucket job's prepare with one line naming the
  node and what to install;
- COPY (a prefix into each node's home, a prefix into a directory every node shares --
  fetched by one node --, one object to a file) lands before setup; a MOUNT of a bucket
  made from `name:` takes what run writes up to the bucket; MOUNT_CACHED reads;
- a MOUNT is the job user's alone: `nobody` can neither list, read, write nor delete;
- a mount left at the workdir stops the job before the workdir copy deletes through it;
- credentials come from the task's secrets: they are in rclone's environment, in no
  process's argv (`ps` during run), in no file gpuctl keeps here or on the nodes, and
  they leave with the job: its mounts go once their writes are uploaded;
- mounts on the nodes' own credentials: the next job reuses them, and mounts a dead one again;
- a storage mount's local `source:` goes up to its `name:` bucket from here before the job (not at
  validate; only what changed the next time), and an upload that fails runs nothing;
- a missing bucket, and a node that lost rclone, are one line each and nothing runs;
- `down` leaves nothing behind while buckets are mounted.

FUSE works in the nodes' namespaces: each node's sshd runs in a private mount
namespace (terraform/modules/local-nodes), where the nodes' `rclone mount` lives.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from e2e import Cluster, Result, files_containing, needs_local_nodes, pids_matching, pids_with_env, wait_for
from mototest import MotoServer

pytestmark = [
    pytest.mark.integration, needs_local_nodes,
    pytest.mark.skipif(not shutil.which("rclone") or not os.path.exists("/dev/fuse"),
                       reason="bucket tests need rclone and fuse3 (make system-deps) and /dev/fuse"),
]

NAME = "bk2"
MOD = f"bk{uuid.uuid4().hex[:8]}"
SHARED = Path(f"/tmp/{MOD}-shared")  # every netns node sees this machine's /tmp
OPEN = Path(f"/tmp/{MOD}-open")  # a MOUNT where every local user can walk
DATA = "gpuctl-data"
CKPT = f"ckpt-{MOD}"  # made by the job (name: without source:)
SECRET_ID = f"AKID{MOD.upper()}"
SECRET_KEY = f"{MOD}-secret-key"


def task(endpoint: str, mounts: str, *, setup: str = "", run: str = "true", secrets: bool = True) -> str:
    """The task; without `secrets` rclone takes the nodes' own credentials (~/.aws/credentials there)."""
    return (f"name: {NAME}\nnum_nodes: 2\nresources:\n  infra: local\n"
            f"envs:\n  AWS_ENDPOINT_URL_S3: {endpoint}\n  AWS_REGION: us-east-1\n"
            + (f"secrets:\n  AWS_ACCESS_KEY_ID: {SECRET_ID}\n  AWS_SECRET_ACCESS_KEY: {SECRET_KEY}\n" if secrets else "")
            + f"file_mounts:\n{mounts}"
            + (f"setup: |\n  {setup}\n" if setup else "") + f"run: |\n  {run}\n")


MOUNTS = f"""\
  ~/copied: s3://{DATA}/ds
  {SHARED}: s3://{DATA}/ds
  ~/one.txt: s3://{DATA}/one/file.txt
  ~/ckpt:
    name: {CKPT}
    mode: MOUNT
  ~/cached:
    source: s3://{DATA}/ds
    mode: MOUNT_CACHED
"""
SETUP = f'echo "seen: $(cat ~/copied/a.txt ~/copied/sub/b.txt ~/one.txt {SHARED}/a.txt ~/cached/sub/b.txt | paste -sd " ")"'
# `[A]KID...` never matches the grep itself; -ww: whole command lines
RUN = (f'echo "$SKYPILOT_TASK_ID" > ~/ckpt/rank$SKYPILOT_NODE_RANK.txt; '
       f'echo "argv with the key: $(ps -eww -o args | grep -c "[{SECRET_ID[0]}]{SECRET_ID[1:]}")"')


@dataclass
class BK:
    cluster: Cluster
    root: Path
    endpoint: str
    s3: object

    def apply(self, body: str, *extra: str) -> Result:
        path = self.root / "task.yaml"
        path.write_text(body)
        return self.cluster.gpuctl("apply", str(path), *extra)

    def on_worker(self, command: str) -> None:
        self.cluster.ssh(self.cluster.nodes()[1], command)

    def bucket_events(self, res: Result) -> dict[int, dict]:
        """Each node's B event of the job (what it copied, shared, mounted, reused)."""
        job = re.search(r"^Job (\d+) running", res.stdout, re.M)
        assert job, res.describe()
        text = self.cluster.read(self.cluster.nodes()[0],
                                 f"~/.gpuctl/jobs/{self.cluster.node_job(job.group(1))}/events.log")
        return {int(m.group(1)): json.loads(m.group(2)) for m in re.finditer(r"^B (\d+) 0 (\{.*\})$", text, re.M)}

    def keys(self, bucket: str) -> dict[str, bytes]:
        listing = self.s3.list_objects_v2(Bucket=bucket).get("Contents", [])  # type: ignore[attr-defined]
        return {o["Key"]: self.s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()  # type: ignore[attr-defined]
                for o in listing}

    def wait_for_keys(self, bucket: str, want: dict[str, bytes], timeout: float = 30) -> dict[str, bytes]:
        deadline = time.monotonic() + timeout
        while True:
            have = self.keys(bucket)
            if all(have.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
                return have
            time.sleep(0.5)


def bridge_address(cluster: Cluster) -> str:
    bridge = dict(line.split("=", 1) for line in (cluster.cdir / "nodes" / "bridge.env").read_text().split())
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", bridge["LN_BRIDGE"]], capture_output=True,
                         text=True, check=True).stdout
    return out.split(" inet ", 1)[1].split("/", 1)[0]


@pytest.fixture(scope="module")
def bk(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("buckets")
    cluster = Cluster(NAME, root / "state")
    moto = None
    try:
        (root / "base.yaml").write_text(f"name: {NAME}\nnum_nodes: 2\nresources:\n  infra: local\n")
        cluster.gpuctl("apply", str(root / "base.yaml"), "--provision-only").check()
        # issue 34.11: autostop on a cluster made with --provision-only (no agent yet) prepares it first
        armed = cluster.gpuctl("autostop", NAME, "-i", "600").check()
        assert "autostop after 600 idle minute(s)" in armed.stdout, armed.describe()
        cluster.gpuctl("autostop", NAME, "--cancel").check()
        moto = MotoServer(host=bridge_address(cluster), log=root / "moto.log").start()
        s3 = boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1", aws_access_key_id="test",
                          aws_secret_access_key="test")
        s3.create_bucket(Bucket=DATA)
        for key, body in (("ds/a.txt", b"alpha\n"), ("ds/sub/b.txt", b"beta\n"), ("one/file.txt", b"single\n")):
            s3.put_object(Bucket=DATA, Key=key, Body=body)
        yield BK(cluster, root, moto.url, s3)
    finally:
        cluster.down_quietly()
        if moto is not None:
            moto.stop()
        shutil.rmtree(SHARED, ignore_errors=True)
        shutil.rmtree(OPEN, ignore_errors=True)


def one_error_line(res: Result) -> str:
    assert res.returncode == 1, res.describe()
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, res.describe()
    return errors[0]


def test_node_without_rclone_stops_the_first_bucket_job(bk: BK):
    """The first job with buckets prepares the nodes again (rclone, FUSE); a local node lacking
    rclone is named, with what to install, before anything runs."""
    bk.on_worker("sudo -n mount --bind /dev/null /usr/bin/rclone")  # in worker1's own mount namespace only
    try:
        res = bk.apply(task(bk.endpoint, MOUNTS, setup="echo SETUP-RAN", run="echo RUN-RAN"))
    finally:
        bk.on_worker("sudo -n umount /usr/bin/rclone")
    line = one_error_line(res)
    assert "Preparing 2 node(s)" in res.stdout
    assert line == ("error: preparing the nodes failed: worker1: rclone missing on worker1, and the job's "
                    "cloud-bucket file_mounts need it; local nodes run this machine's software, so install it "
                    "here: apt-get install rclone fuse3"), res.describe()
    assert "RAN" not in res.stdout


def test_copy_lands_before_setup_and_run_writes_into_the_mount(bk: BK):
    res = bk.apply(task(bk.endpoint, MOUNTS, setup=SETUP, run=RUN)).check()
    bk.first = res  # type: ignore[attr-defined]
    lines = res.stdout.splitlines()
    for n in bk.cluster.nodes():
        # COPY (prefix, shared directory, one object) and MOUNT_CACHED, all read by setup
        assert f"({n.name}, rank={n.rank}) seen: alpha beta single alpha beta" in lines, res.describe()
        assert f"({n.name}, rank={n.rank}) argv with the key: 0" in lines, res.describe()
    events = bk.bucket_events(res)
    assert events[0] == {"copied": ["~/copied", str(SHARED), "~/one.txt"], "mounted": ["~/ckpt", "~/cached"]}
    assert events[1] == {"copied": ["~/copied", "~/one.txt"], "shared": [str(SHARED)],  # the head fetched it
                         "mounted": ["~/ckpt", "~/cached"]}
    assert not list(SHARED.glob(".gpuctl-claim-*"))
    task_id = re.search(r"^Job \d+ running \((\S+)\)", res.stdout, re.M).group(1)  # type: ignore[union-attr]
    want = {"rank0.txt": f"{task_id}\n".encode(), "rank1.txt": f"{task_id}\n".encode()}
    assert bk.wait_for_keys(CKPT, want) == want  # the bucket name: made was created, and run's files are in it


def test_a_local_directory_goes_up_to_its_named_bucket_before_the_job(bk: BK):
    """SkyPilot's storage `name:` + local `source:` (examples/managed_job_with_storage.yaml): apply makes
    the bucket and uploads the directory from here before the job (what .skyignore names stays here),
    the nodes then copy it (COPY) and mount it (MOUNT); validate uploads nothing; a second apply sends
    only what changed."""
    up = f"up-{MOD}"
    src = bk.root / "upload-src"
    (src / "sub").mkdir(parents=True, exist_ok=True)
    for rel, body in (("a.txt", "uploaded-a\n"), ("sub/b.txt", "uploaded-b\n"), (".skyignore", "*.ckpt\n"),
                      ("w.ckpt", "stays here\n")):
        (src / rel).write_text(body)
    mounts = (f"  ~/up-copy:\n    name: {up}\n    source: {src}\n    mode: COPY\n"
              f"  ~/up-mount:\n    name: {up}\n    source: {src}\n    mode: MOUNT\n")
    body = task(bk.endpoint, mounts, run='echo "read: $(cat ~/up-copy/a.txt ~/up-mount/sub/b.txt | paste -sd " ")"')
    (bk.root / "upload.yaml").write_text(body)
    bk.cluster.gpuctl("validate", str(bk.root / "upload.yaml")).check()
    assert up not in [b["Name"] for b in bk.s3.list_buckets()["Buckets"]]  # type: ignore[attr-defined]
    res = bk.apply(body, "--no-setup").check()
    assert f"==> Uploading to s3://{up}" in res.stdout and f"s3://{up}: 3 file(s) sent, 0 unchanged" in res.stdout
    for n in bk.cluster.nodes():
        assert f"({n.name}, rank={n.rank}) read: uploaded-a uploaded-b" in res.stdout.splitlines(), res.describe()
    assert bk.keys(up) == {"a.txt": b"uploaded-a\n", "sub/b.txt": b"uploaded-b\n", ".skyignore": b"*.ckpt\n"}
    (src / "a.txt").write_text("uploaded-a, again\n")
    again = bk.apply(body, "--no-setup").check()
    assert f"s3://{up}: 1 file(s) sent, 2 unchanged" in again.stdout, again.describe()
    for n in bk.cluster.nodes():
        assert f"({n.name}, rank={n.rank}) read: uploaded-a, again uploaded-b" in again.stdout.splitlines()


def test_an_upload_that_fails_runs_nothing(bk: BK):
    """The controller's upload comes before anything runs: an endpoint that does not answer is one
    line naming the field, exit 1, and neither setup nor run starts."""
    src = bk.root / "upload-fail-src"
    src.mkdir(exist_ok=True)
    (src / "a.txt").write_text("never sent\n")
    closed = "http://127.0.0.1:9"  # discard: nothing listens there
    body = task(closed, f"  ~/up-fail:\n    name: up-fail-{MOD}\n    source: {src}\n    mode: MOUNT\n",
                setup="echo SETUP-RAN", run="echo RUN-RAN")
    res = bk.apply(body)
    line = one_error_line(res)
    assert "RAN" not in res.stdout, res.describe()
    assert re.fullmatch(rf"error: job \d+: file_mounts.~/up-fail: uploading {re.escape(str(src))} to "
                        rf"s3://up-fail-{MOD} failed: Could not connect to the endpoint URL: .*", line), line
    job = re.match(r"error: job (\d+):", line).group(1)  # type: ignore[union-attr]
    queue = bk.cluster.gpuctl("queue", NAME).check()
    row = next(r for r in queue.stdout.splitlines() if r.split()[:1] == [job])
    assert "FAILED" in row, queue.stdout


def test_a_mount_is_the_job_users_alone(bk: BK):
    """Another local user (`nobody`) can neither list, read, write nor delete through a MOUNT
    in a directory everyone reaches; the job's user can (--allow-other alone let anyone in)."""
    nobody = "setpriv --reuid=65534 --regid=65534 --clear-groups"
    checks = {"list": f"ls {OPEN}", "read": f"cat {OPEN}/sub/b.txt", "write": f"echo x > {OPEN}/planted.txt",
              "delete": f"rm {OPEN}/a.txt", "mkdir": f"mkdir {OPEN}/sub/new"}
    run = f"cat {OPEN}/a.txt; " + " ".join(f"{nobody} sh -c '{cmd}' >/dev/null 2>&1 && echo {name}=allowed "
                                            f"|| echo {name}=refused;" for name, cmd in checks.items())
    res = bk.apply(task(bk.endpoint, f"  {OPEN}:\n    source: s3://{DATA}/ds\n    mode: MOUNT\n", run=run),
                   "--no-setup").check()
    lines = res.stdout.splitlines()
    for n in bk.cluster.nodes():
        assert f"({n.name}, rank={n.rank}) alpha" in lines, res.describe()
        for name in checks:
            assert f"({n.name}, rank={n.rank}) {name}=refused" in lines, res.describe()
    assert set(bk.keys(DATA)) == {"ds/a.txt", "ds/sub/b.txt", "one/file.txt"}


def test_no_copy_deletes_through_a_mount_left_in_the_workdir(bk: BK):
    """A bucket mounted at the workdir (an older gpuctl accepted ~/gpuctl_workdir as a MOUNT)
    stops the job before the workdir copy would delete through it, on the head (the controller's
    copy) and on a worker (the head's); the bucket keeps every object."""
    victim = f"victim-{MOD}"
    bk.s3.create_bucket(Bucket=victim)  # type: ignore[attr-defined]
    objects = {f"obj{i}.bin": f"object {i}\n".encode() for i in range(3)}
    for key, body in objects.items():
        bk.s3.put_object(Bucket=victim, Key=key, Body=body)  # type: ignore[attr-defined]
    (bk.root / "wd").mkdir(exist_ok=True)
    (bk.root / "wd" / "train.py").write_text("print('train')\n")
    remote = (f"RCLONE_CONFIG_OLD_TYPE=s3 RCLONE_CONFIG_OLD_PROVIDER=Other RCLONE_CONFIG_OLD_ENDPOINT={bk.endpoint} "
              "RCLONE_CONFIG_OLD_ACCESS_KEY_ID=test RCLONE_CONFIG_OLD_SECRET_ACCESS_KEY=test")
    body = f"workdir: {bk.root / 'wd'}\n" + task(bk.endpoint, "  /tmp/unused: s3://gpuctl-data/ds\n", run="echo RAN")
    for node, prefix in zip(bk.cluster.nodes(), ("", "worker1: ")):
        bk.cluster.ssh(node, f"mkdir -p ~/gpuctl_workdir && {remote} rclone mount old:{victim} ~/gpuctl_workdir "
                             "--daemon --allow-non-empty --vfs-cache-mode writes")
        try:
            res = bk.apply(body, "--no-setup")
        finally:
            bk.cluster.ssh(node, "fusermount -u ~/gpuctl_workdir")
        line = one_error_line(res)
        workdir = re.escape(pwd.getpwnam(node.user).pw_dir + "/gpuctl_workdir")  # the nodes' login user's
        assert re.fullmatch(rf"error: job \d+: {prefix}workdir: {workdir} is a mount point \(fuse.rclone "
                            rf"old\S*:{victim}\), and the workdir copy would delete through it whatever your workdir "
                            rf"lacks; unmount it \(fusermount -u {workdir}\) or mount it elsewhere", line), line
        assert "RAN" not in res.stdout
        assert bk.keys(victim) == objects


def test_credentials_only_in_rclones_environment_and_gone_with_the_job(bk: BK):
    """While the job runs the task's credentials are in its mounts' rclone environment and in no
    argv; once it ends, those mounts are unmounted (their writes uploaded first) and no process
    or file gpuctl keeps holds the credentials."""
    res = bk.apply(task(bk.endpoint, MOUNTS, run="echo up > ~/ckpt/last-$SKYPILOT_NODE_RANK.txt; sleep 300"),
                   "--no-setup", "-d").check()
    job = re.search(r"^Job (\d+) running", res.stdout, re.M).group(1)  # type: ignore[union-attr]
    assert not pids_matching(SECRET_ID) and not pids_matching(SECRET_KEY)  # no argv
    mounts = pids_matching(f"rclone\0mount\0gpuctls3:{CKPT}\0")
    assert len(mounts) == 2, mounts  # one per node
    for pid in mounts:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"AWS_SECRET_ACCESS_KEY={SECRET_KEY}".encode() in environ
    want = {"last-0.txt": b"up\n", "last-1.txt": b"up\n"}
    assert {k: v for k, v in bk.wait_for_keys(CKPT, want).items() if k in want} == want
    def mounted(n: object) -> list[str]:
        home, table = bk.cluster.ssh(n, "echo ~; cat /proc/self/mountinfo").stdout.split("\n", 1)  # type: ignore
        return re.findall(rf" {re.escape(home)}/(ckpt|cached) ", table)

    assert all(sorted(mounted(n)) == ["cached", "ckpt"] for n in bk.cluster.nodes())
    bk.cluster.gpuctl("cancel", NAME, job).check()
    wait_for("the credentials to leave with the job",
             lambda: not pids_with_env(f"AWS_SECRET_ACCESS_KEY={SECRET_KEY}"), timeout=60)
    assert not any(mounted(n) for n in bk.cluster.nodes())
    # nothing gpuctl keeps (registry, logs, job files, the nodes' homes and mount logs) holds them
    for secret in (SECRET_ID, SECRET_KEY):
        assert files_containing(bk.cluster.state_dir, secret) == []


def test_a_jobs_last_writes_reach_the_bucket_before_its_mount_goes(bk: BK):
    """MOUNT_CACHED uploads in the background: the mount goes only once they are up."""
    mounts = f"  ~/late:\n    name: {CKPT}\n    mode: MOUNT_CACHED\n"
    run = "head -c 3000000 /dev/urandom > ~/late/final-$SKYPILOT_NODE_RANK.bin"
    bk.apply(task(bk.endpoint, mounts, run=run), "--no-setup").check()
    wait_for("the credentials to leave with the job",
             lambda: not pids_with_env(f"AWS_SECRET_ACCESS_KEY={SECRET_KEY}"), timeout=60)
    sizes = {k: len(v) for k, v in bk.keys(CKPT).items() if k.startswith("final-")}
    assert sizes == {"final-0.bin": 3000000, "final-1.bin": 3000000}


def test_next_job_reuses_mounts_and_mounts_a_dead_one_again(bk: BK):
    """Mounts on the nodes' own credentials (no secret of a job) outlive the job and are reused."""
    for n in bk.cluster.nodes():
        bk.cluster.ssh(n, "mkdir -p ~/.aws && printf '[default]\\naws_access_key_id = node\\n"
                          "aws_secret_access_key = node-identity\\n' > ~/.aws/credentials")
    bk.apply(task(bk.endpoint, MOUNTS, run=RUN, secrets=False), "--no-setup").check()
    tag = bk.cluster.node_env(bk.cluster.nodes()[1])["LN_TAG"].encode()
    dead = [pid for pid in pids_matching(f"rclone\0mount\0gpuctls3:{CKPT}\0")
            if b"GPUCTL_NODE_TAG=" + tag in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")]
    assert len(dead) == 1
    os.kill(dead[0], signal.SIGKILL)  # worker1's ~/ckpt: "Transport endpoint is not connected"
    res = bk.apply(task(bk.endpoint, MOUNTS, run=RUN, secrets=False), "--no-setup").check()
    events = bk.bucket_events(res)
    assert events[0]["reused"] == ["~/ckpt", "~/cached"] and "mounted" not in events[0], events
    assert events[1]["mounted"] == ["~/ckpt"] and events[1]["reused"] == ["~/cached"], events
    task_id = re.search(r"^Job \d+ running \((\S+)\)", res.stdout, re.M).group(1)  # type: ignore[union-attr]
    want = {"rank0.txt": f"{task_id}\n".encode(), "rank1.txt": f"{task_id}\n".encode()}
    assert {k: v for k, v in bk.wait_for_keys(CKPT, want).items() if k in want} == want


def test_missing_bucket_is_one_line_and_nothing_runs(bk: BK):
    missing = f"s3://no-such-{MOD}/data"
    res = bk.apply(task(bk.endpoint, f"  /tmp/{MOD}-m:\n    source: {missing}\n    mode: MOUNT\n",
                        setup="echo SETUP-RAN", run="echo RUN-RAN"))
    line = one_error_line(res)
    assert re.fullmatch(rf"error: job \d+: {missing}: no such bucket \(no-such-{MOD}\); create it, or give name: "
                        r"without source: to have it made", line), line
    assert "RAN" not in res.stdout


def test_node_that_lost_rclone_is_one_line(bk: BK):
    bk.on_worker("sudo -n mount --bind /dev/null /usr/bin/rclone")
    try:
        res = bk.apply(task(bk.endpoint, MOUNTS, setup="echo SETUP-RAN", run="echo RUN-RAN"))
    finally:
        bk.on_worker("sudo -n umount /usr/bin/rclone")
    line = one_error_line(res)
    assert re.match(r"error: job \d+: worker1: rclone is not installed, and the job's cloud-bucket file_mounts "
                    r"need it; .* apt-get install rclone fuse3$", line), line
    assert "RAN" not in res.stdout and "Preparing" not in res.stdout


def test_down_with_mounts_up_leaves_nothing(bk: BK):
    footprint = bk.cluster.footprint()
    assert pids_matching(f"rclone\0mount\0gpuctls3:{CKPT}\0")
    bk.cluster.gpuctl("down", NAME).check()
    footprint.assert_gone()
    assert not pids_matching(f"rclone\0mount\0gpuctls3:{CKPT}\0")
