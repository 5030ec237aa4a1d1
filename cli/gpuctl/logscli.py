"""`gpuctl queue` and `gpuctl logs`: a cluster's jobs and their output, live or after the fact.

A job's logs and its registry row outlive the cluster (jobplane/joblogs.py, Registry.forget), as
SkyPilot keeps ~/sky_logs: after `gpuctl down NAME`, `queue NAME` lists its jobs as they ended and
`logs NAME JOB` prints what was saved, until `logs NAME --purge` removes them. A cluster made again
under the name numbers its jobs on from the old ones, so `logs NAME 3` names one job.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Optional

import typer

from gpuctl import cliargs
from gpuctl.common import output
from gpuctl.common.errors import ClusterNotFound, UserError
from gpuctl.common.output import OutputOption, wants_json
from gpuctl.common.paths import cluster_dir

if TYPE_CHECKING:
    from gpuctl.common.console import Reporter
    from gpuctl.jobplane.runner import JobRunner
    from gpuctl.state.registry import JobRecord, Registry

# The registry and inventories are imported where they are used, so that defining `queue` and
# `logs` (every gpuctl command does) costs nothing.


def _runner(name: str, registry: Registry, reporter: Reporter) -> JobRunner | None:
    """The job runner of cluster `name` as it is now (no bucket call: adopted already), or None when
    no node of it can be asked: no inventory (torn down, never made), or it stopped or took itself
    down (its jobs are read as after `down`, without waiting on ssh to nodes that are not there)."""
    from gpuctl.jobplane.runner import JobRunner
    from gpuctl.provision.inventory import load_inventory
    from gpuctl.state.registry import AUTODOWNED, STOPPED

    path = cluster_dir(name) / "inventory.yml"
    inv = load_inventory(path, cluster=name) if path.is_file() else None
    record = registry.cluster(name)
    if inv is None or (record is not None and record.status in (AUTODOWNED, STOPPED)):
        return None
    return JobRunner(inv, reporter=reporter, registry=registry)


def _live_runner(name: str, registry: Registry, reporter: Reporter) -> JobRunner | None:
    """_runner, and None too for a cluster that took itself down since it was last seen."""
    runner = _runner(name, registry, reporter)
    if runner is not None:
        try:
            cliargs.refuse_gone(name, registry)
        except UserError:
            return None
    return runner


def _away(name: str, registry: Registry) -> str:
    """What a cluster whose nodes cannot be asked is: stopped (and how to get it back), or gone."""
    from gpuctl.state.registry import STOPPED

    record = registry.cluster(name)
    if record is not None and record.status == STOPPED:
        return f"is stopped (`gpuctl start {name}` brings it back)"
    return "is gone"


def _cluster_jobs(name: str, reporter: Reporter) -> tuple[JobRunner | None, Registry]:
    """(its runner, or None once the cluster is gone or stopped, the registry) for a cluster `queue`
    and `logs` can speak of: up, or gone with its jobs kept."""
    from gpuctl.spec.request import check_cluster_name
    from gpuctl.state.registry import Registry

    check_cluster_name(name)
    registry = Registry()
    registry.adopt(name)  # shared state: the bucket's copy of the cluster, if any
    runner = _live_runner(name, registry, reporter)
    if runner is None and registry.cluster(name) is None and not registry.jobs(name):
        raise ClusterNotFound(name)
    return runner, registry


def _fmt_time(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _table(rows: list[JobRecord]) -> None:
    typer.echo(f"{'ID':>4}  {'NAME':<24} {'STATUS':<13} {'SUBMITTED':<19}  {'STARTED':<19}  {'ENDED':<19}  "
               f"{'NODES':>5}  RETURN CODES")
    for job in rows:
        codes = ",".join("?" if c is None else str(c) for _, c in sorted(job.returncodes.items())) or "-"
        if job.status == "PENDING" and job.detail:  # in the cluster's queue: what it waits for
            codes = job.detail
        typer.echo(f"{job.job_id:>4}  {cliargs.shortened(job.name or '-', 24):<24} {job.status:<13} "
                   f"{_fmt_time(job.submitted_at):<19}  {_fmt_time(job.started_at):<19}  "
                   f"{_fmt_time(job.ended_at):<19}  {job.num_nodes:>5}  {codes}")


def _rows(runner: JobRunner | None, registry: Registry, name: str) -> list[JobRecord]:
    """The cluster's jobs, each unwatched unfinished one brought up to date from its head."""
    from gpuctl.jobplane import jobs

    return [jobs.refresh(runner, job) if runner is not None else job for job in registry.jobs(name)]


def queue(name: Optional[str] = typer.Argument(None, metavar="NAME",
                                                help="Cluster whose jobs to list (default: every cluster's)."),
          output_format: str = OutputOption) -> None:
    """List a cluster's jobs (or every cluster's): state, start and end time, and each rank's exit code."""
    from gpuctl.common.console import Reporter

    as_json = wants_json(output_format)
    reporter = Reporter(stream=sys.stderr) if as_json else Reporter()
    if name is None:
        _queue_all(reporter, as_json)
        return
    runner, registry = _cluster_jobs(name, reporter)
    rows = _rows(runner, registry, name)
    if as_json:
        output.emit("queue", {"ok": True, "cluster": name, "jobs": [output.job_doc(j) for j in rows]})
        return
    if not rows:
        typer.echo(f"No jobs on cluster '{name}'.")
        return
    if runner is None:
        typer.echo(f"Cluster '{name}' {_away(name, registry)}; its jobs as they ended (their logs: gpuctl logs "
                   f"{name} JOB; remove them: gpuctl logs {name} --purge)", err=True)
    _table(rows)


def _queue_all(reporter: Reporter, as_json: bool) -> None:
    """`gpuctl queue`: every cluster's jobs, a table per cluster (as `sky queue` without a name)."""
    from gpuctl.state.registry import Registry

    registry = Registry()
    registry.adopt_all()
    clusters = [(rec, _rows(_live_runner(rec.name, registry, reporter), registry, rec.name))
                for rec in registry.clusters()]
    if as_json:
        output.emit("queue", {"ok": True, "clusters": [{"cluster": rec.name, "jobs": [output.job_doc(j) for j in rows]}
                                                      for rec, rows in clusters]})
        return
    if not clusters:
        typer.echo("No clusters.")
        return
    for i, (rec, rows) in enumerate(clusters):
        typer.echo(("\n" if i else "") + f"Cluster {rec.name} ({rec.status}, {rec.num_nodes} node(s))"
                   + ("" if rows else ": no jobs"))
        if rows:
            _table(rows)


def logs(
    name: str = typer.Argument(..., metavar="NAME", help="Cluster (also one that is gone: its kept logs)."),
    job_id: Optional[int] = typer.Argument(None, metavar="JOB", help="Job id (default: the latest job)."),
    rank: Optional[int] = typer.Option(None, "--rank", metavar="N", help="Only this rank's output."),
    follow: bool = typer.Option(True, "--follow/--no-follow", help="Keep streaming until the job ends."),
    tail: Optional[int] = typer.Option(None, "--tail", metavar="N", min=0,
                                       help="Only the last N lines so far (of the ranks shown, in the order "
                                            "they came), then follow; 0: all (as `sky logs --tail`)."),
    by_rank: bool = typer.Option(False, "--by-rank", help="A saved log grouped by rank (each stage's lines rank "
                                 "after rank) instead of in the order the lines came."),
    status_only: bool = typer.Option(False, "--status", help="Print no logs; exit 0 if the job succeeded "
                                     "(100 failed or lost, 101 not finished, 103 cancelled)."),
    purge: bool = typer.Option(False, "--purge", help="Remove the cluster's saved logs (its ended jobs'), and "
                               "once the cluster is gone its job records too."),
    output_format: str = OutputOption,
) -> None:
    """Show a job's output, live or after the fact (in the order it came; kept after `down`)."""
    from gpuctl.common.console import Reporter
    from gpuctl.jobplane import joblogs, jobs
    from gpuctl.state.registry import TERMINAL_JOB_STATES

    as_json = wants_json(output_format)
    if as_json and not status_only:
        raise UserError("--output json: with `gpuctl logs` only together with --status (logs are text)")
    if purge:
        if job_id is not None or rank is not None or tail is not None or by_rank or status_only:
            raise UserError("--purge takes only the cluster: gpuctl logs NAME --purge")
        _purge(name)
        return
    reporter = Reporter(stream=sys.stderr) if as_json else Reporter()
    runner, registry = _cluster_jobs(name, reporter)
    inv = runner.inv if runner is not None else None
    job = jobs.resolve_job(registry, name, job_id)
    if runner is not None:
        job = jobs.refresh(runner, job)
    ranks = list(range(job.num_nodes))
    if rank is not None:
        if rank not in ranks:
            raise UserError(f"--rank {rank}: job {job.job_id} ran on ranks 0..{job.num_nodes - 1}")
        ranks = [rank]
    if status_only:
        code = jobs.STATUS_EXIT.get(job.status, jobs.NOT_FINISHED_EXIT)
        if as_json:
            output.emit("logs", {"ok": code == 0, "cluster": name, "job": output.job_doc(job), "exit_code": code})
        else:
            typer.echo(f"Job {job.job_id}: {job.status}" + "".join(f"; {line}" for line in cliargs.failure_lines(inv, job)))
        raise typer.Exit(code)
    tail = tail or None  # 0: every line, as `sky logs --tail 0`
    ended = job.status in TERMINAL_JOB_STATES
    if (ended or runner is None) and jobs.print_saved_logs(reporter, inv, job, ranks, by_rank=by_rank, tail=tail):
        raise typer.Exit(jobs.STATUS_EXIT.get(job.status, 0) and 1)
    if runner is None:
        raise UserError(f"job {job.job_id} of cluster '{name}' has no saved logs, and the cluster "
                        f"{_away(name, registry)}")
    if follow and not ended:
        if by_rank:
            raise UserError(f"--by-rank: job {job.job_id} is {job.status}, and a live job's lines come in the "
                            "order they are printed; add --no-follow for its lines so far by rank")
        job = jobs.follow_job(runner, job, [n for n in runner.inv.nodes if n.rank in ranks], tail=tail)
    else:
        if not joblogs.is_watched(job.cluster, job.job_id):  # its watcher's copy is current, and being written
            joblogs.fetch(runner.inv, job.job_id, job.node_job, control_dir=runner.control_dir)
        jobs.print_saved_logs(reporter, inv, job, ranks, by_rank=by_rank, tail=tail)
    if job.status in ("FAILED", "FAILED_SETUP", "CANCELLED", "LOST"):
        raise typer.Exit(1)


def _purge(name: str) -> None:
    """`logs NAME --purge`: the saved logs of the cluster's ended jobs go (an unfinished job's are still
    being written); once the cluster is gone, its job records too."""
    from gpuctl.jobplane import joblogs
    from gpuctl.spec.request import check_cluster_name
    from gpuctl.state.registry import TERMINAL_JOB_STATES, Registry

    check_cluster_name(name)
    registry = Registry()
    registry.adopt(name)
    rows = registry.jobs(name)
    gone = registry.cluster(name) is None and not (cluster_dir(name) / "inventory.yml").is_file()
    if gone and not rows and not joblogs.cluster_logs_dir(name).exists():
        raise ClusterNotFound(name)
    ended = [j for j in rows if j.status in TERMINAL_JOB_STATES]
    removed = joblogs.purge(name, keep={j.node_job for j in rows if j.status not in TERMINAL_JOB_STATES},
                            legacy=[j.job_id for j in ended])
    if gone:
        registry.remove_jobs(name)
    typer.echo(f"Removed the saved logs of {removed} job(s) of cluster '{name}'"
               + (f", and its {len(rows)} job record(s): the cluster is gone" if gone else ""))


KEEP_ENDED = 20  # ended jobs without a saved copy that `down` fetches, the latest first (one call each)


def keep_before_down(names: list[str], registry: Registry, reporter: Reporter) -> None:
    """Before `down` destroys the nodes: the jobs of each cluster whose output is not saved here are
    saved from the head's copy, one call each, so `gpuctl logs` still shows them afterwards: every
    job still running, and the KEEP_ENDED latest ended ones with no copy here (a watcher that died,
    jobs run from another machine with shared state). A head that does not answer is said once."""
    from gpuctl.jobplane import joblogs
    from gpuctl.provision import ssh  # only `down` asks a head this way
    from gpuctl.state.registry import TERMINAL_JOB_STATES

    for name in names:
        registry.adopt(name)  # shared state: a cluster this machine never saw, its jobs too
        runner, record = _runner(name, registry, reporter), registry.cluster(name)
        if runner is None or record is None:
            continue
        rows = registry.jobs(name, since=record.created_at)
        unsaved = [j for j in rows if j.status in TERMINAL_JOB_STATES
                   and joblogs.saved_dir(name, j.job_id, j.node_job) is None][-KEEP_ENDED:]
        missing = sorted([j for j in rows if j.status not in TERMINAL_JOB_STATES] + unsaved, key=lambda j: j.job_id)
        if not missing:
            continue
        if ssh.run_ssh(runner.inv.head, "true", runner.control_dir, timeout=20).returncode != 0:
            reporter.info(f"The head of cluster '{name}' does not answer: the output of job(s) "
                          f"{', '.join(str(j.job_id) for j in missing)} is not saved here")
            continue
        reporter.info(f"Saving the output of job(s) {', '.join(str(j.job_id) for j in missing)} of cluster "
                      f"'{name}' before its nodes go")
        for job in missing:
            joblogs.fetch(runner.inv, job.job_id, job.node_job, control_dir=runner.control_dir, timeout=120)
