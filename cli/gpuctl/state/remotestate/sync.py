"""One cluster's files, record and jobs between the state dir and the state bucket.

Layout under the prefix:

    clusters/<name>/terraform.tfstate   Terraform's S3 backend (with its .tflock)
    clusters/<name>/record.json         the registry's cluster row
    clusters/<name>/files/<path>        the cluster directory: cluster.json, inventory.yml,
                                        ssh/ keys, known_hosts, main.tf.json, prepare records
    clusters/<name>/jobs/<id>.json      the registry's job rows (ids allocated here)
    locks/<name>.json                   gpuctl's lock of the cluster (store.cluster_lock)

Paths inside the cluster directory differ between runners, so text files carry
the directory as `@GPUCTL_CLUSTER_DIR@` in the bucket and get the runner's own
on the way down — except the rendered Terraform root, which keeps the paths it
was made with (local nodes stay where they are; providers.local.nodes_dir). What is machine-local stays out: ssh control sockets (cm/),
ansible-runner's private data (runner/), jobs' watchers (jobs/; a job's logs are kept outside
the cluster directory, in the state dir's logs/, and `gpuctl logs` reads a job from the head
where this runner has none), local nodes' homes (nodes/), Terraform's plugin cache.
`.sync.json` remembers each file's hash as last synced, so a command moves only
what changed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from gpuctl.state.remotestate.store import S3Store

PLACEHOLDER = "@GPUCTL_CLUSTER_DIR@"
SYNC_FILE = ".sync.json"
JOBS_SYNC_FILE = ".jobs-sync.json"
_SKIP_TOP = {"cm", "runner", "jobs", "nodes", SYNC_FILE, JOBS_SYNC_FILE}
_SKIP_ANY = {".terraform", "logs"}
_SKIP_NAMES = {"terraform.tfstate", "terraform.tfstate.backup", ".terraform.tfstate.lock.info", "state-snapshot.json"}


def _synced_files(cdir: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted(cdir.rglob("*")):
        rel = path.relative_to(cdir)
        if rel.parts[0] in _SKIP_TOP or _SKIP_ANY & set(rel.parts[:-1]) or path.name in _SKIP_NAMES:
            continue
        if path.name.endswith(".tmp") or path.is_symlink() or not path.is_file():
            continue
        out[rel.as_posix()] = path
    return out


_VERBATIM = {"terraform/main.tf.json"}


def _replace(data: bytes, rel: str, old: str, new: str) -> bytes:
    """`old` -> `new` in a text file of the cluster directory (binary and verbatim files as they are)."""
    if rel in _VERBATIM:
        return data
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return data
    return text.replace(old, new).encode()


def _to_bucket(data: bytes, cdir: Path, rel: str = "") -> bytes:
    return _replace(data, rel, str(cdir), PLACEHOLDER)


def _from_bucket(data: bytes, cdir: Path, rel: str = "") -> bytes:
    return _replace(data, rel, PLACEHOLDER, str(cdir))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_sync(cdir: Path) -> dict[str, list[str]]:
    """relative path -> [sha256 of its bucket form, the bucket's ETag] as last synced."""
    try:
        data = json.loads((cdir / SYNC_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_sync(cdir: Path, seen: dict[str, list[str]]) -> None:
    tmp = cdir / (SYNC_FILE + ".tmp")
    tmp.write_text(json.dumps(seen, sort_keys=True))
    tmp.replace(cdir / SYNC_FILE)


def push_files(store: S3Store, name: str, cdir: Path) -> int:
    """Upload the cluster directory's changed files, drop the bucket's copies of deleted ones; how many moved."""
    prefix = store.key("clusters", name, "files") + "/"
    seen = _read_sync(cdir)
    local = _synced_files(cdir)
    moved = 0
    for rel, path in local.items():
        data = _to_bucket(path.read_bytes(), cdir, rel)
        digest = _digest(data)
        if (seen.get(rel) or [None])[0] != digest:
            seen[rel] = [digest, store.put_etag(prefix + rel, data)]
            moved += 1
    for rel in sorted(set(seen) - set(local)):
        store.delete(prefix + rel)
        del seen[rel]
        moved += 1
    _write_sync(cdir, seen)
    return moved


def pull_files(store: S3Store, name: str, cdir: Path) -> bool:
    """Bring the cluster directory up to the bucket's copy; False when the bucket has no such cluster."""
    prefix = store.key("clusters", name, "files") + "/"
    remote = store.list(prefix)
    if not remote:
        return False
    cdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    seen = _read_sync(cdir)
    for key in sorted(remote):
        rel = key[len(prefix):]
        target = cdir / rel
        if ".." in Path(rel).parts or not rel:
            continue  # never write outside the cluster directory
        known = seen.get(rel)
        if known and known[1] == remote[key] and target.is_file() \
                and _digest(_to_bucket(target.read_bytes(), cdir, rel)) == known[0]:
            continue  # unchanged on both sides
        data = store.get(key)
        if data is None:
            continue
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = target.with_name(target.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(_from_bucket(data, cdir, rel))
        tmp.replace(target)
        seen[rel] = [_digest(data), remote[key]]
    for rel in [r for r in seen if prefix + r not in remote]:
        (cdir / rel).unlink(missing_ok=True)  # another runner removed it (e.g. forget-host-key's prepared)
        del seen[rel]
    _write_sync(cdir, seen)
    return True


# -- records -------------------------------------------------------------------


def put_record(store: S3Store, name: str, record: dict[str, Any]) -> None:
    store.put(store.key("clusters", name, "record.json"), json.dumps(record, sort_keys=True, default=str).encode())


def get_record(store: S3Store, name: str) -> dict[str, Any] | None:
    data = store.get(store.key("clusters", name, "record.json"))
    return _json_object(data)


def cluster_names(store: S3Store) -> list[str]:
    """Every cluster with a record in the bucket."""
    prefix = store.key("clusters") + "/"
    return sorted(k[len(prefix):].split("/", 1)[0] for k in store.list(prefix) if k.endswith("/record.json"))


def put_job(store: S3Store, name: str, job: dict[str, Any], *, new: bool = False) -> bool:
    """Write one job row; with new, only if its id is still free (False: taken by another runner)."""
    return store.put(store.key("clusters", name, "jobs", f"{job['job_id']}.json"),
                     json.dumps(job, sort_keys=True).encode(), only_if_absent=new)


def job_ids(store: S3Store, name: str) -> list[int]:
    prefix = store.key("clusters", name, "jobs") + "/"
    ids = []
    for key in store.list(prefix):
        stem = key[len(prefix):].removesuffix(".json")
        if stem.isdigit():
            ids.append(int(stem))
    return sorted(ids)


def get_jobs(store: S3Store, name: str, cdir: Path | None = None) -> list[dict[str, Any]]:
    """The cluster's job rows; with `cdir`, only those changed since the last call (ETags in JOBS_SYNC_FILE)."""
    prefix = store.key("clusters", name, "jobs") + "/"
    listed = store.list(prefix)
    seen: dict[str, str] = {}
    if cdir is not None:
        try:
            seen = json.loads((cdir / JOBS_SYNC_FILE).read_text())
        except (OSError, ValueError):
            seen = {}
    rows = [_json_object(store.get(key)) for key in sorted(listed) if seen.get(key) != listed[key]]
    if cdir is not None and cdir.is_dir():
        tmp = cdir / (JOBS_SYNC_FILE + ".tmp")
        tmp.write_text(json.dumps(listed, sort_keys=True))
        tmp.replace(cdir / JOBS_SYNC_FILE)
    return [r for r in rows if r is not None]


def delete_cluster(store: S3Store, name: str) -> None:
    """Forget the cluster in the bucket (after terraform destroy): files, jobs, record, Terraform's state."""
    prefix = store.key("clusters", name) + "/"
    keys = sorted(store.list(prefix))
    record = prefix + "record.json"
    for key in [k for k in keys if k != record] + ([record] if record in keys else []):
        store.delete(key)  # the record last: a crash half-way leaves the cluster listed, so down can be re-run


def _json_object(data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
