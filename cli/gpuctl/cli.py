"""The `gpuctl` command line: a thin typer layer over the library.

Errors are values until here: a `UserError` becomes one line on stderr and
exit code 2 (nothing provisioned), a failed job or provision exit code 1.
"""

from __future__ import annotations

import errno
import functools
import os
import shlex
import signal
import sqlite3
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, NoReturn, Optional

import typer

from gpuctl import autostopcli, cliargs, costcli, healthcli, jobscli, usage
from gpuctl.common import output
from gpuctl.common.console import Reporter
from gpuctl.common.envargs import parse_env_assignments
from gpuctl.common.errors import ClusterNotFound, JobCancelled, JobFailed, ProvisionError, UserError
from gpuctl.common.output import OutputOption, wants_json
from gpuctl.common.paths import cluster_dir, state_root
from gpuctl.jobplane import gitworkdir, joblogs, jobs
from gpuctl.jobplane.runner import JobRunner, JobSpec, LeftoverReport
from gpuctl.providers import get_provider, price_quote, request_for, resources_problem
from gpuctl.provision import lifecycle, ssh, sshconfig
from gpuctl.provision.inventory import Inventory, Node
from gpuctl.provision.lifecycle import write_ssh_config
from gpuctl.spec.request import ClusterRequest, check_cluster_name
from gpuctl.state.registry import TERMINAL_JOB_STATES, Registry

if TYPE_CHECKING:
    from gpuctl.spec import Task

# The spec (pydantic) and provisioning (Terraform) layers are imported by the
# commands that use them, so a job on a running cluster starts fast.

app = typer.Typer(
    cls=usage.HelpGroup,
    name="gpuctl",
    help="Multi-node GPU training clusters from one SkyPilot-style cluster.yaml.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: typer 0.29's rich help prints a type (`<bool>`, `<str>`)
    # beside every option, flags included; options carry their own metavars.
    rich_markup_mode=None,
)

# `exec NAME -- CMD...` and `ssh NAME -- CMD...`: main() splits argv at the first
# `--` before click sees it (click would hand the command to FILE otherwise).
_after_dashes: list[str] | None = None


def _command_after_dashes() -> list[str]:
    return list(_after_dashes or [])


FileArg = typer.Argument(..., metavar="FILE", help="Task YAML in SkyPilot's format (cluster.yaml).", show_default=False)


def _load(file: Path, env: list[str] | None, secret: list[str] | None = None, *,
          require_values: bool = True, infra: str | None = None) -> Task:
    from gpuctl.spec import load_task

    return load_task(file, env_overrides=parse_env_assignments(env or []),
                     secret_overrides=parse_env_assignments(secret or [], flag="--secret", secret=True),
                     require_values=require_values, infra_override=infra, resources_check=resources_problem)


def _warn(task: Task, req: ClusterRequest) -> list[str]:
    """One line on stderr per thing in the task gpuctl will not do as written; the warnings' texts."""
    lines = [f"warning: {w}" for w in task.warnings]
    lines += [f"warning: {w}" for w in get_provider(req.cloud).task_warnings(task, req)]
    if task.choice_note:
        lines.append(f"note: {task.choice_note}")
    for line in lines:
        typer.echo(line, err=True)
    return [line.removeprefix("warning: ") for line in lines if line.startswith("warning: ")]


def _request(task: Task, file: Path, *, cluster: str | None, infra: str | None,
             num_nodes: int | None) -> ClusterRequest:
    return request_for(task, name=cluster, infra=infra, num_nodes=num_nodes, base_dir=file.resolve().parent)


EnvOption = typer.Option(None, "--env", metavar="K=V", help="K=V (or K to take it from your environment); repeatable.")
SecretOption = typer.Option(None, "--secret", metavar="K[=V]",
                            help="K=V (or K from your environment) for secrets; never printed.")


InfraOption = typer.Option(None, "--infra", metavar="INFRA",
                           help="Override resources.infra (local, ssh/PATH, aws/REGION, aws/REGION/ZONE).")


@app.command("validate", cls=usage.HelpCommand, epilog=usage.examples_of("validate"))
def validate(file: Path = FileArg, env: Optional[List[str]] = EnvOption,
             secret: Optional[List[str]] = SecretOption, infra: Optional[str] = InfraOption,
             output_format: str = OutputOption) -> None:
    """Check a cluster.yaml as apply would, offline: nothing is provisioned or contacted."""
    from gpuctl.provision.taskchecks import check_task, ssh_reach_problem

    as_json = wants_json(output_format)
    task = _load(file, env, secret, require_values=False, infra=infra)
    req = _request(task, file, cluster=None, infra=infra, num_nodes=None)
    check_task(task, req)  # every refusal of apply that needs no node and no cloud call
    autostopcli.check_setting(task.resources.autostop, req, file)
    warnings = _warn(task, req)
    reach = ssh_reach_problem(task, req)
    if reach is not None:
        typer.echo(f"warning: {reach}", err=True)
        warnings.append(reach)
    parts = [f"{req.num_nodes} node(s) on {req.cloud}"]
    instance_type = get_provider(req.cloud).instance_type(req)
    if instance_type:
        parts.append(instance_type)
    if req.accelerator:
        parts.append(f"{req.accelerator}:{req.gpus_per_node}")
    if task.container_image:
        parts.append(f"in container {task.container_image}")
    if task.workdir_git:
        parts.append(f"workdir from git {task.workdir_git.url}")
    if task.bucket_mounts:
        parts.append(f"{len(task.bucket_mounts)} bucket mount(s)")
    if task.resources.autostop:
        parts.append(task.resources.autostop.describe())
    if task.resources.job_recovery:
        parts.append(f"job_recovery {task.resources.job_recovery.describe()} (gpuctl jobs launch)")
    price, priced_type = price_quote(req)
    if as_json:
        output.emit("validate", {
            "ok": True, "file": str(file), "cluster": req.name, "num_nodes": req.num_nodes, "cloud": req.cloud,
            "region": req.region, "zone": req.zone, "instance_type": instance_type,
            "accelerator": req.accelerator, "gpus_per_node": req.gpus_per_node,
            "container_image": task.container_image, "warnings": warnings,
            "autostop": task.resources.autostop.as_dict() if task.resources.autostop else None,
            "price": costcli.document(price, req.num_nodes, req.use_spot)})
        return
    typer.echo(f"{file}: OK ({', '.join(parts)})")
    typer.echo(costcli.describe(price, priced_type, req.num_nodes, req.use_spot))


@app.command("apply", cls=usage.HelpCommand, epilog=usage.examples_of("apply"))
def apply(
    file: Path = FileArg,
    cluster: Optional[str] = typer.Option(None, "-c", "--cluster", metavar="NAME", help="Cluster name (default: the task's name)."),
    infra: Optional[str] = InfraOption,
    num_nodes: Optional[int] = typer.Option(None, "--num-nodes", metavar="N", help="Override num_nodes."),
    env: Optional[List[str]] = EnvOption,
    secret: Optional[List[str]] = SecretOption,
    no_setup: bool = typer.Option(False, "--no-setup", help="Skip the setup stage."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the Terraform plan; create nothing."),
    provision_only: bool = typer.Option(False, "--provision-only", help="Stop after provisioning and writing the inventory."),
    detach: bool = typer.Option(False, "-d", "--detach", help="Return once every rank has started; follow with `gpuctl logs`."),
    yes: bool = typer.Option(False, "-y", "--yes", help="Ask nothing (as `sky launch -y`)."),
    idle: Optional[int] = autostopcli.IdleOption, down: bool = autostopcli.DownOption,
    lease: Optional[float] = autostopcli.LeaseOption,
    health_check: Optional[bool] = healthcli.GateOption,
    output_format: str = OutputOption,
) -> None:
    """Provision (or reuse) a cluster, sync, run setup, and run the job on every node."""
    from gpuctl.provision import provisioner
    from gpuctl.provision.taskchecks import check_task

    as_json = wants_json(output_format)
    reporter = Reporter(stream=sys.stderr) if as_json else Reporter()
    task = _load(file, env, secret, infra=infra)
    req = _request(task, file, cluster=cluster, infra=infra, num_nodes=num_nodes)
    setting = autostopcli.setting_for_apply(task, idle, down)
    req = replace(req, autodown=bool(setting and setting.down))
    autostopcli.check_setting(setting, req, file)
    check_task(task, req)  # as validate does, before anything is written or provisioned
    _warn(task, req)
    if task.resources.job_recovery is not None:
        typer.echo("warning: resources.job_recovery: `gpuctl apply` runs the job once; "
                   "`gpuctl jobs launch FILE` replaces lost nodes and restarts it", err=True)
    if dry_run:
        summary = provisioner.plan(req)
        for line in summary.describe():
            reporter.info(line)
        if as_json:
            output.emit("apply", {"ok": True, "cluster": req.name, "dry_run": True,
                                  "plan": {"add": summary.add, "change": summary.change, "destroy": summary.destroy},
                                  "lines": summary.describe()})
        return
    if not provision_only and (task.run or task.setup):
        get_provider(req.cloud).check_reach()
    registry = Registry()
    reporter.info(costcli.describe(*price_quote(req), req.num_nodes, req.use_spot))
    inv = lifecycle.bring_up(req, reporter=reporter, registry=registry, workdir=task.workdir,
                             container_image=task.container_image)
    if not as_json and not yes:
        cliargs.offer_ssh_include(reporter)
    # --down: this gpuctl removes the cluster when the job ends, after giving back its lease
    with autostopcli.down_after_job(req.name, setting, detach or provision_only or not (task.run or task.setup),
                                    reporter=reporter, registry=registry), \
            autostopcli.arm_for_apply(inv, setting, registry=registry, lease_minutes=lease, reporter=reporter):
        if not provision_only and (task.run or task.setup):
            healthcli.gate(inv, registry=registry, reporter=reporter, wanted=health_check)
        _apply_job(task, req, inv, registry, reporter, as_json=as_json, provision_only=provision_only,
                   no_setup=no_setup, detach=detach)


def _apply_job(task: Task, req: ClusterRequest, inv: Inventory, registry: Registry, reporter: Reporter, *,
               as_json: bool, provision_only: bool, no_setup: bool, detach: bool) -> None:
    from gpuctl.provision import provisioner

    if provision_only or not task.run and not task.setup:
        reporter.info(f"Cluster '{req.name}' is up; inventory: {provisioner.inventory_path(req.name)}")
        if as_json:
            cliargs.emit_apply(registry, req.name, inv, job_id=None, phases=reporter.phases)
        return
    spec = JobSpec.of_task(task, req)
    job_id: int | None = None
    try:
        with ExitStack() as stack:  # a git workdir's clone lives until the job's copy to the head is done
            if (git := task.workdir_git) is not None:
                with reporter.stage(f"Cloning {gitworkdir.shown(git.url)}" + (f" at {git.ref}" if git.ref else "")):
                    clone = stack.enter_context(gitworkdir.checkout(git.url, git.ref, parent=state_root()))
                spec = replace(spec, workdir=clone.path, envs={**clone.envs, **spec.envs})
            job_id = _run(JobRunner(inv, reporter=reporter, registry=registry), spec, run_setup=not no_setup,
                          sync_file_mounts=True, detach=detach)
    except JobFailed:
        if as_json:  # the failed job is the result: its document, then the error line and exit code 1
            cliargs.emit_apply(registry, req.name, inv, job_id=None, latest_job=True, phases=reporter.phases)
        raise
    if as_json:
        cliargs.emit_apply(registry, req.name, inv, job_id=job_id, phases=reporter.phases)



# `sky launch` is how SkyPilot users bring a cluster up and run a task: the same command here.
app.command("launch", cls=usage.HelpCommand, help="Alias of `apply` (SkyPilot's `sky launch`).",
            epilog=usage.examples_of("launch"))(apply)
autostopcli.register(app)
costcli.register(app)
jobscli.register(app)
healthcli.register(app)


def _run(runner: JobRunner, spec: JobSpec, *, run_setup: bool, sync_file_mounts: bool, detach: bool) -> int:
    """Run the job; its id."""
    try:
        outcome = runner.run(spec, run_setup=run_setup, sync_file_mounts=sync_file_mounts, detach=detach)
    except KeyboardInterrupt:
        raise JobCancelled("job cancelled (Ctrl-C); its processes were stopped on every node") from None
    if outcome.status == "RUNNING":
        name, job_id = runner.inv.cluster, outcome.job_id
        runner.reporter.info(f"Job {job_id} detached. Follow it: gpuctl logs {name} {job_id}; "
                             f"cancel it: gpuctl cancel {name} {job_id}")
    return outcome.job_id


def _job_runner(name: str, reporter: Reporter | None = None) -> JobRunner:
    """The job runner of an existing cluster (its inventory, the registry)."""
    return JobRunner(cliargs.cluster_inventory(name), reporter=reporter or Reporter(), registry=Registry())


@app.command("status", cls=usage.HelpCommand, epilog=usage.examples_of("status"))
def status(name: Optional[str] = typer.Argument(None, metavar="NAME", help="Cluster name (default: all clusters)."),
           refresh: bool = typer.Option(False, "--refresh", "-r",
                                        help="Check Terraform state and whether each node answers over SSH."),
           output_format: str = OutputOption) -> None:
    """Show clusters, their nodes and addresses, the fabric prepare found on each, and their last jobs."""
    from gpuctl.provision import provisioner
    from gpuctl.configplane import fabricrecord
    from gpuctl.healthcheck import health

    as_json = wants_json(output_format)
    registry = Registry()
    if name:
        registry.adopt(check_cluster_name(name))
    else:
        registry.adopt_all()
    records = [registry.cluster(check_cluster_name(name))] if name else registry.clusters()
    if name and records[0] is None:
        raise ClusterNotFound(name)
    if as_json:
        docs = []
        for rec in records:
            assert rec is not None
            inv = provisioner.load_inventory_of(rec.name)
            doc = output.cluster_doc(rec, inv, (registry.jobs(rec.name) or [None])[-1])
            doc.update(autostopcli.status_of(rec.name, rec.status, registry)[1])
            doc.update(costcli.cluster_cost(rec.name, registry, rec.created_at))
            detected = fabricrecord.load_fabric(cluster_dir(rec.name)) or {}
            by_rank = {n.get("rank"): n for n in detected.get("nodes", []) if isinstance(n, dict)}
            doc["fabric"] = detected.get("kind")
            checked = health.last_verdicts(cluster_dir(rec.name), inv) if inv is not None else {}
            for node in doc["nodes"]:
                node["health_check"] = health.status_doc(checked.get(node["rank"]))
                found = by_rank.get(node["rank"])
                node["fabric"] = None if found is None else {
                    "kind": found.get("kind"), "interface": found.get("interface"),
                    "active_ports": found.get("active_ports") or [], "summary": fabricrecord.node_line(found)}
            if refresh and inv is not None:
                reach = cliargs.node_health(inv)
                doc["terraform"] = provisioner.state_drift(rec.name)
                for node in doc["nodes"]:
                    node["health"] = reach.get(node["rank"])
            docs.append(doc)
        output.emit("status", {"ok": True, "clusters": docs})
        return
    if not records:
        typer.echo("No clusters.")
        return
    for rec in records:
        assert rec is not None
        where = "/".join(p for p in (rec.cloud, rec.region, rec.zone) if p)
        lines, fields = autostopcli.status_of(rec.name, rec.status, registry)
        typer.echo(f"{rec.name}: {fields.get('status', rec.status)}, {rec.num_nodes} node(s) on {where}")
        for line in [costcli.status_line(costcli.cluster_cost(rec.name, registry, rec.created_at)), *lines]:
            typer.echo(line)
        inv = None if fields.get("status") else provisioner.load_inventory_of(rec.name)
        health_of: dict[int, str] = {}
        if inv is not None and refresh:
            health_of = cliargs.node_health(inv)
            typer.echo(f"  terraform: {provisioner.state_drift(rec.name)}")
        if inv is not None:
            fabrics = fabricrecord.status_lines(cluster_dir(rec.name))
            checked = health.last_verdicts(cluster_dir(rec.name), inv)
            for node in inv.nodes:
                typer.echo(f"  {node.name:<10} rank={node.rank:<3} {node.address:<16} "
                           f"ssh {node.ssh_user}@{node.ssh_host}:{node.ssh_port}"
                           + (f"  fabric {fabrics[node.rank]}" if node.rank in fabrics else "")
                           + (f"  {health_of[node.rank]}" if node.rank in health_of else "")
                           + (f"  {health.status_text(checked[node.rank])}" if node.rank in checked else ""))
        jobs = registry.jobs(rec.name)
        if jobs:
            last = jobs[-1]
            typer.echo(f"  last job: {last.job_id} {last.status}")


@app.command("exec", cls=usage.DashCommand, epilog=usage.examples_of("exec"))
def exec_(
    name: str = typer.Argument(..., metavar="NAME", help="A running cluster."),
    entrypoint: Optional[str] = typer.Argument(None, metavar="FILE|COMMAND", help="A task YAML whose run (and workdir, envs) to use, or a command string run by bash on every node (as `sky exec`); or the command's words after `--`."),
    num_nodes: Optional[int] = typer.Option(None, "--num-nodes", metavar="N", help="Run on the first K nodes only (ranks 0..K-1)."),
    env: Optional[List[str]] = EnvOption,
    secret: Optional[List[str]] = SecretOption,
    workdir: Optional[Path] = typer.Option(None, "--workdir", metavar="DIR", help="With -- COMMAND: the directory to sync (default: the workdir of the last apply)."),
    detach: bool = typer.Option(False, "-d", "--detach", help="Return once every rank has started."),
    output_format: str = OutputOption,
) -> None:
    """Sync the workdir and run on a running cluster: no provisioning, no setup, no file_mounts."""
    as_json = wants_json(output_format)
    reporter = Reporter(stream=sys.stderr) if as_json else Reporter()
    inv = cliargs.cluster_inventory(name)
    registry = Registry()
    # What the last apply left: its workdir (for `-- COMMAND`) and container image (every exec, as `sky exec`).
    record = registry.cluster(name)
    last_apply = record.request if record else {}
    command = _command_after_dashes()
    if entrypoint is not None and command:
        raise UserError("give either a task FILE, a command string or `-- COMMAND...`, not two of them")
    if entrypoint is None and not command:
        raise UserError(f"nothing to run: `gpuctl exec {name} task.yaml`, `gpuctl exec {name} 'COMMAND'` or "
                        f"`gpuctl exec {name} -- COMMAND...`")
    if entrypoint is not None and not entrypoint.strip():
        raise UserError("the command string is empty: give a command, such as `gpuctl exec NAME 'hostname'`")
    file = Path(entrypoint) if entrypoint is not None and cliargs.names_task_file(entrypoint) else None
    envs = parse_env_assignments(env or [])
    if file is not None:
        task = _load(file, env, secret)
        if not task.run:
            raise UserError(f"{file}: run: the task has no run command to execute")
        spec_workdir, run, envs, secrets, job_name = task.workdir, task.run, dict(task.envs), dict(task.secrets), task.name
    else:
        last_workdir = last_apply.get("workdir")
        spec_workdir = workdir.resolve() if workdir else (Path(last_workdir) if last_workdir else None)
        if workdir is None and spec_workdir is not None and not spec_workdir.is_dir():
            # applied from another machine (shared state): the nodes keep the workdir that apply synced
            reporter.info(f"note: the last apply's workdir {spec_workdir} is not on this machine; running in the "
                          "copy the nodes have (--workdir DIR syncs one)")
            spec_workdir = None
        if spec_workdir is not None and not spec_workdir.is_dir():
            raise UserError(f"--workdir {spec_workdir}: not a directory")
        # A string (as `sky exec CLUSTER 'CMD'`) is a bash script; the words after `--` are the argv,
        # kept as given (as `kubectl exec` and `docker exec`).
        run = entrypoint if entrypoint is not None else shlex.join(command)
        secrets = parse_env_assignments(secret or [], flag="--secret", secret=True)
        job_name = cliargs.shortened(" ".join(run.split()))  # what `queue` shows for it
    # Like `sky exec`: a task file's num_nodes picks the first K nodes, --num-nodes wins.
    k = num_nodes if num_nodes is not None else (task.num_nodes if file is not None else len(inv.nodes))
    if not 1 <= k <= len(inv.nodes):
        where = "--num-nodes" if num_nodes is not None else f"{file}: num_nodes"
        raise UserError(f"{where} {k}: cluster '{name}' has {len(inv.nodes)} node(s); use 1..{len(inv.nodes)}")
    spec = JobSpec(name=job_name, run=run, workdir=spec_workdir, envs=envs, secrets=secrets, num_nodes=k,
                   gpus_per_node=inv.head.gpus, container_image=last_apply.get("container_image"),
                   workdir_implied=file is None and workdir is None)
    try:
        job_id = _run(JobRunner(inv, reporter=reporter, registry=registry), spec, run_setup=False,
                      sync_file_mounts=False, detach=detach)
    except JobFailed:
        if as_json:  # as apply: the failed job is the result
            _emit_job("exec", registry, name, (registry.jobs(name) or [None])[-1])
        raise
    if as_json:
        _emit_job("exec", registry, name, registry.job(name, job_id))


def _emit_job(command: str, registry: Registry, name: str, job: Any) -> None:
    """exec's JSON document: the job it ran (null if it never got an id)."""
    output.emit(command, {"ok": job is not None and job.status in ("SUCCEEDED", "RUNNING"), "cluster": name,
                          "job": output.job_doc(job) if job is not None else None})


def _fmt_time(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


@app.command("queue", cls=usage.HelpCommand, epilog=usage.examples_of("queue"))
def queue(name: str = typer.Argument(..., metavar="NAME", help="Cluster whose jobs to list."),
          output_format: str = OutputOption) -> None:
    """List a cluster's jobs: state, start and end time, and each rank's exit code."""
    as_json = wants_json(output_format)
    runner = _job_runner(name, Reporter(stream=sys.stderr) if as_json else None)
    registry = runner.registry
    rows = [jobs.refresh(runner, job) for job in registry.jobs(name)]
    if as_json:
        output.emit("queue", {"ok": True, "cluster": name, "jobs": [output.job_doc(j) for j in rows]})
        return
    if not rows:
        typer.echo(f"No jobs on cluster '{name}'.")
        return
    typer.echo(f"{'ID':>4}  {'NAME':<24} {'STATUS':<13} {'SUBMITTED':<19}  {'STARTED':<19}  {'ENDED':<19}  {'NODES':>5}  RETURN CODES")
    for job in rows:
        codes = ",".join("?" if c is None else str(c) for _, c in sorted(job.returncodes.items())) or "-"
        typer.echo(f"{job.job_id:>4}  {cliargs.shortened(job.name or '-', 24):<24} {job.status:<13} {_fmt_time(job.submitted_at):<19}  "
                   f"{_fmt_time(job.started_at):<19}  {_fmt_time(job.ended_at):<19}  {job.num_nodes:>5}  {codes}")


@app.command("logs", cls=usage.HelpCommand, epilog=usage.examples_of("logs"))
def logs(
    name: str = typer.Argument(..., metavar="NAME", help="Cluster."),
    job_id: Optional[int] = typer.Argument(None, metavar="JOB", help="Job id (default: the latest job)."),
    rank: Optional[int] = typer.Option(None, "--rank", metavar="N", help="Only this rank's output."),
    follow: bool = typer.Option(True, "--follow/--no-follow", help="Keep streaming until the job ends."),
    status_only: bool = typer.Option(False, "--status", help="Print no logs; exit 0 if the job succeeded "
                                     "(100 failed, 101 not finished, 103 cancelled)."),
    output_format: str = OutputOption,
) -> None:
    """Show a job's output, live or after the fact."""
    as_json = wants_json(output_format)
    if as_json and not status_only:
        raise UserError("--output json: with `gpuctl logs` only together with --status (logs are text)")
    runner = _job_runner(name, Reporter(stream=sys.stderr) if as_json else None)
    reporter, inv, registry = runner.reporter, runner.inv, runner.registry
    job = jobs.refresh(runner, jobs.resolve_job(registry, name, job_id))
    nodes = jobs.job_nodes(inv, job)
    if rank is not None:
        if not 0 <= rank < len(nodes):
            raise UserError(f"--rank {rank}: job {job.job_id} ran on ranks 0..{len(nodes) - 1}")
        nodes = tuple(n for n in nodes if n.rank == rank)
    if status_only:
        code = jobs.STATUS_EXIT.get(job.status, jobs.NOT_FINISHED_EXIT)
        if as_json:
            output.emit("logs", {"ok": code == 0, "cluster": name, "job": output.job_doc(job), "exit_code": code})
        else:
            typer.echo(f"Job {job.job_id}: {job.status}" + "".join(f"; {line}" for line in cliargs.failure_lines(inv, job)))
        raise typer.Exit(code)
    ranks = [n.rank for n in nodes]
    if job.status in TERMINAL_JOB_STATES and jobs.print_saved_logs(reporter, inv, job, ranks):
        raise typer.Exit(jobs.STATUS_EXIT.get(job.status, 0) and 1)
    if follow and job.status not in TERMINAL_JOB_STATES:
        job = jobs.follow_job(runner, job, nodes)
    else:
        joblogs.fetch(inv, job.job_id, job.node_job, control_dir=runner.control_dir)
        jobs.print_saved_logs(reporter, inv, job, ranks)
    if job.status in ("FAILED", "FAILED_SETUP", "CANCELLED"):
        raise typer.Exit(1)


@app.command("cancel", cls=usage.HelpCommand, epilog=usage.examples_of("cancel"))
def cancel(
    name: str = typer.Argument(..., metavar="NAME", help="Cluster."),
    job_id: Optional[int] = typer.Argument(None, metavar="JOB", help="Job id (default: the latest unfinished job)."),
    all_jobs: bool = typer.Option(False, "--all", "-a", help="Cancel every unfinished job."),
    output_format: str = OutputOption,
) -> None:
    """End a job on every node (its whole process tree) and mark it CANCELLED."""
    as_json = wants_json(output_format)
    say = functools.partial(typer.echo, err=as_json)
    runner = _job_runner(name, Reporter(stream=sys.stderr) if as_json else None)
    inv, registry = runner.inv, runner.registry
    if all_jobs and job_id is not None:
        raise UserError("give a JOB id or --all, not both")
    unfinished = [j for j in registry.jobs(name) if j.status not in TERMINAL_JOB_STATES]
    stopped: dict[str, list[int]] = {}  # an ended job's leftovers, by job id
    if job_id is not None:
        target = [jobs.resolve_job(registry, name, job_id)]
        if target[0].status in TERMINAL_JOB_STATES:
            # Its record can be right while a rank whose owner was killed still runs: ask every node.
            ended = target[0]
            report = runner.stop_leftovers(ended.job_id, jobs.job_nodes(inv, ended))
            say(f"Job {job_id} already ended: {ended.status}; " + _describe_leftovers(inv, report))
            stopped[str(ended.job_id)] = list(report.stopped)
            target = []
    else:
        target = unfinished if all_jobs else unfinished[-1:]
        if not target:
            say(f"No unfinished jobs on cluster '{name}'.")
    for job in target:
        report = runner.cancel(job.job_id, jobs.job_nodes(inv, job))
        say(f"Job {job.job_id} cancelled on {job.num_nodes} node(s)."
            + (f" {_describe_leftovers(inv, report)}" if report.unreachable else ""))
    if as_json:  # the jobs asked about, as they are now (an ended one keeps its status)
        asked = [jobs.resolve_job(registry, name, job_id)] if job_id is not None else target
        output.emit("cancel", {"ok": True, "cluster": name, "cancelled": [j.job_id for j in target],
                               "leftovers_stopped": stopped,
                               "jobs": [output.job_doc(row) for j in asked
                                        if (row := registry.job(name, j.job_id)) is not None]})


def _describe_leftovers(inv: Inventory, report: LeftoverReport) -> str:
    """What the nodes' agents found of a job: stopped leftovers, nothing, or nodes not reached."""
    names = {n.rank: f"{n.name} (rank {n.rank})" for n in inv.nodes}
    parts = []
    if report.stopped:
        parts.append("stopped what still ran of it on " + ", ".join(names.get(r, str(r)) for r in report.stopped))
    if report.unreachable:
        parts.append("could not reach " + ", ".join(names.get(r, str(r)) for r in report.unreachable)
                     + " to stop what may still run there")
    return "; ".join(parts) or "nothing of it was running on its nodes"


@app.command("ssh-config", cls=usage.HelpCommand, epilog=usage.examples_of("ssh-config"))
def ssh_config(name: Optional[str] = typer.Argument(None, metavar="NAME", help="Cluster (default: every cluster).")) -> None:
    """Write OpenSSH config for a cluster's nodes, `Host NAME` for the head and `Host NAME-workerN` for the others."""
    names = [check_cluster_name(name)] if name else [c.name for c in Registry().clusters()]
    paths = [write_ssh_config(cliargs.cluster_inventory(n)) for n in names]
    for p in paths:
        typer.echo(str(p))
    typer.echo(f"Use: ssh -F {paths[0] if len(paths) == 1 else state_root() / 'ssh' / 'config'} HOST, "
               f"or add `Include {state_root() / 'ssh' / 'config'}` to ~/.ssh/config")


@app.command("inventory", cls=usage.HelpCommand, epilog=usage.examples_of("inventory"))
def inventory_(name: str = typer.Argument(..., metavar="NAME", help="Cluster."),
               fmt: str = typer.Option("ansible", "--format", "-f", metavar="FORMAT",
                                       help="ansible (YAML), json, hostfile (MPI/DeepSpeed) or ssh-config.")) -> None:
    """Print the cluster's inventory for your own tools: Ansible, MPI, DeepSpeed, ssh."""
    from gpuctl.provision import inventoryexport

    if fmt.strip().lower() not in inventoryexport.FORMATS:
        raise UserError(f"--format {fmt}: use one of {', '.join(inventoryexport.FORMATS)}")
    inv = cliargs.cluster_inventory(name)
    sys.stdout.write(inventoryexport.export(inv, fmt, ssh_config_path=state_root() / "ssh" / f"{name}.conf"))


@app.command("ssh", cls=usage.DashCommand, epilog=usage.examples_of("ssh"))
def ssh_(name: str = typer.Argument(..., metavar="NAME", help="Cluster."),
         node: Optional[str] = typer.Argument(None, metavar="NODE", help="A node's name (head, worker2) or rank (default: the head)."),
         rank: Optional[int] = typer.Option(None, "--rank", metavar="N", help="Node rank (0 = head); the same as NODE."),
         ) -> None:
    """SSH into a node (default: the head); the words after `--` run there as a command."""
    inv = cliargs.cluster_inventory(name)
    if node is not None and rank is not None:
        raise UserError("give the node either as NODE or as --rank, not both")
    if rank is not None and not 0 <= rank < len(inv.nodes):
        raise UserError(f"--rank {rank}: cluster '{name}' has ranks 0..{len(inv.nodes) - 1}")
    target = cliargs.node_of(inv, name, node) if node is not None else inv.nodes[rank or 0]
    conf = write_ssh_config(inv)
    alias = sshconfig.host_alias(name, target)
    command = _command_after_dashes()
    argv = ["ssh", "-F", str(conf), "--", alias, *command]
    sys.stdout.flush()
    os.execvp("ssh", argv)


@app.command("forget-host-key", cls=usage.HelpCommand, epilog=usage.examples_of("forget-host-key"))
def forget_host_key(name: str = typer.Argument(..., metavar="NAME", help="Cluster."),
                    node: str = typer.Argument(..., metavar="NODE", help="Node name (head, worker1, ...) or rank.")
                    ) -> None:
    """Forget a node's SSH host key (after you rebuilt the machine); the next job learns the new one."""
    from gpuctl.configplane import prepare

    inv = cliargs.cluster_inventory(name)
    target = cliargs.node_of(inv, name, node)
    if not target.known_hosts:
        raise UserError(f"cluster '{name}' keeps no host keys")
    dropped = ssh.forget_host_keys(Path(target.known_hosts), {target.host_key_alias})
    prepare.forget(cluster_dir(name), [target])  # prepared again; the others learn its key from the next job
    typer.echo(f"Forgot {dropped} host key(s) of {target.name} ({target.ssh_host}); the next job learns its key "
               "again and copies it to the other nodes")


@app.command("force-unlock", cls=usage.HelpCommand, epilog=usage.examples_of("force-unlock"))
def force_unlock(name: str = typer.Argument(..., metavar="NAME", help="Cluster whose lock to remove.")) -> None:
    """Remove a cluster's lock in the shared state bucket, left by a runner that died (as `terraform force-unlock`)."""
    from gpuctl.state.remotestate.store import break_lock, holder_text

    check_cluster_name(name)
    registry = Registry()
    if registry.remote is None:
        raise UserError("force-unlock: state is local (no state.bucket in config.yaml or GPUCTL_STATE_BUCKET); "
                        "a local lock is released when its gpuctl exits")
    holder = break_lock(registry.remote.store, name)
    if holder is None:
        typer.echo(f"Cluster '{name}' is not locked.")
        return
    typer.echo(f"Removed the lock of cluster '{name}' held by {holder_text(holder)}; make sure that runner is gone, "
               f"then re-run your command (Terraform's own state lock, if left, is in its .tflock next to the state)")


@app.command("_watch", hidden=True)
def watch_(name: str, job_id: int) -> None:
    """Background watcher of a detached job (started by `-d`)."""
    runner = _job_runner(name, Reporter(plain=True))
    job = jobs.resolve_job(runner.registry, name, job_id)
    job_nodes = jobs.job_nodes(runner.inv, job)
    joblogs.mark_watching(name, job.job_id)
    try:
        outcome = runner.attach(job.job_id, job_nodes, echo=False)
        if runner.registry.job(name, job.job_id).status not in TERMINAL_JOB_STATES:  # type: ignore[union-attr]
            runner.conclude(job.job_id, job_nodes, outcome)
    except JobFailed as exc:
        print(exc.message)
    finally:
        joblogs.unmark_watching(name, job.job_id)


@app.command("down", cls=usage.HelpCommand, epilog=usage.examples_of("down"))
def down(names: list[str] = typer.Argument(None, metavar="NAME...", help="Clusters to tear down.", show_default=False),
         all_clusters: bool = typer.Option(False, "-a", "--all", help="Tear down every cluster gpuctl knows."),
         yes: bool = typer.Option(False, "-y", "--yes", help="Accepted as `sky down -y`: down never asks."),
         output_format: str = OutputOption) -> None:
    """Destroy clusters (terraform destroy) and forget them; one that does not exist is passed over."""
    as_json, registry = wants_json(output_format), Registry()
    reporter = Reporter(stream=sys.stderr) if as_json else Reporter()
    results = lifecycle.tear_down_all(cliargs.down_targets(names or [], all_clusters, registry), reporter=reporter,
                                      registry=registry)
    if not results:
        reporter.info("No clusters to tear down.")
    if as_json:  # destroyed: false when nothing was provisioned behind a record (found) or no record (not found)
        output.emit("down", cliargs.down_document(results, one=bool(names) and len(results) == 1))
    if any(r.error for r in results):
        failed = [r.cluster for r in results if r.error]
        raise ProvisionError(f"{len(failed)} of {len(results)} cluster(s) not torn down: {', '.join(failed)}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gpuctl {package_version()}")
        raise typer.Exit(0)


@app.command("version", cls=usage.HelpCommand, epilog=usage.examples_of("version"))
def version_(output_format: str = OutputOption) -> None:
    """Print gpuctl's version (as `gpuctl --version`)."""
    if wants_json(output_format):
        output.emit("version", {"ok": True, "version": package_version()})
        return
    typer.echo(f"gpuctl {package_version()}")


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, metavar="",
                                       help="Print gpuctl's version and exit.")) -> None:
    """Multi-node GPU training clusters from one SkyPilot-style cluster.yaml."""


def package_version() -> str:
    """The installed distribution's version (what `pip show gpuctl` says)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpuctl")
    except PackageNotFoundError:  # running from a source tree that was never installed
        from gpuctl import __version__

        return __version__


def _misplaced_dashes(argv: list[str]) -> None:
    """`--` outside `exec`/`ssh`: the usage line and one error line, exit 2."""
    words = [w for w in argv if not w.startswith("-")]
    command = words[0] if words and words[0] in _command_names() else None
    print(f"Usage: gpuctl {command + ' ' if command else ''}[OPTIONS] ...", file=sys.stderr)
    where = f"`gpuctl {command}` takes no `-- COMMAND...`" if command else "`--` is misplaced"
    print(f"error: {where}; only `gpuctl exec NAME -- COMMAND...` and "
          f"`gpuctl ssh NAME -- COMMAND...` take one", file=sys.stderr)
    sys.exit(2)


def _command_names() -> set[str]:
    return {c.name or c.callback.__name__ for c in app.registered_commands if c.callback is not None}


def main() -> None:
    global _after_dashes
    # Ctrl-C and SIGTERM both end the job on every node (jobplane.runner.JobRunner.watch);
    # set explicitly since a parent may have started us with SIGINT ignored.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    # Everything gpuctl writes (state dir, Terraform state, ansible-runner artifacts,
    # logs) is private to the user: group and others get no bits.
    os.umask(0o077)
    argv = sys.argv[1:] or ["--help"]  # a bare `gpuctl` shows the help, as `sky` does, and exits 0
    if "--" in argv:
        cut = argv.index("--")
        argv, _after_dashes = argv[:cut], argv[cut + 1:]
        if not argv or argv[0] not in ("exec", "ssh"):
            _misplaced_dashes(argv)
    jobscli.revive_supervisors(argv)  # any command: a managed job whose supervisor died gets one again
    try:
        # Without standalone mode click returns typer.Exit's code instead of
        # raising it, and leaves usage errors to us (usage.report).
        rv = app(args=argv, prog_name="gpuctl", standalone_mode=False)
    except (UserError, JobFailed, ProvisionError) as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        _exit_with_error(argv, exc.message, exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        _exit_with_error(argv, "interrupted", 130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (sqlite3.OperationalError, OSError) as exc:
        # The state dir is full or unwritable: say so in one line. Jobs keep their outcome on
        # the head (job.json), and `queue` / `logs` bring the registry up to date later.
        full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)) or (
            isinstance(exc, sqlite3.OperationalError) and ("disk" in str(exc) or "readonly" in str(exc)))
        if not full:
            raise
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        message = (f"cannot write gpuctl's state in {state_root()}: {why}; free some space or fix its "
                   "permissions, then `gpuctl queue NAME` brings the cluster's jobs up to date")
        print(f"error: {message}", file=sys.stderr)
        _exit_with_error(argv, message, 1)
    except (typer.Abort, usage.Abort):  # type: ignore[misc]
        print("aborted", file=sys.stderr)
        _exit_with_error(argv, "aborted", 1)
    except usage.ClickException as exc:
        _exit_with_error(argv, exc.format_message().rstrip("."), usage.report(exc, app, argv))
    sys.exit(rv if isinstance(rv, int) else 0)


def _exit_with_error(argv: list[str], message: str, code: int) -> NoReturn:
    """Exit with `code`; with `--output json`, after the error's document on stdout unless one was printed."""
    if output.json_requested(argv) and not output.emitted():
        output.emit_error(next((w for w in argv if w in _command_names()), None), message, code)
    sys.exit(code)
