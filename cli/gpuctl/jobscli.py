"""`gpuctl jobs launch|queue|logs|cancel`: managed jobs, as SkyPilot's `sky jobs`.

A managed job owns its cluster: its supervisor (managed/supervisor.py, a detached process on this
machine) brings the cluster up, recovers lost nodes by replacing only them, restarts every rank
with the same task id, and takes the cluster down however the job ends. Every `jobs` command first
starts a supervisor again for any job whose supervisor died.
"""

from __future__ import annotations

import sqlite3
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

import typer

from gpuctl import usage
from gpuctl.common import output
from gpuctl.common.envargs import parse_env_assignments
from gpuctl.common.errors import UserError
from gpuctl.common.output import OutputOption, wants_json

jobs_app = typer.Typer(help="Managed jobs: a job that owns its cluster and survives node loss (sky jobs).",
                       no_args_is_help=True, add_completion=False, epilog=usage.examples_of("jobs"))

FOLLOW_POLL_S = 0.5


def revive_supervisors(argv: list[str]) -> None:
    """What every gpuctl command does first: start a supervisor again for each managed job not
    ended whose supervisor died, and with shared state take over another runner's job whose lease
    ran out. Only where managed jobs can be (a file to look at, or shared state); a state it
    cannot read is left to the `jobs` commands, which say why."""
    from gpuctl.common.errors import ProvisionError
    from gpuctl.common.paths import state_root

    if argv[:1] in (["_supervise"], ["jobs"], ["--help"], ["--version"]) or not argv:
        return
    try:
        from gpuctl.state import remotestate

        remote = remotestate.current()
    except UserError:
        return  # a broken state setting: the command itself says so
    if remote is None and not (state_root() / "managed.db").exists():
        return
    from gpuctl.managed.launch import revive
    from gpuctl.managed.store import Store

    try:
        revive(Store(remote=remote), say=_tell)
    except (sqlite3.Error, OSError, UserError, ProvisionError):
        pass


def _tell(text: str) -> None:
    typer.echo(text, err=True)


def _store() -> Any:
    from gpuctl.managed.launch import revive
    from gpuctl.managed.store import Store

    store = Store()
    revive(store, say=_tell)  # a supervisor that died is started again by whichever command comes next
    return store


def _job(store: Any, job_id: int) -> Any:
    job = store.get(job_id)
    if job is None:
        raise UserError(f"managed job {job_id} not found; `gpuctl jobs queue` lists them")
    return job


def _duration(job: Any, now: float) -> str:
    return _span(job.started_at, job.ended_at, now)


def _span(started_at: float | None, ended_at: float | None, now: float) -> str:
    if started_at is None:
        return "-"
    seconds = int((ended_at or now) - started_at)
    return f"{seconds // 3600}h {seconds % 3600 // 60}m" if seconds >= 3600 else f"{seconds // 60}m {seconds % 60}s"


def _banner(attempt: int, events: list[Any]) -> str:
    before = [e for e in events if e.attempt == attempt - 1]
    why = f": after {before[-1].cause}" if before else ""
    return f"== attempt {attempt}{why} =="


def _attempts(job: Any) -> list[int]:
    from gpuctl.managed.store import attempt_log

    return [k for k in range(1, job.attempt + 1) if attempt_log(job.id, k).exists()]


class Progress:
    """The supervisor's log (provisioning, preparing, recoveries, teardown) shown as it grows, whole
    lines only, while its job is followed: without it a follower sees nothing until ranks print
    (as SkyPilot streams its controller's provisioning)."""

    def __init__(self, job_id: int, out: Any, *, from_start: bool) -> None:
        from gpuctl.managed.store import supervisor_log

        self.path = supervisor_log(job_id)
        self.out = out
        self.offset = 0 if from_start or not self.path.exists() else self.path.stat().st_size

    def show(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return
        whole = data[:data.rfind(b"\n") + 1]
        if whole:
            self.offset += len(whole)
            self.out.write(whole.decode(errors="replace"))
            self.out.flush()


def follow_logs(store: Any, job_id: int, *, attempt: int | None, follow: bool, out: Any = None,
                progress: Progress | None = None, stage: int | None = None) -> Any:
    """Print the attempts' output in order with a banner each (or one attempt's; or a pipeline's
    `stage`'s), a pipeline's stages each after a banner of its own, following the newest until the
    job (or that stage) ends; with `progress`, the supervisor's new lines as they come too."""
    from gpuctl.managed import stages
    from gpuctl.managed.store import attempt_log

    out = out or sys.stdout
    shown, offset, shown_stage = 0, 0, None
    while True:
        if progress is not None:
            progress.show()
        job = store.get(job_id)
        events = store.events(job_id)
        record = stages.of(job)
        ks = [attempt] if attempt is not None else _attempts(job)
        if stage is not None and record is not None:
            ks = [k for k in ks if (st := stages.stage_of_attempt(record, k)) is not None and st["index"] == stage]
        for k in ks:
            path = attempt_log(job_id, k)
            if k < shown or not path.exists():
                continue
            if k > shown:
                st = stages.stage_of_attempt(record, k) if record is not None else None
                if st is not None and st["index"] != shown_stage:
                    out.write(f"==== stage {st['index']} of {len(record['stages'])}: {st['name']} ====\n")
                    shown_stage = st["index"]
                out.write(_banner(k, events) + "\n")
                shown, offset = k, 0
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
            offset += len(data)
            out.write(data.decode(errors="replace"))
            out.flush()
        stage_over = stage is not None and record is not None and (
            int(record["current"]) > stage or record["stages"][stage - 1]["status"] not in ("PENDING", "RUNNING"))
        if not follow or job.terminal or (attempt is not None and job.attempt > attempt) or stage_over:
            if progress is not None:
                progress.show()  # how it ended: the teardown's lines
            return job
        time.sleep(FOLLOW_POLL_S)


def register(app: typer.Typer) -> None:
    app.add_typer(jobs_app, name="jobs")

    @app.command("_supervise", hidden=True)
    def supervise_(job_id: int) -> None:
        from gpuctl.managed.supervisor import main

        raise typer.Exit(main(job_id))


@jobs_app.command("launch", cls=usage.HelpCommand, epilog=usage.examples_of("jobs launch"))
def launch_(file: Path = typer.Argument(..., metavar="FILE", help="Task YAML in SkyPilot's format."),
            name: Optional[str] = typer.Option(None, "-n", "--name", metavar="NAME", help="Job name (default: the task's)."),
            detach: bool = typer.Option(False, "-d", "--detach", help="Return once submitted; follow with `jobs logs`."),
            env: Optional[List[str]] = typer.Option(None, "--env", metavar="K=V", help="K=V (or K from your environment)."),
            secret: Optional[List[str]] = typer.Option(None, "--secret", metavar="K[=V]", help="Secrets; never printed."),
            infra: Optional[str] = typer.Option(None, "--infra", metavar="INFRA", help="Override resources.infra."),
            num_nodes: Optional[int] = typer.Option(None, "--num-nodes", metavar="N", help="Override num_nodes."),
            yes: bool = typer.Option(False, "-y", "--yes", help="Ask nothing (as `sky jobs launch -y`)."),
            output_format: str = OutputOption) -> None:
    """Run a task as a managed job on its own cluster: lost nodes are replaced and the job restarted."""
    from gpuctl.managed import launch
    from gpuctl.providers import get_provider, request_for, resources_problem
    from gpuctl.provision.taskchecks import check_task
    from gpuctl.spec import load_task

    as_json = wants_json(output_format)
    envs = parse_env_assignments(env or [])
    secrets = parse_env_assignments(secret or [], flag="--secret", secret=True)
    from gpuctl.common.yamlfile import read_text
    from gpuctl.managed.store import job_document
    from gpuctl.provision.provisioner import cluster_exists
    from gpuctl.spec.pipeline import is_pipeline, load_pipeline
    from gpuctl.state.registry import Registry

    text = read_text(file, what="task YAML file", source=str(file))  # read once: what is checked is what runs

    def load(source: Any, stage_text: str) -> Any:
        return load_task(source, env_overrides=envs, secret_overrides=secrets, infra_override=infra,
                         resources_check=resources_problem, text=stage_text)

    def check(task: Any, _text: str = "") -> None:
        req = request_for(task, name=launch.cluster_name(name or task.name or file.stem, 0), infra=infra,
                          num_nodes=num_nodes, base_dir=file.resolve().parent)
        if not get_provider(req.cloud).provisions:
            raise UserError(f"{file}: resources.infra: a managed job needs nodes gpuctl makes (local or aws), "
                            f"so that it can replace a lost one; {req.cloud} nodes are yours")
        if not (task.run or task.setup):
            raise UserError(f"{file}: a managed job needs `run` (or `setup`): there is nothing to run")
        check_task(task, req)

    pipeline = None
    if is_pipeline(text):  # SkyPilot's pipeline: its stages, one after another, as one managed job
        if num_nodes is not None:
            raise UserError(f"--num-nodes {num_nodes}: {file} is a pipeline, whose stages ask for their own "
                            "nodes; set num_nodes in each stage")
        pipeline = load_pipeline(file, text=text, load_stage=load, check_stage=check)
        tasks = [stage.task for stage in pipeline.stages]
        job_name = name or pipeline.name or file.stem
    else:
        tasks = [load(file, text)]
        check(tasks[0])
        job_name = name or tasks[0].name or file.stem
    for task in tasks:
        for line in task.warnings:
            typer.echo(f"warning: {line}", err=True)
        if task.resources.autostop is not None:
            typer.echo("warning: resources.autostop: a managed job's cluster goes when the job ends; the setting "
                       "is not used", err=True)
    store = _store()
    registry = Registry()
    job = launch.create(name=job_name, file=file, text=text, envs=envs,
                        secrets={k: v for task in tasks for k, v in task.secrets.items()}, infra=infra,
                        num_nodes=num_nodes, store=store, pipeline=pipeline,
                        taken=lambda c: cluster_exists(c) or registry.cluster(c) is not None)
    pid = launch.spawn(job.id)
    if not launch.wait_claimed(store, job.id, pid):
        raise UserError(f"managed job {job.id}: its supervisor did not start; see "
                        f"{launch.supervisor_log(job.id)}")
    say = (lambda text: typer.echo(text, err=True)) if as_json else typer.echo
    say(f"Managed job {job.id} ({job_name}) submitted; its cluster: {job.cluster}")
    if detach or as_json:
        say(f"Follow it: gpuctl jobs logs {job.id}; cancel it: gpuctl jobs cancel {job.id}")
        if as_json:
            output.emit("jobs launch", {"ok": True, "job": job_document(store.get(job.id), [])})
        return
    try:
        final = follow_logs(store, job.id, attempt=None, follow=True,
                            progress=Progress(job.id, sys.stderr, from_start=True))
    except KeyboardInterrupt:
        typer.echo(f"\nStopped following; managed job {job.id} goes on. Follow again: gpuctl jobs logs {job.id}; "
                   f"cancel it: gpuctl jobs cancel {job.id}", err=True)
        raise typer.Exit(130) from None
    _say_end(final)


def _say_end(job: Any) -> None:
    line = f"Managed job {job.id} {job.status}"
    if job.reason and job.status != "SUCCEEDED":
        line += f": {job.reason}"
    typer.echo(line, err=job.status != "SUCCEEDED")
    if job.status != "SUCCEEDED":
        raise typer.Exit(1)


def _stage_lines(job: Any, now: float) -> list[str]:
    """A pipeline's stages under its row: state, cluster, duration, attempts, why it ended."""
    from gpuctl.managed import stages

    record = stages.of(job)
    if record is None:
        return []
    lines = []
    for st in record["stages"]:
        took = _span(st["started_at"], st["ended_at"], now)
        first, last = st["first_attempt"], st["last_attempt"]
        attempts = "-" if first is None else (str(first) if first == last else f"{first}-{last}")
        lines.append(f"  └ stage {st['index']} {st['name']}: {st['status']}, cluster {st['cluster'] or '-'}, "
                     f"{took}, attempt(s) {attempts}" + (f"; {st['reason']}" if st["reason"] else ""))
    return lines


@jobs_app.command("queue", cls=usage.HelpCommand, epilog=usage.examples_of("jobs queue"))
def queue_(output_format: str = OutputOption) -> None:
    """List managed jobs: state, attempt, recoveries and why the last attempt ended."""
    from gpuctl.managed.store import job_document, last_cause

    as_json = wants_json(output_format)
    store = _store()
    jobs = store.all() if store.path.exists() else []
    if as_json:
        output.emit("jobs queue", {"ok": True, "jobs": [job_document(j, store.events(j.id)) for j in jobs]})
        return
    if not jobs:
        typer.echo("No managed jobs.")
        return
    now = time.time()
    rows = [("ID", "NAME", "STATUS", "ATTEMPT", "RECOVERIES", "SUBMITTED", "DURATION", "CLUSTER", "DETAIL")]
    for j in jobs:
        events = store.events(j.id)
        rows.append((str(j.id), j.name, j.status, str(j.attempt), str(j.recoveries + j.transient),
                     time.strftime("%m-%d %H:%M", time.localtime(j.submitted_at)), _duration(j, now), j.cluster,
                     last_cause(j, events)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r, j in zip(rows, [None, *jobs]):
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        for line in _stage_lines(j, now) if j is not None else []:
            typer.echo(line)
    for j in jobs:
        for e in store.events(j.id):
            when = time.strftime("%H:%M:%S", time.localtime(e.detected_at))
            back = (f", ranks running again after {e.resumed_at - e.detected_at:.1f} s" if e.resumed_at else "")
            typer.echo(f"  job {j.id} attempt {e.attempt}: {e.kind} at {when}: {e.cause}{back}")


@jobs_app.command("logs", cls=usage.HelpCommand, epilog=usage.examples_of("jobs logs"))
def logs_(job_id: int = typer.Argument(..., metavar="ID", help="Managed job id (`gpuctl jobs queue`)."),
          attempt: Optional[int] = typer.Option(None, "--attempt", metavar="K", min=1, help="Only attempt K."),
          supervisor: bool = typer.Option(False, "--supervisor", help="The supervisor's own log."),
          no_follow: bool = typer.Option(False, "--no-follow", help="Print what there is and return."),
          stage: Optional[int] = typer.Option(None, "--stage", metavar="K", min=1,
                                              help="A pipeline's stage K only (its attempts)."),
          output_format: str = OutputOption) -> None:
    """Every attempt's output, with a banner saying why each new attempt started (a pipeline's
    stages in order, a banner each)."""
    from gpuctl.managed.store import attempt_log, job_document, supervisor_log

    as_json = wants_json(output_format)
    store = _store()
    job = _job(store, job_id)
    elsewhere = _supervised_elsewhere(store, job)
    if elsewhere is not None:
        no_follow = True  # its live output is on that runner and on the cluster's head
    if attempt is not None and attempt > max(job.attempt, 1):
        raise UserError(f"--attempt {attempt}: managed job {job_id} has {job.attempt} attempt(s) so far")
    if stage is not None:
        from gpuctl.managed import stages

        record = stages.of(job)
        if record is None:
            raise UserError(f"--stage {stage}: managed job {job_id} is one task, not a pipeline")
        if stage > len(record["stages"]):
            raise UserError(f"--stage {stage}: managed job {job_id} has {len(record['stages'])} stage(s)")
        if attempt is not None:
            raise UserError("--stage and --attempt: give one (a stage's attempts, or one attempt)")
    if as_json:
        events = store.events(job_id)
        from gpuctl.managed import stages

        record = stages.of(job)
        ks = [attempt] if attempt is not None else _attempts(job)
        of_stage = {k: stages.stage_of_attempt(record, k) if record is not None else None for k in ks}
        if stage is not None:
            ks = [k for k in ks if of_stage[k] is not None and of_stage[k]["index"] == stage]  # type: ignore[index]
        output.emit("jobs logs", {"ok": True, "job": job_document(job, events), "attempts": [
            {"attempt": k, "banner": _banner(k, events),
             "stage": of_stage[k]["index"] if of_stage[k] is not None else None,  # type: ignore[index]
             "log": attempt_log(job_id, k).read_text(errors="replace") if attempt_log(job_id, k).exists() else ""}
            for k in ks]})
        return
    if supervisor:
        typer.echo(supervisor_log(job_id).read_text(errors="replace"), nl=False)
        return
    live = not no_follow and not job.terminal  # what the supervisor does from now on, while following
    try:
        final = follow_logs(store, job_id, attempt=attempt, follow=not no_follow, stage=stage,
                            progress=Progress(job_id, sys.stderr, from_start=False) if live else None)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if elsewhere is not None:
        typer.echo(elsewhere, err=True)
    if final.terminal:
        _say_end(final)


def _supervised_elsewhere(store: Any, job: Any) -> str | None:
    """Shared state: a job another runner's supervisor holds, with its kept attempt logs brought
    here; what to say of its live output. None for a job of this runner's."""
    if store.bucket is None:
        return None
    from gpuctl.managed import shared
    from gpuctl.managed.store import kept_log

    shared.pull_logs(store.bucket, job.id, lambda k: kept_log(job.id, k))
    lease = shared.read_lease(store.bucket, job.id)
    if job.terminal or lease is None or lease.runner == shared.runner_identity()["id"]:
        return None
    live = (f"; its live output: gpuctl logs {job.cluster} {job.cluster_job}" if job.cluster_job else "")
    return f"Managed job {job.id} attempt {job.attempt} is supervised by {lease.text()}{live}"


def _seconds_of(text: str, flag: str) -> float:
    """'540', '540s', '9m', '1h' -> seconds."""
    import re

    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text or "")
    if not found:
        raise UserError(f"{flag} '{text}': give a duration such as 540s, 9m or 1h")
    return float(found.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[found.group(2)]


@jobs_app.command("supervise", cls=usage.HelpCommand, epilog=usage.examples_of("jobs supervise"))
def supervise_cmd(duration: str = typer.Option(..., "--for", metavar="DURATION",
                                               help="How long this runner supervises (e.g. 9m)."),
                  poll: str = typer.Option("30s", "--poll", metavar="DURATION",
                                           help="How often it looks for jobs left without a supervisor."),
                  output_format: str = OutputOption) -> None:
    """Supervise the shared state's managed jobs from this runner for a while (a scheduled CI job):
    take over every job whose supervisor stopped renewing its lease, then hand each back once its
    ranks run and the time is up, so the next run takes it over at once."""
    from gpuctl.managed import launch, shared
    from gpuctl.managed.store import Store, job_document

    as_json = wants_json(output_format)
    span, every = _seconds_of(duration, "--for"), max(1.0, _seconds_of(poll, "--poll"))
    store = Store()
    if store.bucket is None:
        raise UserError("jobs supervise: managed jobs are this machine's without shared state (state.backend: s3 "
                        "or GPUCTL_STATE_BUCKET); here every gpuctl command starts a supervisor that died again")
    until = time.time() + span
    taken: set[int] = set()
    me = shared.runner_identity()["id"]

    def mine_running() -> list[int]:
        return [j for j in sorted(taken) if (lease := shared.read_lease(store.bucket, j)) and lease.live_here(me)]

    while True:
        taken.update(launch.revive(store, say=_tell, until=until))
        if time.time() >= until:
            break
        time.sleep(min(every, max(0.0, until - time.time())))
    waiting = mine_running()
    if waiting:
        _tell(f"Time is up: waiting for managed job(s) {', '.join(map(str, waiting))} to hand back "
              "(once every rank runs) or end")
    while waiting:
        time.sleep(2.0)
        waiting = mine_running()
    store.pull()
    jobs = [store.get(j) for j in sorted(taken)]
    if as_json:
        output.emit("jobs supervise", {"ok": True, "supervised": [job_document(j, store.events(j.id))
                                                                   for j in jobs if j is not None]})
        return
    for j in jobs:
        if j is not None:
            typer.echo(f"Managed job {j.id} ({j.name}): {j.status}" + (f", attempt {j.attempt}" if j.attempt else ""))
    if not taken:
        typer.echo("No managed job needed a supervisor.")


@jobs_app.command("cancel", cls=usage.HelpCommand, epilog=usage.examples_of("jobs cancel"))
def cancel_(job_id: int = typer.Argument(..., metavar="ID", help="Managed job id."),
            yes: bool = typer.Option(False, "-y", "--yes", help="Ask nothing (as `sky jobs cancel -y`)."),
            timeout: float = typer.Option(900, "--timeout", metavar="S", help="How long to wait for the cluster to go."),
            output_format: str = OutputOption) -> None:
    """Stop a managed job, whatever it is doing (recovering too), and remove its cluster."""
    from gpuctl.managed import launch
    from gpuctl.managed.store import job_document

    as_json = wants_json(output_format)
    store = _store()
    job = _job(store, job_id)
    say = (lambda text: typer.echo(text, err=True)) if as_json else typer.echo
    if not job.terminal:
        store.request_cancel(job_id)
        if store.bucket is None and not launch.supervisor_alive(job):
            launch.spawn(job_id)  # the supervisor is the one that takes the cluster down
        say(f"Cancelling managed job {job_id} ({job.status}); removing its cluster {job.cluster}")
        deadline = time.monotonic() + timeout
        while not job.terminal and time.monotonic() < deadline:
            time.sleep(FOLLOW_POLL_S if store.bucket is None else 2.0)
            job = store.refresh(job_id) or job
            if store.bucket is not None:
                launch.revive(store, say=_tell)
            elif not job.terminal and not launch.supervisor_alive(job) and job.supervisor_pid is not None:
                launch.revive(store)
        if not job.terminal:
            raise UserError(f"managed job {job_id}: not cancelled within {timeout:g} s (state {job.status}); "
                            f"see gpuctl jobs logs {job_id} --supervisor")
    else:
        say(f"Managed job {job_id} already ended ({job.status})")
    if as_json:
        output.emit("jobs cancel", {"ok": job.status == "CANCELLED" or job.terminal,
                                    "job": job_document(job, store.events(job_id))})
        return
    if job.status == "CANCELLED":
        say(f"Managed job {job_id} CANCELLED; cluster {job.cluster} " +
            ("removed" if job.destroyed else f"NOT fully removed: {job.reason}"))


@jobs_app.command("resume", cls=usage.HelpCommand, epilog=usage.examples_of("jobs resume"))
def resume_(job_id: int = typer.Argument(..., metavar="ID", help="A managed pipeline that did not succeed."),
            detach: bool = typer.Option(False, "-d", "--detach", help="Return once it runs again; follow with `jobs logs`."),
            output_format: str = OutputOption) -> None:
    """Run a pipeline that failed (or was cancelled) again from its first stage that did not
    succeed: the stages as they were launched; the stages that succeeded are kept, not run again."""
    import json

    from gpuctl.managed import freeze, launch, shared, stages
    from gpuctl.managed.store import job_document, write_secrets
    from gpuctl.state.registry import Registry

    as_json = wants_json(output_format)
    store = _store()
    job = store.refresh(job_id) or _job(store, job_id)  # with shared state: as the bucket has it now
    record = stages.of(job)
    if record is None:
        raise UserError(f"managed job {job_id} is one task, not a pipeline: `gpuctl jobs launch FILE` runs it again")
    if store.bucket is not None and (lease := shared.read_lease(store.bucket, job_id)) is not None \
            and not lease.expired:
        raise UserError(f"managed job {job_id} is supervised by {lease.text()}: resume it once that has ended")
    if not job.terminal:
        raise UserError(f"managed job {job_id} is {job.status}: a pipeline resumes once it ended (`gpuctl jobs "
                        f"cancel {job_id}` ends it)")
    if job.status == "SUCCEEDED":
        raise UserError(f"managed job {job_id} SUCCEEDED: every stage ran; nothing to resume")
    kept = freeze.frozen_task(job)
    problem = freeze.pull(job, store)  # with shared state: the kept stages and files, from the bucket
    if kept is None or not kept.is_file() or problem or freeze.missing_trees(job):
        raise UserError(f"managed job {job_id}: the stages as launched are no longer kept here"
                        + (f" ({problem})" if problem else "") + "; launch the pipeline again")
    found, missing = shared.missing_secrets(job.launch.get("secrets") or [])
    if missing:  # a job's secrets are dropped when it ends: given again, by name, from the environment
        raise UserError(f"managed job {job_id} needs {', '.join(missing)}: set {'it' if len(missing) == 1 else 'them'} "
                        "in the environment (a job's secrets are not kept once it ended), then resume it")
    resumed, first = stages.resumed(job.launch)
    cluster = launch.stage_cluster_name(job, first, store, Registry())
    resumed["pipeline"]["clusters"].append(cluster)
    if found:
        write_secrets(job.id, found)
    if store.bucket is not None:
        shared.clear_cancel(store.bucket, job.id)  # a cancelled pipeline's cancel is not the resumed one's
    store.update(job.id, launch=json.dumps(resumed), cluster=cluster, task_id=stages.task_id(record, first),
                 status="PENDING", reason=None, exit_code=None, failed_rank=None, ended_at=None, cluster_job=None,
                 cancel_requested=0, destroyed=0, supervisor_pid=None, supervisor_start=None, supervisor_runs=0,
                 restarts=0, transient=0)
    pid = launch.spawn(job.id)
    if not launch.wait_claimed(store, job.id, pid):
        raise UserError(f"managed job {job.id}: its supervisor did not start; see {launch.supervisor_log(job.id)}")
    stage = resumed["pipeline"]["stages"][first - 1]
    say = (lambda text: typer.echo(text, err=True)) if as_json else typer.echo
    say(f"Managed job {job.id} ({job.name}) resumes from stage {first} ({stage['name']})"
        + (f"; stage(s) 1-{first - 1} succeeded and are kept" if first > 1 else ""))
    if detach or as_json:
        if as_json:
            output.emit("jobs resume", {"ok": True, "job": job_document(store.get(job.id), store.events(job.id)),
                                        "from_stage": first})
        return
    try:
        final = follow_logs(store, job.id, attempt=None, follow=True, progress=Progress(job.id, sys.stderr,
                                                                                       from_start=False))
    except KeyboardInterrupt:
        typer.echo(f"\nStopped following; managed job {job.id} goes on. Follow again: gpuctl jobs logs {job.id}",
                   err=True)
        raise typer.Exit(130) from None
    _say_end(final)
