"""What a managed job runs, kept at launch: every attempt runs the same program whatever happens
to the user's files afterwards (SkyPilot uploads a managed job's workdir for the same reason).

`freeze` writes the job's task as launched (`task.yaml` in its private directory): the user's
YAML with its workdir and local file_mount sources pointing at copies taken now, and secret values
left out (they stay in secrets.json, 0600). The copies are content-addressed trees under
`managed/trees/<sha256>`: a workdir launched ten times unchanged is kept once. The workdir copy
leaves out what the job plane's sync leaves out (git's ignore rules), so it holds what a node gets.
A tree goes when no job that has not ended refers to it any more (`release`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from gpuctl.common.errors import UserError
from gpuctl.managed.store import ManagedJob, Store, job_dir, managed_root

FROZEN_TASK = "task.yaml"
TREES = "trees"


def trees_root() -> Path:
    path = managed_root() / TREES
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _tree_hash(root: Path) -> str:
    """sha256 over every entry's relative path, kind, mode and content (links by their target)."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            st = path.lstat()
            if path.is_symlink():
                digest.update(f"L {rel} {os.readlink(path)}\n".encode())
            elif path.is_dir():
                digest.update(f"D {rel} {st.st_mode & 0o7777:o}\n".encode())
            else:
                digest.update(f"F {rel} {st.st_mode & 0o7777:o} ".encode())
                with open(path, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        digest.update(block)
                digest.update(b"\n")
    return digest.hexdigest()


def _copy_workdir(src: Path, dest: Path) -> None:
    """The workdir as the job plane's sync would send it: git's ignore rules, no .git."""
    from gpuctl.jobplane.gitignore import workdir_filter
    from gpuctl.jobplane.upload import workdir_args

    args, listed = workdir_args(workdir_filter(src))
    proc = subprocess.run(["rsync", "--archive", *args, "--", f"{src}/", f"{dest}/"], input=listed,
                          capture_output=True, timeout=3600)
    if proc.returncode != 0:
        why = (proc.stderr.decode(errors="replace").strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise UserError(f"could not keep a copy of the workdir {src} for the managed job: {why}")


def keep(src: Path, *, workdir: bool = False) -> Path:
    """A content-addressed copy of `src` (a directory, or a file kept under its own name); its path."""
    with tempfile.TemporaryDirectory(prefix=".incoming-", dir=trees_root()) as tmp:
        staged = Path(tmp) / "tree"
        try:
            if workdir:
                staged.mkdir()
                _copy_workdir(src, staged)
            elif src.is_dir():
                shutil.copytree(src, staged, symlinks=True)
            else:
                staged.mkdir()
                shutil.copy2(src, staged / src.name)
        except OSError as exc:
            raise UserError(f"could not keep a copy of {src} for the managed job: {exc.strerror or exc}") from None
        final = trees_root() / _tree_hash(staged)
        if not final.exists():
            try:
                staged.rename(final)
            except OSError:  # another launch kept the same tree meanwhile
                if not final.exists():
                    raise
    return final if src.is_dir() or workdir else final / src.name


def _local_source(value: Any, base: Path) -> Path | None:
    """A file_mounts or workdir value that names a local path (not a bucket URL), resolved."""
    if not isinstance(value, str) or "://" in value or "$" in value:
        return None
    path = Path(os.path.expanduser(value))
    path = path if path.is_absolute() else base / path
    return path.resolve() if path.exists() else None


def freeze(job_id: int, file: Path, text: str, *, stages: list[str] | None = None) -> dict[str, Any]:
    """Keep the task and its local files for job `job_id`; what `launch` records of it. A pipeline's
    `stages` (each stage's document, spec/pipeline.py) are kept in one file, a document each."""
    base = file.resolve().parent
    kept: list[str] = []
    docs = [_kept_doc(file, t, base, kept) for t in (stages if stages is not None else [text])]
    path = job_dir(job_id) / FROZEN_TASK
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"# managed job {job_id}: {file} as launched (local paths point at copies kept then)\n")
        if stages is not None:  # a header, so that the first stage is never taken for one
            fh.write("name: pipeline\nexecution: serial\n---\n")
        yaml.safe_dump_all(docs, fh, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return {"task": str(path), "trees": sorted({_tree_of(p) for p in kept})}


def _kept_doc(file: Path, text: str, base: Path, kept: list[str]) -> dict[str, Any]:
    """One task's document with its local workdir and file_mounts kept (their copies' paths in it)
    and its secrets' values out."""
    doc = yaml.safe_load(text)
    if not isinstance(doc, dict):
        raise UserError(f"{file}: a task YAML is a mapping")
    if (src := _local_source(doc.get("workdir"), base)) is not None and src.is_dir():
        doc["workdir"] = str(keep(src, workdir=True))
        kept.append(doc["workdir"])
    mounts = doc.get("file_mounts")
    if isinstance(mounts, dict):
        for dest, value in list(mounts.items()):
            if (src := _local_source(value, base)) is not None:
                mounts[dest] = str(keep(src))
                kept.append(mounts[dest])
            elif isinstance(value, dict) and (src := _local_source(value.get("source"), base)) is not None:
                mounts[dest] = {**value, "source": str(keep(src))}
                kept.append(mounts[dest]["source"])
    if isinstance(doc.get("secrets"), dict):  # values stay in secrets.json (0600), never in the kept task
        doc["secrets"] = {key: None for key in doc["secrets"]}
    return doc


def _tree_of(path: str) -> str:
    """The tree directory a kept path lies in."""
    rel = Path(path).relative_to(trees_root())
    return rel.parts[0]


def frozen_task(job: ManagedJob) -> Path | None:
    """The kept task of a job launched by this gpuctl (None for one launched before), in this
    state dir (a runner that took the job over keeps it where its launcher did)."""
    frozen = job.launch.get("frozen") or {}
    return job_dir(job.id) / FROZEN_TASK if frozen.get("task") else None


def kept_trees(job: ManagedJob) -> list[str]:
    """The trees the job's kept task points at (none for a job launched before they were kept)."""
    return list((job.launch.get("frozen") or {}).get("trees") or ())


def push(job: ManagedJob, store: Store) -> None:
    """Leave the kept task and trees in the shared state bucket, for a runner that takes over."""
    from gpuctl.managed import shared

    task = frozen_task(job)
    if store.bucket is not None and task is not None:
        shared.push_frozen(store.bucket, job.id, task, kept_trees(job), trees_root())


def pull(job: ManagedJob, store: Store) -> str | None:
    """This runner's copy of the kept task and trees of a job launched elsewhere; what is missing."""
    from gpuctl.managed import shared

    task = frozen_task(job)
    if store.bucket is None or task is None:
        return None
    return shared.pull_frozen(store.bucket, job.id, task, kept_trees(job), trees_root())


def resumable(job: ManagedJob) -> bool:
    """A pipeline that ended without succeeding: `jobs resume` runs its kept stages again."""
    return bool(job.launch.get("pipeline")) and job.terminal and job.status != "SUCCEEDED"


def missing_trees(job: ManagedJob) -> list[str]:
    """The kept trees of the job that are not on this machine."""
    return [t for t in kept_trees(job) if not (trees_root() / t).is_dir()]


def release(job: ManagedJob, store: Store | None = None) -> None:
    """Remove the trees of an ended job that no job still running refers to."""
    store = store or Store()
    store.pull()  # with shared state, other runners' jobs may use the same trees
    mine = set(kept_trees(job))
    used = {t for other in store.all() if other.id != job.id and (not other.terminal or resumable(other))
            for t in kept_trees(other)}
    for tree in mine - used:
        shutil.rmtree(trees_root() / tree, ignore_errors=True)
    if store.bucket is not None:
        from gpuctl.managed import shared

        shared.release_trees(store.bucket, mine, used)
        shared.remove_kept(store.bucket, job.id)
