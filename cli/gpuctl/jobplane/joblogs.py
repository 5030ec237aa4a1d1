"""A job's logs on the controller, so they outlive the cluster.

Layout: `clusters/<name>/jobs/<job_id>/<stage>-rank<N>.log`, one file per
stage and rank, written from the job's events as they stream in (attached
jobs), or rebuilt from the head's events.log in one call (`fetch`: detached
jobs, cancelled jobs, `logs` after the fact). Every rank's lines pass through
the head, so no node but the head is asked.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import IO, Callable

from gpuctl.common.paths import cluster_dir
from gpuctl.jobplane import protocol
from gpuctl.jobplane.events import LineJoiner, Outcome, decode, parse_event
from gpuctl.provision import ssh
from gpuctl.provision.inventory import Inventory

STAGES = protocol.STAGES


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

    def write(self, stage: str, rank: int, line: str, eol: bool = True) -> None:
        """One line of output (event text: surrogate-escaped bytes); `eol` False: no newline came with it."""
        if self.failed:
            return
        stage = stage if stage in STAGES else protocol.STAGE_RUN  # the agent's own notes go with the run log
        try:
            fh = self.files.get((stage, rank))
            if fh is None:
                path = local_log(self.cluster, self.job_id, stage, rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                self.written.add((stage, rank))
                # The rank's bytes as it wrote them: invalid UTF-8 and \r included.
                fh = self.files[(stage, rank)] = open(path, "w", encoding="utf-8", errors="surrogateescape",
                                                      newline="")
            fh.write(line + "\n" if eol else line)
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
    argv = ssh.ssh_argv(inv.head, f"cat -- {protocol.node_job_dir(node_job)}/events.log", control_dir=control_dir)
    try:  # bytes: the ranks' output may be anything but a newline
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return None
    writer = LogWriter(inv.cluster, job_id)
    joiner = LineJoiner()
    outcome = None
    ranks = {n.rank for n in inv.nodes}
    try:
        for raw in proc.stdout.split(b"\n"):
            event = parse_event(decode(raw))
            for whole in joiner.feed(event) if event is not None else ():
                if whole.kind == protocol.EV_OUTPUT and whole.rank in ranks:
                    writer.write(whole.stage or protocol.STAGE_RUN, whole.rank, whole.text, whole.eol)
                elif whole.kind == protocol.EV_DONE:
                    outcome = Outcome.from_data(whole.text, whole.data)
        for held in joiner.flush_all():  # a line still being written, or cut by a killed coordinator
            if held.rank in ranks:
                writer.write(held.stage or protocol.STAGE_RUN, held.rank, held.text, held.eol)
    finally:
        writer.close()
    return outcome


def watcher_pidfile(cluster: str, job_id: int) -> Path:
    return local_job_dir(cluster, job_id) / "watch.pid"


def process_start(pid: int) -> str | None:
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
    path.write_text(f"{os.getpid()} {process_start(os.getpid()) or ''}".strip())
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
    return same_process(pid, words[1] if len(words) > 1 else None)


def same_process(pid: int, start: str | None) -> bool:
    """Whether `pid` still runs and is the process that started at `start` (None: any start; "" where
    /proc is missing and start times cannot be told apart)."""
    started = process_start(pid)
    return started is not None and (start is None or started in ("", start))
