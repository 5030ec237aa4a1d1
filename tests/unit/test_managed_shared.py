"""Managed jobs in the shared state bucket without nodes (moto in-process stands in for S3): ids
no two runners share, the supervisor's lease and its takeover, the kept task and trees between
runners, secrets that never reach the bucket, and the CLI's refusals."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

import gpuctlfork
import pytest

from gpuctl.managed import freeze, launch, shared
from gpuctl.managed.store import Store, job_dir
from gpuctl.state.remotestate import Remote

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def remote(state_bucket: Remote) -> Remote:
    return state_bucket


def as_runner(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    monkeypatch.setenv("GPUCTL_STATE_DIR", str(root))


def new_job(store: Store, tmp_path: Path, name: str = "train") -> object:
    task = tmp_path / f"{name}.yaml"
    task.write_text("num_nodes: 2\nresources: {infra: local}\nrun: echo hi\n")
    return launch.create(name=name, file=task, text=task.read_text(), envs={}, secrets={"WANDB_API_KEY": "k3y"},
                         infra=None, num_nodes=None, store=store)


def test_two_runners_never_get_the_same_id_and_each_lists_both(remote: Remote, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ids = []
    for runner in ("a", "b", "a", "b"):
        as_runner(monkeypatch, tmp_path / runner)
        ids.append(new_job(Store(remote=remote), tmp_path).id)
    assert ids == [1, 2, 3, 4]
    for runner in ("a", "b"):
        as_runner(monkeypatch, tmp_path / runner)
        store = Store(remote=remote)
        store.pull()
        jobs = store.all()
        assert [j.id for j in jobs] == ids and len({j.cluster for j in jobs}) == 4
        assert len({j.task_id for j in jobs}) == 4
    # the secret's value never reaches the bucket: only its name, in the job's row
    store = remote.store
    for key in store.list(store.key("managed") + "/"):
        assert b"k3y" not in store.get(key)
    row = shared.get_row(store, 1)
    assert row is not None and row["job"]["launch"]["secrets"] == ["WANDB_API_KEY"]


def test_the_lease_goes_to_one_runner_and_a_run_out_one_is_taken_over(remote: Remote, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    as_runner(monkeypatch, tmp_path / "a")
    a = shared.Lease(remote.store, 7, pid=os.getpid(), start="a")
    # a short term, as GPUCTL_MANAGED_LEASE_S would give a runner; the store's clock counts whole
    # seconds, so a term under 3 s could run out between two lines on a loaded machine
    a.term = 3.0
    assert a.acquire(lambda view: view.expired) is None and a.held() is False  # its margin exceeds the term
    a._stop.set()  # A's supervisor dies: nothing renews its lease any more
    a._thread.join()
    as_runner(monkeypatch, tmp_path / "b")
    b = shared.Lease(remote.store, 7, pid=os.getpid(), start="b")
    held = b.acquire(lambda view: view.expired)
    assert held is not None and held.runner == a.me["id"] and "supervisor pid" in held.text()
    deadline = time.monotonic() + 30
    while not shared.read_lease(remote.store, 7).expired and time.monotonic() < deadline:
        time.sleep(0.25)
    assert b.acquire(lambda view: view.expired) is None  # run out: taken with If-Match on what A wrote
    assert a.renew() is False and a.lost_to is not None and b.me["who"] in a.lost_to
    with pytest.raises(shared.LeaseLost, match="taken over by"):
        a.check()
    a.release()  # gives up nothing it no longer holds
    assert shared.read_lease(remote.store, 7).runner == b.me["id"]
    b.release()
    assert shared.read_lease(remote.store, 7) is None


def test_a_supervisor_that_lost_its_lease_writes_no_row(remote: Remote, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(remote=remote)
    job = new_job(store, tmp_path)
    lease = shared.Lease(remote.store, job.id, pid=os.getpid(), start="x")
    lease.lost_to = "ci@runner-9 (supervisor pid 4711)"
    store.lease = lease
    with pytest.raises(shared.LeaseLost, match="runner-9"):
        store.set_status(job.id, "RUNNING")
    assert shared.get_row(remote.store, job.id)["job"]["status"] == "PENDING"


def test_a_taking_runner_gets_the_kept_task_and_files_and_its_own_secrets(remote: Remote, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "project"
    (work / "src").mkdir(parents=True)
    (work / "src" / "train.py").write_text("print('v1')\n")
    (work / "run.sh").write_text("#!/bin/sh\n")
    (work / "run.sh").chmod(0o755)
    (tmp_path / "data.txt").write_text("kept\n")
    task = work / "task.yaml"
    task.write_text("num_nodes: 1\nresources: {infra: local}\nworkdir: .\nfile_mounts:\n  /data/d.txt: ../data.txt\n"
                    "run: python src/train.py\n")
    as_runner(monkeypatch, tmp_path / "a")
    store_a = Store(remote=remote)
    job = launch.create(name="t", file=task, text=task.read_text(), envs={}, secrets={"HF_TOKEN": "x"},
                        infra=None, num_nodes=None, store=store_a)
    (work / "src" / "train.py").write_text("print('edited after launch')\n")

    as_runner(monkeypatch, tmp_path / "b")
    store_b = Store(remote=remote)
    store_b.pull()
    theirs = store_b.get(job.id)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    problem = launch.take_over(store_b, theirs)
    assert problem is not None and problem.startswith("HF_TOKEN is not set in its environment")
    monkeypatch.setenv("HF_TOKEN", "from-b")
    assert launch.take_over(store_b, theirs) is None
    secrets = job_dir(job.id) / "secrets.json"
    assert json.loads(secrets.read_text()) == {"HF_TOKEN": "from-b"} and stat.S_IMODE(secrets.stat().st_mode) == 0o600
    kept = freeze.frozen_task(theirs)
    assert kept is not None and str(tmp_path / "b") in kept.read_text() and str(tmp_path / "a") not in kept.read_text()
    trees = freeze.trees_root()
    [workdir] = [p for p in trees.iterdir() if (p / "src").is_dir()]
    assert (workdir / "src" / "train.py").read_text() == "print('v1')\n"  # as launched, not as edited
    assert os.access(workdir / "run.sh", os.X_OK)
    assert any((p / "data.txt").read_text() == "kept\n" for p in trees.iterdir() if (p / "data.txt").exists())

    # the job's end leaves its row (and logs) but not its task, trees or lease
    store_b.set_status(job.id, "CANCELLED")
    freeze.release(store_b.get(job.id), store_b)
    left = remote.store.list(remote.store.key("managed") + "/")
    assert [k.split("ci/gpuctl/", 1)[1] for k in left] == [f"managed/jobs/{job.id}.json"]


def test_a_tree_damaged_or_missing_in_the_bucket_is_named(remote: Remote, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "w"
    work.mkdir()
    (work / "a.py").write_text("1\n")
    task = work / "task.yaml"
    task.write_text("num_nodes: 1\nresources: {infra: local}\nworkdir: .\nrun: true\n")
    job = launch.create(name="t", file=task, text=task.read_text(), envs={}, secrets={}, infra=None, num_nodes=None,
                        store=Store(remote=remote))
    [key] = remote.store.list(remote.store.key("managed", "trees") + "/")
    remote.store.put(key, b"not a tar archive")
    as_runner(monkeypatch, tmp_path / "b")
    store_b = Store(remote=remote)
    store_b.pull()
    problem = launch.take_over(store_b, store_b.get(job.id))
    assert problem is not None and "its kept files in the state bucket are damaged (managed/trees/" in problem
    remote.store.delete(key)
    problem = launch.take_over(store_b, store_b.get(job.id))
    assert problem is not None and "its kept files are not in the state bucket (managed/trees/" in problem
    # a row that names a tree outside the trees (a damaged or hostile bucket) writes nothing there
    row = shared.get_row(remote.store, job.id)
    row["job"]["launch"]["frozen"]["trees"] = ["../../escaped"]
    shared.put_row(remote.store, row["job"], row["events"], row["runner"])
    store_b.pull()
    problem = launch.take_over(store_b, store_b.get(job.id))
    assert problem is not None and "'../../escaped' is no sha256" in problem


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return gpuctlfork.run([*args], env=env,
                          cwd=REPO, timeout=120)


@pytest.mark.parametrize("args, words", [
    (["jobs", "supervise", "--for", "9m"], "jobs supervise: managed jobs are this machine's without shared state"),
    (["jobs", "supervise", "--for", "soon"], "--for 'soon': give a duration such as 540s, 9m or 1h"),
    (["jobs", "supervise", "--for", "9m", "--poll", "-1"], "--poll '-1': give a duration"),
])
def test_supervise_refusals_are_one_line_with_exit_2(args: list[str], words: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_STATE_")}
    env["GPUCTL_STATE_DIR"] = str(tmp_path / "state")
    res = cli(*args, env=env)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().count("\n") == 0 and words in res.stderr and "Traceback" not in res.stderr


def test_a_cancel_from_any_runner_reaches_the_lease_holder(remote: Remote, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    lease = shared.Lease(remote.store, 5, pid=os.getpid(), start="x")
    lease.term = 1.0  # its thread looks every sixth of the term (0.5 s at least)
    assert lease.acquire(lambda view: False) is None
    try:
        time.sleep(0.7)
        assert lease.cancelled is False
        as_runner(monkeypatch, tmp_path / "other")
        Store(remote=remote).request_cancel(5)
        deadline = time.monotonic() + 5
        while not lease.cancelled and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lease.cancelled
    finally:
        lease.release()


def test_kept_logs_follow_their_newest_writer_and_a_stale_copy_never_undoes_them(
        remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runner B's supervisor died mid-attempt with a short copy it never kept; runner C watched the
    attempt again and kept its whole output. B's next look (or its next supervisor) takes C's copy in
    place of its own, so B keeping its logs again cannot undo C's; a copy the bucket has nothing newer
    for stays, and the supervisor's log keeps B's own lines the bucket lacks."""
    store = remote.store

    def log_of(root: Path, k: int) -> Path:
        path = root / f"attempt-{k}.log" if k else root / "supervisor.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    b, c = tmp_path / "b", tmp_path / "c"
    log_of(b, 1).write_text("attempt 1 whole\n")
    shared.push_log(store, 7, 1, log_of(b, 1))
    log_of(b, 2).write_text("== attempt 2 ==\nJob 2 running\n")  # died before keeping it
    log_of(b, 0).write_text("10:00 attempt 2: starting\n10:01 only b saw this\n")

    log_of(c, 2).write_text("== attempt 2 ==\nrank 0 attempt 2 resumes at step 8\n")
    log_of(c, 0).write_text("10:00 attempt 2: starting\n10:05 watching attempt 2 again\n")
    for k in (0, 2):
        shared.push_log(store, 7, k, log_of(c, k))

    shared.pull_logs(store, 7, lambda k: log_of(b, k))
    assert log_of(b, 1).read_text() == "attempt 1 whole\n"  # its own kept copy, nothing newer: untouched
    assert log_of(b, 2).read_text() == "== attempt 2 ==\nrank 0 attempt 2 resumes at step 8\n"
    merged = log_of(b, 0).read_text()
    assert merged.startswith("10:00 attempt 2: starting\n10:05 watching attempt 2 again\n")
    assert merged.endswith("== lines this runner wrote that the state bucket did not keep ==\n10:01 only b saw this\n")
    # B keeps its logs again: the bucket now has C's output, never B's short copy
    shared.push_log(store, 7, 2, log_of(b, 2))
    assert b"resumes at step 8" in store.get(store.key("managed", "jobs", "7", "attempt-2.log"))
    # a copy B grew after keeping it is its newest: a second look leaves it alone
    log_of(b, 1).write_text("attempt 1 whole\nand more\n")
    shared.pull_logs(store, 7, lambda k: log_of(b, k))
    assert log_of(b, 1).read_text() == "attempt 1 whole\nand more\n"
    # the remembered ETags are private, as the logs are
    assert stat.S_IMODE(os.stat(b / ".attempt-2.log.etag").st_mode) == 0o600
