"""The `gpuctl` command line: a thin typer layer over the library.

Errors are values until here: a `UserError` becomes one line on stderr and
exit code 2 (nothing provisioned), a failed job or provision exit code 1.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

import typer

from gpuctl import jobenv, provision
from gpuctl.cluster import ClusterRequest, check_cluster_name, request_from_task
from gpuctl.console import Reporter
from gpuctl.errors import JobFailed, ProvisionError, UserError
from gpuctl.launch import JobRunner, JobSpec
from gpuctl.spec import Task, load_task, parse_env_assignments
from gpuctl.state import Registry

app = typer.Typer(
    name="gpuctl",
    help="Multi-node GPU training clusters from one SkyPilot-style cluster.yaml.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

FileArg = typer.Argument(..., help="Task YAML in SkyPilot's format (cluster.yaml).", show_default=False)


def _load(file: Path, env: list[str] | None, secret: list[str] | None = None) -> Task:
    return load_task(file, env_overrides=parse_env_assignments(env or []),
                     secret_overrides=parse_env_assignments(secret or [], flag="--secret", secret=True))


def _request(task: Task, file: Path, *, cluster: str | None, infra: str | None,
             num_nodes: int | None) -> ClusterRequest:
    return request_from_task(task, name=cluster, infra=infra, num_nodes=num_nodes,
                             base_dir=file.resolve().parent)


def _job_spec(task: Task, req: ClusterRequest) -> JobSpec:
    return JobSpec(name=task.name, run=task.run, setup=task.setup, workdir=task.workdir,
                   file_mounts=dict(task.file_mounts), envs=dict(task.envs), secrets=dict(task.secrets),
                   num_nodes=req.num_nodes, gpus_per_node=req.gpus_per_node,
                   fabric_env=jobenv.fabric_env(req.cloud, efa=req.network_tier == "best",
                                                instance_type=req.instance_type))


@app.command()
def validate(file: Path = FileArg) -> None:
    """Check a cluster.yaml without provisioning anything."""
    task = load_task(file)
    req = _request(task, file, cluster=None, infra=None, num_nodes=None)
    typer.echo(f"{file}: OK ({req.num_nodes} node(s) on {req.cloud}"
               + (f", {req.accelerator}:{req.gpus_per_node}" if req.accelerator else "") + ")")


@app.command()
def apply(
    file: Path = FileArg,
    cluster: Optional[str] = typer.Option(None, "-c", "--cluster", help="Cluster name (default: the task's name)."),
    infra: Optional[str] = typer.Option(None, "--infra", help="Override resources.infra (local, ssh/PATH, aws/REGION[/ZONE])."),
    num_nodes: Optional[int] = typer.Option(None, "--num-nodes", help="Override num_nodes."),
    env: Optional[List[str]] = typer.Option(None, "--env", help="K=V (or K to take it from your environment); repeatable."),
    secret: Optional[List[str]] = typer.Option(None, "--secret", help="K=V (or K from your environment) for secrets; never printed."),
    no_setup: bool = typer.Option(False, "--no-setup", help="Skip the setup stage."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the Terraform plan; create nothing."),
    provision_only: bool = typer.Option(False, "--provision-only", help="Stop after provisioning and writing the inventory."),
) -> None:
    """Provision (or reuse) a cluster, sync, run setup, and run the job on every node."""
    reporter = Reporter()
    task = _load(file, env, secret)
    req = _request(task, file, cluster=cluster, infra=infra, num_nodes=num_nodes)
    if dry_run:
        summary = provision.plan(req)
        for line in summary.describe():
            reporter.info(line)
        return
    registry = Registry()
    with reporter.stage(f"Provisioning {req.num_nodes} {req.cloud} node(s) for cluster '{req.name}'"):
        registry.upsert_cluster(req.name, cloud=req.cloud, region=req.region, zone=req.zone,
                                num_nodes=req.num_nodes, status="INIT", request=asdict(req))
        try:
            inv = provision.provision(req, on_progress=reporter.info)
        except BaseException:
            registry.set_cluster_status(req.name, "INIT")
            raise
        registry.upsert_cluster(req.name, cloud=req.cloud, region=inv.region, zone=inv.zone,
                                num_nodes=len(inv.nodes), status="UP", request=asdict(req))
    for node in inv.nodes:
        reporter.info(f"  {node.name:<10} rank={node.rank:<3} {node.address:<16} ssh {node.ssh_user}@{node.ssh_host}:{node.ssh_port}")
    if provision_only or not task.run and not task.setup:
        reporter.info(f"Cluster '{req.name}' is up; inventory: {provision.inventory_path(req.name)}")
        return
    runner = JobRunner(inv, reporter=reporter, registry=registry)
    job_id, job_nodes = runner.submit(_job_spec(task, req), run_setup=not no_setup, sync_file_mounts=True)
    runner.watch(job_id, job_nodes)


@app.command()
def status(name: Optional[str] = typer.Argument(None, help="Cluster name (default: all clusters).")) -> None:
    """Show clusters, their nodes and addresses, and their last jobs."""
    registry = Registry()
    records = [registry.cluster(check_cluster_name(name))] if name else registry.clusters()
    if name and records[0] is None:
        raise UserError(f"cluster '{name}' not found; `gpuctl status` lists the clusters you have")
    if not records:
        typer.echo("No clusters.")
        return
    for rec in records:
        assert rec is not None
        where = "/".join(p for p in (rec.cloud, rec.region, rec.zone) if p)
        typer.echo(f"{rec.name}: {rec.status}, {rec.num_nodes} node(s) on {where}")
        inv = provision.load_inventory_of(rec.name)
        if inv is not None:
            for node in inv.nodes:
                typer.echo(f"  {node.name:<10} rank={node.rank:<3} {node.address:<16} "
                           f"ssh {node.ssh_user}@{node.ssh_host}:{node.ssh_port}")
        jobs = registry.jobs(rec.name)
        if jobs:
            last = jobs[-1]
            typer.echo(f"  last job: {last.job_id} {last.status}")


@app.command()
def down(name: str = typer.Argument(..., help="Cluster to tear down."),
         yes: bool = typer.Option(True, "-y", "--yes", hidden=True)) -> None:
    """Destroy a cluster (terraform destroy) and forget it."""
    reporter = Reporter()
    check_cluster_name(name)
    registry = Registry()
    if registry.cluster(name) is None and not provision.cluster_exists(name):
        raise UserError(f"cluster '{name}' not found; `gpuctl status` lists the clusters you have")
    with reporter.stage(f"Tearing down cluster '{name}'"):
        registry.set_cluster_status(name, "STOPPING")
        provision.destroy(name)
        registry.remove_jobs(name)
        registry.remove_cluster(name)
    reporter.info(f"Cluster '{name}' is gone.")


def main() -> None:
    try:
        app(standalone_mode=False)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (JobFailed, ProvisionError) as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:  # click usage errors arrive as ClickException
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise
    sys.exit(0)
