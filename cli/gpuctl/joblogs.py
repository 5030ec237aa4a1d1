"""A job's logs on the controller, so they outlive the cluster.

Layout: `clusters/<name>/jobs/<job_id>/<stage>-rank<N>.log`, one file per
stage and rank, written from the job's events as they stream in (attached
jobs), or rebuilt from the head's events.log in one call (`fetch`: detached
jobs, cancelled jobs, `logs` after the fact). Every rank's lines pass through
the head, so no node but the head is asked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Callable

from gpuctl import ssh
from gpuctl.inventory import Inventory
from gpuctl.jobplane.events import Outcome, parse_event
from gpuctl.paths import cluster_dir

STAGES = ("setup", "run")


def local_job_dir(cluster: str, job_id: int | str) -> Path:
    return cluster_dir(cluster) / "jobs" / str(job_id)


def local_log(cluster: str, job_id: int | str, stage: str, rank: int) -> Path:
    return local_job_dir(cluster, job_id) / f"{stage}-rank{rank}.log"


class LogWriter:
    """Per-(stage, rank) log files of one job, started afresh by this writer."""

    def __init__(self, cluster: str, job_id: int | str, on_error: Callable[[str], None] | None = None) -> None:
        self.cluster = cluster
        self.job_id = job_id
        self.files: dict[tuple[str, int], IO[str]] = {}
        self.failed: str | None = None  # why saving stopped (a full disk...): the job goes on
        self.written: set[tuple[str, int]] = set()
        self.on_error = on_error

    def write(self, stage: str, rank: int, line: str) -> None:
        if self.failed:
            return
        stage = stage if stage in STAGES else "run"  # the agent's own notes go with the run log
        try:
            fh = self.files.get((stage, rank))
            if fh is None:
                path = local_log(self.cluster, self.job_id, stage, rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                self.written.add((stage, rank))
                fh = self.files[(stage, rank)] = open(path, "w", encoding="utf-8", errors="replace")
            fh.write(line + "\n")
            fh.flush()
        except OSError as exc:
            self.failed = (f"cannot save job {self.job_id}'s logs under {local_job_dir(self.cluster, self.job_id)}: "
                           f"{exc.strerror}; the job goes on, and its output stays on the head "
                           f"(`gpuctl logs {self.cluster} {self.job_id}` once there is room)")
            if self.on_error is not None:
                self.on_error(self.failed)
            self.close()
            # Incomplete copies would pass for the whole log: drop them, so `gpuctl logs`
            # reads the job's output from the head instead.
            for stage_rank in list(self.written):
                local_log(self.cluster, self.job_id, *stage_rank).unlink(missing_ok=True)

    def close(self) -> None:
        for fh in self.files.values():
            try:
                fh.close()
            except OSError:
                pass
        self.files.clear()


def fetch(inv: Inventory, job_id: int | str, node_job: str, *, control_dir: Path | None,
          timeout: float = 300) -> Outcome | None:
    """Rebuild job `job_id`'s local logs from the head's events.log (of `node_job`, its name on the
    nodes: JobRecord.node_job); the outcome if the job ended."""
    proc = ssh.run_ssh(inv.head, f"cat -- {ssh.job_dir(node_job)}/events.log", control_dir, timeout=timeout)
    if proc.returncode != 0:
        return None
    writer = LogWriter(inv.cluster, job_id)
    outcome = None
    ranks = {n.rank for n in inv.nodes}
    try:
        for line in proc.stdout.splitlines():
            event = parse_event(line)
            if event is None:
                continue
            if event.kind == "O" and event.rank in ranks:
                writer.write(event.stage or "run", event.rank, event.text)
            elif event.kind == "D":
                outcome = Outcome.from_data(event.text, event.data)
    finally:
        writer.close()
    return outcome


def watcher_pidfile(cluster: str, job_id: int) -> Path:
    return local_job_dir(cluster, job_id) / "watch.pid"


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot) if it runs and is no
    zombie; "" where /proc is missing (macOS); None if it has ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]


def mark_watching(cluster: str, job_id: int) -> Path:
    """Record that this process watches the job (removed by `unmark_watching`).
    The start time goes with the PID: a watcher killed without cleaning up
    (SIGKILL, a reboot) must not live on in whatever process reuses its PID,
    or the job would never be looked up on the head again."""
    path = watcher_pidfile(cluster, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()} {_start_time(os.getpid()) or ''}".strip())
    return path


def unmark_watching(cluster: str, job_id: int) -> None:
    path = watcher_pidfile(cluster, job_id)
    try:
        if path.read_text().split()[:1] == [str(os.getpid())]:
            path.unlink()
    except FileNotFoundError:
        pass


def is_watched(cluster: str, job_id: int) -> bool:
    """Whether the job's watcher still runs: the recorded process, alive and
    started when recorded."""
    try:
        words = watcher_pidfile(cluster, job_id).read_text().split()
        pid = int(words[0])
    except (FileNotFoundError, ValueError, IndexError):
        return False
    started = _start_time(pid)
    return started is not None and (len(words) < 2 or started in ("", words[1]))
