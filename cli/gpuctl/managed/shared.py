"""Managed jobs in the shared state bucket: every runner lists them, and any runner takes over a
job whose supervisor stopped renewing its lease.

Layout under the state prefix, beside the clusters (remotestate.sync):

    managed/jobs/<id>.json               the job's row and events, as its launcher, then its supervisor, wrote them
    managed/jobs/<id>/task.yaml          the task as launched (freeze.py), kept trees named by a placeholder
    managed/jobs/<id>/lease.json         the supervisor's lease: runner, pid; rewritten while it lives
    managed/jobs/<id>/cancel             `gpuctl jobs cancel` on any runner
    managed/jobs/<id>/attempt-<K>.log    each attempt's output, once it ended
    managed/trees/<sha256>.tar.gz        the kept workdirs and file_mount sources, content-addressed

An id is taken by creating its row (If-None-Match), so two runners never get the same one. Only
the lease's holder writes a job's row. The lease is replaced with If-Match on the ETag its holder
wrote last, so of two runners taking it at once one wins; it counts as run out once the store's
own clock says it is older than its term (Last-Modified against the reply's Date), so runners'
clocks need not agree. A holder stops acting a margin before its term ends, and the new holder's
first act on the nodes is a fence at a newer epoch: two supervisors never run ranks at once.

Secret values are never in the bucket: the row names them, and a runner that takes a job over
reads them from its own environment under the same names, and says which are missing.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets as tokens
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from gpuctl.common.errors import ProvisionError, UserError
from gpuctl.common.paths import state_root
from gpuctl.state.remotestate.store import S3Store

TREES_PLACEHOLDER = "@GPUCTL_MANAGED_TREES@"
TREE_NAME = re.compile(r"[0-9a-f]{64}")  # a kept tree's name: its sha256 (freeze._tree_hash)
LEASE_MARGIN_S = 5.0


class LeaseLost(Exception):
    """Another runner holds the job's lease now: this supervisor must touch nothing more."""


def lease_seconds() -> float:
    """A lease's term: a runner takes a job over once its supervisor left it unrenewed this long."""
    try:
        return max(3 * LEASE_MARGIN_S, float(os.environ.get("GPUCTL_MANAGED_LEASE_S") or 30))
    except ValueError:
        return 30.0


# -- this runner ---------------------------------------------------------------------------------


def runner_identity() -> dict[str, str]:
    """This state dir's runner: a random id kept in the state dir (a runner whose state dir went is a
    new one) and who@host, for people."""
    import getpass
    import socket

    path = state_root() / "runner.json"
    if path in _IDENTITIES:  # written once, never changed: read once per process
        return _IDENTITIES[path]
    try:
        found = json.loads(path.read_text())
        if isinstance(found, dict) and found.get("id"):
            _IDENTITIES[path] = {"id": str(found["id"]), "who": str(found.get("who") or "?")}
            return _IDENTITIES[path]
    except (OSError, ValueError):
        pass
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    me = {"id": tokens.token_hex(8), "who": f"{user}@{socket.gethostname()}"}
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".runner.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(me, fh)
    try:
        os.link(tmp, path)  # the first command to get here names the runner; the others read it
    except FileExistsError:
        tmp.unlink(missing_ok=True)
        return runner_identity()
    tmp.unlink(missing_ok=True)
    _IDENTITIES[path] = me
    return me


_IDENTITIES: dict[Path, dict[str, str]] = {}


# -- rows ------------------------------------------------------------------------------------------


def _job_key(store: S3Store, job_id: int, *rest: str) -> str:
    if rest:
        return store.key("managed", "jobs", str(job_id), *rest)
    return store.key("managed", "jobs", f"{job_id}.json")


def listed_rows(store: S3Store) -> dict[int, str]:
    """job id -> its row's ETag, for every job in the bucket."""
    prefix = store.key("managed", "jobs") + "/"
    rows = {}
    for key, etag in store.list(prefix).items():
        name = key[len(prefix):]
        if name.endswith(".json") and name[:-5].isdigit():
            rows[int(name[:-5])] = etag
    return rows


def allocate(store: S3Store, floor: int, row_of: Callable[[int], dict[str, Any]]) -> int:
    """A job id no runner has: the first above every id in the bucket and `floor` whose row this
    call creates (If-None-Match)."""
    job_id = max([floor, *listed_rows(store)]) + 1
    while not store.put(_job_key(store, job_id), _encode(row_of(job_id), [], ""), only_if_absent=True):
        job_id += 1
    return job_id


def _encode(row: dict[str, Any], events: list[dict[str, Any]], runner: str) -> bytes:
    return json.dumps({"job": row, "events": events, "runner": runner}, sort_keys=True, default=str).encode()


def put_row(store: S3Store, row: dict[str, Any], events: list[dict[str, Any]], runner: str) -> None:
    store.put(_job_key(store, int(row["id"])), _encode(row, events, runner))


def get_row(store: S3Store, job_id: int) -> dict[str, Any] | None:
    """{"job": row, "events": [...], "runner": id of the runner that wrote it}, or None."""
    data = store.get(_job_key(store, job_id))
    try:
        doc = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("job"), dict) else None


def delete_job(store: S3Store, job_id: int) -> None:
    """A job refused before it started: its row and whatever was kept for it."""
    for key in store.list(_job_key(store, job_id, "")):
        store.delete(key)
    store.delete(_job_key(store, job_id))


# -- the task and its trees -----------------------------------------------------------------------


def push_frozen(store: S3Store, job_id: int, task: Path, trees: Iterable[str], trees_root: Path) -> None:
    """The kept task (its tree paths as a placeholder) and every kept tree the bucket lacks."""
    store.put(_job_key(store, job_id, "task.yaml"), task.read_text().replace(str(trees_root), TREES_PLACEHOLDER)
              .encode())
    prefix = store.key("managed", "trees") + "/"
    have = store.list(prefix)
    for tree in trees:
        key = f"{prefix}{tree}.tar.gz"
        if key not in have:
            store.put(key, _archive(trees_root / tree))


def _archive(root: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(root, arcname=".")
    return buf.getvalue()


def pull_frozen(store: S3Store, job_id: int, task: Path, trees: Iterable[str], trees_root: Path) -> str | None:
    """This runner's copy of the kept task and trees; what is missing from the bucket, else None."""
    data = store.get(_job_key(store, job_id, "task.yaml"))
    if data is None:
        return f"its task is not in the state bucket ({_job_key(store, job_id, 'task.yaml')})"
    for tree in trees:
        if not TREE_NAME.fullmatch(str(tree)):
            return f"its kept files are named wrongly in the state bucket ({tree!r} is no sha256)"
        if (trees_root / tree).is_dir():
            continue
        archive = store.get(store.key("managed", "trees", f"{tree}.tar.gz"))
        if archive is None:
            return f"its kept files are not in the state bucket (managed/trees/{tree}.tar.gz)"
        with tempfile.TemporaryDirectory(prefix=".incoming-", dir=trees_root) as tmp:
            staged = Path(tmp) / "tree"
            try:
                with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
                    tar.extractall(staged, filter="data")  # nothing outside the tree, no devices
            except (tarfile.TarError, OSError, EOFError) as exc:
                return f"its kept files in the state bucket are damaged (managed/trees/{tree}.tar.gz: {exc})"
            try:
                staged.rename(trees_root / tree)
            except OSError:  # another command brought it meanwhile
                if not (trees_root / tree).is_dir():
                    raise
    task.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(task, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(data.decode().replace(TREES_PLACEHOLDER, str(trees_root)))
    return None


def missing_secrets(names: Iterable[str], env: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """The job's secrets from this runner's environment, and the names it lacks."""
    environ = os.environ if env is None else env
    found = {n: environ[n] for n in names if environ.get(n)}
    return found, sorted(n for n in names if n not in found)


# -- logs and cancels ------------------------------------------------------------------------------


def push_log(store: S3Store, job_id: int, attempt: int, path: Path) -> None:
    """Keep a log (attempt 0: the supervisor's) in the bucket, and remember the copy's ETag beside
    it: the bucket's copy is this runner's word until another runner replaces it."""
    if path.is_file():
        etag = store.put_etag(_job_key(store, job_id, f"attempt-{attempt}.log"), path.read_bytes())
        _write_private(_synced(path), etag.encode())


def pull_logs(store: S3Store, job_id: int, into: Callable[[int], Path]) -> None:
    """Every kept log another runner wrote since this runner last kept or fetched it, in place of
    this runner's copy (an attempt another runner's supervisor watched after this runner's died:
    its copy is the newer). A local copy the bucket has nothing newer for stays, as it may hold
    more than the bucket (a supervisor that died before keeping it). The supervisor's log keeps
    this runner's lines the bucket's copy lacks, after it."""
    prefix = _job_key(store, job_id, "attempt-")
    for key, etag in store.list(prefix).items():
        stem = key[len(prefix):].removesuffix(".log")
        if not stem.isdigit():
            continue
        path = into(int(stem))
        if path.exists() and _read_text(_synced(path)) == etag:
            continue
        found = store.get_tagged(key)
        if found is None:
            continue
        data, etag = found
        if int(stem) == 0 and path.exists():
            data = _merged_supervisor_log(data, path.read_bytes())
        _write_private(path, data)  # in place: a supervisor of this runner may hold it open to append
        _write_private(_synced(path), etag.encode())


def _synced(path: Path) -> Path:
    return path.with_name(f".{path.name}.etag")


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _merged_supervisor_log(kept: bytes, local: bytes) -> bytes:
    """The bucket's supervisor log, then the lines only this runner's copy has (from a supervisor
    of this runner that died before keeping them)."""
    if kept.startswith(local):
        return kept
    known = set(kept.splitlines())
    extra = [line for line in local.splitlines() if line not in known]
    if not extra:
        return kept
    if kept and not kept.endswith(b"\n"):
        kept += b"\n"
    return kept + b"== lines this runner wrote that the state bucket did not keep ==\n" + b"\n".join(extra) + b"\n"


def request_cancel(store: S3Store, job_id: int) -> None:
    store.put(_job_key(store, job_id, "cancel"), b"cancel requested\n")


def clear_cancel(store: S3Store, job_id: int) -> None:
    """`jobs resume` of a cancelled pipeline: the old cancel is not the resumed job's."""
    store.delete(_job_key(store, job_id, "cancel"))


def cancel_requested(store: S3Store, job_id: int) -> bool:
    return store.get(_job_key(store, job_id, "cancel")) is not None  # a GET: a tenth of a LIST's price


# -- the lease -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeaseView:
    """The lease as read: its holder, its object's ETag, and its age by the store's clock."""

    holder: dict[str, Any]
    etag: str
    age: float

    @property
    def runner(self) -> str:
        return str(self.holder.get("runner") or "")

    @property
    def expired(self) -> bool:
        try:
            term = float(self.holder.get("term_s") or lease_seconds())
        except (TypeError, ValueError):
            term = lease_seconds()
        return self.age > term

    def text(self) -> str:
        return f"{self.holder.get('who', '?')} (supervisor pid {self.holder.get('pid', '?')})"

    def live_here(self, runner: str) -> bool:
        """Whether `runner` (this one) holds it by a process that still runs here."""
        from gpuctl.jobplane.joblogs import same_process

        return self.runner == runner and same_process(int(self.holder.get("pid") or 0),
                                                      str(self.holder.get("start") or ""))


def read_lease(store: S3Store, job_id: int) -> LeaseView | None:
    found = store.get_aged(_job_key(store, job_id, "lease.json"))
    if found is None:
        return None
    data, etag, age = found
    try:
        holder = json.loads(data)
    except ValueError:
        holder = {}
    return LeaseView(holder if isinstance(holder, dict) else {}, etag, age)


class Lease:
    """One supervisor's hold on its job's lease: taken with a conditional write, rewritten every
    third of its term by a thread of its own, given up when the supervisor ends."""

    def __init__(self, store: S3Store, job_id: int, *, pid: int, start: str) -> None:
        self.store = store
        self.job_id = job_id
        self.key = _job_key(store, job_id, "lease.json")
        self.term = lease_seconds()
        self.me = runner_identity()
        self.pid, self.start = pid, start
        self.etag: str | None = None
        self.valid_until = 0.0  # monotonic: when this holder stops acting without a renewal
        self.lost_to: str | None = None
        self.cancelled = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({"runner": self.me["id"], "who": self.me["who"], "pid": self.pid, "start": self.start,
                           "term_s": self.term, "nonce": tokens.token_hex(8),
                           "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode()

    def acquire(self, may_take: Callable[[LeaseView], bool]) -> LeaseView | None:
        """Take the lease when it is free or `may_take` it; None when taken, else who holds it."""
        sent = time.monotonic()
        current = read_lease(self.store, self.job_id)
        if current is None:
            etag = self.store.put_new(self.key, self._body())
        elif may_take(current):
            etag = self.store.put_if(self.key, self._body(), current.etag)
        else:
            return current
        if etag is None:  # another runner took it between our read and our write
            return read_lease(self.store, self.job_id) or LeaseView({}, "", 0.0)
        self.etag, self.valid_until = etag, sent + self.term - LEASE_MARGIN_S
        self._thread = threading.Thread(target=self._keep, name=f"lease-{self.job_id}", daemon=True)
        self._thread.start()
        return None

    def held(self) -> bool:
        return self.lost_to is None and time.monotonic() < self.valid_until

    def check(self) -> None:
        if self.lost_to is not None:
            raise LeaseLost(f"managed job {self.job_id} was taken over by {self.lost_to}")
        if not self.held():
            raise LeaseLost(f"managed job {self.job_id}: its lease could not be renewed for {self.term:g} s "
                            "(the state bucket did not answer); another runner may take it over")

    def renew(self) -> bool:
        """Rewrite the lease; False once another runner holds it."""
        if self.etag is None or self.lost_to is not None:
            return False
        sent = time.monotonic()
        try:
            etag = self.store.put_if(self.key, self._body(), self.etag)
        except (ProvisionError, UserError):
            return True  # the store did not answer: held until the term ends, tried again meanwhile
        if etag is None:
            view = read_lease(self.store, self.job_id)
            self.lost_to = view.text() if view is not None else "nobody (its lease was removed)"
            return False
        self.etag, self.valid_until = etag, sent + self.term - LEASE_MARGIN_S
        return True

    def _keep(self) -> None:
        step = max(0.5, self.term / 6)
        last = time.monotonic()
        while not self._stop.wait(step):
            if time.monotonic() - last >= self.term / 3:
                if not self.renew():
                    return
                last = time.monotonic()
            try:
                self.cancelled = self.cancelled or cancel_requested(self.store, self.job_id)
            except (ProvisionError, UserError):
                pass

    def release(self) -> None:
        """Give the lease up, unless another runner holds it by now."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.etag is not None and self.lost_to is None:
            self.store.delete_if(self.key, self.etag)
        self.etag = None


def remove_kept(store: S3Store, job_id: int) -> None:
    """An ended job's task and cancel word (its lease goes with its holder, Lease.release); its row
    and attempt logs stay, as they do locally."""
    for name in ("task.yaml", "cancel"):
        store.delete(_job_key(store, job_id, name))


def release_trees(store: S3Store, trees: Iterable[str], used: set[str]) -> None:
    for tree in set(trees) - used:
        store.delete(store.key("managed", "trees", f"{tree}.tar.gz"))
