"""Jobs on a running cluster: queue, logs, cancel, and keeping their state true.

A job's state is written by whoever watches it (the attached `apply`/`exec`,
or the background watcher of a detached one). If nobody is watching any more
(the controller was killed), `refresh` asks the head, whose coordinator
recorded the outcome (and, if the coordinator itself is gone, every node's
agent), so `queue` and `logs --status` never report a stale RUNNING.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from gpuctl.common.console import Reporter
from gpuctl.common.ranklines import RankLines
from gpuctl.common.errors import UserError
from gpuctl.jobplane import agentcall, client, joblogs
from gpuctl.node import protocol
from gpuctl.jobplane.events import Outcome
from gpuctl.jobplane.runner import JobRunner, LeftoverReport, describe_codes
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.state.registry import TERMINAL_JOB_STATES, JobRecord, Registry

# `gpuctl logs --status` exit codes (SkyPilot's JobExitCode values; LOST, a job whose cluster went
# with its outcome unknown, did not succeed: FAILED's).
STATUS_EXIT = {"SUCCEEDED": 0, "FAILED": 100, "FAILED_SETUP": 100, "CANCELLED": 103, "LOST": 100}
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


def node_status(nodes: Sequence[Node], node_job: str, stage: str, control_dir: Path) -> dict[int, StageStatus]:
    """Ask every node's agent about one stage of a job (its name on the nodes), all at once (when the
    head cannot say)."""
    replies = agentcall.call_all(nodes, agentcall.stage_command(protocol.CMD_STATUS, node_job, stage),
                                 control_dir=control_dir, timeout=30)
    out: dict[int, StageStatus] = {}
    for rank, reply in replies.items():
        try:
            data = reply.answer()
        except agentcall.AgentError:  # no answer: nothing can be said of the stage there
            out[rank] = StageStatus(running=False, exit=None, reachable=False)
            continue
        out[rank] = StageStatus(running=bool(data.get("running")), exit=data.get("exit"), reachable=True)
    return out


# A job record nobody watches that is still PENDING this long after it was
# submitted lost its gpuctl before the head took it.
PENDING_STALE_S = 120.0


def refresh(runner: JobRunner, job: JobRecord) -> JobRecord:
    """Bring an unwatched, unfinished job's state up to date from the head (one call)."""
    if job.status in TERMINAL_JOB_STATES or joblogs.is_watched(job.cluster, job.job_id):
        return job
    answer = client.job_status_on_head(runner.inv.head, job.node_job, runner.control_dir)
    if answer is None:  # head unreachable: nothing can be said
        return job
    status = answer.get("status")
    if status == "RUNNING":
        if job.status == "PENDING":  # started (left the head's queue) while nobody watched it
            runner.registry.update_job(job.cluster, job.job_id, status="RUNNING", detail=None,
                                       started_at=job.started_at or time.time())
            return runner.registry.job(job.cluster, job.job_id) or job
        return job
    if status == "PENDING":  # in the head's GPU queue: what it waits for now
        why = f"waits for {answer.get('waiting') or 'its GPUs'}"
        if job.status == "PENDING" and job.detail != why:
            runner.registry.update_job(job.cluster, job.job_id, detail=why)
        return runner.registry.job(job.cluster, job.job_id) or job
    if status in ("SUCCEEDED", "FAILED", "FAILED_SETUP", "CANCELLED", "UNPREPARED"):
        outcome = Outcome.from_data(status, answer)
        joblogs.fetch(runner.inv, job.job_id, job.node_job, control_dir=runner.control_dir)
        _record(runner, job, outcome)
    elif status == "UNKNOWN" and job.status == "PENDING":
        if job.submitted_at and time.time() - job.submitted_at > PENDING_STALE_S:
            runner.record_outcome(job.job_id, "FAILED", {}, ["gpuctl stopped before the head took the job"])
    elif status in ("LOST", "UNKNOWN"):
        _refresh_from_nodes(runner, job)
    refreshed = runner.registry.job(job.cluster, job.job_id)
    assert refreshed is not None
    return refreshed


def _record(runner: JobRunner, job: JobRecord, outcome: Outcome) -> None:
    runner.settle(job.job_id, job_nodes(runner.inv, job), outcome)  # no one to tell but the registry


def _refresh_from_nodes(runner: JobRunner, job: JobRecord) -> None:
    """The head's coordinator is gone without an outcome: ask each node's agent.

    Once no stage has a supervisor left, what still runs of the job has nobody
    to answer for it (the head's whole agent may have died): it is stopped
    before the job is recorded as ended."""
    nodes = job_nodes(runner.inv, job)
    stage = protocol.STAGE_SETUP if job.status == "SETTING_UP" else protocol.STAGE_RUN
    status = node_status(nodes, job.node_job, stage, runner.control_dir)
    if any(s.running for s in status.values()) or not all(s.reachable for s in status.values()):
        return
    report = runner.stop_leftovers(job.job_id, nodes)
    stopped = [f"stopped what still ran of it on rank {r}" for r in report.stopped]
    codes = {rank: s.exit for rank, s in status.items()}
    if stage == protocol.STAGE_SETUP:
        runner.record_outcome(job.job_id, "FAILED_SETUP", codes, describe_codes(codes, runner.by_rank) + stopped)
    else:
        failed = describe_codes(codes, runner.by_rank)
        runner.record_outcome(job.job_id, "FAILED" if failed else "SUCCEEDED", codes, failed + stopped)


def follow_job(runner: JobRunner, job: JobRecord, nodes: Sequence[Node], *, tail: int | None = None) -> JobRecord:
    """Stream a running job's output (every line so far, or with `tail` the last `tail` lines so
    far in the order they came, then live) until it ends; its final record."""
    inv, ranks = runner.inv, [n.rank for n in nodes]
    offset, ended = 0, None
    if tail is not None:
        # The head's events.log so far (one call): its last lines printed, the rest followed from
        # where it ended. Nothing is saved meanwhile: the job's watcher saves its logs.
        read = joblogs.read_head(inv, job.node_job, control_dir=runner.control_dir)
        if read is not None:
            offset, ended = read.offset, read.outcome
            for line in deque((li for li in read.lines if li.rank in ranks), maxlen=tail) if tail > 0 else ():
                runner.print_line(runner.by_rank[line.rank], line.text, stage=line.stage or protocol.STAGE_RUN,
                                  eol=line.eol)
    # a job's watcher saves its logs: a second writer of the same files would garble them
    watched = joblogs.is_watched(job.cluster, job.job_id)
    outcome = ended or runner.attach(job.job_id, job_nodes(inv, job), echo=True, ranks=ranks, offset=offset,
                                     save=offset == 0 and not watched)
    if offset and not joblogs.is_watched(job.cluster, job.job_id):  # nobody saved it: the head's copy
        joblogs.fetch(inv, job.job_id, job.node_job, control_dir=runner.control_dir)
    latest = wait_until(runner.registry, job, lambda j: j.status in TERMINAL_JOB_STATES,
                        timeout=10 if joblogs.is_watched(job.cluster, job.job_id) else 0)
    if latest.status not in TERMINAL_JOB_STATES:
        _record(runner, latest, outcome)
        latest = runner.registry.job(job.cluster, job.job_id) or latest
    return latest


def wait_until(registry: Registry, job: JobRecord, done: Callable[[JobRecord], bool], timeout: float) -> JobRecord:
    """Poll the registry until `done(job)` or `timeout` s passed; the latest record."""
    deadline = time.monotonic() + timeout
    while True:
        latest = registry.job(job.cluster, job.job_id)
        assert latest is not None
        if done(latest) or time.monotonic() >= deadline:
            return latest
        time.sleep(0.2)


def print_saved_logs(reporter: Reporter, inv: Inventory | None, job: JobRecord, ranks: Sequence[int], *,
                     by_rank: bool = False, tail: int | None = None) -> bool:
    """Print the saved logs of a job (`inv`: its cluster's inventory, None once the cluster is
    gone): in the order the lines came, or grouped by rank; only the last `tail` lines with it.
    False if none were saved."""
    directory = joblogs.saved_dir(job.cluster, job.job_id, job.node_job)
    if directory is None:
        return False
    names = joblogs.saved_names(directory)
    for node in inv.nodes if inv is not None else ():
        names.setdefault(node.rank, node.name)
    shown = RankLines(reporter, interval=0, in_place=0)  # every \r redraw: a line of its own off a terminal
    for line in joblogs.read_saved(directory, set(ranks), by_rank=by_rank, tail=tail):
        prefix = f"({names[line.rank]}, rank={line.rank})" if line.rank in names else f"(rank={line.rank})"
        shown.line(line.rank, line.stage, prefix, line.text)
    return True


def cancel(runner: JobRunner, job: JobRecord) -> tuple[str, LeftoverReport]:
    """`gpuctl cancel` (and the dashboard's Cancel) of one job: an unfinished one is ended on every
    node and recorded CANCELLED; an ended one keeps its record, and what may still run of it (a rank
    whose owner was killed) is stopped. (the line that says which, what the agents found)"""
    if job.status in TERMINAL_JOB_STATES:
        report = runner.stop_leftovers(job.job_id, job_nodes(runner.inv, job))
        return f"Job {job.job_id} already ended: {job.status}; " + describe_leftovers(runner.inv, report), report
    report = runner.cancel(job.job_id, job_nodes(runner.inv, job))
    return (f"Job {job.job_id} cancelled on {job.num_nodes} node(s)."
            + (f" {describe_leftovers(runner.inv, report)}" if report.unreachable else "")), report


def describe_leftovers(inv: Inventory, report: LeftoverReport) -> str:
    """What the nodes' agents found of a job: stopped leftovers, nothing, or nodes not reached."""
    names = {n.rank: f"{n.name} (rank {n.rank})" for n in inv.nodes}
    parts = []
    if report.stopped:
        parts.append("stopped what still ran of it on " + ", ".join(names.get(r, str(r)) for r in report.stopped))
    if report.unreachable:
        parts.append("could not reach " + ", ".join(names.get(r, str(r)) for r in report.unreachable)
                     + " to stop what may still run there")
    return "; ".join(parts) or "nothing of it was running on its nodes"
