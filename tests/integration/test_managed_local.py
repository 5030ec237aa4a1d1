"""Managed jobs on local netns nodes: a node dies mid-run and only it is replaced.

The "bucket" is a directory under /tmp, shared by every node (outside their bind-mounted homes).
Each rank takes `flock -n` on its rank's lock file there and exits 97 if it is held, so two copies
of one rank can never go unnoticed; it logs its start (rank, attempt, both task ids, host, time)
and resumes from the step rank 0 checkpointed. Ticks are 1 s here (GPUCTL_MANAGED_TICK_S).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest

from e2e import Cluster, ManagedJobs, kill_dead, needs_local_nodes, queue_rows, run_gpuctl, wait_for

from gpuctl.managed.store import Store

pytestmark = [pytest.mark.integration, needs_local_nodes]

RANK_SCRIPT = r"""
exec 9>"$CKPT/rank-$GPUCTL_NODE_RANK.lock"
if ! flock -n 9; then echo "dup $GPUCTL_NODE_RANK $GPUCTL_ATTEMPT" >> "$CKPT/dupes"; exit 97; fi
trap 'echo "term $GPUCTL_NODE_RANK $GPUCTL_ATTEMPT" >> "$CKPT/terms"; exit 143' TERM
echo "start $GPUCTL_NODE_RANK $GPUCTL_ATTEMPT $GPUCTL_TASK_ID $SKYPILOT_TASK_ID $(date +%s.%N)" >> "$CKPT/events"
step=$(cat "$CKPT/step" 2>/dev/null || echo 0)
echo "rank $GPUCTL_NODE_RANK attempt $GPUCTL_ATTEMPT resumes at step $step"
FAIL="FAIL_${GPUCTL_ATTEMPT}_${GPUCTL_NODE_RANK}"
if [ -n "${!FAIL:-}" ]; then echo "failing with ${!FAIL}"; exit "${!FAIL}"; fi
while [ "$step" -lt "$STEPS" ]; do
  sleep 0.25 & wait $!
  step=$((step + 1))
  if [ "$GPUCTL_NODE_RANK" = 0 ]; then echo "$step" > "$CKPT/step.tmp"; mv "$CKPT/step.tmp" "$CKPT/step"; fi
done
echo "end $GPUCTL_NODE_RANK $GPUCTL_ATTEMPT $(date +%s.%N)" >> "$CKPT/events"
"""


class Managed(ManagedJobs):
    def __init__(self, root: Path, ckpt: Path) -> None:
        super().__init__(root)
        self.ckpt = ckpt

    def task(self, nodes: int, *, steps: int = 40, recovery: str = "{}", envs: dict[str, str] | None = None) -> Path:
        path = self.root / "task.yaml"
        env_lines = "".join(f"  {k}: '{v}'\n" for k, v in {"CKPT": str(self.ckpt), "STEPS": str(steps),
                                                            **(envs or {})}.items())
        path.write_text(f"name: mjt\nnum_nodes: {nodes}\nresources:\n  infra: local\n  job_recovery: {recovery}\n"
                        f"envs:\n{env_lines}run: |\n{textwrap.indent(RANK_SCRIPT.strip(), '  ')}\n")
        return path

    def launch(self, task: Path) -> int:
        res = self.gpuctl("jobs", "launch", str(task), "-d", "-o", "json").check()
        return int(json.loads(res.stdout)["job"]["id"])

    def cluster(self, job_id: int) -> Cluster:
        return Cluster(self.job(job_id).cluster, self.state)

    def events(self) -> list[list[str]]:
        path = self.ckpt / "events"
        return [line.split() for line in path.read_text().splitlines()] if path.exists() else []

    def started(self, attempt: int) -> list[list[str]]:
        return [e for e in self.events() if e[0] == "start" and e[2] == str(attempt)]

    def step(self) -> int:
        try:
            return int((self.ckpt / "step").read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def doc(self, job_id: int) -> dict:
        res = self.gpuctl("jobs", "queue", "-o", "json").check()
        return next(j for j in json.loads(res.stdout)["jobs"] if j["id"] == job_id)



@pytest.fixture
def mj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Managed]:
    monkeypatch.setenv("GPUCTL_MANAGED_TICK_S", "1")
    monkeypatch.setenv("GPUCTL_MANAGED_GRACE_S", "20")
    ckpt = Path(tempfile.mkdtemp(prefix="gpuctl-mj-", dir="/tmp"))
    ckpt.chmod(0o777)
    m = Managed(tmp_path, ckpt)
    yield m
    try:
        if m.store.path.exists():
            for job in m.store.all():
                if not job.terminal:
                    m.gpuctl("jobs", "cancel", str(job.id), timeout=300)
                cluster = Cluster(job.cluster, m.state)
                if cluster.cdir.exists():
                    sys.stderr.write(m.supervisor_log(job.id))
                    cluster.down_quietly()
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


def kill_node(ns: str) -> float:
    """The machine dies: every process in its namespace, then the namespace."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    killed = time.time()
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return killed


def test_a_lost_worker_is_replaced_alone_and_the_job_resumes_even_after_its_supervisor_died(mj: Managed) -> None:
    job_id = mj.launch(mj.task(3, steps=48))
    job = mj.wait_status(job_id, ("RUNNING",), 120)
    wait_for("every rank of attempt 1", lambda: len(mj.started(1)) == 3, 30)
    # the supervisor dies (SIGKILL); the next gpuctl command starts another that watches the attempt again
    kill_dead(job.supervisor_pid)
    mj.gpuctl("jobs", "queue").check()
    wait_for("a new supervisor", lambda: mj.job(job_id).supervisor_pid not in (None, job.supervisor_pid), 30)
    wait_for("a checkpoint", lambda: mj.step() >= 12, 60)
    cluster = mj.cluster(job_id)
    before = cluster.footprint()
    killed = kill_node(before.netns[1])
    mj.wait_status(job_id, ("RECOVERING",), 15 + 5)
    wait_for("every rank of attempt 2", lambda: len(mj.started(2)) == 3, 90)
    after = cluster.footprint()
    assert after.sshd[0] == before.sshd[0] and after.sshd[2] == before.sshd[2]  # the others untouched
    assert after.sshd[1] != before.sshd[1]
    final = mj.wait_status(job_id, ("SUCCEEDED", "FAILED", "FAILED_SETUP", "CANCELLED", "FAILED_SUPERVISOR"), 120)
    assert final.status == "SUCCEEDED", mj.supervisor_log(job_id)
    doc = mj.doc(job_id)
    assert doc["recoveries"] == 1 and doc["attempt"] == 2 and doc["cluster_removed"] is True
    [event] = doc["events"]
    assert event["kind"] == "recovery" and event["nodes"] == [1] and "rank 1 lost" in event["cause"]
    assert event["detected_at"] - killed <= 15 and event["resumed_at"] - killed <= 60, (event, killed)
    # one task id for every attempt, under both names; attempt 2 resumed from the checkpoint
    ids = {(e[3], e[4]) for e in mj.events() if e[0] == "start"}
    assert ids == {(doc["task_id"], doc["task_id"])}
    logs = mj.gpuctl("jobs", "logs", str(job_id), "--no-follow").check().stdout
    assert "== attempt 1 ==" in logs and "== attempt 2: after rank 1 lost (" in logs
    resumed = [int(line.rsplit(" ", 1)[1]) for line in logs.splitlines() if "attempt 2 resumes at step" in line]
    assert resumed and min(resumed) >= 12
    assert not (mj.ckpt / "dupes").exists(), (mj.ckpt / "dupes").read_text()
    assert len([e for e in mj.events() if e[0] == "end" and e[2] == "2"]) == 3
    before.assert_gone()
    after.assert_gone()


def test_a_lost_head_is_replaced_even_when_the_supervisor_dies_while_recovering(mj: Managed) -> None:
    job_id = mj.launch(mj.task(2, steps=36))
    mj.wait_status(job_id, ("RUNNING",), 120)
    wait_for("a checkpoint", lambda: mj.step() >= 6, 60)
    cluster = mj.cluster(job_id)
    before = cluster.footprint()
    killed = kill_node(before.netns[0])
    recovering = mj.wait_status(job_id, ("RECOVERING",), 15 + 5)
    kill_dead(recovering.supervisor_pid)  # mid-recovery: what it was doing is unknown
    mj.gpuctl("status").check()  # any gpuctl command starts another
    final = mj.wait_status(job_id, ("SUCCEEDED", "FAILED", "FAILED_SETUP", "CANCELLED", "FAILED_SUPERVISOR"), 180)
    assert final.status == "SUCCEEDED", mj.supervisor_log(job_id)
    assert final.supervisor_pid != recovering.supervisor_pid and final.transient == 0
    [event] = mj.doc(job_id)["events"]
    assert event["nodes"] == [0] and event["detected_at"] - killed <= 15
    assert final.attempt >= 2 and len(mj.started(final.attempt)) == 2
    assert not (mj.ckpt / "dupes").exists(), (mj.ckpt / "dupes").read_text()
    before.assert_gone()


def test_user_errors_follow_max_restarts_and_recover_on_exit_codes(mj: Managed) -> None:
    # attempt 1: rank 1 exits 33 (listed: restarted, not counted); attempts 2 and 3: rank 0 exits 1
    task = mj.task(2, steps=8, recovery="{max_restarts_on_errors: 1, recover_on_exit_codes: [33]}",
                   envs={"FAIL_1_1": "33", "FAIL_2_0": "1", "FAIL_3_0": "1"})
    # followed, as a user runs it: the supervisor's progress on stderr as it comes, not silence
    res = mj.gpuctl("jobs", "launch", str(task), timeout=300)
    (job_id,) = [j.id for j in mj.store.all()]
    final = mj.wait_status(job_id, ("SUCCEEDED", "FAILED", "FAILED_SETUP", "CANCELLED", "FAILED_SUPERVISOR"), 240)
    assert res.returncode == 1 and f"Managed job {job_id} FAILED" in res.stderr, res.describe()
    said = {what: next((t for t, line in res.stderr_lines if what in line), None)
            for what in ("Provisioning 2 local node(s)", "attempt 1 ended", "taking its cluster down")}
    assert all(said.values()), res.describe()
    first_rank_line = next(t for t, line in res.stdout_lines if "resumes at step" in line)
    assert said["Provisioning 2 local node(s)"] < first_rank_line, res.describe()  # shown live, before any rank ran
    doc = mj.doc(job_id)
    assert final.status == "FAILED" and doc["exit_code"] == 1 and doc["failed_rank"] == 0, mj.supervisor_log(job_id)
    assert doc["attempt"] == 3 and doc["restarts_on_errors"] == 1 and doc["recoveries"] == 0
    assert [(e["kind"], e["exit_code"], e["failed_rank"]) for e in doc["events"]] == [("restart", 33, 1),
                                                                                     ("restart", 1, 0)]
    assert "rank 0 exited with code 1" in doc["reason"] and doc["cluster_removed"] is True
    text = mj.gpuctl("jobs", "queue").check().stdout
    assert "FAILED" in text and "recover_on_exit_codes" in text
    assert not mj.cluster(job_id).cdir.exists()


def test_cancel_while_recovering_leaves_nothing(mj: Managed) -> None:
    job_id = mj.launch(mj.task(2, steps=400))
    mj.wait_status(job_id, ("RUNNING",), 120)
    wait_for("every rank", lambda: len(mj.started(1)) == 2, 30)
    cluster = mj.cluster(job_id)
    before = cluster.footprint()
    kill_node(before.netns[1])
    mj.wait_status(job_id, ("RECOVERING",), 20)
    res = mj.gpuctl("jobs", "cancel", str(job_id), "-o", "json").check()
    assert json.loads(res.stdout)["job"]["status"] == "CANCELLED"
    assert mj.job(job_id).destroyed
    before.assert_gone()


def test_a_network_blip_shorter_than_the_grace_recovers_nothing(mj: Managed) -> None:
    job_id = mj.launch(mj.task(2, steps=60))
    mj.wait_status(job_id, ("RUNNING",), 120)
    wait_for("every rank", lambda: len(mj.started(1)) == 2, 30)
    fp = mj.cluster(job_id).footprint()
    veth = fp.veths[1]
    subprocess.run(["ip", "link", "set", veth, "down"], check=True)
    try:
        time.sleep(6)
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
    final = mj.wait_status(job_id, ("SUCCEEDED", "FAILED", "FAILED_SETUP", "CANCELLED", "FAILED_SUPERVISOR"), 120)
    doc = mj.doc(job_id)
    assert final.status == "SUCCEEDED" and doc["attempt"] == 1 and doc["events"] == [], mj.supervisor_log(job_id)
    fp.assert_gone()


FAKE_IMDS = r"""
import http.server, json, sys, time
port, delay = int(sys.argv[1]), float(sys.argv[2])
start = time.time()
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_PUT(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"token")
    def do_GET(self):
        if self.path.endswith("/spot/instance-action") and time.time() - start > delay:
            body = json.dumps({"action": "terminate", "time": "2026-11-26T08:22:00Z"}).encode()
            self.send_response(200); self.end_headers(); self.wfile.write(body)
        else:
            self.send_response(404); self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_a_spot_notice_lets_the_ranks_checkpoint_and_replaces_the_doomed_node(mj: Managed,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # each node polls 127.0.0.1:PORT in its own namespace: only worker1 has a metadata service there
    monkeypatch.setenv("GPUCTL_TEST_SPOT_NOTICE_URL", "http://127.0.0.1:18169")
    job_id = mj.launch(mj.task(2, steps=60))
    mj.wait_status(job_id, ("RUNNING",), 120)
    wait_for("every rank", lambda: len(mj.started(1)) == 2, 30)
    fp = mj.cluster(job_id).footprint()
    imds = subprocess.Popen(["ip", "netns", "exec", fp.netns[1], sys.executable, "-c", FAKE_IMDS, "18169", "1"],
                            start_new_session=True)
    try:
        final = mj.wait_status(job_id, ("SUCCEEDED", "FAILED", "FAILED_SETUP", "CANCELLED", "FAILED_SUPERVISOR"),
                               180)
    finally:
        os.killpg(imds.pid, signal.SIGKILL)
        imds.wait()
    doc = mj.doc(job_id)
    assert final.status == "SUCCEEDED" and doc["recoveries"] == 1, mj.supervisor_log(job_id)
    assert doc["events"][0]["nodes"] == [1] and "spot interruption notice" in doc["events"][0]["cause"]
    terms = (mj.ckpt / "terms").read_text().split("\n")
    assert "term 1 1" in terms  # worker1's rank had its SIGTERM to checkpoint
    fp.assert_gone()


# -- truth under faults (issue 35) ------------------------------------------------------------------

TERMINAL = ("SUCCEEDED", "FAILED", "FAILED_SETUP", "CANCELLED", "FAILED_SUPERVISOR", "FAILED_NO_RESOURCE", "LOST")


def test_a_job_never_takes_a_users_cluster_of_its_name_and_a_quick_one_has_a_start_time(mj: Managed) -> None:
    """The user's own cluster is called what job 1's would be: the job makes its own beside it, and
    its end leaves the user's cluster alone. A job over before the supervisor's first look still
    says when it started."""
    users = mj.root / "users.yaml"
    users.write_text("name: mjt-mj1\nresources:\n  infra: local\n")
    mj.gpuctl("apply", str(users), "--provision-only").check()
    try:
        job_id = mj.launch(mj.task(1, steps=0))
        final = mj.wait_status(job_id, TERMINAL, 180)
        assert final.status == "SUCCEEDED", mj.supervisor_log(job_id)
        assert job_id == 1 and final.cluster == "mjt-mj1-2", final.cluster
        assert final.started_at is not None and final.submitted_at <= final.started_at <= final.ended_at
        assert mj.doc(job_id)["started_at"] == final.started_at
        shown = json.loads(mj.gpuctl("status", "mjt-mj1", "-o", "json").check().stdout)["clusters"][0]
        assert shown["status"] == "UP" and len(shown["nodes"]) == 1  # the user's, untouched
        assert mj.gpuctl("exec", "mjt-mj1", "--", "true").returncode == 0
    finally:
        mj.gpuctl("down", "mjt-mj1")


def test_the_task_as_launched_runs_whatever_happens_to_its_files_and_down_refuses_its_cluster(
        mj: Managed) -> None:
    """Once `jobs launch` returned, the task file is deleted and the workdir's program edited. Attempt
    1 fails (a user error, one restart allowed); attempt 2, and the supervisor revived after a
    SIGKILL during it, run the program as launched. `down` of the job's cluster is refused."""
    workdir = mj.root / "wd"
    workdir.mkdir()
    (workdir / "prog.sh").write_text("echo program ORIGINAL\n")
    task = mj.task(1, steps=24, recovery="{max_restarts_on_errors: 1}", envs={"FAIL_1_0": "3"})
    task.write_text(task.read_text().replace("run: |\n", "workdir: wd\nrun: |\n  bash prog.sh\n", 1))
    job_id = mj.launch(task)
    task.unlink()
    (workdir / "prog.sh").write_text("echo program EDITED\n")
    running = wait_for("attempt 2 running", lambda: (j := mj.job(job_id)).status == "RUNNING" and j.attempt == 2
                       and len(mj.started(2)) == 1 and j, 180, interval=0.1)
    cluster = running.cluster
    for argv in (("down", cluster), ("down", "-a", "-y")):
        refused = mj.gpuctl(*argv)
        assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
            f"error: cluster '{cluster}' is managed job {job_id}'s (mjt, RUNNING): `gpuctl jobs cancel {job_id}` "
            "ends it and removes its cluster; nothing was torn down"), refused.describe()
    kill_dead(running.supervisor_pid)
    mj.gpuctl("jobs", "queue").check()  # revives one, which reads the task as launched
    final = mj.wait_status(job_id, TERMINAL, 180)
    assert final.status == "SUCCEEDED" and final.supervisor_pid != running.supervisor_pid, mj.supervisor_log(job_id)
    logs = mj.gpuctl("jobs", "logs", str(job_id), "--no-follow").check().stdout
    assert logs.count("program ORIGINAL") >= 2 and "EDITED" not in logs, logs
    kept = mj.state / "managed" / "trees"
    assert not kept.exists() or not [p for p in kept.iterdir() if not p.name.startswith(".")]  # released


def test_a_job_that_ends_while_no_supervisor_lives_keeps_its_outcome(mj: Managed,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor is SIGKILLed while the attempt runs; the attempt ends, the lease runs out and the
    cluster removes itself, its head leaving the job's outcome behind. The cluster job's status is
    a terminal answer at once, and the revived supervisor records SUCCEEDED, never makes the
    cluster again."""
    from gpuctl.providers import get_provider

    monkeypatch.setenv("GPUCTL_TEST_MINUTE_SECONDS", "1")
    monkeypatch.setenv("GPUCTL_LEASE_MINUTES", "3")
    job_id = mj.launch(mj.task(1, steps=16))
    running = wait_for("every rank", lambda: (j := mj.job(job_id)).status == "RUNNING" and mj.started(1) and j,
                       120, interval=0.1)
    kill_dead(running.supervisor_pid)
    cluster = mj.cluster(job_id)
    wait_for("the cluster removed itself", lambda: get_provider("local").removed_itself(cluster.cdir), 120)
    asked = time.monotonic()
    polled = mj.gpuctl("logs", cluster.name, str(running.cluster_job), "--status")
    assert polled.returncode == 0 and time.monotonic() - asked < 60, polled.describe()
    mj.gpuctl("jobs", "queue").check()
    final = mj.wait_status(job_id, TERMINAL, 120)
    assert final.status == "SUCCEEDED", mj.supervisor_log(job_id)
    assert len(mj.started(1)) == 1 and [e for e in mj.events() if e[0] == "end"]
    assert not mj.started(2) and not cluster.cdir.exists()  # never made again; its records removed


STATE_BUCKET = "gpuctl-managed-state"


def test_any_runner_of_the_shared_state_takes_over_a_job_its_launcher_left(
        mj: Managed, tmp_path: Path, moto_server, tf_cli_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared state in S3 (moto on loopback). Runner A launches a 3-node job with a secret; its
    supervisor is SIGKILLed and its state dir removed, all but the local nodes' homes (they stand
    for the cloud's machines, which outlive a runner); then the head is lost. Runner B, which never
    saw the job, names the secret it lacks and takes nothing over; given it, its next `jobs queue`
    takes the job over: only the lost node is replaced, every rank starts again with the same task
    id and no duplicate. B's supervisor dies too; runner C's scheduled `jobs supervise --for` takes
    the job over and hands it back; B's `jobs cancel` takes it again at once and its new supervisor,
    which never saw the cluster, leaves nothing of it (nodes, bucket objects, secrets)."""
    import boto3
    from mototest import fake_aws_env

    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=moto_server.url, aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    try:
        s3.create_bucket(Bucket=STATE_BUCKET)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    prefix = f"mj-{os.getpid()}-{int(time.time())}"
    for key, value in {**fake_aws_env(moto_server.url, {}), "GPUCTL_STATE_BUCKET": STATE_BUCKET,
                       "GPUCTL_STATE_PREFIX": prefix, "GPUCTL_STATE_ENDPOINT_URL": moto_server.url,
                       "TF_CLI_CONFIG_FILE": str(tf_cli_config), "GPUCTL_MANAGED_LEASE_S": "15"}.items():
        monkeypatch.setenv(key, value)

    def keys(under: str = "") -> list[str]:
        return [o["Key"] for o in s3.list_objects_v2(Bucket=STATE_BUCKET, Prefix=f"{prefix}/{under}")
                .get("Contents", [])]

    def bucket_row(job: int) -> dict:
        """The job's row as the state bucket has it (what another runner reads), {} while there is none."""
        try:
            body = s3.get_object(Bucket=STATE_BUCKET, Key=f"{prefix}/managed/jobs/{job}.json")["Body"].read()
        except s3.exceptions.NoSuchKey:
            return {}
        return json.loads(body).get("job") or {}

    def holding(secret: bytes) -> list[str]:
        """The keys whose object holds `secret`; one gone since the listing (a Terraform lock) holds nothing."""
        found = []
        for key in keys():
            try:
                body = s3.get_object(Bucket=STATE_BUCKET, Key=key)["Body"].read()
            except s3.exceptions.NoSuchKey:
                continue
            if secret in body:
                found.append(key)
        return found

    task = mj.task(3, steps=400)
    digest = hashlib.sha256(b"s3cr3t").hexdigest()  # the script names the secret's hash, never the secret
    task.write_text(task.read_text().replace(
        "run: |\n", f"run: |\n  [ \"$(printf %s \"$MJ_TOKEN\" | sha256sum | cut -d' ' -f1)\" = {digest} ] || exit 55\n"))
    state_a = mj.state
    monkeypatch.setenv("MJ_TOKEN", "s3cr3t")
    job_id = int(json.loads(mj.gpuctl("jobs", "launch", str(task), "-d", "--secret", "MJ_TOKEN", "-o", "json")
                            .check().stdout)["job"]["id"])
    assert f"{prefix}/managed/jobs/{job_id}.json" in keys("managed/")
    assert not holding(b"s3cr3t")
    state_b = tmp_path / "runner-b"
    try:
        running = mj.wait_status(job_id, ("RUNNING",), 150)
        wait_for("every rank of attempt 1", lambda: len(mj.started(1)) == 3, 30)
        wait_for("a checkpoint", lambda: mj.step() >= 8, 60)
        cluster = mj.cluster(job_id)
        before = cluster.footprint()

        # runner A is gone: its supervisor killed, its state dir removed (the nodes' homes stay)
        kill_dead(running.supervisor_pid)
        for path in state_a.iterdir():
            if path.name != "clusters":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in (state_a / "clusters" / cluster.name).iterdir():
            if path.name != "nodes":
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        killed = kill_node(before.netns[0])  # the head: nothing answers for the job any more
        time.sleep(16)  # the lease's term

        # runner B lacks the secret: it says which, and takes nothing over
        monkeypatch.delenv("MJ_TOKEN")
        refused = run_gpuctl("jobs", "queue", state_dir=state_b).check()
        assert f"Managed job {job_id} (mjt) needs a supervisor" in refused.stderr, refused.describe()
        assert "MJ_TOKEN is not set in its environment" in refused.stderr
        assert not (state_b / "managed" / str(job_id) / "secrets.json").exists()
        monkeypatch.setenv("MJ_TOKEN", "s3cr3t")
        took = run_gpuctl("jobs", "queue", state_dir=state_b).check()
        assert f"Taking over managed job {job_id} (mjt): its supervisor on " in took.stderr, took.describe()
        assert "stopped renewing its lease" in took.stderr
        assert [r[:3] for r in queue_rows(took.stdout)] == [[str(job_id), "mjt", "RUNNING"]], took.stdout
        store_b = Store(state_b / "managed.db", remote=None)
        wait_for("every rank of attempt 2", lambda: len(mj.started(2)) == 3, 120)
        # runner B's supervisor dies too; a scheduled `jobs supervise` on runner C takes the job over once
        # the lease runs out, watches the attempt, and hands it back when its time is up
        # killed once the bucket's row, which runner C reads, says attempt 2 runs (B's own store says so a
        # moment before the row reaches the bucket: killed in between, the job is RECOVERING to C)
        kill_dead(wait_for("B's supervisor, RUNNING in the bucket", lambda: (row := bucket_row(job_id))
                           and row.get("status") == "RUNNING" and row.get("attempt") == 2
                           and (j := store_b.get(job_id)) and j.supervisor_pid == row.get("supervisor_pid")
                           and j.supervisor_pid, 60))
        state_c = tmp_path / "runner-c"
        handed = run_gpuctl("jobs", "supervise", "--for", "20s", "--poll", "2s", state_dir=state_c,
                            timeout=120).check()
        assert f"Taking over managed job {job_id} (mjt)" in handed.stderr, handed.describe()
        assert f"Managed job {job_id} (mjt): RUNNING, attempt 2" in handed.stdout, handed.describe()
        log_c = (state_c / "managed" / str(job_id) / "supervisor.log").read_text()
        assert "watching attempt 2 again" in log_c and "handing the job back" in log_c, log_c
        assert not (state_c / "managed" / str(job_id) / "secrets.json").exists()  # none kept once handed back
        assert len(mj.started(2)) == 3 and not mj.started(3)  # watched again, never restarted
        after = cluster.footprint()  # the nodes stay where runner A's Terraform put them
        assert after.sshd[1] == before.sshd[1] and after.sshd[2] == before.sshd[2]  # the others untouched
        assert after.sshd[0] != before.sshd[0]
        ids = {(e[3], e[4]) for e in mj.events() if e[0] == "start"}
        assert ids == {(running.task_id, running.task_id)}
        # runner B cancels: the same command takes the handed-back job over (at once: the lease was given
        # up), and its new supervisor, which never saw the cluster, removes all of it
        cancelled = run_gpuctl("jobs", "cancel", str(job_id), state_dir=state_b).check()
        assert "its last supervisor handed it back" in cancelled.stderr, cancelled.describe()
        assert f"Managed job {job_id} CANCELLED; cluster {cluster.name} removed" in cancelled.stdout
        final = store_b.get(job_id)
        assert final.status == "CANCELLED" and final.destroyed and final.recoveries == 1, final
        assert not (mj.ckpt / "dupes").exists(), (mj.ckpt / "dupes").read_text()
        [event] = final_events = store_b.events(job_id)
        assert event.resumed_at is not None and event.resumed_at - killed < 120, (final_events, killed)
        logs = run_gpuctl("jobs", "logs", str(job_id), "--no-follow", state_dir=state_b).stdout  # exit 1: cancelled
        assert "== attempt 2: after rank 0 lost (" in logs
        # nothing is left: the nodes, the cluster's and the job's objects but its row and logs, the secret
        assert not before.nodes_left() and not after.nodes_left(), before.nodes_left() + after.nodes_left()
        assert not (state_b / "clusters" / cluster.name).exists()
        left = keys()
        assert not [k for k in left if "/clusters/" in k or "/trees/" in k or k.endswith(("lease.json", "task.yaml"))]
        assert f"{prefix}/managed/jobs/{job_id}.json" in left
        assert not (state_b / "managed" / str(job_id) / "secrets.json").exists()
    finally:
        if not ((j := Store(state_b / "managed.db", remote=None).get(job_id)) and j.terminal):
            sys.stderr.write(run_gpuctl("jobs", "cancel", str(job_id), state_dir=state_b, timeout=300).describe())
    # runner A, back with a fresh state dir, sees the job's end
    queue_a = json.loads(mj.gpuctl("jobs", "queue", "-o", "json").check().stdout)["jobs"]
    assert [(j["id"], j["status"]) for j in queue_a] == [(job_id, "CANCELLED")]
    logs_a = mj.gpuctl("jobs", "logs", str(job_id), "--no-follow").stdout  # the attempts' output, from the bucket
    assert "== attempt 2: after rank 0 lost (" in logs_a and "attempt 2 resumes at step" in logs_a, logs_a
