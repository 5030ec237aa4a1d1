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
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, NoReturn, Optional

import typer

from gpuctl import (autostopcli, cliargs, costcli, dashboardcli, entrypoints, healthcli, jobscli, logscli,
                    pipelinecli, powercli, usage)
from gpuctl.common import output
from gpuctl.common.envargs import parse_env_assignments
from gpuctl.common.errors import ClusterNotFound, JobCancelled, JobDetached, JobFailed, ProvisionError, UserError
from gpuctl.common.output import OutputOption, wants_json
from gpuctl.common.paths import cluster_dir, state_root

if TYPE_CHECKING:
    from gpuctl.common.console import Reporter
    from gpuctl.jobplane.runner import JobRunner, JobSpec
    from gpuctl.provision.inventory import Inventory
    from gpuctl.spec import Task
    from gpuctl.spec.request import ClusterRequest
    from gpuctl.state.registry import Registry

# Every layer below this one (the registry, providers, the spec, provisioning) is imported by the
# commands that use it: `gpuctl --help` loads none of them, and a job on a running cluster starts fast.

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
          require_values: bool = True, infra: str | None = None, text: str | None = None) -> Task:
    from gpuctl.providers import resources_problem
    from gpuctl.spec import load_task

    return load_task(file, env_overrides=parse_env_assignments(env or []),
                     secret_overrides=parse_env_assignments(secret or [], flag="--secret", secret=True),
                     require_values=require_values, infra_override=infra, resources_check=resources_problem,
                     text=text)


def _entry(words: list[str], env: list[str] | None, secret: list[str] | None, *, infra: str | None,
           cluster: str | None) -> tuple[Task, Path, str | None, str | None]:
    """apply's FILE|COMMAND as (task, the file its paths are relative to, cluster name, the note to say
    before anything is made): a task YAML, or a command (`gpuctl launch 'echo hi'`, as `sky launch`)
    made into the task of that `run` and loaded as any YAML, on a new cluster named as SkyPilot names
    one unless -c gives it."""
    entrypoint = entrypoints.launch_entrypoint(words)
    if not entrypoints.is_command(entrypoint):
        return _load(Path(entrypoint), env, secret, infra=infra), Path(entrypoint), cluster, None
    source, cluster = Path(entrypoints.COMMAND_SOURCE), cluster or entrypoints.generated_cluster_name()
    task = _load(source, env, secret, infra=infra, text=entrypoints.command_task_text(entrypoint))
    return task, source, cluster, entrypoints.command_note(entrypoint, cluster)


def _warn(task: Task, req: ClusterRequest) -> list[str]:
    """One line on stderr per thing in the task gpuctl will not do as written; the warnings' texts."""
    from gpuctl.providers import get_provider

    lines = [f"warning: {w}" for w in task.warnings]
    lines += [f"warning: {w}" for w in get_provider(req.cloud).task_warnings(task, req)]
    if task.choice_note:
        lines.append(f"note: {task.choice_note}")
    for line in lines:
        typer.echo(line, err=True)
    return [line.removeprefix("warning: ") for line in lines if line.startswith("warning: ")]


def _request(task: Task, file: Path, *, cluster: str | None, infra: str | None,
             num_nodes: int | None) -> ClusterRequest:
    from gpuctl.providers import request_for

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
    from gpuctl.providers import get_provider, price_quote
    from gpuctl.common.yamlfile import read_text
    from gpuctl.provision.taskchecks import check_task, ssh_reach_problem
    from gpuctl.spec.pipeline import is_pipeline
    from gpuctl.spec.request import describe_cluster_name

    as_json = wants_json(output_format)
    text = read_text(file, what="task YAML file", source=str(file))
    if is_pipeline(text):  # several tasks in one file: every stage checked, each error naming its stage
        pipelinecli.validate(
            file, text, load=lambda stage: _load(file, env, secret, require_values=False, infra=infra, text=stage),
            request=lambda task: _request(task, file, cluster=None, infra=infra, num_nodes=None),
            check=lambda task, req: (check_task(task, req),
                                     autostopcli.check_setting(task.resources.autostop, req, file)),
            as_json=as_json)
        return
    task = _load(file, env, secret, require_values=False, infra=infra, text=text)
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
    typer.echo(f"{file}: OK ({', '.join(parts)}); cluster {describe_cluster_name(req.name, task.name)}")
    typer.echo(costcli.describe(price, priced_type, req.num_nodes, req.use_spot))


@app.command("apply", cls=entrypoints.LaunchCommand, epilog=usage.examples_of("apply"))
def apply(
    file: List[str] = typer.Argument(..., metavar="FILE|COMMAND...", show_default=False,
                                     help="Task YAML in SkyPilot's format (cluster.yaml), or a command (quoted, or "
                                          "its words after gpuctl's options) to run on a new cluster, as `sky "
                                          "launch 'CMD'`: one node on the default infra, local, unless -c, --infra, "
                                          "--num-nodes say otherwise."),
    cluster: Optional[str] = typer.Option(None, "-c", "--cluster", metavar="NAME", help="Cluster name (default: the task's name)."),
    infra: Optional[str] = InfraOption,
    num_nodes: Optional[int] = typer.Option(None, "--num-nodes", metavar="N", help="Override num_nodes."),
    env: Optional[List[str]] = EnvOption,
    secret: Optional[List[str]] = SecretOption,
    no_setup: bool = typer.Option(False, "--no-setup", help="Skip the setup stage."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the Terraform plan; create nothing."),
    provision_only: bool = typer.Option(False, "--provision-only", help="Stop after provisioning and writing the inventory."),
    detach: bool = typer.Option(False, "-d", "--detach", help="Return once every rank has started; follow with `gpuctl logs`."),
    cancel_on_interrupt: bool = cliargs.CancelOnInterruptOption,
    yes: bool = typer.Option(False, "-y", "--yes", help="Ask nothing (as `sky launch -y`)."),
    idle: Optional[int] = autostopcli.IdleOption, down: bool = autostopcli.DownOption,
    lease: Optional[float] = autostopcli.LeaseOption,
    health_check: Optional[bool] = healthcli.GateOption,
    output_format: str = OutputOption,
) -> None:
    """Provision (or reuse) a cluster, sync, run setup, and run the job on every node."""
    from gpuctl.common.console import Reporter
    from gpuctl.providers import get_provider, price_quote
    from gpuctl.provision import bringuprecord, lifecycle, provisioner
    from gpuctl.provision.taskchecks import check_task
    from gpuctl.state.registry import Registry

    as_json = wants_json(output_format)
    reporter = Reporter(stream=sys.stderr) if as_json else Reporter()
    task, path, cluster, note = _entry(file, env, secret, infra=infra, cluster=cluster)
    req = _request(task, path, cluster=cluster, infra=infra, num_nodes=num_nodes)
    setting = autostopcli.setting_for_apply(task, idle, down)
    req = replace(req, autodown=bool(setting and setting.down))
    autostopcli.check_setting(setting, req, path)
    check_task(task, req)  # as validate does, before anything is written or provisioned
    _warn(task, req)
    if note is not None:  # a command, not a file: said once it passed every check
        typer.echo(note, err=True)
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
                             container_image=task.container_image,
                             on_destroy=cliargs.consent_to_destroy(req.name, yes=yes, registry=registry,
                                                                   reporter=reporter))
    if not as_json:
        cliargs.hint_ssh_include(reporter)
    docs: list[dict] = []  # -o json: the document, printed once --down had its say
    try:
        # --down: this gpuctl removes the cluster when the job ends, after giving back its lease
        with autostopcli.down_after_job(req.name, setting, detach or provision_only or not (task.run or task.setup),
                                        reporter=reporter, registry=registry), \
                autostopcli.arm_for_apply(inv, setting, registry=registry, lease_minutes=lease, reporter=reporter):
            if not provision_only and (task.run or task.setup):
                healthcli.gate(inv, registry=registry, reporter=reporter, wanted=health_check)
            _apply_job(task, req, inv, registry, reporter, docs, provision_only=provision_only,
                       no_setup=no_setup, detach=detach, cancel_on_interrupt=cancel_on_interrupt)
    finally:
        bringuprecord.save(req.name, reporter.phases)  # the dashboard's timeline of this bring-up
        if as_json and docs:
            cliargs.emit_apply(docs[-1], registry)


def _apply_job(task: Task, req: ClusterRequest, inv: Inventory, registry: Registry, reporter: Reporter,
               docs: list[dict], *, provision_only: bool, no_setup: bool, detach: bool,
               cancel_on_interrupt: bool = False) -> None:
    from gpuctl.jobplane import gitworkdir
    from gpuctl.jobplane.runner import JobRunner, JobSpec
    from gpuctl.provision import provisioner

    if provision_only or not task.run and not task.setup:
        reporter.info(f"Cluster '{req.name}' is up; inventory: {provisioner.inventory_path(req.name)}")
        docs.append(cliargs.apply_document(registry, req.name, inv, job_id=None, phases=reporter.phases))
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
                          sync_file_mounts=True, detach=detach, cancel_on_interrupt=cancel_on_interrupt)
    except JobFailed as exc:  # the failed job is the result: its document, then the error line and exit code 1
        docs.append(cliargs.apply_document(registry, req.name, inv, job_id=exc.job_id, phases=reporter.phases))
        raise
    docs.append(cliargs.apply_document(registry, req.name, inv, job_id=job_id, phases=reporter.phases))



# `sky launch` is how SkyPilot users bring a cluster up and run a task: the same command here.
app.command("launch", cls=entrypoints.LaunchCommand, help="Alias of `apply` (SkyPilot's `sky launch`).",
            epilog=usage.examples_of("launch"))(apply)
autostopcli.register(app)
costcli.register(app)
powercli.register(app)
jobscli.register(app)
healthcli.register(app)
dashboardcli.register(app)


def _run(runner: JobRunner, spec: JobSpec, *, run_setup: bool, sync_file_mounts: bool, detach: bool,
         cancel_on_interrupt: bool = False) -> int:
    """Run the job; its id. Ctrl-C stops following a job the head took (JobDetached), or with
    `cancel_on_interrupt` ends it on every node."""
    runner.cancel_on_interrupt = cliargs.cancels_on_interrupt(cancel_on_interrupt)
    try:
        outcome = runner.run(spec, run_setup=run_setup, sync_file_mounts=sync_file_mounts, detach=detach)
    except KeyboardInterrupt:  # before the job existed (runner.run acts on one that does)
        raise JobCancelled("interrupted (Ctrl-C) before the job started; nothing of it runs") from None
    if outcome.status in ("RUNNING", "PENDING"):
        name, job_id = runner.inv.cluster, outcome.job_id
        runner.reporter.info(f"Job {job_id} {'detached' if outcome.status == 'RUNNING' else 'waits in the queue'}. "
                             f"Follow it: gpuctl logs {name} {job_id}; cancel it: gpuctl cancel {name} {job_id}")
    return outcome.job_id


def _job_runner(name: str, reporter: Reporter | None = None, *, live: bool = True) -> JobRunner:
    """The job runner of an existing cluster (its inventory, the registry); `live`: its nodes must
    still be there (cliargs.cluster_inventory)."""
    from gpuctl.common.console import Reporter
    from gpuctl.jobplane.runner import JobRunner
    from gpuctl.state.registry import Registry

    return JobRunner(cliargs.cluster_inventory(name, live=live), reporter=reporter or Reporter(), registry=Registry())


@app.command("status", cls=usage.HelpCommand, epilog=usage.examples_of("status"))
def status(name: Optional[str] = typer.Argument(None, metavar="NAME", help="Cluster name (default: all clusters)."),
           refresh: bool = typer.Option(False, "--refresh", "-r",
                                        help="Check Terraform state and whether each node answers over SSH."),
           output_format: str = OutputOption) -> None:
    """Show clusters, their nodes and addresses, the fabric prepare found on each, and their last jobs."""
    from gpuctl.configplane import fabricrecord
    from gpuctl.healthcheck import health
    from gpuctl.provision import provisioner
    from gpuctl.spec.request import check_cluster_name
    from gpuctl.state import costs
    from gpuctl.state.registry import Registry

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
            doc = output.cluster_doc(rec, inv, (registry.jobs(rec.name, since=rec.created_at) or [None])[-1])
            doc.update(autostopcli.status_of(rec.name, rec.status, registry)[1])
            doc.update(costs.cluster_cost(rec.name, registry, rec.created_at))
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
        for line in [costcli.status_line(costs.cluster_cost(rec.name, registry, rec.created_at)), *lines]:
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
        jobs = registry.jobs(rec.name, since=rec.created_at)  # this cluster's, not an earlier one's of its name
        if jobs:
            last = jobs[-1]
            typer.echo(f"  last job: {last.job_id} {last.status}")


@app.command("exec", cls=entrypoints.ExecCommand, epilog=usage.examples_of("exec"))
def exec_(
    name: str = typer.Argument(..., metavar="NAME", help="A running cluster."),
    words: Optional[List[str]] = typer.Argument(None, metavar="FILE|COMMAND...", help="A task YAML whose run (and workdir, envs) to use, or a command run by bash on every node: quoted, or its words unquoted after gpuctl's options (joined with spaces, as `sky exec`); or an exact argv after `--`."),
    num_nodes: Optional[int] = typer.Option(None, "--num-nodes", metavar="N", help="Run on the first K nodes only (ranks 0..K-1)."),
    env: Optional[List[str]] = EnvOption,
    secret: Optional[List[str]] = SecretOption,
    workdir: Optional[Path] = typer.Option(None, "--workdir", metavar="DIR", help="With -- COMMAND: the directory to sync (default: the workdir of the last apply)."),
    gpus: Optional[str] = typer.Option(None, "--gpus", metavar="[TYPE:]N", help="GPUs the job needs on each of its nodes (as `sky exec --gpus H100:4`; default: the task file's resources.accelerators, else none). It waits in the cluster's queue until they are free, and sees only its own (CUDA_VISIBLE_DEVICES)."),
    detach: bool = typer.Option(False, "-d", "--detach", help="Return once every rank has started (or the job waits in the cluster's queue)."),
    cancel_on_interrupt: bool = cliargs.CancelOnInterruptOption,
    output_format: str = OutputOption,
) -> None:
    """Sync the workdir and run on a running cluster: no provisioning, no setup, no file_mounts. A job
    that asks for GPUs queues for them (first come, first served)."""
    from gpuctl.common.console import Reporter
    from gpuctl.jobplane.runner import JobRunner, JobSpec
    from gpuctl.state.registry import Registry

    as_json = wants_json(output_format)
    reporter = Reporter(stream=sys.stderr) if as_json else Reporter()
    inv = cliargs.cluster_inventory(name)
    registry = Registry()
    # What the last apply left: its workdir (for `-- COMMAND`) and container image (every exec, as `sky exec`).
    record = registry.cluster(name)
    last_apply = record.request if record else {}
    entrypoint, command = entrypoints.exec_entrypoint(list(words or []), _command_after_dashes())
    if entrypoint is None and not command:
        raise UserError(f"nothing to run: `gpuctl exec {name} task.yaml`, `gpuctl exec {name} 'COMMAND'` or "
                        f"`gpuctl exec {name} -- COMMAND...`")
    if entrypoint is not None and not entrypoint.strip():
        raise UserError("the command string is empty: give a command, such as `gpuctl exec NAME 'hostname'`")
    file = Path(entrypoint) if entrypoint is not None and cliargs.names_task_file(entrypoint) else None
    envs = parse_env_assignments(env or [])
    task_accelerator = None
    if file is not None:
        task = _load(file, env, secret)
        if not task.run:
            raise UserError(f"{file}: run: the task has no run command to execute")
        spec_workdir, run, envs, secrets, job_name = task.workdir, task.run, dict(task.envs), dict(task.secrets), task.name
        task_accelerator = task.resources.accelerator_pair()
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
    per_node = cliargs.gpus_asked(gpus, task_accelerator, cluster=name, cluster_accelerator=last_apply.get("accelerator"),
                                  capacity=min(n.gpus for n in inv.first(k)),
                                  flag="--gpus" if gpus is not None else f"{file}: resources.accelerators")
    spec = JobSpec(name=job_name, run=run, workdir=spec_workdir, envs=envs, secrets=secrets, num_nodes=k,
                   gpus_per_node=per_node, container_image=last_apply.get("container_image"),
                   workdir_implied=file is None and workdir is None)
    try:
        job_id = _run(JobRunner(inv, reporter=reporter, registry=registry), spec, run_setup=False,
                      sync_file_mounts=False, detach=detach, cancel_on_interrupt=cancel_on_interrupt)
    except JobFailed as exc:
        if as_json:  # as apply: the failed job is the result
            _emit_job("exec", registry, name, registry.job(name, exc.job_id) if exc.job_id is not None else None)
        raise
    if as_json:
        _emit_job("exec", registry, name, registry.job(name, job_id))


def _emit_job(command: str, registry: Registry, name: str, job: Any) -> None:
    """exec's JSON document: the job it ran (null if it never got an id)."""
    output.emit(command, {"ok": job is not None and job.status in ("SUCCEEDED", "RUNNING", "PENDING"), "cluster": name,
                          "job": output.job_doc(job) if job is not None else None})


# `queue` and `logs` (logscli.py): registered here, so `gpuctl --help` lists them after `exec`.
app.command("queue", cls=usage.HelpCommand, epilog=usage.examples_of("queue"))(logscli.queue)
app.command("logs", cls=usage.HelpCommand, epilog=usage.examples_of("logs"))(logscli.logs)


@app.command("cancel", cls=usage.HelpCommand, epilog=usage.examples_of("cancel"))
def cancel(
    name: str = typer.Argument(..., metavar="NAME", help="Cluster."),
    job_id: Optional[int] = typer.Argument(None, metavar="JOB", help="Job id (default: the latest unfinished job)."),
    all_jobs: bool = typer.Option(False, "--all", "-a", help="Cancel every unfinished job."),
    output_format: str = OutputOption,
) -> None:
    """End a job on every node (its whole process tree) and mark it CANCELLED."""
    from gpuctl.common.console import Reporter
    from gpuctl.jobplane import jobs
    from gpuctl.state.registry import TERMINAL_JOB_STATES

    as_json = wants_json(output_format)
    say = functools.partial(typer.echo, err=as_json)
    runner = _job_runner(name, Reporter(stream=sys.stderr) if as_json else None)
    registry = runner.registry
    if all_jobs and job_id is not None:
        raise UserError("give a JOB id or --all, not both")
    unfinished = [j for j in registry.jobs(name) if j.status not in TERMINAL_JOB_STATES]
    stopped: dict[str, list[int]] = {}  # an ended job's leftovers, by job id
    if job_id is not None:
        target = [jobs.resolve_job(registry, name, job_id)]
        if target[0].status in TERMINAL_JOB_STATES:
            # Its record can be right while a rank whose owner was killed still runs: ask every node.
            line, report = jobs.cancel(runner, target[0])
            say(line)
            stopped[str(target[0].job_id)] = list(report.stopped)
            target = []
    else:
        target = unfinished if all_jobs else unfinished[-1:]
        if not target:
            say(f"No unfinished jobs on cluster '{name}'.")
    for job in target:
        say(jobs.cancel(runner, job)[0])
    if as_json:  # the jobs asked about, as they are now (an ended one keeps its status)
        asked = [jobs.resolve_job(registry, name, job_id)] if job_id is not None else target
        output.emit("cancel", {"ok": True, "cluster": name, "cancelled": [j.job_id for j in target],
                               "leftovers_stopped": stopped,
                               "jobs": [output.job_doc(row) for j in asked
                                        if (row := registry.job(name, j.job_id)) is not None]})


@app.command("ssh-config", cls=usage.HelpCommand, epilog=usage.examples_of("ssh-config"))
def ssh_config(name: Optional[str] = typer.Argument(None, metavar="NAME", help="Cluster (default: every cluster)."),
               include: bool = typer.Option(False, "--include", help="Also add `Include ~/.gpuctl/ssh/config` "
                                            "first in ~/.ssh/config (once), so `ssh NAME` works.")) -> None:
    """Write OpenSSH config for a cluster's nodes, `Host NAME` for the head and `Host NAME-workerN` for the others."""
    from gpuctl.common.console import Reporter
    from gpuctl.provision.lifecycle import write_ssh_config
    from gpuctl.spec.request import check_cluster_name
    from gpuctl.state.registry import Registry

    names = [check_cluster_name(name)] if name else [c.name for c in Registry().clusters()]
    paths = []
    for n in names:
        try:
            paths.append(write_ssh_config(cliargs.cluster_inventory(n)))
        except UserError as exc:  # of every cluster: one that is gone is said and passed over
            if name:
                raise
            typer.echo(f"skipped {n}: {exc.message}", err=True)
    if include:
        cliargs.add_ssh_include(Reporter())
    for p in paths:
        typer.echo(str(p))
    typer.echo(f"Use: ssh -F {paths[0] if len(paths) == 1 else state_root() / 'ssh' / 'config'} HOST"
               + ("" if include else ", or `gpuctl ssh-config --include` for plain `ssh HOST`"))


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
    from gpuctl.provision import sshconfig
    from gpuctl.provision.lifecycle import write_ssh_config

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
    from gpuctl.provision import ssh

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
    from gpuctl.spec.request import check_cluster_name
    from gpuctl.state.registry import Registry
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
    from gpuctl.common.console import Reporter
    from gpuctl.jobplane import joblogs, jobs
    from gpuctl.state.registry import TERMINAL_JOB_STATES

    runner = _job_runner(name, Reporter(plain=True), live=False)  # a job's end is recorded, whatever came of its nodes
    job = jobs.resolve_job(runner.registry, name, job_id)
    job_nodes = jobs.job_nodes(runner.inv, job)
    joblogs.mark_watching(name, job.job_id)
    try:
        outcome = runner.attach(job.job_id, job_nodes, echo=False, record=True)
        if runner.registry.job(name, job.job_id).status not in TERMINAL_JOB_STATES:  # type: ignore[union-attr]
            runner.conclude(job.job_id, job_nodes, outcome)
    except JobFailed as exc:
        print(exc.message)
    finally:
        joblogs.unmark_watching(name, job.job_id)


@app.command("down", cls=usage.HelpCommand, epilog=usage.examples_of("down"))
def down(names: list[str] = typer.Argument(None, metavar="NAME...", help="Clusters to tear down.", show_default=False),
         all_clusters: bool = typer.Option(False, "-a", "--all", help="Tear down every cluster gpuctl knows."),
         yes: bool = typer.Option(False, "-y", "--yes", help="Ask nothing: -a asks first, naming the clusters "
                                  "(as `sky down -a`); `down NAME` never asks."),
         output_format: str = OutputOption) -> None:
    """Destroy clusters (terraform destroy) and forget them; one that does not exist is passed over."""
    from gpuctl.common.console import Reporter
    from gpuctl.provision import lifecycle
    from gpuctl.state.registry import Registry

    as_json, registry = wants_json(output_format), Registry()
    reporter = Reporter(stream=sys.stderr) if as_json else Reporter()
    targets = cliargs.down_targets(names or [], all_clusters, registry)
    cliargs.refuse_managed(targets)  # a managed job's cluster goes with the job (`gpuctl jobs cancel ID`)
    if all_clusters and targets:  # every cluster, named by nobody: only with a yes (down NAME stays unasked, for CI)
        listed = ", ".join(targets)
        cliargs.confirm(f"Tear down {len(targets)} cluster(s): {listed}? Their nodes and what is on them go.",
                        yes=yes, refusal=f"down -a would tear down {len(targets)} cluster(s) ({listed}) and no "
                                         "terminal can confirm it: add -y; nothing was torn down")
    logscli.keep_before_down(targets, registry, reporter)  # the jobs' logs stay readable after
    results = lifecycle.tear_down_all(targets, reporter=reporter, registry=registry)
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
    """gpuctl's version: `gpuctl.__version__`, kept equal to pyproject's (tests/unit/test_cli_start.py),
    so it is what `pip show gpuctl` says without reading the installed metadata (importlib.metadata)."""
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
    # Ctrl-C and SIGTERM both stop following a job, which goes on (with --cancel-on-interrupt they end
    # it on every node: jobplane.runner.JobRunner.run); set explicitly since a parent may have started
    # us with SIGINT ignored.
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
        rv = usage.reachable(app, argv)(args=argv, prog_name="gpuctl", standalone_mode=False)
    except (UserError, JobFailed, ProvisionError) as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        _exit_with_error(argv, exc.message, exc.exit_code)
    except JobDetached as exc:  # not an error: the job goes on, and the line says how to reach it
        print(f"\n{exc.message}", file=sys.stderr)
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
