"""The local registry of clusters and jobs: SQLite in the state dir.

SQLite in WAL mode with a busy timeout lets two gpuctl commands run at once
without corrupting the file; job ids are allocated inside `BEGIN IMMEDIATE`
so concurrent submissions never get the same id. The schema carries a version
so later releases can migrate it.

Job ids are this state's own (1, 2, 3...): another state dir using the same
nodes counts from 1 too. So each job also gets a random token, and the nodes
know it by `<id>-<token>` (JobRecord.node_job): no other controller can name,
read, cancel or overwrite it.

With shared state (gpuctl.state.remotestate) the database stays this runner's
working copy: cluster and job rows are written through to the state bucket,
job ids are allocated there (an id is taken by creating its object, so two
runners never get the same one), and `import_cluster` / `import_jobs` bring in
what other runners wrote.

The Registry is the one place that keeps the state dir and the bucket in step
(remotestate.sync is the bucket's layout): besides the rows' write-through,
`adopt` brings a cluster's directory, record and jobs down before a command
acts, `publish` leaves its directory there after one changed it, and `forget`
drops it on both sides. Each is a no-op with local state. A cluster's job rows
outlive it here (`forget`, `adopt` of a cluster another runner took down): they
index its kept logs, and job ids go on from them when the name is used again.
"""

from __future__ import annotations

import getpass
import json
import secrets
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from gpuctl.common.paths import cluster_dir, state_root
from gpuctl.state import remotestate
from gpuctl.state.remotestate import Remote, sync

_CONFIGURED: Any = object()  # Registry(remote=...) default: the configured remote state, if any

SCHEMA_VERSION = 3  # 2: jobs.token; 3: jobs.user

JOB_STATES = ("PENDING", "SETTING_UP", "RUNNING", "SUCCEEDED", "FAILED", "FAILED_SETUP", "CANCELLED")
# LOST: its cluster went while nobody watched the job, and no record of its end survived
TERMINAL_JOB_STATES = ("SUCCEEDED", "FAILED", "FAILED_SETUP", "CANCELLED", "LOST")
AUTODOWNED = "AUTODOWNED"  # a cluster's status once it took itself down (autodown)
STOPPED = "STOPPED"  # ... once its nodes stopped themselves (autostop; cloud nodes only)

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
    token        TEXT,
    user         TEXT,
    PRIMARY KEY (cluster, job_id)
);
CREATE TABLE IF NOT EXISTS history (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    cluster       TEXT NOT NULL,
    cloud         TEXT NOT NULL,
    region        TEXT,
    instance_type TEXT,
    num_nodes     INTEGER NOT NULL,
    use_spot      INTEGER NOT NULL,
    node_price    REAL,
    price_source  TEXT,
    started_at    REAL NOT NULL,
    ended_at      REAL,
    ended_how     TEXT
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
class Segment:
    """A stretch of a cluster's life at one size and price (`cost-report`): from an apply that made
    or resized it to the next such apply, its `down`, its autodown, its autostop or `gpuctl stop` (the
    compute no longer bills; a stopped cluster's disks do; `gpuctl start` opens the next). Kept after
    the cluster goes."""

    cluster: str
    cloud: str
    region: str | None
    instance_type: str | None
    num_nodes: int
    use_spot: bool
    node_price: float | None  # USD per node-hour; None: unknown (never shown as $0); 0.0: no cloud bill
    price_source: str | None
    started_at: float
    ended_at: float | None
    ended_how: str | None  # down | autodown | stopped (autostop) | stop (gpuctl stop) | resized; None while it runs

    def cost(self, now: float) -> float | None:
        """Estimated USD so far (or in all, once ended); None when the price is unknown."""
        if self.node_price is None:
            return None
        return self.node_price * self.num_nodes * max(0.0, (self.ended_at or now) - self.started_at) / 3600.0


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
    token: str | None = None  # random, per job: see node_job
    user: str | None = None  # who submitted it (the login of the gpuctl that did): shared state has many

    @property
    def node_job(self) -> str:
        """The job's name on the nodes (its directory ~/.gpuctl/jobs/NAME there): the id and the
        job's random token, which no other controller has. A job recorded before tokens: its id."""
        return f"{self.job_id}-{self.token}" if self.token else str(self.job_id)


class Registry:
    def __init__(self, path: Path | None = None, remote: Remote | None = _CONFIGURED) -> None:
        if remote is _CONFIGURED:
            remote = remotestate.current()
        self.remote: Remote | None = remote
        self.path = path or state_root() / "state.db"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            for statement in filter(str.strip, _SCHEMA.split(";")):
                db.execute(statement)
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is not None and int(row[0]) > SCHEMA_VERSION:
                raise RuntimeError(f"{self.path} was written by a newer gpuctl (schema {row[0]})")
            columns = {r[1] for r in db.execute("PRAGMA table_info(jobs)")}
            if "token" not in columns:  # schema 1: its jobs keep their plain ids on the nodes
                db.execute("ALTER TABLE jobs ADD COLUMN token TEXT")
            if "user" not in columns:  # schema 2: its jobs' submitters were not recorded
                db.execute("ALTER TABLE jobs ADD COLUMN user TEXT")
            db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))

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
        self._publish_cluster(name)

    def set_cluster_status(self, name: str, status: str) -> None:
        with self._connect() as db:
            db.execute("UPDATE clusters SET status=?, updated_at=? WHERE name=?", (status, time.time(), name))
        self._publish_cluster(name)

    def import_cluster(self, row: dict[str, Any]) -> None:
        """Take a cluster row as another runner wrote it (no write-through)."""
        with self._connect() as db:
            db.execute("INSERT OR REPLACE INTO clusters VALUES (?,?,?,?,?,?,?,?,?)",
                       (row["name"], row["cloud"], row.get("region"), row.get("zone"), int(row["num_nodes"]),
                        row["status"], json.dumps(row.get("request") or {}, default=str),
                        float(row.get("created_at") or 0), float(row.get("updated_at") or 0)))

    def import_jobs(self, cluster: str, rows: list[dict[str, Any]]) -> None:
        """Take job rows as other runners wrote them (no write-through)."""
        with self._connect() as db:
            for row in rows:
                codes = row.get("returncodes") or {}
                db.execute("INSERT OR REPLACE INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                           (cluster, int(row["job_id"]), row.get("name"), row["status"], row.get("task_id"),
                            int(row["num_nodes"]), float(row["submitted_at"]), row.get("started_at"),
                            row.get("ended_at"), json.dumps({str(k): v for k, v in codes.items()}),
                            row.get("failed_rank"), row.get("detail"), row.get("token"), row.get("user")))

    def _publish_cluster(self, name: str) -> None:
        if self.remote is None:
            return
        record = self.cluster(name)
        if record is not None:
            sync.put_record(self.remote.store, name, asdict(record))

    def _publish_job(self, cluster: str, job_id: int, *, new: bool = False) -> bool:
        if self.remote is None:
            return True
        job = self.job(cluster, job_id)
        return job is None or sync.put_job(self.remote.store, cluster, asdict(job), new=new)

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
        token = secrets.token_hex(8)
        user = _login()
        taken = 0
        if self.remote is not None:
            taken = max(sync.job_ids(self.remote.store, cluster), default=0)
        while True:
            with self._connect() as db:
                (last,) = db.execute("SELECT COALESCE(MAX(job_id), 0) FROM jobs WHERE cluster=?",
                                     (cluster,)).fetchone()
                job_id = max(last, taken) + 1
                db.execute(
                    "INSERT INTO jobs (cluster, job_id, name, status, num_nodes, submitted_at, token, user) "
                    "VALUES (?,?,?,?,?,?,?,?)",
                    (cluster, job_id, name, "PENDING", num_nodes, now, token, user),
                )
            if self._publish_job(cluster, job_id, new=True):
                break
            taken = job_id  # another runner created this id first: its row arrives with import_jobs
            with self._connect() as db:
                db.execute("DELETE FROM jobs WHERE cluster=? AND job_id=?", (cluster, job_id))
        return JobRecord(cluster=cluster, job_id=job_id, name=name, status="PENDING", task_id=None,
                         num_nodes=num_nodes, submitted_at=now, token=token, user=user)

    def update_job(self, cluster: str, job_id: int, **fields: Any) -> None:
        if "status" in fields and fields["status"] not in JOB_STATES:
            raise ValueError(f"unknown job state {fields['status']}")
        if "returncodes" in fields:
            fields["returncodes"] = json.dumps({str(k): v for k, v in fields["returncodes"].items()})
        cols = ", ".join(f"{k}=?" for k in fields)
        with self._connect() as db:
            db.execute(f"UPDATE jobs SET {cols} WHERE cluster=? AND job_id=?", (*fields.values(), cluster, job_id))
        self._publish_job(cluster, job_id)

    def job(self, cluster: str, job_id: int) -> JobRecord | None:
        with self._connect() as db:
            row = db.execute("SELECT * FROM jobs WHERE cluster=? AND job_id=?", (cluster, job_id)).fetchone()
        return _job(row) if row else None

    def jobs(self, cluster: str, *, since: float | None = None) -> list[JobRecord]:
        """The cluster's jobs by id; with `since`, only those submitted from then on (the jobs of a
        cluster made then, not of an earlier one of the same name)."""
        with self._connect() as db:
            rows = db.execute("SELECT * FROM jobs WHERE cluster=? AND submitted_at>=? ORDER BY job_id",
                              (cluster, since if since is not None else float("-inf"))).fetchall()
        return [_job(r) for r in rows]

    def job_page(self, *, offset: int, limit: int, cluster: str | None = None,
                 status: str | None = None) -> tuple[int, list[JobRecord]]:
        """(how many jobs match, a page of them), every cluster's, the latest submitted first: the
        dashboard's jobs page reads 10,000 jobs a page at a time."""
        where = "WHERE (? IS NULL OR cluster=?) AND (? IS NULL OR status=?)"
        args = (cluster, cluster, status, status)
        with self._connect() as db:
            (total,) = db.execute(f"SELECT COUNT(*) FROM jobs {where}", args).fetchone()
            rows = db.execute(f"SELECT * FROM jobs {where} ORDER BY submitted_at DESC, cluster, job_id DESC "
                              "LIMIT ? OFFSET ?", (*args, limit, offset)).fetchall()
        return total, [_job(r) for r in rows]

    def remove_jobs(self, cluster: str) -> None:
        with self._connect() as db:
            db.execute("DELETE FROM jobs WHERE cluster=?", (cluster,))

    def end_jobs(self, cluster: str, why: str, *, status: str = "CANCELLED") -> None:
        """The cluster is gone: its jobs not yet ended are CANCELLED (or LOST: nobody ended them and
        their outcome is unknown), here only (its rows stay, with their logs, for `queue` and `logs`;
        the bucket's go with the cluster)."""
        with self._connect() as db:
            # a job that waited in the queue: what it waited for is no reason for its end
            db.execute(f"UPDATE jobs SET status=?, ended_at=?, detail=CASE WHEN status='PENDING' THEN ? "
                       f"ELSE COALESCE(detail, ?) END WHERE cluster=? "
                       f"AND status NOT IN ({','.join('?' * len(TERMINAL_JOB_STATES))})",
                       (status, time.time(), why, why, cluster, *TERMINAL_JOB_STATES))

    # history: what each cluster cost while it lived (cost-report), this state dir's own
    def open_segment(self, name: str, *, cloud: str, region: str | None, instance_type: str | None,
                     num_nodes: int, use_spot: bool, node_price: float | None, price_source: str | None) -> None:
        """The cluster runs at this size and price from now: a new segment unless the open one matches."""
        now = time.time()
        with self._connect() as db:
            row = db.execute("SELECT id, instance_type, num_nodes, use_spot, node_price FROM history "
                             "WHERE cluster=? AND ended_at IS NULL ORDER BY id DESC LIMIT 1", (name,)).fetchone()
            if row is not None and tuple(row[1:]) == (instance_type, num_nodes, int(use_spot), node_price):
                return
            if row is not None:
                db.execute("UPDATE history SET ended_at=?, ended_how='resized' WHERE id=?", (now, row[0]))
            db.execute("INSERT INTO history (cluster, cloud, region, instance_type, num_nodes, use_spot, node_price, "
                       "price_source, started_at) VALUES (?,?,?,?,?,?,?,?,?)",
                       (name, cloud, region, instance_type, num_nodes, int(use_spot), node_price, price_source, now))

    def close_segment(self, name: str, how: str, at: float | None = None) -> None:
        """The cluster went (`down`, or it took itself down at `at`)."""
        with self._connect() as db:
            db.execute("UPDATE history SET ended_at=?, ended_how=? WHERE cluster=? AND ended_at IS NULL",
                       (time.time() if at is None else at, how, name))

    def history(self, cluster: str | None = None) -> list[Segment]:
        """Every cluster's segments, or one cluster's, oldest first."""
        where, args = ("WHERE cluster=? ", (cluster,)) if cluster is not None else ("", ())
        with self._connect() as db:
            rows = db.execute("SELECT cluster, cloud, region, instance_type, num_nodes, use_spot, node_price, "
                              f"price_source, started_at, ended_at, ended_how FROM history {where}"
                              "ORDER BY started_at, id", args).fetchall()
        return [Segment(r[0], r[1], r[2], r[3], r[4], bool(r[5]), r[6], r[7], r[8], r[9], r[10]) for r in rows]

    # shared state: the state dir as the working copy of the state bucket
    def adopt(self, name: str) -> bool:
        """Bring the state bucket's copy of cluster `name` (files, record, jobs) into this state dir.

        False when state is local or the bucket has no such cluster. A cluster this
        runner knew from the bucket but the bucket no longer has (another runner
        took it down) is dropped from the registry.
        """
        remote = self.remote
        if remote is None:
            return False
        record = sync.get_record(remote.store, name)
        if record is None:
            known = self.cluster(name)
            if known is not None and known.request.get("state") == remote.where(name):
                self.end_jobs(name, "its cluster was torn down")
                self.remove_cluster(name)
            return False
        sync.pull_files(remote.store, name, cluster_dir(name))
        self.import_cluster(record)
        self.import_jobs(name, sync.get_jobs(remote.store, name, cluster_dir(name)))
        return True

    def adopt_all(self) -> None:
        """adopt() every cluster the state bucket has (for `gpuctl status` without a name)."""
        if self.remote is None:
            return
        names = set(sync.cluster_names(self.remote.store))
        for rec in self.clusters():
            if rec.name not in names and rec.request.get("state") == self.remote.where(rec.name):
                names.add(rec.name)  # gone from the bucket: adopt() drops it
        for name in sorted(names):
            self.adopt(name)

    def publish(self, name: str) -> None:
        """Leave this runner's copy of the cluster's directory in the state bucket (shared state only)."""
        if self.remote is None or not cluster_dir(name).is_dir():
            return
        sync.push_files(self.remote.store, name, cluster_dir(name))

    def forget(self, name: str) -> None:
        """Drop a cluster's record, here and in the state bucket (its job rows there too). Here its job
        rows stay, ended, as its logs do (joblogs): `queue NAME` and `logs NAME JOB` read them after
        `down`, and a new cluster of the same name numbers its jobs on from them."""
        if self.remote is not None:
            sync.delete_cluster(self.remote.store, name)
        self.end_jobs(name, "its cluster was torn down")
        self.remove_cluster(name)


def _cluster(row: tuple[Any, ...]) -> ClusterRecord:
    name, cloud, region, zone, num_nodes, status, request, created, updated = row
    return ClusterRecord(name, cloud, region, zone, num_nodes, status, json.loads(request), created, updated)


def _job(row: tuple[Any, ...]) -> JobRecord:
    (cluster, job_id, name, status, task_id, num_nodes, submitted, started, ended, rcs, failed_rank, detail,
     token, user) = row
    codes = {int(k): v for k, v in json.loads(rcs).items()} if rcs else {}
    return JobRecord(cluster, job_id, name, status, task_id, num_nodes, submitted, started, ended, codes,
                     failed_rank, detail, token, user)


def _login() -> str | None:
    """Who submits a job: the login name, as `sky queue`'s USER column shows it."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no LOGNAME/USER (a bare container)
        return None
