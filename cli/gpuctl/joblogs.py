"""Copy a job's logs from its nodes into the state dir, so they outlive the cluster.

Layout: `clusters/<name>/jobs/<job_id>/<stage>-rank<N>.log`. rsync appends only
what is new, so copying again while a job still runs is cheap; all nodes are
fetched at once.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from gpuctl import ssh
from gpuctl.inventory import Node
from gpuctl.paths import cluster_dir

STAGES = ("setup", "run")


def local_job_dir(cluster: str, job_id: int | str) -> Path:
    return cluster_dir(cluster) / "jobs" / str(job_id)


def local_log(cluster: str, job_id: int | str, stage: str, rank: int) -> Path:
    return local_job_dir(cluster, job_id) / f"{stage}-rank{rank}.log"


def _fetch_one(node: Node, cluster: str, job_id: str, stages: Sequence[str], control_dir: Path | None,
               timeout: float) -> bool:
    dest = local_job_dir(cluster, job_id)
    dest.mkdir(parents=True, exist_ok=True)
    ok = True
    for stage in stages:
        remote = f"{ssh.job_dir(job_id)}/{stage}.log"
        rsh = shlex.join(["ssh", *ssh.ssh_options(node, control_dir)])
        argv = ["rsync", "-q", "--append-verify", "--ignore-missing-args", "-e", rsh,
                f"{node.ssh_host}:{remote}", str(local_log(cluster, job_id, stage, node.rank))]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            ok = False
            continue
        ok = ok and proc.returncode == 0
    return ok


def fetch(cluster: str, job_id: int | str, nodes: Sequence[Node], *, control_dir: Path | None,
          stages: Sequence[str] = STAGES, timeout: float = 300) -> dict[int, bool]:
    """Copy each node's stage logs; rank -> whether every copy succeeded."""
    if not nodes:
        return {}
    with ThreadPoolExecutor(max_workers=min(64, len(nodes)), thread_name_prefix="fetch") as pool:
        futures = {n.rank: pool.submit(_fetch_one, n, cluster, str(job_id), stages, control_dir, timeout)
                   for n in nodes}
        return {rank: f.result() for rank, f in futures.items()}


def watcher_pidfile(cluster: str, job_id: int) -> Path:
    return local_job_dir(cluster, job_id) / "watch.pid"


def mark_watching(cluster: str, job_id: int) -> Path:
    """Record that this process watches the job (removed by `unmark_watching`)."""
    path = watcher_pidfile(cluster, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(os.getpid()))
    return path


def unmark_watching(cluster: str, job_id: int) -> None:
    path = watcher_pidfile(cluster, job_id)
    try:
        if path.read_text().strip() == str(os.getpid()):
            path.unlink()
    except FileNotFoundError:
        pass


def is_watched(cluster: str, job_id: int) -> bool:
    try:
        pid = int(watcher_pidfile(cluster, job_id).read_text())
    except (FileNotFoundError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
