"""`gpuctl autostop` and apply's `-i/--down/--lease`: SkyPilot's autostop, decided on the cluster.

The setting goes to the head (jobplane/autostop.py), whose watcher stops or removes the cluster
once idle, with no controller running. `apply --down` also holds a lease while it works: a
controller killed mid-way leaves a cluster that takes itself down once the lease runs out.
"""

from __future__ import annotations

import sys
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Iterator, Optional

import typer

from gpuctl import usage
from gpuctl.cliargs import cluster_inventory
from gpuctl.common import output
from gpuctl.common.errors import ClusterNotFound, JobDetached, ProvisionError, UserError
from gpuctl.common.output import OutputOption, wants_json
from gpuctl.spec.autostop import DEFAULT_IDLE_MINUTES, Autostop, with_flags

if TYPE_CHECKING:
    from gpuctl.common.console import Reporter
    from gpuctl.provision.inventory import Inventory
    from gpuctl.spec import Task
    from gpuctl.spec.request import ClusterRequest
    from gpuctl.state.registry import Registry

# The head's side of autostop (jobplane/autostop.py) and the registry are imported where they are
# used: `apply` and `status` need them, `gpuctl --help` and most commands do not.


IdleOption = typer.Option(None, "-i", "--idle-minutes-to-autostop", metavar="MIN", min=0,
                          help="Stop the cluster after MIN idle minutes (no job, no ssh session); as `sky launch -i`.")
DownOption = typer.Option(False, "--down", help="Remove the cluster instead of stopping it: when the job ends "
                          "(without -i), or after -i idle minutes; done by the cluster, so a killed gpuctl "
                          "cannot leak it.")
LeaseOption = typer.Option(None, "--lease", metavar="MIN", min=0.01,
                           help="With autostop: if gpuctl dies mid-apply, the cluster waits this long without a "
                                "job before it stops or goes (default 10, or GPUCTL_LEASE_MINUTES).")


def setting_for_apply(task: "Task", idle: int | None, down: bool) -> Autostop | None:
    """The task's resources.autostop with apply's -i/--down over it."""
    return with_flags(task.resources.autostop, idle, down)


def check_setting(setting: Autostop | None, req: ClusterRequest, file: object) -> None:
    """Refuse, before anything is made, a setting the cluster could not act on (spot nodes that would
    have to stop, nodes gpuctl did not make)."""
    from gpuctl.providers import get_provider
    from gpuctl.provision.provisioner import request_to_dict

    if setting is None:
        return
    problem = get_provider(req.cloud).autostop_problem(request_to_dict(req), down=setting.down)
    if problem:
        raise UserError(f"{file}: resources.autostop (or -i/--down): {problem}")


def _prepared(inv: Inventory, registry: Registry, reporter: Reporter) -> None:
    """The watcher is the head's agent: nodes made with --provision-only have none yet."""
    from gpuctl.jobplane.preparer import Preparer

    Preparer(inv, reporter=reporter, registry=registry).ensure_prepared()


def arm_for_apply(inv: Inventory, setting: Autostop | None, *, registry: Registry, lease_minutes: float | None,
                  reporter: Reporter) -> AbstractContextManager[object]:
    """Send the setting to the head; the lease to hold while apply works (nothing without a setting)."""
    from gpuctl.jobplane import autostop

    if setting is None:
        return nullcontext()
    lease_s = autostop.lease_seconds(lease_minutes)
    _prepared(inv, registry, reporter)  # the job's own run then finds nothing to do
    record = registry.cluster(inv.cluster)
    armed = autostop.arm(inv, setting, request=record.request if record else {}, lease_s=lease_s)
    reporter.info(f"Cluster '{inv.cluster}': {setting.describe()}, decided on the cluster")
    for note in armed.notes:
        typer.echo(f"warning: {note}", err=True)
    return autostop.Lease(inv, lease_s)


def downs_when_job_ends(setting: Autostop | None, no_attached_job: bool) -> bool:
    """`apply --down` without idle minutes, with a job it waits for: this gpuctl removes the cluster
    when the job ends, however it ends (the cluster's own watcher does it if this gpuctl is gone)."""
    return bool(setting and setting.down and setting.idle_minutes == 0 and not no_attached_job)


@contextmanager
def down_after_job(name: str, setting: Autostop | None, no_attached_job: bool, *, reporter: Reporter,
                   registry: Registry) -> Iterator[None]:
    from gpuctl.provision import lifecycle

    detached = False
    try:
        yield
    except JobDetached:
        detached = True  # the job goes on: the head's watcher removes the cluster once it ends
        if downs_when_job_ends(setting, no_attached_job):
            reporter.info(f"--down: cluster '{name}' removes itself once the job ends (its head's watcher; "
                          f"`gpuctl down {name}` removes it now)")
        raise
    finally:
        if downs_when_job_ends(setting, no_attached_job) and not detached:
            try:
                lifecycle.tear_down(name, reporter=reporter, registry=registry)
            except (UserError, ProvisionError) as exc:  # the job's own error, if any, stays the one raised
                reporter.error(f"--down: cluster '{name}' was not torn down ({exc}); it takes itself down once "
                               "its lease runs out, or run: gpuctl down " + name)


def register(app: typer.Typer) -> None:
    @app.command("autostop", cls=usage.HelpCommand, epilog=usage.examples_of("autostop"))
    def autostop_(name: str = typer.Argument(..., metavar="NAME", help="Cluster."),
                  idle: Optional[int] = typer.Option(None, "-i", "--idle-minutes", metavar="MIN", min=0,
                                                     help=f"Idle minutes before it stops (default {DEFAULT_IDLE_MINUTES})."),
                  down: bool = typer.Option(False, "--down", help="Remove the cluster instead of stopping it."),
                  cancel: bool = typer.Option(False, "--cancel", help="Turn autostop off."),
                  yes: bool = typer.Option(False, "-y", "--yes", help="Accepted as `sky autostop -y`."),
                  output_format: str = OutputOption) -> None:
        """Stop (or with --down remove) a cluster after it has been idle; the cluster does it itself."""
        from gpuctl.common.console import Reporter
        from gpuctl.jobplane import autostop
        from gpuctl.state.registry import Registry

        as_json = wants_json(output_format)
        reporter = Reporter(stream=sys.stderr) if as_json else Reporter()
        if cancel and (down or idle is not None):
            raise UserError("--cancel turns autostop off; give it without -i or --down")
        inv, registry = cluster_inventory(name), Registry()
        if registry.cluster(name) is None:
            raise ClusterNotFound(name)
        _prepared(inv, registry, reporter)  # a cluster made with --provision-only has no agent yet
        if cancel:
            head = autostop.cancel(inv)
            reporter.info(f"Cluster '{name}': autostop cancelled")
            setting = None
        else:
            before = autostop.saved(name)
            setting = Autostop(idle_minutes=DEFAULT_IDLE_MINUTES if idle is None else idle, down=down,
                               **({"wait_for": before.wait_for, "hook": before.hook,
                                   "hook_timeout": before.hook_timeout} if before else {}))
            record = registry.cluster(name)
            armed = autostop.arm(inv, setting, request=record.request if record else {})
            head = armed.head
            reporter.info(f"Cluster '{name}': {setting.describe()}, decided on the cluster")
            for note in armed.notes:
                typer.echo(f"warning: {note}", err=True)
        if as_json:
            output.emit("autostop", {"ok": True, "cluster": name,
                                     "autostop": setting.as_dict() if setting else None, "head": head})


def status_of(name: str, status: str, registry: Registry) -> tuple[list[str], dict[str, Any]]:
    """`status`'s autostop lines and JSON fields for one cluster: the setting, how long the cluster
    has been idle (its head's watcher says), and when it took itself down or was stopped."""
    from gpuctl.jobplane.autostop import reconcile
    from gpuctl.provision import lifecycle
    from gpuctl.state.registry import AUTODOWNED, STOPPED

    what, when = reconcile(name, status, registry)
    stopped_by_command = lifecycle.stopped_at(name)
    if stopped_by_command is not None and what in (None, STOPPED):  # `gpuctl stop`, not the cluster itself
        what, when = STOPPED, stopped_by_command
    elif what is None and status == STOPPED:  # stopped, and no setting to ask the cloud about since
        record = registry.cluster(name)
        what, when = STOPPED, record.updated_at if record is not None else time.time()
    if what is None:
        lines, fields, reached = _watcher_view(name)
        if reached:
            return lines, fields
        what, when = reconcile(name, status, registry)  # a head that went while asked may have removed itself
        if what is None:
            return lines, fields
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
    if what == STOPPED:
        how = "stopped at {} (`gpuctl stop`)" if stopped_by_command is not None else "stopped itself at {} (autostop)"
        return ([f"  {how.format(stamp)}; its disks still bill: `gpuctl start {name}` brings it back, "
                 f"`gpuctl down {name}` removes it"],
                {"status": STOPPED, "stopped_at": when, "autostop": None, "idle_s": None})
    return ([f"  took itself down at {stamp} (autodown); `gpuctl apply` brings it up again, "
             f"`gpuctl down {name}` forgets it"],
            {"status": AUTODOWNED, "autodowned_at": when, "autostop": None, "idle_s": None})


def _watcher_view(name: str) -> tuple[list[str], dict[str, Any], bool]:
    """The setting and what the head's watcher sees, and whether the head answered."""
    from gpuctl.jobplane import autostop
    from gpuctl.provision.provisioner import load_inventory_of

    setting = autostop.saved(name)
    if setting is None:
        return [], {"autostop": None, "idle_s": None}, True
    try:
        inv = load_inventory_of(name)
        head = autostop.show(inv) if inv is not None else {}
    except UserError:
        return ([f"  {setting.describe()}, idle time unknown (head not reachable)"],
                {"autostop": setting.as_dict(), "idle_s": None}, False)
    idle_s = head.get("idle_s") if head.get("set") else None
    seen = (f", idle {idle_s / 60:.1f} min" if idle_s is not None else "") + (
        f" (busy: {head['busy']})" if head.get("busy") else "")
    return [f"  {setting.describe()}{seen}"], {"autostop": setting.as_dict(), "idle_s": idle_s}, True
