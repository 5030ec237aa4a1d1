"""Autostop and autodown on local netns nodes, decided by the cluster itself.

A "minute" lasts one second here (GPUCTL_TEST_MINUTE_SECONDS, for tests only); the user-facing
unit stays minutes. Where a test must act before the countdown ends (log in, cancel), its minute
lasts SLOW_MINUTE_S, so a loaded CI runner still acts in time. Each test checks what a user relies on: the cluster goes by itself (nodes,
namespaces, links, processes), the controller's view says so, an ssh session or a cancel holds it,
and `apply --down` cannot leak a cluster when gpuctl is SIGKILLed mid-job.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from e2e import REPO, Cluster, Watched, gpuctl_env, needs_local_nodes, running, wait_for

pytestmark = [pytest.mark.integration, needs_local_nodes]

SLOW_MINUTE_S = 5  # two such minutes: the window to log in or cancel before the cluster goes


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GPUCTL_TEST_MINUTE_SECONDS", "1")
    c = Cluster(f"as-{uuid.uuid4().hex[:6]}", tmp_path / "state")
    yield c
    c.down_quietly()


def task_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "task.yaml"
    path.write_text(body)
    return path


def status_doc(c: Cluster) -> dict:
    res = c.gpuctl("status", c.name, "-o", "json")
    assert res.returncode == 0, res.describe()
    return json.loads(res.stdout)["clusters"][0]


def anchor_of(c: Cluster) -> int:
    env = dict(line.split("=", 1) for line in (c.cdir / "nodes" / "bridge.env").read_text().split())
    return int(env["LN_ANCHOR"])


def test_idle_cluster_runs_its_hook_and_removes_itself_and_apply_makes_it_again(
        cluster: Cluster, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCTL_TEST_MINUTE_SECONDS", str(SLOW_MINUTE_S))  # status reads it while it is up
    # where the hook, run by the nodes' login user, may write (pytest's own directories are root's)
    marks = Path(tempfile.mkdtemp(prefix="gpuctl-hook-", dir="/tmp"))
    marks.chmod(0o777)
    request.addfinalizer(lambda: shutil.rmtree(marks, ignore_errors=True))
    task = task_file(tmp_path, f"""
name: autodown
num_nodes: 2
resources:
  infra: local
  autostop:
    idle_minutes: 2
    down: true
    hook: echo "hooked on $(hostname)" > {marks}/hook; sleep 300
    hook_timeout: 2
run: echo hi
""")
    applied = cluster.gpuctl("apply", str(task), "-c", cluster.name, "-y").check()
    assert "autodown after 2 idle minute(s)" in applied.stdout
    fp, anchor = cluster.footprint(), anchor_of(cluster)
    fp.assert_present(2)
    doc = status_doc(cluster)
    assert doc["autostop"]["down"] is True and doc["autostop"]["idle_minutes"] == 2
    # idle time + hook_timeout + 60 s at most
    wait_for("the cluster to remove itself", lambda: status_doc(cluster)["status"] == "AUTODOWNED",
             timeout=2 * SLOW_MINUTE_S + 2 + 60)
    assert fp.nodes_left() == [] and not running(anchor)
    assert (marks / "hook").read_text().startswith("hooked on ")  # on the head, before it went
    doc = status_doc(cluster)
    assert doc["autodowned_at"] > 0 and "took itself down at" in cluster.gpuctl("status").stdout
    # issue 34.5: a command that needs the nodes says at once that they are gone, since when, and how
    # to bring them back (no ssh to a vanished head: exec's rsync error, health's "reboot", ssh's hang)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["autodowned_at"]))
    for argv in (["exec", cluster.name, "hostname"], ["check", cluster.name, "--health"], ["ssh", cluster.name],
                 ["cancel", cluster.name], ["autostop", cluster.name, "-i", "5"], ["inventory", cluster.name]):
        gone = cluster.gpuctl(*argv, timeout=30)
        assert gone.returncode == 2 and gone.duration < 5, (argv, gone.describe())
        assert gone.stderr.strip().splitlines() == [
            f"error: cluster '{cluster.name}' is gone: it took itself down (autodown) at {since}; `gpuctl apply` "
            f"brings it up again, `gpuctl down {cluster.name}` forgets it"], (argv, gone.describe())
    again = cluster.gpuctl("apply", str(task), "-c", cluster.name, "-y").check()
    assert "took itself down (autodown)" in again.stdout and "Job 2 succeeded" in again.stdout  # its history kept
    cluster.footprint().assert_present(2)
    # the controller's history: the life that ended by itself, then the new one; local nodes bill nothing
    report = json.loads(cluster.gpuctl("cost-report", "-o", "json").check().stdout)
    lives = [r for r in report["clusters"] if r["name"] == cluster.name]
    assert [r["status"] for r in lives] == ["AUTODOWNED", "UP"] and all(r["no_cloud_bill"] for r in lives)
    assert lives[0]["ended_at"] == doc["autodowned_at"]
    assert "no cloud bill" in cluster.gpuctl("status", cluster.name).check().stdout


@pytest.mark.parametrize("wait_for_ssh", ["jobs_and_ssh", "jobs"])
def test_an_ssh_session_holds_the_cluster_only_under_jobs_and_ssh(cluster: Cluster, tmp_path: Path,
                                                                  wait_for_ssh: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCTL_TEST_MINUTE_SECONDS", str(SLOW_MINUTE_S))
    task = task_file(tmp_path, f"""
num_nodes: 2
resources:
  infra: local
  autostop: {{idle_minutes: 2, down: true, wait_for: {wait_for_ssh}}}
run: "true"
""")
    cluster.gpuctl("apply", str(task), "-c", cluster.name, "-y").check()
    fp = cluster.footprint()
    worker_ns = fp.netns[1]
    # an interactive login on the worker, with a terminal, as `gpuctl ssh NAME worker1` gives one
    session = subprocess.Popen(["script", "-qfec", f"{sys.executable} -m gpuctl ssh {cluster.name} worker1",
                                "/dev/null"], cwd=REPO, env=gpuctl_env(cluster.state_dir), stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        def logged_in() -> bool:
            pids = subprocess.run(["ip", "netns", "pids", worker_ns], capture_output=True, text=True).stdout.split()
            titles = []
            for pid in pids:
                try:
                    titles.append(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0])
                except OSError:
                    pass
            return any(b"@pts/" in t for t in titles)

        wait_for("the terminal session on worker1", logged_in, timeout=2 * SLOW_MINUTE_S)
        if wait_for_ssh == "jobs":
            wait_for("the cluster to remove itself", lambda: status_doc(cluster)["status"] == "AUTODOWNED",
                     timeout=2 * SLOW_MINUTE_S + 60)
            assert fp.nodes_left() == []
            return
        time.sleep(2 * SLOW_MINUTE_S + 2)  # the two idle minutes have run out since the login
        doc = status_doc(cluster)
        assert doc["status"] == "UP" and fp.nodes_left() != [], doc
        logged_out_at = time.time()
        session.stdin.write(b"exit\n")
        session.stdin.close()
        session.wait(timeout=20)
        try:
            wait_for("the cluster to remove itself once the session ended",
                     lambda: status_doc(cluster)["status"] == "AUTODOWNED", timeout=60)
        except BaseException:  # what the head's watcher logged (kept beside its word) and what still runs
            for kept in sorted(p for p in (cluster.cdir / "nodes").glob("autodown*") if p.is_file()):
                print(kept, kept.read_text(), sep="\n")
            print(subprocess.run(["ps", "-eo", "pid,ppid,stat,etime,args"], capture_output=True, text=True).stdout)
            raise
        assert fp.nodes_left() == []
        began = float((cluster.cdir / "nodes" / "autodown").read_text().split()[0])
        kept_log = cluster.cdir / "nodes" / "autodown.log"
        assert began >= int(logged_out_at), f"the cluster went while the session was open:\n{kept_log.read_text()}"
    finally:
        if session.poll() is None:
            os.killpg(session.pid, signal.SIGKILL)
            session.wait()


def test_cancel_stops_the_countdown_and_autostop_sets_it_again(cluster: Cluster, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    task = task_file(tmp_path, "num_nodes: 1\nresources:\n  infra: local\nrun: 'true'\n")
    monkeypatch.setenv("GPUCTL_TEST_MINUTE_SECONDS", str(SLOW_MINUTE_S))
    cluster.gpuctl("apply", str(task), "-c", cluster.name, "-y", "-i", "2", "--down").check()
    idle_from = time.monotonic()
    cancelled = cluster.gpuctl("autostop", cluster.name, "--cancel").check()
    assert "autostop cancelled" in cancelled.stdout
    time.sleep(max(0.0, idle_from + 2 * SLOW_MINUTE_S + 2 - time.monotonic()))  # past the countdown
    doc = status_doc(cluster)
    assert doc["status"] == "UP" and doc["autostop"] is None
    monkeypatch.setenv("GPUCTL_TEST_MINUTE_SECONDS", "1")
    res = cluster.gpuctl("autostop", cluster.name, "-i", "1", "--down", "-o", "json").check()
    answer = json.loads(res.stdout)
    assert answer["autostop"]["idle_minutes"] == 1 and answer["head"]["set"] is True
    wait_for("the cluster to remove itself", lambda: status_doc(cluster)["status"] == "AUTODOWNED", timeout=60)
    refused = cluster.gpuctl("autostop", cluster.name, "--cancel", "--down")
    assert refused.returncode == 2 and "--cancel turns autostop off" in refused.stderr


def test_apply_down_removes_the_cluster_when_the_job_ends_even_if_gpuctl_is_killed(cluster: Cluster,
                                                                                   tmp_path: Path) -> None:
    quick = task_file(tmp_path, "num_nodes: 2\nresources:\n  infra: local\nrun: echo done\n")
    res = cluster.gpuctl("apply", str(quick), "-c", cluster.name, "--down", "-y", "-o", "json").check()
    assert "Job 1 succeeded" in res.stderr and f"Cluster '{cluster.name}' is gone." in res.stderr
    assert not cluster.cdir.exists()
    doc = json.loads(res.stdout)  # issue 34.7: the document tells what is true once it is printed
    assert doc["ok"] is True and doc["status"] == "DOWN" and doc["autostop"] is None, doc
    assert doc["job"]["status"] == "SUCCEEDED" and len(doc["nodes"]) == 2

    slow = task_file(tmp_path, "num_nodes: 2\nresources:\n  infra: local\nrun: sleep 6\n")
    watched = Watched([sys.executable, "-m", "gpuctl", "apply", str(slow), "-c", cluster.name, "--down", "-y",
                       "--lease", "3"], gpuctl_env(cluster.state_dir), lambda line: "running (" in line)
    try:
        assert watched.seen.wait(120), watched.text
        fp = cluster.footprint()
        os.killpg(watched.proc.pid, signal.SIGKILL)  # the CI runner dies mid-job
        watched.proc.wait()
        killed = time.monotonic()
        wait_for("the cluster to remove itself", lambda: status_doc(cluster)["status"] == "AUTODOWNED",
                 timeout=6 + 3 + 60)
        assert time.monotonic() - killed >= 3  # the job ran to its end first
        assert fp.nodes_left() == []
        # both lives are in the history: the one this gpuctl took down, the one that went by itself
        report = json.loads(cluster.gpuctl("cost-report", "-o", "json").check().stdout)
        assert [r["status"] for r in report["clusters"] if r["name"] == cluster.name] == ["DOWN", "AUTODOWNED"]
    finally:
        watched.close()
