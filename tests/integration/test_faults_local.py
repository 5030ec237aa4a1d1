"""Faults a cluster must survive (issue 8), on real local nodes through the real
`gpuctl` command:

- two `gpuctl apply` of one cluster at the same moment: the second waits for
  the cluster's lock (saying so) and Terraform never runs twice at once;
- a worker dies mid-run (its sshd and every process in it killed): gpuctl
  names the lost rank, stops the others, exits non-zero, `queue` says FAILED;
- the controller's gpuctl is SIGKILLed mid-job: the head still fails fast,
  and a later `queue` / `logs` show the true outcome and the output;
- the head's coordinator or a worker's relay is SIGKILLed: no rank and no
  secrets file of the job is left on any node; with the head's whole agent
  killed, the watcher or `queue` stops its rank there, and `cancel` of a job
  recorded as ended still stops what is left of it;
- two controllers (state dirs) on the same nodes both have a job N: neither
  touches, shows or cancels the other's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from e2e import (REPO, Cluster, gpuctl_env, needs_local_nodes, pids_matching, queue_row_once_ended, queue_rows,
                 wait_for)

pytestmark = [pytest.mark.integration, needs_local_nodes]

NAME = "flt3"
MOD = f"ft{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def ft(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("faults")
    (root / "c.yaml").write_text(f"name: {NAME}\nnum_nodes: 3\nresources:\n  infra: local\nrun: echo up\n")
    shim = root / "shim"
    shim.mkdir()
    log = root / "terraform.log"
    real = subprocess.run(["bash", "-c", "command -v terraform"], capture_output=True, text=True).stdout.strip()
    # Records when each terraform command ran: two on one state must never overlap. While `hold`
    # exists, a command waits before it starts, so a test can keep one apply inside the lock.
    hold = root / "hold"
    (shim / "terraform").write_text(f'#!/bin/bash\necho "start $(date +%s.%N) $$ $1" >> {log}\n'
                                    f'for _ in $(seq 600); do [ -e {hold} ] || break; sleep 0.1; done\n'
                                    f'{real} "$@"; rc=$?\necho "end $(date +%s.%N) $$ $1" >> {log}\nexit $rc\n')
    (shim / "terraform").chmod(0o755)
    cluster = Cluster(NAME, root / "state")
    try:
        cluster.gpuctl("apply", str(root / "c.yaml")).check()
        yield cluster, root, shim, log
    finally:
        for other in ("fltint", "fltdead"):  # the clusters of single tests, should one fail midway
            Cluster(other, cluster.state_dir).down_quietly()
        cluster.down_quietly()
        for pid in pids_matching(MOD):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_two_applies_at_once_take_turns(ft):
    cluster, root, shim, log = ft
    env_path = f"{shim}:{os.environ['PATH']}"
    old = os.environ["PATH"]
    os.environ["PATH"] = env_path
    hold = root / "hold"
    hold.touch()
    try:
        # The first apply holds the lock inside terraform until the second is seen blocked on it:
        # two processes started together may otherwise simply not meet on a loaded machine.
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(cluster.gpuctl, "apply", str(root / "c.yaml"))
            wait_for("the first apply's terraform", lambda: log.exists() and "start" in log.read_text(), 120)
            second = pool.submit(cluster.gpuctl, "apply", str(root / "c.yaml"))
            lock = cluster.state_dir / "locks" / f"{NAME}.lock"
            wait_for("the second apply waiting on the cluster's lock", lambda: flock_waiters(lock) > 0, 120)
            hold.unlink()
            results = [first.result(), second.result()]
    finally:
        hold.unlink(missing_ok=True)
        os.environ["PATH"] = old
    for res in results:
        res.check()
    assert sum("Waiting for another gpuctl" in r.stdout for r in results) == 1, [r.stdout for r in results]
    spans: dict[str, list[float]] = {}
    for line in log.read_text().splitlines():
        kind, ts, pid, _ = (line.split() + [""])[:4]
        spans.setdefault(pid, []).append(float(ts))
    intervals = sorted((s[0], s[-1]) for s in spans.values())
    for (_, end), (start, _) in zip(intervals, intervals[1:]):
        assert start >= end, f"two terraform commands overlapped: {intervals}"
    status = cluster.gpuctl("status", NAME).check()
    assert status.stdout.splitlines()[0] == f"{NAME}: UP, 3 node(s) on local"
    assert len(cluster.footprint().sshd) == 3


def flock_waiters(path: Path) -> int:
    """How many processes are blocked in flock on `path` (/proc/locks lists each waiter with '->')."""
    inode = os.stat(path).st_ino
    return sum(1 for line in Path("/proc/locks").read_text().splitlines()
               if "->" in line and line.split()[-3].rsplit(":", 1)[-1] == str(inode))


def netns_of(cluster: Cluster, rank: int) -> str:
    return cluster.node_env(cluster.nodes()[rank])["LN_NETNS"]


def test_a_worker_dying_mid_run_is_named_and_the_others_stop(ft):
    cluster, root, _, _ = ft
    marker = f"{MOD}-dies"
    env = {**gpuctl_env(cluster.state_dir), "FT_SCRIPT": f'echo "rank $GPUCTL_NODE_RANK up"; (exec -a {marker} sleep 120)'}
    proc = subprocess.Popen([sys.executable, "-m", "gpuctl", "exec", NAME, "--env", "FT_SCRIPT", "--", "bash", "-c",
                             'eval "$FT_SCRIPT"'],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(pids_matching(marker)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(pids_matching(marker)) == 3, "the ranks did not start"
    ns = netns_of(cluster, 2)
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    killed_at = time.monotonic()
    for pid in pids:  # the machine dies: its sshd and everything running in it
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - killed_at
    assert proc.returncode == 1, out + err
    assert took < 30, took
    assert re.search(r"rank 2 \(worker2, [0-9.]+\) was lost first", err), out + err
    assert not pids_matching(marker), "the other ranks kept running"
    rows = queue_rows(cluster.gpuctl("queue", NAME).check().stdout)
    assert rows[-1][2] == "FAILED", rows
    # the node is gone for good: bring the cluster back for the next test
    cluster.gpuctl("down", NAME).check()
    cluster.gpuctl("apply", str(root / "c.yaml")).check()


def test_controller_killed_mid_job_leaves_the_head_in_charge(ft):
    cluster, _, _, _ = ft
    marker = f"{MOD}-orphan"
    script = (f'echo "rank $GPUCTL_NODE_RANK starts"; if [ "$GPUCTL_NODE_RANK" == "1" ]; then sleep 4; '
              f'echo "rank 1 fails"; exit 6; fi; (exec -a {marker} sleep 120)')
    env = {**gpuctl_env(cluster.state_dir), "FT_SCRIPT": script}
    proc = subprocess.Popen([sys.executable, "-m", "gpuctl", "exec", NAME, "--env", "FT_SCRIPT", "--", "bash", "-c",
                             'eval "$FT_SCRIPT"'],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while len(pids_matching(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # gpuctl and its ssh: the controller is gone
    proc.wait()
    deadline = time.monotonic() + 30
    while pids_matching(marker) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not pids_matching(marker), "nobody failed fast without the controller"
    last = queue_row_once_ended(lambda: cluster.gpuctl("queue", NAME))
    assert last[2] == "FAILED" and last[-1].split(",")[1] == "6", last
    logs = cluster.gpuctl("logs", NAME, last[0]).stdout.splitlines()
    assert "(worker1, rank=1) rank 1 fails" in logs, logs
    assert "(head, rank=0) rank 0 starts" in logs, logs


def test_sigint_during_terraform_apply_then_reapply_converges_and_down_leaves_nothing(ft):
    cluster, root, _, _ = ft
    other = Cluster("fltint", cluster.state_dir)
    task = root / "int.yaml"
    task.write_text("name: fltint\nnum_nodes: 4\nresources:\n  infra: local\nrun: echo up\n")
    proc = subprocess.Popen([sys.executable, "-m", "gpuctl", "apply", str(task)], cwd=REPO,
                            env=gpuctl_env(cluster.state_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("terraform apply:"):
            time.sleep(0.3)  # inside terraform's apply: some nodes made, some not
            os.killpg(proc.pid, signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=180)
    assert proc.returncode != 0, "".join(seen) + rest
    assert "Traceback" not in "".join(seen) + rest
    again = other.gpuctl("apply", str(task)).check()  # converges on the same cluster
    assert "(head, rank=0) up" in again.stdout and "(worker3, rank=3) up" in again.stdout
    footprint = other.footprint()
    footprint.assert_present(4)
    other.gpuctl("down", "fltint").check()
    footprint.assert_gone()


def test_a_node_that_never_answers_is_named_within_the_wait_bound(ft):
    cluster, root, _, _ = ft
    other = Cluster("fltdead", cluster.state_dir)
    task = root / "dead.yaml"
    task.write_text("name: fltdead\nnum_nodes: 3\nresources:\n  infra: local\nrun: echo up\n")
    other.gpuctl("apply", str(task), "--provision-only").check()
    footprint = other.footprint()
    dead = other.nodes()[2]
    pid = int((Path(other.node_env(dead)["LN_DIR"]) / "sshd.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)  # its sshd is gone: the node never accepts a connection
    started = time.monotonic()
    old = os.environ.get("GPUCTL_WAIT_TIMEOUT")
    os.environ["GPUCTL_WAIT_TIMEOUT"] = "15"
    try:
        res = other.gpuctl("exec", "fltdead", "--", "true", timeout=240)
    finally:
        if old is None:
            os.environ.pop("GPUCTL_WAIT_TIMEOUT", None)
        else:
            os.environ["GPUCTL_WAIT_TIMEOUT"] = old
    took = time.monotonic() - started
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.describe()
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "worker2" in errors[0], res.describe()
    assert took < 90, took
    other.gpuctl("down", "fltdead").check()
    footprint.assert_gone()


def test_full_disk_while_logs_are_saved_keeps_the_outcome(ft, tmp_path: Path):
    """The controller's disk fills while a job's logs are saved (a 1 MB tmpfs where they go):
    one clear line, the job runs to its end, its outcome is recorded, nothing is corrupted,
    and `gpuctl logs` reads the whole output from the head."""
    cluster, _, _, _ = ft
    jobs_dir = cluster.state_dir / "logs" / NAME  # where the cluster's job logs are kept
    jobs_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(jobs_dir)], check=True)
    try:
        script = 'for i in $(seq 1 20000); do echo "line $i of a job whose logs no longer fit"; done'
        res = cluster.gpuctl("exec", NAME, "--env", f"FT_SCRIPT={script}", "--", "bash", "-c", 'eval "$FT_SCRIPT"',
                             timeout=240)
        assert "Traceback" not in res.stderr, res.describe()
        errors = [line for line in res.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and "cannot save job" in errors[0] and "No space left on device" in errors[0], \
            res.describe()
        assert res.returncode == 0, res.describe()  # the job itself succeeded
    finally:
        subprocess.run(["umount", "-l", str(jobs_dir)], check=False)
    job = re.search(r"^Job (\d+) running", res.stdout, re.M)
    assert job, res.describe()
    rows = queue_rows(cluster.gpuctl("queue", NAME).check().stdout)
    mine = next(row for row in rows if row[0] == job.group(1))
    assert mine[2] == "SUCCEEDED", rows
    check = subprocess.run([sys.executable, "-c", "import sqlite3,sys; print(sqlite3.connect(sys.argv[1])"
                            ".execute('pragma integrity_check').fetchone()[0])", str(cluster.state_dir / "state.db")],
                           capture_output=True, text=True)
    assert check.stdout.strip() == "ok", check
    logs = cluster.gpuctl("logs", NAME, job.group(1)).check().stdout.splitlines()
    for rank, name in enumerate(("head", "worker1", "worker2")):
        assert f"({name}, rank={rank}) line 20000 of a job whose logs no longer fit" in logs


# -- nothing of a job outlives whoever answers for it (issue 20, item 1) ---------------------


def _detached_sleeper(cluster: Cluster, marker: str, secret: str) -> tuple[int, str]:
    """A detached job whose every rank runs a `sleep` named `marker` (a grandchild of the stage, as
    a launcher's workers are), with a secret; (job id, its name on the nodes) once all run."""
    script = f'echo "rank $GPUCTL_NODE_RANK up"; (exec -a {marker} sleep 300); echo survived'
    res = cluster.gpuctl("exec", NAME, "-d", "--secret", f"FT_TOKEN={secret}", "--env", f"FT_SCRIPT={script}",
                         "--", "bash", "-c", 'eval "$FT_SCRIPT"').check()
    m = re.search(r"^Job (\d+) detached", res.stdout, re.M)
    assert m, res.describe()
    wait_for("every rank to start", lambda: len(pids_matching(marker)) == 3, 60)
    return int(m.group(1)), cluster.node_job(m.group(1))


def _owner_pid(cluster: Cluster, rank: int, node_job: str) -> int:
    """The process that answers for the job on the node: the head's coordinator, a worker's relay
    (a stage's supervisor is a fork of it, with its command line: told apart by its recorded pid)."""
    node = cluster.nodes()[rank]
    if rank == 0:
        return int(cluster.read(node, f"~/.gpuctl/jobs/{node_job}/events.supervisor"))
    supervisor = int(cluster.read(node, f"~/.gpuctl/jobs/{node_job}/run.supervisor"))
    found = []
    for pid in subprocess.run(["ip", "netns", "pids", netns_of(cluster, rank)], capture_output=True,
                              text=True).stdout.split():
        try:
            if b"gpuctl-node\0relay" in Path(f"/proc/{pid}/cmdline").read_bytes() and int(pid) != supervisor:
                found.append(int(pid))
        except OSError:
            continue
    assert len(found) == 1, (rank, found)
    return found[0]


def _secrets_left(cluster: Cluster, node_job: str) -> list[str]:
    return [n.name for n in cluster.nodes() if cluster.exists_on(n, f"~/.gpuctl/jobs/{node_job}/secrets.sh")]


@pytest.mark.parametrize("victim", ["the head's coordinator", "a worker's relay"])
def test_a_killed_owner_leaves_no_rank_and_no_secret_on_any_node(ft, victim: str):
    cluster, _, _, _ = ft
    marker = f"{MOD}-owner{victim.split()[-1]}"
    job, node_job = _detached_sleeper(cluster, marker, f"s3cr3t-{uuid.uuid4().hex}")
    assert len(_secrets_left(cluster, node_job)) == 3  # there while the ranks run
    os.kill(_owner_pid(cluster, 0 if "coordinator" in victim else 1, node_job), signal.SIGKILL)
    try:
        wait_for("every rank of the job to be stopped", lambda: not pids_matching(marker), 20)
        wait_for("the job's secrets to leave every node", lambda: not _secrets_left(cluster, node_job), 10)
        row = queue_row_once_ended(lambda: cluster.gpuctl("queue", NAME), job)
        assert row[2] == "FAILED", row
    finally:
        cluster.gpuctl("cancel", NAME, str(job))


def _kill_heads_agent(cluster: Cluster, node_job: str) -> None:
    """SIGKILL the job's coordinator and its rank's supervisor on the head at once: nothing there
    watches rank 0 any more (the workers' relays still stop their ranks)."""
    supervisor = int(cluster.read(cluster.nodes()[0], f"~/.gpuctl/jobs/{node_job}/run.supervisor"))
    coordinator = _owner_pid(cluster, 0, node_job)
    os.kill(supervisor, signal.SIGKILL)
    os.kill(coordinator, signal.SIGKILL)


def test_the_watcher_stops_what_the_heads_killed_agent_left(ft):
    cluster, _, _, _ = ft
    marker = f"{MOD}-watched"
    job, node_job = _detached_sleeper(cluster, marker, f"s3cr3t-{uuid.uuid4().hex}")
    _kill_heads_agent(cluster, node_job)
    try:
        wait_for("the watcher to stop rank 0", lambda: not pids_matching(marker), 30)
        assert not _secrets_left(cluster, node_job)
        row = queue_row_once_ended(lambda: cluster.gpuctl("queue", NAME), job)
        assert row[2] == "FAILED", row
    finally:
        for pid in pids_matching(marker):
            os.kill(pid, signal.SIGKILL)


def _without_watcher(cluster: Cluster, job: int) -> None:
    """Kill the detached job's watcher here: nobody on the controller follows the job any more."""
    watcher = f"_watch\0{NAME}\0{job}\0"
    for pid in pids_matching(watcher):
        os.kill(pid, signal.SIGKILL)
    wait_for("the watcher to be gone", lambda: not pids_matching(watcher), 10)


def test_queue_stops_what_the_heads_killed_agent_left(ft):
    """The head's whole agent and the job's watcher killed: the `queue` that finds the
    coordinator gone stops rank 0 before it records the job as ended."""
    cluster, _, _, _ = ft
    marker = f"{MOD}-queued"
    job, node_job = _detached_sleeper(cluster, marker, f"s3cr3t-{uuid.uuid4().hex}")
    _without_watcher(cluster, job)
    _kill_heads_agent(cluster, node_job)
    try:
        row = queue_row_once_ended(lambda: cluster.gpuctl("queue", NAME), job)
        assert row[2] == "FAILED", row
        wait_for("rank 0 to be stopped", lambda: not pids_matching(marker), 10)
        assert not _secrets_left(cluster, node_job)
    finally:
        for pid in pids_matching(marker):
            os.kill(pid, signal.SIGKILL)


def test_cancel_stops_what_is_left_of_a_job_recorded_as_ended(ft):
    """A job recorded FAILED while its rank 0 still runs (as an older gpuctl's watcher recorded
    it, 3 s after the head's coordinator was killed): `cancel` of it still stops the rank, and
    says so; a second `cancel` finds nothing."""
    cluster, _, _, _ = ft
    marker = f"{MOD}-leftover"
    job, node_job = _detached_sleeper(cluster, marker, f"s3cr3t-{uuid.uuid4().hex}")
    _without_watcher(cluster, job)
    _kill_heads_agent(cluster, node_job)
    with sqlite3.connect(cluster.state_dir / "state.db") as db:
        db.execute("UPDATE jobs SET status='FAILED' WHERE cluster=? AND job_id=?", (NAME, job))
    try:
        wait_for("the workers' ranks to be stopped by their relays", lambda: len(pids_matching(marker)) == 1, 20)
        res = cluster.gpuctl("cancel", NAME, str(job)).check()
        assert res.stdout.splitlines() == [
            f"Job {job} already ended: FAILED; stopped what still ran of it on head (rank 0)"], res.describe()
        wait_for("rank 0 to be stopped", lambda: not pids_matching(marker), 10)
        assert not _secrets_left(cluster, node_job)
        again = cluster.gpuctl("cancel", NAME, str(job)).check()
        assert again.stdout.splitlines() == [
            f"Job {job} already ended: FAILED; nothing of it was running on its nodes"], again.describe()
    finally:
        for pid in pids_matching(marker):
            os.kill(pid, signal.SIGKILL)


# -- two controllers on the same nodes (issue 20, item 8) -------------------------------------


def _second_controller(cluster: Cluster, root: Path) -> Cluster:
    """Another gpuctl state dir for the same nodes, its registry at the same job id: a second
    controller (a colleague's laptop) that has run as many jobs there."""
    other = root / f"state-{uuid.uuid4().hex[:6]}"
    shutil.copytree(cluster.cdir, other / "clusters" / NAME, symlinks=True,
                    ignore=shutil.ignore_patterns("cm", "jobs", "*.lock", "*.sock"))
    with sqlite3.connect(cluster.state_dir / "state.db") as src, sqlite3.connect(other / "state.db") as dst:
        src.backup(dst)
    return Cluster(NAME, other)


def _queue_status(cluster: Cluster, job: int) -> str:
    return next(r[2] for r in queue_rows(cluster.gpuctl("queue", NAME).check().stdout) if r[0] == str(job))


def test_two_controllers_on_the_same_nodes_never_touch_each_others_job(ft):
    cluster, root, _, _ = ft
    other = _second_controller(cluster, root)
    mine, theirs = f"{MOD}-mine", f"{MOD}-theirs"
    try:
        job, node_job = _detached_sleeper(cluster, mine, "a")
        their_job, their_node_job = _detached_sleeper(other, theirs, "b")
        assert job == their_job  # the same id on both controllers
        assert len(pids_matching(mine)) == 3, "the other controller's submit touched this job"
        assert _queue_status(cluster, job) == _queue_status(other, job) == "RUNNING"
        res = cluster.gpuctl("cancel", NAME, str(job)).check()
        assert res.stdout.splitlines() == [f"Job {job} cancelled on 3 node(s)."], res.describe()
        wait_for("this controller's job to stop", lambda: not pids_matching(mine), 15)
        assert len(pids_matching(theirs)) == 3, "cancelling a job stopped the other controller's job"
        assert _queue_status(other, job) == "RUNNING" and _queue_status(cluster, job) == "CANCELLED"
        assert node_job != their_node_job
        for node in cluster.nodes():  # both jobs' directories are there, each its own
            assert [cluster.exists_on(node, f"~/.gpuctl/jobs/{d}/run.log") for d in (node_job, their_node_job)] \
                == [True, True], node.name
    finally:
        other.gpuctl("cancel", NAME, "--all")
        for pid in pids_matching(mine) + pids_matching(theirs):
            os.kill(pid, signal.SIGKILL)
