"""`gpuctl check` (the fabric's all_reduce, or with --health every node's own health), `gpuctl replace`
(a bad node made again, alone), and apply's health gate: finding the bad node and fixing it are one flow.

The health verdicts live in clusters/<name>/health.json (healthcheck/health.py); replace reads them
for --unhealthy, and the gate reads them to check only what it has not seen healthy yet.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, List, Optional

import typer

from gpuctl import cliargs, usage
from gpuctl.common import output
from gpuctl.common.envargs import parse_env_assignments
from gpuctl.common.errors import JobFailed, UserError
from gpuctl.common.output import OutputOption, wants_json
from gpuctl.common.paths import cluster_dir

if TYPE_CHECKING:
    from gpuctl.common.console import Reporter
    from gpuctl.healthcheck import health
    from gpuctl.provision.inventory import Inventory
    from gpuctl.state.registry import Registry

# The health checks, the registry and the job runner are imported by the commands that use them,
# so that defining `check` and `replace` (every gpuctl command does) costs nothing.

GateOption = typer.Option(None, "--health-check/--no-health-check",
                          help="Check every node's health before the job (default: on for GPU nodes not yet "
                               "seen healthy); an unhealthy node stops the job.")
LevelOption = typer.Option(None, "--level", metavar="N",
                           help="With --health: dcgmi diag -r N where DCGM is installed (1: seconds, the "
                                "default; 2: about 2 minutes; 0: no DCGM run).")


def show(report: health.Report, reporter: Reporter) -> None:
    for line in report.text():
        reporter.info(line)


def gate(inv: Inventory, *, registry: Registry, reporter: Reporter, wanted: bool | None) -> None:
    """apply's health gate: on by default for GPU nodes, and then only while some node has no healthy
    or degraded verdict yet (new, replaced, or unhealthy last time); JobFailed (exit 1) naming the
    unhealthy nodes and the command that replaces them."""
    from gpuctl.healthcheck import health

    if wanted is False:
        return
    expect = health.expectations(inv, health.recorded_request(registry, inv.cluster))
    if wanted is None and expect.gpus <= 0:
        return
    seen = health.last_verdicts(cluster_dir(inv.cluster), inv)
    if wanted is None and all(n.rank in seen and seen[n.rank]["verdict"] != "unhealthy" for n in inv.nodes):
        return
    report = health.run_health(inv, registry=registry, reporter=reporter, expect=expect)
    if report.ok:
        reporter.info(f"Health gate: {len(report.nodes)} node(s) {report.verdict}")
        return
    show(report, reporter)
    raise JobFailed(f"{report.problem}; or run without the gate: --no-health-check")


def register(app: typer.Typer) -> None:
    @app.command("check", cls=usage.HelpCommand, epilog=usage.examples_of("check"))
    def check(name: str = typer.Argument(..., metavar="NAME", help="Cluster."),
              node_health: bool = typer.Option(False, "--health",
                                               help="Check every node's GPUs, Xid log, NVLink, fabric devices, "
                                                    "memlock and disks instead; exit 1 when a node is unhealthy."),
              level: Optional[int] = LevelOption,
              node_pairs: bool = typer.Option(False, "--pairs",
                                              help="The all_reduce on each pair of ring neighbours alone; exit 1 "
                                                   "naming the node whose pairs are all slow."),
              sizes: str = typer.Option("1M,64M,1G", "--sizes", metavar="SIZES",
                                        help="Message sizes, comma-separated: bytes, or K, M, G (powers of 1024)."),
              expect_fabric: Optional[str] = typer.Option(
                  None, "--expect-fabric", metavar="FABRIC",
                  help="efa, ib, roce or socket (default: efa for an AWS cluster provisioned with EFA, else the "
                       "best fabric prepare found on any node, expected of every node)."),
              min_busbw: Optional[float] = typer.Option(None, "--min-busbw", metavar="GBPS",
                                                        help="Fail when the bus bandwidth at the largest size is "
                                                             "below this many GB/s."),
              method: str = typer.Option("auto", "--method", metavar="METHOD",
                                         help="auto (nccl-tests' all_reduce_perf where the nodes have it, else "
                                              "torch.distributed), nccl-tests or torch."),
              env: Optional[List[str]] = typer.Option(None, "--env", metavar="K=V",
                                                      help="K=V (or K to take it from your environment); "
                                                           "repeatable."),
              output_format: str = OutputOption) -> None:
        """All-reduce across every node and GPU (bandwidth, and whether NCCL used the fabric), or with
        --health each node's own health and what to do with it."""
        from gpuctl.common.console import Reporter
        from gpuctl.healthcheck import command as healthcheck
        from gpuctl.healthcheck import health
        from gpuctl.state.registry import Registry

        as_json = wants_json(output_format)
        reporter = Reporter(stream=sys.stderr) if as_json else Reporter()
        if level is not None and not node_health:
            raise UserError("--level: it sets the DCGM run of --health; add --health")
        if node_pairs and node_health:
            raise UserError("--pairs and --health are two checks: run one, then the other")
        inv = cliargs.cluster_inventory(name) if node_health else None
        if inv is not None:
            report: health.Report | Any = health.run_health(
                inv, registry=Registry(), reporter=reporter, level=health.check_level(1 if level is None else level))
        else:
            options = healthcheck.parse_options(sizes=sizes, expect_fabric=expect_fabric, min_busbw=min_busbw,
                                                method=method, envs=parse_env_assignments(env or []),
                                                pairs=node_pairs)
            report = healthcheck.run_check(cliargs.cluster_inventory(name), registry=Registry(), options=options,
                                           reporter=reporter)
        if as_json:
            output.emit("check", report.document())
        else:
            for line in report.text():
                typer.echo(line)
        if report.problem is not None:
            raise JobFailed(report.problem)

    @app.command("replace", cls=usage.HelpCommand, epilog=usage.examples_of("replace"))
    def replace_(name: str = typer.Argument(..., metavar="NAME", help="Cluster."),
                 nodes: Optional[List[str]] = typer.Argument(None, metavar="NODE...",
                                                             help="Nodes to make again: names (worker1) or ranks."),
                 unhealthy: bool = typer.Option(False, "--unhealthy",
                                                help="Every node whose last health verdict was unhealthy."),
                 recheck: bool = typer.Option(True, "--health-check/--no-health-check",
                                              help="Check the cluster's health once the nodes are ready."),
                 force: bool = typer.Option(False, "--force", help="Replace even while a job runs on the cluster: "
                                            "the job is cancelled first (replacing one node ends it everywhere)."),
                 yes: bool = typer.Option(False, "-y", "--yes",
                                          help="Ask nothing: on a terminal replace asks first, naming the nodes."),
                 output_format: str = OutputOption) -> None:
        """Make nodes again with Terraform (same rank, name and placement), prepare only them, and check health."""
        from gpuctl.common.console import Reporter
        from gpuctl.healthcheck import health
        from gpuctl.jobplane import replacement
        from gpuctl.state.registry import Registry

        as_json = wants_json(output_format)
        reporter = Reporter(stream=sys.stderr) if as_json else Reporter()
        registry = Registry()
        if not nodes and not unhealthy:
            raise UserError(f"replace {name}: name the nodes to make again (worker1, or a rank), or give --unhealthy")
        inv = cliargs.cluster_inventory(name)
        ranks = sorted({cliargs.node_of(inv, name, node).rank for node in nodes or []}
                       | (set(_unhealthy_ranks(inv)) if unhealthy else set()))
        document: dict[str, Any] = {"ok": True, "cluster": name, "replaced": [], "health": None}
        if not ranks:
            reporter.info(f"Cluster '{name}': no node's last health verdict is unhealthy; nothing to replace")
            if as_json:
                output.emit("replace", document)
            return
        _consent_to_replace(name, inv, [n for n in inv.nodes if n.rank in ranks], registry, reporter, force=force,
                            yes=yes)
        made = replacement.replace_nodes(inv, ranks, reporter=reporter, registry=registry)
        old = {n.rank: n for n in made.old}
        document["replaced"] = [{"name": n.name, "rank": n.rank, "old_node_id": old[n.rank].node_id,
                                 "node_id": n.node_id, "address": n.address} for n in made.new]
        report = health.run_health(made.inv, registry=registry, reporter=reporter) if recheck else None
        if report is not None:
            document.update(ok=report.ok, health=report.document())
            if not as_json:
                for line in report.text():
                    typer.echo(line)
        if as_json:
            output.emit("replace", document)
        if report is not None and report.problem is not None:
            raise JobFailed(report.problem)


def _consent_to_replace(name: str, inv: Inventory, nodes: list[Any], registry: Registry, reporter: Reporter, *,
                        force: bool, yes: bool) -> None:
    """Before a node is made again: never under a managed job (its supervisor replaces nodes), never
    silently under a running job (a distributed job ends everywhere when one node goes): refused
    naming it, or with --force cancelled first; on a terminal, a yes (or -y)."""
    from gpuctl.jobplane import jobs
    from gpuctl.jobplane.runner import JobRunner

    cliargs.refuse_managed([name])
    listed = ", ".join(f"{n.name} (rank {n.rank})" for n in nodes)
    runner = JobRunner(inv, reporter=reporter, registry=registry)
    running = cliargs.jobs_running(runner)
    if running and not force:
        ids = ", ".join(str(j.job_id) for j in running)
        raise UserError(f"job(s) {ids} still run on cluster '{name}' and replacing {listed} ends them; wait for "
                        f"them (`gpuctl queue {name}`), cancel them (`gpuctl cancel {name} --all`), or replace "
                        "anyway with --force; nothing was replaced")
    ending = f" Job(s) {', '.join(str(j.job_id) for j in running)} are cancelled first." if running else ""
    cliargs.confirm(f"Make {listed} of cluster '{name}' again? What is on those nodes goes.{ending}", yes=yes,
                    refusal=None)
    if running:
        for job in running:
            runner.cancel(job.job_id, jobs.job_nodes(inv, job))
            registry.update_job(name, job.job_id, detail=f"cancelled by `gpuctl replace --force` ({listed})")
            reporter.info(f"Job {job.job_id} cancelled: replacing {listed} would have ended it")


def _unhealthy_ranks(inv: Inventory) -> list[int]:
    """The ranks whose last verdict was unhealthy; UserError when the cluster was never checked."""
    from gpuctl.healthcheck import health

    if not (cluster_dir(inv.cluster) / health.HEALTH_FILE).is_file():
        raise UserError(f"--unhealthy: cluster '{inv.cluster}' has no health report yet; run "
                        f"`gpuctl check {inv.cluster} --health` first")
    seen = health.last_verdicts(cluster_dir(inv.cluster), inv)
    return [rank for rank, entry in seen.items() if entry["verdict"] == "unhealthy"]
