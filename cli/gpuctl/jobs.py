"""Jobs on a running cluster: queue, logs, cancel, and keeping their state true.

A job's state is written by whoever watches it (the attached `apply`/`exec`,
or the background watcher of a detached one). If nobody is watching any more
(the controller was killed), `refresh` asks the nodes' agents directly, so
`queue` and `logs --status` never report a stale RUNNING.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from gpuctl import joblogs, ssh, stream
from gpuctl.console import Reporter
from gpuctl.errors import UserError
from gpuctl.inventory import Inventory, Node
from gpuctl.launch import JobRunner, describe_codes
from gpuctl.state import TERMINAL_JOB_STATES, JobRecord, Registry

# `gpuctl logs --status` exit codes (SkyPilot's JobExitCode values).
STATUS_EXIT = {"SUCCEEDED": 0, "FAILED": 100, "FAILED_SETUP": 100, "CANCELLED": 103}
NOT_FINISHED_EXIT = 101


def job_nodes(inv: Inventory, job: JobRecord) -> tuple[Node, ...]:
    return inv.first(job.num_nodes)


def resolve_job(registry: Registry, cluster: str, job_id: int | None) -> JobRecord:
    """The named job, or the cluster's latest one."""
    if job_id is not None:
        job = registry.job(cluster, job_id)
        if job is None:
            raise UserError(f"job {job_id} not found on cluster '{cluster}'; `gpuctl queue {cluster}` lists its jobs")
        return job
    jobs = registry.jobs(cluster)
    if not jobs:
        raise UserError(f"cluster '{cluster}' has no jobs yet; start one with `gpuctl exec {cluster} -- CMD`")
    return jobs[-1]


@dataclass(frozen=True)
class StageStatus:
    running: bool
    exit: int | None
    reachable: bool


def node_status(nodes: Sequence[Node], job_id: int, stage: str, control_dir: Path) -> dict[int, StageStatus]:
    """Ask every node's agent about one stage of a job, all at once."""
    results = ssh.run_on_all(nodes, ssh.agent_command("status", str(job_id), stage), control_dir=control_dir,
                             timeout=30)
    out: dict[int, StageStatus] = {}
    for rank, proc in results.items():
        if proc.returncode != 0:
            out[rank] = StageStatus(running=False, exit=None, reachable=False)
            continue
        data = json.loads(proc.stdout.strip().splitlines()[-1])
        out[rank] = StageStatus(running=bool(data.get("running")), exit=data.get("exit"), reachable=True)
    return out


def refresh(runner: JobRunner, job: JobRecord) -> JobRecord:
    """Bring an unwatched, unfinished job's state up to date from the nodes."""
    if job.status in TERMINAL_JOB_STATES or job.status == "PENDING" or joblogs.is_watched(job.cluster, job.job_id):
        return job
    nodes = job_nodes(runner.inv, job)
    stage = "setup" if job.status == "SETTING_UP" else "run"
    status = node_status(nodes, job.job_id, stage, runner.control_dir)
    if any(s.running for s in status.values()) or not all(s.reachable for s in status.values()):
        return job
    codes = {rank: s.exit for rank, s in status.items()}
    if stage == "setup":
        runner.record_outcome(job.job_id, "FAILED_SETUP", codes, describe_codes(codes, runner.by_rank))
    else:
        joblogs.fetch(job.cluster, job.job_id, nodes, control_dir=runner.control_dir)
        failed = describe_codes(codes, runner.by_rank)
        runner.record_outcome(job.job_id, "FAILED" if failed else "SUCCEEDED", codes, failed)
    refreshed = runner.registry.job(job.cluster, job.job_id)
    assert refreshed is not None
    return refreshed


def follow_job(runner: JobRunner, job: JobRecord, nodes: Sequence[Node]) -> JobRecord:
    """Stream a running job's output (setup, then run) until it ends; its final record.

    Only follows: the job's watcher (or, if it has none, `refresh`) records the outcome.
    """
    registry = runner.registry

    def tail(stage: str) -> None:
        stream.follow(nodes, job_id=str(job.job_id), stage=stage, on_line=runner.print_line,
                      control_dir=runner.control_dir)

    if job.status == "SETTING_UP":
        tail("setup")
        job = wait_until(registry, job, lambda j: j.status != "SETTING_UP", timeout=60)
    if job.status == "RUNNING":
        tail("run")
        watched = joblogs.is_watched(job.cluster, job.job_id)
        job = wait_until(registry, job, lambda j: j.status in TERMINAL_JOB_STATES, timeout=30 if watched else 0)
        job = refresh(runner, job)
    return job


def wait_until(registry: Registry, job: JobRecord, done: Callable[[JobRecord], bool], timeout: float) -> JobRecord:
    """Poll the registry until `done(job)` or `timeout` s passed; the latest record."""
    deadline = time.monotonic() + timeout
    while True:
        latest = registry.job(job.cluster, job.job_id)
        assert latest is not None
        if done(latest) or time.monotonic() >= deadline:
            return latest
        time.sleep(0.2)


def print_saved_logs(reporter: Reporter, inv: Inventory, job: JobRecord, ranks: Sequence[int]) -> bool:
    """Print the copied-back logs of a finished job; False if none were saved."""
    found = False
    by_rank = {n.rank: n for n in inv.nodes}
    for stage in joblogs.STAGES:
        for rank in ranks:
            path = joblogs.local_log(inv.cluster, job.job_id, stage, rank)
            if not path.exists():
                continue
            found = True
            prefix = stream.format_prefix(by_rank[rank]) if rank in by_rank else f"(rank={rank})"
            with open(path, errors="replace") as fh:
                for line in fh:
                    reporter.rank_line(prefix, rank, line.rstrip("\n"))
    return found
