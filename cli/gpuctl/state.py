"""The local registry of clusters and jobs: SQLite in the state dir.

SQLite in WAL mode with a busy timeout lets two gpuctl commands run at once
without corrupting the file; job ids are allocated inside `BEGIN IMMEDIATE`
so concurrent submissions never get the same id. The schema carries a version
so later releases can migrate it.
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from gpuctl.paths import state_root

SCHEMA_VERSION = 1

JOB_STATES = ("PENDING", "SETTING_UP", "RUNNING", "SUCCEEDED", "FAILED", "FAILED_SETUP", "CANCELLED")
TERMINAL_JOB_STATES = ("SUCCEEDED", "FAILED", "FAILED_SETUP", "CANCELLED")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS clusters (
    name        TEXT PRIMARY KEY,
    cloud       TEXT NOT NULL,
    region      TEXT,
    zone        TEXT,
    num_nodes   INTEGER NOT NULL,
    status      TEXT NOT NULL,
    request     TEXT NOT NULL,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    cluster      TEXT NOT NULL,
    job_id       INTEGER NOT NULL,
    name         TEXT,
    status       TEXT NOT NULL,
    task_id      TEXT,
    num_nodes    INTEGER NOT NULL,
    submitted_at REAL NOT NULL,
    started_at   REAL,
    ended_at     REAL,
    returncodes  TEXT,
    failed_rank  INTEGER,
    detail       TEXT,
    PRIMARY KEY (cluster, job_id)
);
"""


@dataclass(frozen=True)
class ClusterRecord:
    name: str
    cloud: str
    region: str | None
    zone: str | None
    num_nodes: int
    status: str
    request: dict[str, Any]
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class JobRecord:
    cluster: str
    job_id: int
    name: str | None
    status: str
    task_id: str | None
    num_nodes: int
    submitted_at: float
    started_at: float | None = None
    ended_at: float | None = None
    returncodes: dict[int, int | None] = field(default_factory=dict)
    failed_rank: int | None = None
    detail: str | None = None


class Registry:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or state_root() / "state.db"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            for statement in filter(str.strip, _SCHEMA.split(";")):
                db.execute(statement)
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) > SCHEMA_VERSION:
                raise RuntimeError(f"{self.path} was written by a newer gpuctl (schema {row[0]})")

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA busy_timeout=30000")
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        finally:
            db.close()

    # clusters
    def upsert_cluster(self, name: str, *, cloud: str, region: str | None, zone: str | None,
                       num_nodes: int, status: str, request: dict[str, Any]) -> None:
        now = time.time()
        with self._connect() as db:
            db.execute(
                """INSERT INTO clusters VALUES (?,?,?,?,?,?,?,?,?)
                   ON CONFLICT(name) DO UPDATE SET cloud=excluded.cloud, region=excluded.region,
                   zone=excluded.zone, num_nodes=excluded.num_nodes, status=excluded.status,
                   request=excluded.request, updated_at=excluded.updated_at""",
                (name, cloud, region, zone, num_nodes, status, json.dumps(request, default=str), now, now),
            )

    def set_cluster_status(self, name: str, status: str) -> None:
        with self._connect() as db:
            db.execute("UPDATE clusters SET status=?, updated_at=? WHERE name=?", (status, time.time(), name))

    def remove_cluster(self, name: str) -> None:
        with self._connect() as db:
            db.execute("DELETE FROM clusters WHERE name=?", (name,))

    def cluster(self, name: str) -> ClusterRecord | None:
        with self._connect() as db:
            row = db.execute("SELECT * FROM clusters WHERE name=?", (name,)).fetchone()
        return _cluster(row) if row else None

    def clusters(self) -> list[ClusterRecord]:
        with self._connect() as db:
            rows = db.execute("SELECT * FROM clusters ORDER BY name").fetchall()
        return [_cluster(r) for r in rows]

    # jobs
    def new_job(self, cluster: str, *, name: str | None, num_nodes: int) -> JobRecord:
        now = time.time()
        with self._connect() as db:
            (last,) = db.execute("SELECT COALESCE(MAX(job_id), 0) FROM jobs WHERE cluster=?", (cluster,)).fetchone()
            job_id = last + 1
            db.execute(
                "INSERT INTO jobs (cluster, job_id, name, status, num_nodes, submitted_at) VALUES (?,?,?,?,?,?)",
                (cluster, job_id, name, "PENDING", num_nodes, now),
            )
        return JobRecord(cluster=cluster, job_id=job_id, name=name, status="PENDING", task_id=None,
                         num_nodes=num_nodes, submitted_at=now)

    def update_job(self, cluster: str, job_id: int, **fields: Any) -> None:
        if "status" in fields and fields["status"] not in JOB_STATES:
            raise ValueError(f"unknown job state {fields['status']}")
        if "returncodes" in fields:
            fields["returncodes"] = json.dumps({str(k): v for k, v in fields["returncodes"].items()})
        cols = ", ".join(f"{k}=?" for k in fields)
        with self._connect() as db:
            db.execute(f"UPDATE jobs SET {cols} WHERE cluster=? AND job_id=?", (*fields.values(), cluster, job_id))

    def job(self, cluster: str, job_id: int) -> JobRecord | None:
        with self._connect() as db:
            row = db.execute("SELECT * FROM jobs WHERE cluster=? AND job_id=?", (cluster, job_id)).fetchone()
        return _job(row) if row else None

    def jobs(self, cluster: str) -> list[JobRecord]:
        with self._connect() as db:
            rows = db.execute("SELECT * FROM jobs WHERE cluster=? ORDER BY job_id", (cluster,)).fetchall()
        return [_job(r) for r in rows]

    def remove_jobs(self, cluster: str) -> None:
        with self._connect() as db:
            db.execute("DELETE FROM jobs WHERE cluster=?", (cluster,))


def _cluster(row: tuple[Any, ...]) -> ClusterRecord:
    name, cloud, region, zone, num_nodes, status, request, created, updated = row
    return ClusterRecord(name, cloud, region, zone, num_nodes, status, json.loads(request), created, updated)


def _job(row: tuple[Any, ...]) -> JobRecord:
    (cluster, job_id, name, status, task_id, num_nodes, submitted, started, ended, rcs, failed_rank, detail) = row
    codes = {int(k): v for k, v in json.loads(rcs).items()} if rcs else {}
    return JobRecord(cluster, job_id, name, status, task_id, num_nodes, submitted, started, ended, codes,
                     failed_rank, detail)
