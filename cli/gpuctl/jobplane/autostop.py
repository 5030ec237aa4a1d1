"""The controller's end of autostop: the setting goes to the head's agent, which then acts alone.

`arm` sends the setting with the provider's power-off plan (node/autostop.py keeps it
and runs the watcher); `cancel` removes it; `show` asks what the watcher sees. A copy of what was
sent stays in the cluster's directory (SETTING_FILE), so `status` shows the setting without a
round trip.

The controller's lease is the dead-man switch of `apply --down`: while apply works (copying the
workdir, starting the job) it holds a lease on the head and renews it (`Lease`); a job that runs
keeps the cluster busy by itself. A controller killed at any point stops renewing, and once the
lease has run out and no job runs, the cluster takes itself down. The lease never ends a running
job, so a controller on a flaky network cannot kill healthy work (SkyPilot #10123, #10162).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from gpuctl.common.errors import UserError
from gpuctl.common.paths import cluster_dir
from gpuctl.providers import get_provider
from gpuctl.spec.autostop import Autostop, parse_autostop
from gpuctl.state.registry import AUTODOWNED, STOPPED, TERMINAL_JOB_STATES, Registry

if TYPE_CHECKING:
    from gpuctl.provision.inventory import Inventory

# The ssh and payload layers load when a head is asked: `status` and the refusals of a gone
# cluster read only the saved setting and the registry.

SETTING_FILE = "autostop.json"
LEASE_ENV = "GPUCTL_LEASE_MINUTES"
DEFAULT_LEASE_MINUTES = 10.0
MINUTE_ENV = "GPUCTL_TEST_MINUTE_SECONDS"  # for tests: how many seconds a "minute" lasts (default 60)


class AutostopUnreachable(UserError):
    """The head did not take the setting (unreachable, or an agent without autostop)."""


class AutostopTooLate(UserError):
    """A cancel that came after the head's watcher began powering the cluster off."""

    exit_code = 1


def minute_seconds() -> float:
    try:
        value = float(os.environ.get(MINUTE_ENV) or 60)
    except ValueError:
        raise UserError(f"{MINUTE_ENV}: give seconds (a number)") from None
    return max(0.1, value)


def lease_seconds(minutes: float | None = None) -> float:
    """The controller's lease: --lease MIN, else GPUCTL_LEASE_MINUTES, else 10 minutes."""
    if minutes is None:
        raw = os.environ.get(LEASE_ENV)
        try:
            minutes = float(raw) if raw else DEFAULT_LEASE_MINUTES
        except ValueError:
            raise UserError(f"{LEASE_ENV}: give minutes (a number > 0)") from None
    if minutes <= 0:
        raise UserError("the lease must last more than 0 minutes (--lease / GPUCTL_LEASE_MINUTES)")
    return minutes * minute_seconds()


def _control_dir(inv: Inventory) -> Path:
    from gpuctl.provision import ssh

    return ssh.control_dir_for(cluster_dir(inv.cluster) / "cm")


def _call(inv: Inventory, action: str, *, document: Mapping[str, Any] | None = None,
          lease: float | None = None, timeout: float = 60) -> dict[str, Any]:
    from gpuctl.common.safetext import clean
    from gpuctl.jobplane import agentcall
    from gpuctl.node import protocol

    try:
        answer = agentcall.ask(inv.head, agentcall.command(protocol.CMD_AUTOSTOP, action, lease=lease),
                               control_dir=_control_dir(inv), timeout=timeout,
                               input=json.dumps(document) if document is not None else None)
    except agentcall.AgentError as exc:
        why = exc.why
        if isinstance(exc, agentcall.AgentMissing):
            why = "its agent has no autostop; run `gpuctl apply` once to update the nodes"
        raise AutostopUnreachable(f"cluster '{inv.cluster}': the head ({inv.head.name}) did not answer "
                                  f"`autostop {action}`: {why}") from None
    return clean(answer)  # the head's word, printed by `autostop show` and `status`


@dataclass(frozen=True)
class Armed:
    setting: Autostop
    notes: list[str]
    head: dict[str, Any]  # what the head's agent answered


def arm(inv: Inventory, setting: Autostop, *, request: Mapping[str, Any], lease_s: float = 0.0) -> Armed:
    """Give the head the setting and how to take every node down; start its watcher."""
    from gpuctl.jobplane import payload

    provider = get_provider(inv.cloud)
    plan = provider.power_off(cluster_dir(inv.cluster), [n.rank for n in inv.nodes], inv.head.ssh_user, request,
                              down=setting.down)
    # every worker is asked for ssh sessions; those the plan names are also shut down from the head
    workers = [{**payload.peer_entry(n), "off": plan.workers.get(n.rank)} for n in inv.nodes if n.rank != 0]
    document = {**setting.as_dict(), "minute_s": minute_seconds(), "lease_s": lease_s, "workers": workers,
                "head_off": plan.head}
    answer = _call(inv, "set", document=document)
    save(inv.cluster, setting)
    Registry().publish(inv.cluster)  # shared state: other runners see the setting (and ask EC2 in status)
    return Armed(setting=setting, notes=list(plan.notes), head=answer)


def cancel(inv: Inventory) -> dict[str, Any]:
    answer = _call(inv, "cancel")
    if answer.get("too_late"):
        # the setting stays saved: status goes on asking the cloud whether the cluster went
        what = "remove" if answer.get("phase") == "down" else "stop"
        raise AutostopTooLate(f"cluster '{inv.cluster}': too late to cancel; autostop already began to {what} "
                              f"it. `gpuctl status {inv.cluster}` shows when it is done; "
                              "`gpuctl apply` brings it back")
    forget(inv.cluster)
    Registry().publish(inv.cluster)
    return answer


SHOW_TIMEOUT_S = 15.0  # `show` only reads two files; longer means the head is going or gone


def show(inv: Inventory) -> dict[str, Any]:
    """What the head's watcher sees now: {set, idle_minutes, down, idle_s, busy, phase, ...}.

    Bounded well below the ssh keepalives' minute: a head that removes itself while asked can
    leave the controller's ssh master waiting on a connection nobody will close."""
    return _call(inv, "show", timeout=SHOW_TIMEOUT_S)


def save(name: str, setting: Autostop) -> None:
    path = cluster_dir(name) / SETTING_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(setting.as_dict(), fh)
    os.replace(tmp, path)


def forget(name: str) -> None:
    try:
        (cluster_dir(name) / SETTING_FILE).unlink()
    except FileNotFoundError:
        pass


def saved(name: str) -> Autostop | None:
    """The setting last sent to the cluster's head, as `status` shows it."""
    try:
        return parse_autostop(json.loads((cluster_dir(name) / SETTING_FILE).read_text()))
    except (OSError, ValueError):  # AutostopError is a ValueError
        return None


class Lease:
    """Renews the controller's lease on the head every third of its length while the `with` block
    runs; releases it at the end (the cluster's countdown then starts from the last job)."""

    def __init__(self, inv: Inventory, lease_s: float) -> None:
        self.inv, self.lease_s = inv, lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="lease", daemon=True)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                _call(self.inv, "renew", lease=float(self.lease_s))
            except UserError:
                pass  # a missed renewal is harmless: the lease lasts three periods

    def __enter__(self) -> Lease:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            _call(self.inv, "release")
        except UserError:
            pass  # the lease then runs out by itself


def reconcile(name: str, status: str, registry: Registry) -> tuple[str | None, float | None]:
    """What the cluster did by itself, recorded: (AUTODOWNED | STOPPED, when) or (None, None).

    Local nodes leave word where they were made; cloud nodes are asked of the cloud (one call), and
    only for a cluster that holds an autostop setting: no other can have stopped itself."""
    from gpuctl.provision import ssh
    from gpuctl.provision.provisioner import load_inventory_of

    record = registry.cluster(name)
    if record is None:
        return None, None
    provider = get_provider(record.cloud)
    what: str | None = None
    try:
        when = provider.removed_itself(cluster_dir(name))
    except UserError:
        when = None
    if when is not None:
        what = AUTODOWNED
    elif saved(name) is not None and (inv := load_inventory_of(name)) is not None:
        states = provider.node_states([n.node_id for n in inv.nodes], inv.region)
        kinds = {state for state, _ in states.values()}
        times = [t for _, t in states.values() if t is not None]
        if states and kinds == {"terminated"}:
            what, when = AUTODOWNED, max(times, default=time.time())
        elif states and kinds == {"stopped"}:
            what, when = STOPPED, max(times, default=time.time())
    if what is not None and status != what:
        if what == AUTODOWNED:  # before the status: a command that sees AUTODOWNED finds them recorded
            _record_outcomes_left(name, registry, provider.outcomes_left(cluster_dir(name)))
        registry.set_cluster_status(name, what)
        # nobody saw how what still ran there ended: said, so a poll of it (`logs --status`) ends
        registry.end_jobs(name, "its cluster " + ("took itself down (autodown)" if what == AUTODOWNED else
                                                  "stopped itself (autostop)")
                          + " while no gpuctl watched the job; its outcome is unknown", status="LOST")
        registry.close_segment(name, "autodown" if what == AUTODOWNED else "stopped", at=when)
        ssh.exit_masters(cluster_dir(name) / "cm")  # their connections went with the nodes
    return what, when


def _record_outcomes_left(name: str, registry: Registry, left: Mapping[str, Mapping[str, Any]]) -> None:
    """The outcomes the head left as it removed itself (local nodes: its job.json files), recorded for
    the jobs nobody saw end, as a watcher would have recorded them."""
    if not left:
        return
    import sys

    from gpuctl.common.console import Reporter
    from gpuctl.jobplane import client, jobs
    from gpuctl.jobplane.events import Outcome
    from gpuctl.jobplane.runner import JobRunner
    from gpuctl.provision.provisioner import load_inventory_of

    inv = load_inventory_of(name)
    if inv is None:
        return
    runner = JobRunner(inv, reporter=Reporter(stream=sys.stderr, plain=True), registry=registry)
    for job in registry.jobs(name):
        doc = left.get(job.node_job)
        if job.status in TERMINAL_JOB_STATES or doc is None:
            continue
        outcome = Outcome.from_data(str(doc.get("status")), dict(doc))
        if outcome.status not in TERMINAL_JOB_STATES or outcome.detail == client.COORDINATOR_GONE:
            continue  # nothing its nodes could still be asked about: LOST below
        runner.settle(job.job_id, jobs.job_nodes(inv, job), outcome)
