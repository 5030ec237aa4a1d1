from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from gpuctl.state import SCHEMA_VERSION, Registry


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
