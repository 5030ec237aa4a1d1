"""`gpuctl stop` and `gpuctl start`: SkyPilot's `sky stop` / `sky start`, through Terraform.

stop: every node of a cluster stopped with its disks kept (on AWS the module's instance_state, so
the Terraform state says so), its unfinished jobs ended and recorded CANCELLED (with consent: -y,
or a yes typed at a terminal), the registry STOPPED and the cost history no longer counting.
Nodes that cannot be stopped and kept (spot, local nodes, ssh hosts) are refused in one line that
names `gpuctl down`, before anything is changed.

start: the same nodes running again, without the task file; once every node answers ssh (its
host key checked against the one pinned before the stop) the nodes are prepared only if gpuctl
changed meanwhile, and the head's autostop, if set, is armed again with a fresh countdown.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import typer

from gpuctl import autostopcli, cliargs, usage
from gpuctl.common import output
from gpuctl.common.errors import ClusterNotFound, ProvisionError, UserError
from gpuctl.common.output import OutputOption, wants_json
from gpuctl.common.paths import cluster_dir

if TYPE_CHECKING:
    from gpuctl.common.console import Reporter
    from gpuctl.jobplane.runner import JobRunner
    from gpuctl.provision.inventory import Inventory
    from gpuctl.state.registry import ClusterRecord, JobRecord, Registry

# The registry, the providers and autostop are imported where they are used: only `stop` and
# `start` need them, and every gpuctl command defines these two.

WAIT_POLL_S = 5.0  # between rounds of ssh to the nodes that did not answer yet


def _not_up(record: ClusterRecord, verb: str) -> UserError:
    """Why a cluster that is neither UP nor STOPPED cannot be stopped or started."""
    from gpuctl.state.registry import AUTODOWNED

    name = record.name
    if record.status == AUTODOWNED:
        return UserError(f"cluster '{name}' took itself down (autodown): there is nothing to {verb}; "
                         f"`gpuctl apply` makes it again, `gpuctl down {name}` forgets it")
    return UserError(f"cluster '{name}' is {record.status} (an apply or down did not finish): run `gpuctl apply` "
                     f"again, or `gpuctl down {name}`")


def _current(name: str, registry: Registry) -> ClusterRecord:
    """The cluster's record once what it did by itself is known (autostop, autodown); ClusterNotFound."""
    from gpuctl.jobplane import autostop

    registry.adopt(name)
    record = registry.cluster(name)
    if record is None:
        raise ClusterNotFound(name)
    autostop.reconcile(name, record.status, registry)
    record = registry.cluster(name)
    if record is None:
        raise ClusterNotFound(name)
    return record


def stop_targets(names: list[str], registry: Registry) -> list[ClusterRecord]:
    """The named clusters, each checked before any is stopped: it exists, its nodes can be stopped and
    kept (the provider's stop_problem), and it is UP or already STOPPED."""
    from gpuctl.providers import get_provider
    from gpuctl.spec.request import check_cluster_name
    from gpuctl.state.registry import STOPPED

    if not names:
        raise UserError("give the cluster to stop (gpuctl stop NAME [NAME...])")
    records = []
    for name in dict.fromkeys(check_cluster_name(n) for n in names):
        record = _current(name, registry)
        problem = get_provider(record.cloud).stop_problem({**record.request, "name": name})
        if problem:
            raise UserError(f"cluster '{name}': {problem}")
        if record.status not in ("UP", STOPPED):
            raise _not_up(record, "stop")
        records.append(record)
    return records


def consent(running: dict[str, list[JobRecord]], yes: bool) -> None:
    """Ask once before ending jobs that run (cliargs.confirm: -y, or a yes at a terminal; exit 2 without)."""
    if not running:
        return
    what = "; ".join(f"cluster '{name}': job(s) {', '.join(str(j.job_id) for j in found)}"
                     for name, found in running.items())
    names = " ".join(running)
    cliargs.confirm(f"Stopping ends the jobs still running ({what}). Stop anyway?", yes=yes,
                    refusal=f"jobs still run ({what}) and stopping ends them; wait for them (`gpuctl queue NAME`), "
                            f"or stop anyway with `gpuctl stop {names} -y`")


def end_jobs(runner: JobRunner, found: list[JobRecord]) -> list[int]:
    """End each job on every node (its process tree, its secrets; logs fetched) and record it
    CANCELLED, saying the stop ended it; the ids."""
    from gpuctl.jobplane import jobs

    for job in found:
        runner.cancel(job.job_id, jobs.job_nodes(runner.inv, job))
        runner.registry.update_job(runner.inv.cluster, job.job_id, status="CANCELLED",
                                   detail="ended by `gpuctl stop`: the cluster was stopped")
    return [j.job_id for j in found]


def ended_meanwhile(name: str, registry: Registry) -> list[int]:
    """Jobs submitted while the cluster was being stopped (jobs take no cluster lock): they ended
    with it, so they are recorded so; the ids."""
    from gpuctl.state.registry import TERMINAL_JOB_STATES

    late = [j.job_id for j in registry.jobs(name) if j.status not in TERMINAL_JOB_STATES]
    registry.end_jobs(name, "ended by `gpuctl stop`: the cluster was stopped")
    return late


def wait_for_ssh(inv: Inventory, *, reporter: Reporter, timeout: float) -> None:
    """Until every node answers ssh, each host key checked against the one pinned (a different key is
    a UserError naming the node, nothing sent); ProvisionError naming the nodes still silent after
    `timeout` seconds."""
    from gpuctl.configplane import prepare
    from gpuctl.provision import ssh

    control = ssh.control_dir_for(cluster_dir(inv.cluster) / "cm")
    waiting = list(inv.nodes)
    reasons: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    with reporter.stage(f"Waiting for {len(waiting)} node(s) to accept SSH", phase="wait") as step:
        while True:
            results = ssh.run_on_all(waiting, "true", control_dir=control, timeout=30)
            for node in list(waiting):
                proc = results[node.rank]
                if proc.returncode == 0:
                    waiting.remove(node)
                    continue
                if ssh.host_key_changed(proc.stderr):
                    raise UserError(ssh.host_key_error(node))
                reasons[node.rank] = (proc.stderr.strip().splitlines() or [f"ssh exit code {proc.returncode}"])[-1]
            if not waiting:
                return
            done = len(inv.nodes) - len(waiting)
            step.update(f"{done} of {len(inv.nodes)} node(s) answer", done, len(inv.nodes))
            left = deadline - time.monotonic()
            if left <= 0:
                silent = ", ".join(f"{n.name} ({reasons.get(n.rank, 'no answer')})" for n in waiting[:4])
                raise ProvisionError(
                    f"cluster '{inv.cluster}' is running again, but {silent}"
                    f"{f' and {len(waiting) - 4} more' if len(waiting) > 4 else ''} did not answer ssh within "
                    f"{timeout:g} s ({prepare.WAIT_TIMEOUT_ENV}); `gpuctl status {inv.cluster} --refresh` shows each "
                    f"node, `gpuctl stop {inv.cluster}` stops it again")
            time.sleep(min(WAIT_POLL_S, left))


def stopped_nodes(record: ClusterRecord, inv: Inventory) -> list[str]:
    """The nodes the cloud says are stopped or stopping (one call; none where it cannot be asked)."""
    from gpuctl.providers import get_provider

    states = get_provider(record.cloud).node_states([n.node_id for n in inv.nodes], inv.region)
    return [n.name for n in inv.nodes if states.get(n.node_id, ("", None))[0] in ("stopped", "stopping")]


def start_cluster(record: ClusterRecord, *, registry: Registry, reporter: Reporter) -> Inventory:
    """Start a stopped cluster and make it ready for jobs (answering ssh, prepared, its autostop armed
    again); its inventory."""
    from gpuctl.configplane import prepare
    from gpuctl.jobplane import autostop
    from gpuctl.jobplane.preparer import Preparer
    from gpuctl.provision import lifecycle

    name = record.name
    inv = lifecycle.start_cluster(name, reporter=reporter, registry=registry)
    wait_for_ssh(inv, reporter=reporter, timeout=prepare.wait_timeout())
    # nothing to do unless gpuctl changed while it was stopped
    Preparer(inv, reporter=reporter, registry=registry).ensure_prepared()
    setting = autostop.saved(name)
    if setting is not None:  # a fresh countdown: the time it spent stopped is not idle time
        armed = autostop.arm(inv, setting, request=record.request)
        reporter.info(f"Cluster '{name}': {setting.describe()}, decided on the cluster")
        for note in armed.notes:
            typer.echo(f"warning: {note}", err=True)
    return inv


def register(app: typer.Typer) -> None:
    @app.command("stop", cls=usage.HelpCommand, epilog=usage.examples_of("stop"))
    def stop_(names: list[str] = typer.Argument(None, metavar="NAME...", help="Clusters to stop.",
                                                show_default=False),
              yes: bool = typer.Option(False, "-y", "--yes", help="Stop without asking, also when jobs still run "
                                                                  "(they are cancelled)."),
              output_format: str = OutputOption) -> None:
        """Stop a cluster's nodes and keep their disks (as `sky stop`); `gpuctl start` brings them back."""
        from gpuctl.common.console import Reporter
        from gpuctl.jobplane.runner import JobRunner
        from gpuctl.provision import lifecycle
        from gpuctl.state.registry import STOPPED, Registry

        as_json, registry = wants_json(output_format), Registry()
        reporter = Reporter(stream=sys.stderr) if as_json else Reporter()
        records = stop_targets(names or [], registry)
        runners = {r.name: JobRunner(cliargs.cluster_inventory(r.name), reporter=reporter, registry=registry)
                   for r in records if r.status != STOPPED}
        running = {name: found for name, runner in runners.items() if (found := cliargs.jobs_running(runner))}
        consent(running, yes)
        results: list[dict[str, Any]] = []
        for record in records:
            name = record.name
            if record.status == STOPPED:
                reporter.info(f"Cluster '{name}' is already stopped.")
                fields = autostopcli.status_of(name, STOPPED, registry)[1]
                results.append({"cluster": name, "status": STOPPED, "stopped_at": fields.get("stopped_at"),
                                "cancelled": []})
                continue
            cancelled = end_jobs(runners[name], running.get(name, []))
            try:
                when = lifecycle.stop_cluster(name, reporter=reporter, registry=registry)
            except (ProvisionError, UserError) as exc:
                if len(records) == 1:
                    raise
                reporter.error(f"{name}: {exc.message}")
                results.append({"cluster": name, "status": "UP", "stopped_at": None, "cancelled": cancelled,
                                "error": exc.message})
                continue
            cancelled += ended_meanwhile(name, registry)
            count = len(runners[name].inv.nodes)
            reporter.info(f"Cluster '{name}' is stopped: {count} node(s), their disks kept (storage still "
                          f"bills); `gpuctl start {name}` brings it back, `gpuctl down {name}` removes it.")
            results.append({"cluster": name, "status": STOPPED, "stopped_at": when, "cancelled": cancelled})
        failed = [r["cluster"] for r in results if r.get("error")]
        if as_json:
            output.emit("stop", {"ok": not failed, **results[0]} if len(results) == 1 else
                        {"ok": not failed, "clusters": results})
        if failed:
            raise ProvisionError(f"{len(failed)} of {len(results)} cluster(s) not stopped: {', '.join(failed)}")

    @app.command("start", cls=usage.HelpCommand, epilog=usage.examples_of("start"))
    def start_(name: str = typer.Argument(..., metavar="NAME", help="A stopped cluster."),
               output_format: str = OutputOption) -> None:
        """Start a stopped cluster again: the same nodes and disks, no task file needed (as `sky start`)."""
        from gpuctl.common.console import Reporter
        from gpuctl.jobplane import autostop
        from gpuctl.spec.request import check_cluster_name
        from gpuctl.state.registry import STOPPED, Registry

        as_json, registry = wants_json(output_format), Registry()
        reporter = Reporter(stream=sys.stderr) if as_json else Reporter()
        record = _current(check_cluster_name(name), registry)
        if record.status not in ("UP", STOPPED):
            raise _not_up(record, "start")
        inv = cliargs.cluster_inventory(name, live=False)  # its nodes are stopped: that is the point
        stopped = stopped_nodes(record, inv) if record.status == "UP" else []
        if record.status == "UP" and not stopped:
            reporter.info(f"Cluster '{name}' is already up.")
            started = False
        else:
            if record.status == "UP":  # a stop or start that did not finish, or nodes stopped behind gpuctl
                reporter.info(f"Cluster '{name}' is up, but {', '.join(stopped)} stopped: starting them")
            inv = start_cluster(record, registry=registry, reporter=reporter)
            reporter.info(f"Cluster '{name}' is up again: {len(inv.nodes)} node(s).")
            started = True
        if as_json:
            saved = autostop.saved(name)
            output.emit("start", {"ok": True, "cluster": name, "status": "UP", "started": started,
                                  "nodes": [output.node_doc(n) for n in inv.nodes],
                                  "autostop": saved.as_dict() if saved else None})
