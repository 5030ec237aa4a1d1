"""Managed jobs on disk: `managed.db` in the state dir, and one private directory per job.

A job's row says where it stands (status, attempt, supervisor); `events` keep every recovery
(cause, nodes, when it was detected and when all ranks ran again) and every user failure, so
`jobs queue` can say why an attempt ended. The attempt number is the job's epoch: the supervisor
that owns the job (its PID and start time, set with a compare-and-set) is the only one that may
raise it, and the nodes refuse ranks of an epoch older than the newest they saw.

Each job's directory (`managed/<id>/`, 0700) holds the supervisor's log, each attempt's output
(`attempt-K.log`) and, until the job ends, the secrets the ranks need (secrets.json, 0600).

With shared state the table is this runner's working copy of the bucket's rows (managed/shared.py):
ids are allocated in the bucket, the lease's holder writes its job's row through, and `pull` brings
in what other runners wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator

from gpuctl.common.paths import state_root

_CONFIGURED: Any = object()  # Store(remote=...) default: the configured shared state, if any
ROWS_SYNC_FILE = ".rows-sync.json"

STATES = ("PENDING", "STARTING", "RUNNING", "RECOVERING", "CANCELLING", "SUCCEEDED", "CANCELLED", "FAILED",
          "FAILED_SETUP", "FAILED_NO_RESOURCE", "FAILED_SUPERVISOR", "LOST")
# LOST: the job's cluster went while no supervisor watched it, and no record of the attempt's end survived
TERMINAL = ("SUCCEEDED", "CANCELLED", "FAILED", "FAILED_SETUP", "FAILED_NO_RESOURCE", "FAILED_SUPERVISOR", "LOST")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS managed_jobs (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    name             TEXT NOT NULL,
    cluster          TEXT NOT NULL,
    status           TEXT NOT NULL,
    task_id          TEXT NOT NULL,
    attempt          INTEGER NOT NULL DEFAULT 0,
    recoveries       INTEGER NOT NULL DEFAULT 0,
    transient        INTEGER NOT NULL DEFAULT 0,
    restarts         INTEGER NOT NULL DEFAULT 0,
    launch           TEXT NOT NULL,
    submitted_at     REAL NOT NULL,
    started_at       REAL,
    ended_at         REAL,
    reason           TEXT,
    exit_code        INTEGER,
    failed_rank      INTEGER,
    cluster_job      INTEGER,
    supervisor_pid   INTEGER,
    supervisor_start TEXT,
    supervisor_runs  INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    destroyed        INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS managed_events (
    job          INTEGER NOT NULL,
    attempt      INTEGER NOT NULL,
    kind         TEXT NOT NULL,
    cause        TEXT NOT NULL,
    nodes        TEXT,
    detected_at  REAL NOT NULL,
    resumed_at   REAL,
    exit_code    INTEGER,
    failed_rank  INTEGER
);
"""


@dataclass(frozen=True)
class ManagedJob:
    id: int
    name: str
    cluster: str
    status: str
    task_id: str
    attempt: int
    recoveries: int
    transient: int
    restarts: int
    launch: dict[str, Any]  # what `jobs launch` was given: file, envs, infra, num_nodes (no secrets)
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    reason: str | None
    exit_code: int | None
    failed_rank: int | None
    cluster_job: int | None
    supervisor_pid: int | None
    supervisor_start: str | None
    supervisor_runs: int
    cancel_requested: bool
    destroyed: bool

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


@dataclass(frozen=True)
class Event:
    """One attempt's end: a recovery (kind "recovery", "transient") or a user failure ("restart")."""

    job: int
    attempt: int
    kind: str
    cause: str
    nodes: list[str]
    detected_at: float
    resumed_at: float | None
    exit_code: int | None
    failed_rank: int | None


def managed_root() -> Path:
    return state_root() / "managed"


def job_dir(job_id: int) -> Path:
    path = managed_root() / str(job_id)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def attempt_log(job_id: int, attempt: int) -> Path:
    return job_dir(job_id) / f"attempt-{attempt}.log"


def supervisor_log(job_id: int) -> Path:
    return job_dir(job_id) / "supervisor.log"


def kept_log(job_id: int, number: int) -> Path:
    """A log by its number in the state bucket (managed/shared.py): attempt N's output, 0 the supervisor's."""
    return attempt_log(job_id, number) if number else supervisor_log(job_id)


def write_secrets(job_id: int, secrets: dict[str, str]) -> None:
    """The ranks' secrets, for every attempt: private, and removed when the job ends."""
    path = job_dir(job_id) / "secrets.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(secrets, fh)


def read_secrets(job_id: int) -> dict[str, str]:
    try:
        return json.loads((job_dir(job_id) / "secrets.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def drop_secrets(job_id: int) -> None:
    (managed_root() / str(job_id) / "secrets.json").unlink(missing_ok=True)


class Store:
    """The managed jobs table; every write is one transaction."""

    def __init__(self, path: Path | None = None, remote: Any = _CONFIGURED) -> None:
        self.path = path or state_root() / "managed.db"
        if remote is _CONFIGURED:
            from gpuctl.state import remotestate

            remote = remotestate.current()
        self.bucket: Any = remote.store if remote is not None else None  # S3Store of the shared state
        self.lease: Any = None  # a supervisor's shared.Lease: only while it holds it does it write the row

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fresh = not self.path.exists()
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            if fresh:
                os.chmod(self.path, 0o600)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
            yield db
        finally:
            db.close()

    def create(self, *, name: str, launch: dict[str, Any], cluster_of: Any, task_id_of: Any) -> ManagedJob:
        """A new PENDING job; its cluster and task id are made from its id (`cluster_of(id)`). With
        shared state the id is one no runner has (its row created in the bucket first)."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            now = time.time()
            if self.bucket is not None:
                from gpuctl.managed import shared

                floor = int(db.execute("SELECT COALESCE(MAX(id), 0) FROM managed_jobs").fetchone()[0])
                job_id = shared.allocate(self.bucket, floor, lambda i: {"id": i, "name": name, "status": "PENDING",
                                                                         "submitted_at": now})
                db.execute("INSERT INTO managed_jobs (id, name, cluster, status, task_id, launch, submitted_at) "
                           "VALUES (?, ?, '', 'PENDING', '', ?, ?)", (job_id, name, json.dumps(launch), now))
            else:
                cur = db.execute("INSERT INTO managed_jobs (name, cluster, status, task_id, launch, submitted_at) "
                                 "VALUES (?, '', 'PENDING', '', ?, ?)", (name, json.dumps(launch), now))
                job_id = int(cur.lastrowid or 0)
            db.execute("UPDATE managed_jobs SET cluster = ?, task_id = ? WHERE id = ?",
                       (cluster_of(job_id), task_id_of(job_id), job_id))
            db.execute("COMMIT")
        self.push(job_id)
        job = self.get(job_id)
        assert job is not None
        return job

    def delete(self, job_id: int) -> None:
        """A job refused before it started (its files could not be kept): no row, no directory."""
        with self._connect() as db:
            db.execute("DELETE FROM managed_jobs WHERE id = ?", (job_id,))
            db.execute("DELETE FROM managed_events WHERE job = ?", (job_id,))
        shutil.rmtree(managed_root() / str(job_id), ignore_errors=True)
        if self.bucket is not None:
            from gpuctl.managed import shared

            shared.delete_job(self.bucket, job_id)

    def get(self, job_id: int) -> ManagedJob | None:
        with self._connect() as db:
            row = db.execute("SELECT * FROM managed_jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row) if row else None

    def all(self) -> list[ManagedJob]:
        with self._connect() as db:
            return [_job(r) for r in db.execute("SELECT * FROM managed_jobs ORDER BY id")]

    def update(self, job_id: int, **fields: Any) -> None:
        if not fields:
            return
        if "status" in fields and fields["status"] not in STATES:
            raise ValueError(f"unknown managed job state {fields['status']}")
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self._connect() as db:
            db.execute(f"UPDATE managed_jobs SET {cols} WHERE id = ?", (*fields.values(), job_id))
        self.push(job_id)

    def set_status(self, job_id: int, status: str, **fields: Any) -> None:
        """A new state, unless the job already ended (a late write never revives it)."""
        if status not in STATES:
            raise ValueError(f"unknown managed job state {status}")
        if status in TERMINAL:
            fields.setdefault("ended_at", time.time())
        cols = ", ".join(f"{k} = ?" for k in ("status", *fields))
        with self._connect() as db:
            db.execute(f"UPDATE managed_jobs SET {cols} WHERE id = ? AND status NOT IN "
                       f"({', '.join('?' * len(TERMINAL))})", (status, *fields.values(), job_id, *TERMINAL))
        self.push(job_id)

    def claim(self, job_id: int, pid: int, start: str, *, previous: tuple[int | None, str | None]) -> bool:
        """Take the job for supervisor (pid, start) if `previous` still holds it: compare-and-set,
        so two supervisors started at once (two `queue` runs) never both own it."""
        with self._connect() as db:
            cur = db.execute("UPDATE managed_jobs SET supervisor_pid = ?, supervisor_start = ?, "
                             "supervisor_runs = supervisor_runs + 1 WHERE id = ? AND supervisor_pid IS ? "
                             "AND supervisor_start IS ?", (pid, start, job_id, *previous))
            return cur.rowcount == 1

    def owns(self, job_id: int, pid: int, start: str) -> bool:
        job = self.get(job_id)
        return job is not None and (job.supervisor_pid, job.supervisor_start) == (pid, start)

    def add_event(self, event: Event) -> None:
        with self._connect() as db:
            db.execute("INSERT INTO managed_events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (event.job, event.attempt, event.kind, event.cause, json.dumps(event.nodes),
                        event.detected_at, event.resumed_at, event.exit_code, event.failed_rank))
        self.push(event.job)

    def resumed(self, job_id: int, attempt: int, at: float) -> None:
        """The attempt that followed an event has every rank running again."""
        with self._connect() as db:
            db.execute("UPDATE managed_events SET resumed_at = ? WHERE job = ? AND attempt = ? "
                       "AND resumed_at IS NULL", (at, job_id, attempt - 1))
        self.push(job_id)

    def events(self, job_id: int) -> list[Event]:
        with self._connect() as db:
            rows = db.execute("SELECT * FROM managed_events WHERE job = ? ORDER BY attempt, detected_at",
                              (job_id,)).fetchall()
        return [Event(job=r["job"], attempt=r["attempt"], kind=r["kind"], cause=r["cause"],
                      nodes=json.loads(r["nodes"] or "[]"), detected_at=r["detected_at"],
                      resumed_at=r["resumed_at"], exit_code=r["exit_code"], failed_rank=r["failed_rank"])
                for r in rows]

    def request_cancel(self, job_id: int) -> None:
        """Ask the job's supervisor, on this runner or any other, to cancel it: a flag here and a word
        in the bucket, never a write of the row (its supervisor's alone)."""
        with self._connect() as db:
            db.execute("UPDATE managed_jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
        if self.bucket is not None:
            from gpuctl.managed import shared

            shared.request_cancel(self.bucket, job_id)

    # -- shared state ------------------------------------------------------------------------------
    def push(self, job_id: int) -> None:
        """Write the job's row through to the bucket (shared state): by its launcher, before any
        supervisor, then only by the supervisor that holds its lease."""
        if self.bucket is None:
            return
        from gpuctl.managed import shared

        if self.lease is not None:
            self.lease.check()
        with self._connect() as db:
            row = db.execute("SELECT * FROM managed_jobs WHERE id = ?", (job_id,)).fetchone()
            events = db.execute("SELECT * FROM managed_events WHERE job = ? ORDER BY attempt, detected_at",
                                (job_id,)).fetchall()
        if row is None:
            return
        data = dict(row)
        data["launch"] = json.loads(data["launch"])
        shared.put_row(self.bucket, data, [dict(e) for e in events], shared.runner_identity()["id"])

    def pull(self) -> None:
        """Bring in the rows other runners wrote (shared state only): those changed since the last
        pull, except a job whose supervisor lives here (it writes that row itself)."""
        if self.bucket is None:
            return
        from gpuctl.jobplane.joblogs import same_process
        from gpuctl.managed import shared

        listed = shared.listed_rows(self.bucket)
        sync = managed_root() / ROWS_SYNC_FILE
        try:
            seen = json.loads(sync.read_text())
        except (OSError, ValueError):
            seen = {}
        for job_id, etag in sorted(listed.items()):
            local = self.get(job_id) if self.path.exists() else None
            if seen.get(str(job_id)) == etag and local is not None:
                continue
            if local is not None and local.supervisor_pid is not None \
                    and same_process(local.supervisor_pid, local.supervisor_start or ""):
                continue
            doc = shared.get_row(self.bucket, job_id)
            if doc is not None and self._import(doc, local):
                seen[str(job_id)] = etag
        managed_root().mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = sync.with_name(f"{ROWS_SYNC_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(seen, sort_keys=True))
        tmp.replace(sync)

    def refresh(self, job_id: int) -> ManagedJob | None:
        """The job as the bucket has it now (shared state), else as here."""
        if self.bucket is not None:
            from gpuctl.managed import shared

            doc = shared.get_row(self.bucket, job_id)
            if doc is not None:
                self._import(doc, self.get(job_id))
        return self.get(job_id)

    def _import(self, doc: dict[str, Any], local: ManagedJob | None) -> bool:
        """The bucket's row `doc` over this runner's copy `local`; False when `local` is another job
        of this state dir's own, from before it shared its state (kept as it is)."""
        from gpuctl.managed import shared

        if local is not None and not _same_job(local, doc["job"]):
            return False
        row = {k: v for k, v in doc["job"].items() if k in _COLUMNS}
        row["launch"] = json.dumps(row.get("launch") or {})
        if doc.get("runner") != shared.runner_identity()["id"]:  # another runner's process: not to look up here
            row["supervisor_pid"] = row["supervisor_start"] = None
        cols = ", ".join(row)
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute(f"INSERT OR REPLACE INTO managed_jobs ({cols}) VALUES ({', '.join('?' * len(row))})",
                       tuple(row.values()))
            db.execute("DELETE FROM managed_events WHERE job = ?", (row["id"],))
            for e in doc.get("events") or []:
                db.execute("INSERT INTO managed_events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           (row["id"], e.get("attempt", 0), e.get("kind", ""), e.get("cause", ""),
                            e.get("nodes") or "[]", e.get("detected_at") or 0, e.get("resumed_at"),
                            e.get("exit_code"), e.get("failed_rank")))
            db.execute("COMMIT")
        return True


def _same_job(local: ManagedJob, theirs: dict[str, Any]) -> bool:
    """Whether the bucket's row is this job's: the token its launch drew (a pipeline's task id changes
    with every stage), else, for a job launched before tokens, its task id."""
    mine, token = local.launch.get("cluster_token"), (theirs.get("launch") or {}).get("cluster_token")
    if mine and token:
        return bool(mine == token)
    return not local.task_id or local.task_id == theirs.get("task_id")


_COLUMNS = frozenset(f.name for f in fields(ManagedJob))  # a row's columns are the job's fields (_job)


def _job(row: sqlite3.Row) -> ManagedJob:
    data = dict(row)
    data["launch"] = json.loads(data["launch"])
    data["cancel_requested"] = bool(data["cancel_requested"])
    data["destroyed"] = bool(data["destroyed"])
    return ManagedJob(**data)


def last_cause(job: ManagedJob, events: list[Event]) -> str:
    """Why the job ended, or what its last recovery was for (`jobs queue`'s DETAIL)."""
    if job.terminal and job.reason:
        return job.reason
    return events[-1].cause if events else (job.reason or "")


def job_document(job: ManagedJob, events: list[Event]) -> dict[str, Any]:
    """`jobs queue -o json`'s job: its row and every event (recoveries, user failures)."""
    return {"id": job.id, "name": job.name, "status": job.status, "cluster": job.cluster, "task_id": job.task_id,
            "attempt": job.attempt, "recoveries": job.recoveries, "transient_recoveries": job.transient,
            "restarts_on_errors": job.restarts, "submitted_at": job.submitted_at, "started_at": job.started_at,
            "ended_at": job.ended_at, "reason": job.reason, "exit_code": job.exit_code,
            "failed_rank": job.failed_rank, "cluster_removed": job.destroyed if job.terminal else None,
            "supervisor_pid": job.supervisor_pid,
            # a pipeline: its name, the stage that runs (or ran last), each stage's state, cluster, attempts
            "pipeline": (job.launch.get("pipeline") or {}).get("name"),
            "stage": (job.launch.get("pipeline") or {}).get("current"),
            "stages": (job.launch.get("pipeline") or {}).get("stages"),
            "events": [{"attempt": e.attempt, "kind": e.kind, "cause": e.cause, "nodes": [int(n) for n in e.nodes],
                        "detected_at": e.detected_at, "resumed_at": e.resumed_at, "exit_code": e.exit_code,
                        "failed_rank": e.failed_rank} for e in events]}
