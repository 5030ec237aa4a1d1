from __future__ import annotations

import multiprocessing
import re
import getpass
import sqlite3
from dataclasses import asdict
from pathlib import Path

import pytest

from gpuctl.state.registry import SCHEMA_VERSION, Registry


def test_cluster_upsert_and_remove(tmp_path: Path):
    reg = Registry(tmp_path / "s.db")
    reg.upsert_cluster("c1", cloud="local", region=None, zone=None, num_nodes=2, status="INIT", request={"a": 1})
    reg.upsert_cluster("c1", cloud="local", region=None, zone=None, num_nodes=3, status="UP", request={"a": 2})
    rec = reg.cluster("c1")
    assert rec is not None and rec.num_nodes == 3 and rec.status == "UP" and rec.request == {"a": 2}
    reg.remove_cluster("c1")
    assert reg.cluster("c1") is None


def test_job_lifecycle(tmp_path: Path):
    reg = Registry(tmp_path / "s.db")
    job = reg.new_job("c1", name="train", num_nodes=2)
    assert job.job_id == 1 and job.status == "PENDING"
    reg.update_job("c1", 1, status="FAILED", returncodes={0: 0, 1: 3}, failed_rank=1)
    got = reg.job("c1", 1)
    assert got is not None and got.status == "FAILED" and got.returncodes == {0: 0, 1: 3} and got.failed_rank == 1
    with pytest.raises(ValueError):
        reg.update_job("c1", 1, status="BOGUS")


def test_schema_version_recorded_and_newer_refused(tmp_path: Path):
    import sqlite3

    path = tmp_path / "s.db"
    Registry(path)
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)
    db.execute("UPDATE meta SET value='999' WHERE key='schema_version'")
    db.commit()
    db.close()
    with pytest.raises(RuntimeError, match="newer gpuctl"):
        Registry(path)


def _submit(path: str, n: int) -> list[int]:
    reg = Registry(Path(path))
    return [reg.new_job("c1", name=None, num_nodes=1).job_id for _ in range(n)]


def test_concurrent_processes_never_share_or_lose_a_job_id(tmp_path: Path):
    path = str(tmp_path / "s.db")
    Registry(Path(path))
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        ids = sum(pool.starmap(_submit, [(path, 25)] * 4), [])
    assert sorted(ids) == list(range(1, 101))
    assert len(Registry(Path(path)).jobs("c1")) == 100


# -- a job's name on the nodes (issue 20, item 8) --------------------------------------------


def test_two_state_dirs_count_from_1_but_name_their_jobs_apart_on_the_nodes(tmp_path: Path):
    """Two controllers using the same nodes: each shows its own job 1, 2, ...; on the nodes they
    never share a name (the node name carries a random per-job token)."""
    a, b = Registry(tmp_path / "a.db", remote=None), Registry(tmp_path / "b.db", remote=None)
    jobs_a = [a.new_job("c1", name=None, num_nodes=2) for _ in range(3)]
    jobs_b = [b.new_job("c1", name=None, num_nodes=2) for _ in range(3)]
    assert [j.job_id for j in jobs_a] == [j.job_id for j in jobs_b] == [1, 2, 3]
    names = [j.node_job for j in jobs_a + jobs_b]
    assert len(set(names)) == 6, names
    for job in jobs_a + jobs_b:
        assert re.fullmatch(rf"{job.job_id}-[0-9a-f]{{16}}", job.node_job), job.node_job
        assert a.job("c1", job.job_id) is not None
    assert [a.job("c1", j.job_id).node_job for j in jobs_a] == [j.node_job for j in jobs_a]  # type: ignore[union-attr]


def test_runners_sharing_state_share_the_job_name_on_the_nodes(tmp_path: Path):
    """Shared (remote) state: another runner imports the job row, token included, and so reaches
    the same job directory on the nodes (cancel, logs)."""
    mine, theirs = Registry(tmp_path / "a.db", remote=None), Registry(tmp_path / "b.db", remote=None)
    job = mine.new_job("c1", name="t", num_nodes=1)
    theirs.import_jobs("c1", [asdict(mine.job("c1", job.job_id))])  # type: ignore[arg-type]
    assert theirs.job("c1", job.job_id).node_job == job.node_job  # type: ignore[union-attr]
    theirs.import_jobs("c1", [{k: v for k, v in asdict(job).items() if k != "token"}])  # an older runner's row
    assert theirs.job("c1", job.job_id).node_job == str(job.job_id)  # type: ignore[union-attr]


def test_a_schema_1_database_keeps_its_jobs_and_gains_tokens(tmp_path: Path):
    path = tmp_path / "s.db"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        CREATE TABLE jobs (cluster TEXT NOT NULL, job_id INTEGER NOT NULL, name TEXT, status TEXT NOT NULL,
            task_id TEXT, num_nodes INTEGER NOT NULL, submitted_at REAL NOT NULL, started_at REAL, ended_at REAL,
            returncodes TEXT, failed_rank INTEGER, detail TEXT, PRIMARY KEY (cluster, job_id));
        INSERT INTO jobs (cluster, job_id, status, num_nodes, submitted_at) VALUES ('c1', 1, 'SUCCEEDED', 1, 0);
    """)
    db.close()
    reg = Registry(path, remote=None)
    assert reg.job("c1", 1).node_job == "1"  # type: ignore[union-attr]  # what its agent was given then
    new = reg.new_job("c1", name=None, num_nodes=1)
    assert new.job_id == 2 and new.node_job.startswith("2-")
    assert reg.job("c1", 2).node_job == new.node_job  # type: ignore[union-attr]
    # schema 3: who submitted a job (the dashboard's and `queue -o json`'s user); unknown before
    assert reg.job("c1", 1).user is None and reg.job("c1", 2).user == getpass.getuser()  # type: ignore[union-attr]
    with sqlite3.connect(path) as check:
        assert check.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)


def test_down_keeps_the_jobs_ended_and_a_new_cluster_of_the_name_numbers_on(tmp_path: Path):
    """`forget` (down) drops the cluster, not its jobs: they index its kept logs, so `queue`/`logs` read
    them after, and the next cluster of that name never reuses their ids."""
    reg = Registry(tmp_path / "s.db", remote=None)
    reg.upsert_cluster("c1", cloud="local", region=None, zone=None, num_nodes=2, status="UP", request={})
    done, running = reg.new_job("c1", name="a", num_nodes=2), reg.new_job("c1", name="b", num_nodes=2)
    reg.update_job("c1", done.job_id, status="SUCCEEDED", returncodes={0: 0, 1: 0}, ended_at=5.0)
    reg.update_job("c1", running.job_id, status="RUNNING")
    other = reg.new_job("c2", name="x", num_nodes=1)  # another cluster's job: untouched
    reg.forget("c1")
    assert reg.cluster("c1") is None
    kept = {j.job_id: j for j in reg.jobs("c1")}
    assert (kept[1].status, kept[1].ended_at, kept[1].detail) == ("SUCCEEDED", 5.0, None)
    assert kept[2].status == "CANCELLED" and kept[2].ended_at and kept[2].detail == "its cluster was torn down"
    assert reg.job("c2", other.job_id).status == "PENDING"
    reg.upsert_cluster("c1", cloud="local", region=None, zone=None, num_nodes=1, status="UP", request={})
    made = reg.cluster("c1").created_at
    new = reg.new_job("c1", name="again", num_nodes=1)
    assert new.job_id == 3 and new.token not in (done.token, running.token)
    assert [j.job_id for j in reg.jobs("c1")] == [1, 2, 3]
    assert [j.job_id for j in reg.jobs("c1", since=made)] == [3]  # status's "last job": this cluster's
    reg.remove_jobs("c1")  # `logs c1 --purge` of a cluster that is gone
    assert reg.jobs("c1") == [] and reg.jobs("c2") != []
