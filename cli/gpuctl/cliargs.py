"""How the command line reads what it is given and words what it answers, beside cli.py (which
defines the commands): `exec`'s argument, job names and failures as lines, the ssh config offer."""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import typer

from gpuctl import usage
from gpuctl.common import output
from gpuctl.common.errors import ClusterNotFound, UserError
from gpuctl.common.paths import cluster_dir, state_root

if TYPE_CHECKING:
    from gpuctl.common.console import Reporter
    from gpuctl.jobplane.runner import JobRunner
    from gpuctl.provision.inventory import Inventory, Node
    from gpuctl.provision.lifecycle import Teardown
    from gpuctl.provision.provisioner import Doomed
    from gpuctl.state.registry import Registry

# Every command reads its arguments through here: what only some of them need (the registry,
# inventories, autostop, ssh, the job runner, the console) is imported where it is used, so
# `gpuctl --help` loads none of it and `gpuctl status` starts fast.


def shortened(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def names_task_file(entrypoint: str) -> bool:
    """Whether `exec`'s argument is a task YAML (as `sky exec` decides): one shell word that is a
    .yaml/.yml path, found or not (a missing one is an error, not a command), or an existing file
    holding a YAML mapping. Anything else (`python train.py --cfg c.yaml`) is a command string."""
    try:
        words = shlex.split(entrypoint)
    except ValueError:  # unbalanced quotes: bash will say what is wrong with it
        return False
    if len(words) != 1 or words[0] != entrypoint:
        return False
    path = Path(entrypoint)
    if path.suffix.lower() in (".yaml", ".yml"):
        return True
    import yaml

    try:
        if not path.is_file():
            return False
        with path.open() as fh:
            return isinstance(yaml.safe_load(fh.read(1_000_000)), dict)
    except (OSError, ValueError, yaml.YAMLError):  # a name too long for a path, unreadable: a command
        return False


def failure_lines(inv: Inventory | None, job: Any) -> list[str]:
    """What ended a failed job: the first rank that failed, with its node (when the cluster's inventory
    is still there) and exit code (or the recorded reason when no rank ran). The others were stopped
    because of it (fail-fast)."""
    if job.status not in ("FAILED", "FAILED_SETUP"):
        return []
    by_rank = {n.rank: n for n in inv.nodes} if inv is not None else {}
    failed = [r for r, c in sorted(job.returncodes.items()) if c != 0]
    first = job.failed_rank if job.failed_rank in job.returncodes else (failed[0] if failed else None)
    if first is None:
        return [job.detail] if job.detail else []
    code = job.returncodes.get(first)
    node = by_rank.get(first)
    where = f"rank {first}" + (f" ({node.name})" if node else "")
    return [f"{where} " + ("lost (no exit code)" if code is None else f"exit code {code}")]


def hint_ssh_include(reporter: Reporter) -> None:
    """Once, and only on a terminal: say how `ssh NAME` can reach a cluster's head. gpuctl never asks
    (a `make demo` or a script must run unattended) and never edits ~/.ssh/config unasked:
    `gpuctl ssh-config --include` adds the line (SkyPilot adds its own)."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        return
    from gpuctl.provision import sshconfig

    ssh_dir = state_root() / "ssh"
    marker, gpuctl_config = ssh_dir / sshconfig.INCLUDE_ASKED, ssh_dir / "config"
    if marker.exists() or sshconfig.includes(Path.home() / ".ssh" / "config", gpuctl_config):
        return
    try:
        marker.touch()  # said once
    except OSError:
        return
    reporter.info(f"tip: `gpuctl ssh NAME` logs in to a cluster's head; for plain `ssh NAME`, run `gpuctl "
                  f"ssh-config --include` (adds `{sshconfig.include_line(gpuctl_config)}` to ~/.ssh/config)")


def add_ssh_include(reporter: Reporter) -> None:
    """`ssh-config --include`: gpuctl's Include line first in ~/.ssh/config (once), so `ssh NAME`
    and `ssh NAME-worker1` reach a cluster's nodes."""
    from gpuctl.provision import sshconfig

    gpuctl_config, user_config = state_root() / "ssh" / "config", Path.home() / ".ssh" / "config"
    if sshconfig.includes(user_config, gpuctl_config):
        reporter.info(f"{user_config} already includes {gpuctl_config}")
        return
    try:
        sshconfig.add_include(user_config, gpuctl_config)
    except OSError as exc:  # a read-only config (a dotfiles link into a store)
        raise UserError(f"could not add `{sshconfig.include_line(gpuctl_config)}` to {user_config} "
                        f"({exc.strerror or exc}); add it there yourself, or use `gpuctl ssh NAME`") from None
    reporter.info(f"Added `{sshconfig.include_line(gpuctl_config)}` at the top of {user_config}; `ssh NAME` and "
                  "`ssh NAME-worker1` work now")


CANCEL_ON_INTERRUPT_ENV = "GPUCTL_CANCEL_ON_INTERRUPT"
CancelOnInterruptOption = typer.Option(
    False, "--cancel-on-interrupt",
    help=f"Ctrl-C (or SIGTERM) ends the job on every node, instead of only stopping to follow it "
         f"(also {CANCEL_ON_INTERRUPT_ENV}=1: a CI step whose cancel should end the job).")


def cancels_on_interrupt(flag: bool) -> bool:
    """--cancel-on-interrupt, or GPUCTL_CANCEL_ON_INTERRUPT set to 1/true/yes."""
    return flag or os.environ.get(CANCEL_ON_INTERRUPT_ENV, "").strip().lower() in ("1", "true", "yes")


def confirm(question: str, *, yes: bool, refusal: str | None) -> None:
    """Go on only with consent to something that destroys nodes or stops jobs: `-y`, or a yes typed at
    a terminal (as `sky down` asks). Without a terminal nobody can answer, so nothing waits: the
    refusal line (what would be lost, and that -y does it) ends the command with exit code 2; a
    command named explicitly (`replace NAME NODE`) has no refusal and goes on."""
    if yes:
        return
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        if refusal is None:
            return
        raise UserError(refusal)
    try:
        agreed = typer.confirm(question, default=False, err=True)
    except (typer.Abort, usage.Abort, EOFError):  # type: ignore[misc]
        agreed = False
    if not agreed:
        raise UserError("not confirmed; nothing was changed")


def jobs_running(runner: JobRunner, ranks: set[int] | None = None) -> list[Any]:
    """The cluster's jobs that still run (on any of `ranks`), each asked of the head: a record can
    say RUNNING of a job that ended unwatched (a head that does not answer: as recorded)."""
    from gpuctl.jobplane import jobs
    from gpuctl.state.registry import TERMINAL_JOB_STATES

    inv, registry = runner.inv, runner.registry
    running = []
    for job in registry.jobs(inv.cluster):
        if job.status in TERMINAL_JOB_STATES:
            continue
        if ranks is not None and not ranks & {n.rank for n in jobs.job_nodes(inv, job)}:
            continue
        job = jobs.refresh(runner, job)
        if job.status not in TERMINAL_JOB_STATES:
            running.append(job)
    return running


def consent_to_destroy(name: str, *, yes: bool, registry: Registry,
                       reporter: Reporter | None = None) -> Callable[[Doomed], None]:
    """apply's say before its plan destroys nodes of cluster `name` (a smaller num_nodes, a setting
    that replaces them): never under a job that runs there, then -y or a yes at a terminal (as `sky
    launch` never resizes a cluster unasked). It refuses by raising UserError: nothing is changed."""
    def check(doomed: Doomed) -> None:
        from gpuctl.common.console import Reporter
        from gpuctl.jobplane.runner import JobRunner
        from gpuctl.provision.provisioner import load_inventory_of

        inv = load_inventory_of(name)
        if inv is not None:
            runner = JobRunner(inv, reporter=Reporter(stream=sys.stderr), registry=registry)
            for job in jobs_running(runner, {n.rank for n in doomed.nodes})[:1]:
                raise UserError(f"{doomed.describe()}, where job {job.job_id} ({job.status}) runs: it would be "
                                f"killed; wait for it to end or cancel it (gpuctl cancel {name} {job.job_id}), "
                                "then apply again; nothing was changed")
        with reporter.paused() if reporter is not None else contextlib.nullcontext():  # the stage's live line
            confirm(f"{doomed.describe()[0].upper()}{doomed.describe()[1:]}. Go on?", yes=yes,
                    refusal=doomed.refusal())
    return check


def down_targets(names: list[str], all_clusters: bool, registry: Registry) -> list[str]:
    """The clusters `gpuctl down` acts on (`-a`: every one, the state bucket's too), each name
    checked before any is torn down."""
    from gpuctl.spec.request import check_cluster_name

    if all_clusters and names:
        raise UserError("give cluster names or -a/--all, not both")
    if not all_clusters:
        if not names:
            raise UserError("give the cluster to tear down (gpuctl down NAME [NAME...]), or -a/--all for every one")
        return list(dict.fromkeys(check_cluster_name(name) for name in names))
    registry.adopt_all()
    return [record.name for record in registry.clusters()]


def refuse_managed(clusters: list[str]) -> None:
    """UserError, before anything is torn down, when a managed job that has not ended runs on one of
    `clusters`: removing it under the job would leave its supervisor to make it again or lose the job."""
    from gpuctl.managed.owner import running_jobs_of

    held = running_jobs_of(clusters)
    if not held:
        return
    named = "; ".join(f"cluster '{c}' is managed job {j.id}'s ({j.name}, {j.status})" for c, j in sorted(held.items()))
    cancel = " and ".join(f"`gpuctl jobs cancel {j.id}`" for j in sorted(held.values(), key=lambda j: j.id))
    raise UserError(f"{named}: {cancel} ends it and removes its cluster; nothing was torn down")


def down_document(results: list[Teardown], one: bool) -> dict[str, Any]:
    """`down -o json`: one cluster as before (its `cluster` and `destroyed`, and `found`), or a list."""
    ok = not any(r.error for r in results)
    if one:
        return {"ok": ok, "cluster": results[0].cluster, "found": results[0].found, "destroyed": results[0].destroyed}
    return {"ok": ok, "clusters": [{k: v for k, v in asdict(r).items() if k != "error" or v} for r in results]}


def apply_document(registry: Registry, name: str, inv: Inventory, *, job_id: int | None,
                   phases: list | None = None) -> dict[str, Any]:
    """apply's JSON document: the cluster as `status` shows it, the job this apply ran (or null), and
    how long each phase took (provision, prepare, job). Made when the job ends; emitted by
    `emit_apply` once `--down` had its say."""
    from gpuctl.jobplane import autostop

    record = registry.cluster(name)
    job = registry.job(name, job_id) if job_id is not None else None
    doc = output.cluster_doc(record, inv, None) if record is not None else {"name": name}
    doc.pop("last_job", None)
    return {"ok": job is None or job.status in ("SUCCEEDED", "RUNNING", "PENDING"), "cluster": name,
            **{k: v for k, v in doc.items() if k != "name"},
            "inventory": str(cluster_dir(name) / "inventory.yml"),
            "job": output.job_doc(job) if job is not None else None, "phases": phases or [],
            "autostop": setting.as_dict() if (setting := autostop.saved(name)) else None}


def emit_apply(doc: dict[str, Any], registry: Registry) -> None:
    """Print apply's document as things are now: a cluster that `apply --down` removed meanwhile is
    DOWN (its nodes listed as the job had them), never the UP it was when the job ended."""
    if registry.cluster(doc["cluster"]) is None:
        doc = {**doc, "status": "DOWN", "autostop": None}
    output.emit("apply", doc)


def node_health(inv: Inventory) -> dict[int, str]:
    """reachable / UNREACHABLE (ssh's reason), asked of every node at once."""
    from gpuctl.provision import ssh

    control = ssh.control_dir_for(cluster_dir(inv.cluster) / "cm")
    results = ssh.run_on_all(inv.nodes, "true", control_dir=control, timeout=20)
    health = {}
    for rank, proc in results.items():
        if proc.returncode == 0:
            health[rank] = "reachable"
        else:
            reason = (proc.stderr.strip().splitlines() or [f"ssh exit code {proc.returncode}"])[-1]
            health[rank] = f"UNREACHABLE ({reason})"
    return health


def cluster_inventory(name: str, *, live: bool = True) -> Inventory:
    """The inventory of cluster `name`, for a command that needs its nodes (`live`): one that took
    itself down (autodown) is said at once, with when and how to bring it back, instead of ssh
    failing on nodes that are gone."""
    from gpuctl.provision.inventory import load_inventory
    from gpuctl.spec.request import check_cluster_name
    from gpuctl.state.registry import Registry

    check_cluster_name(name)
    registry = Registry()
    registry.adopt(name)  # shared state: the bucket's copy of the cluster, if any
    path = cluster_dir(name) / "inventory.yml"
    inv = load_inventory(path, cluster=name) if path.is_file() else None
    if inv is None:
        raise ClusterNotFound(name)
    if live:
        refuse_gone(name, registry)
    return inv


def stopped_line(name: str) -> str:
    """What a command that needs the nodes says of a stopped cluster."""
    return f"cluster '{name}' is stopped; `gpuctl start {name}` brings it back"


def refuse_gone(name: str, registry: Registry) -> None:
    """UserError for a cluster whose nodes are not there: stopped (`gpuctl stop`, or autostop seen by
    status), or removed by itself: local nodes leave word where they were made (a file); cloud nodes
    are asked of the cloud, only where an autostop setting could have done it."""
    from gpuctl.jobplane import autostop
    from gpuctl.providers import get_provider
    from gpuctl.state.registry import AUTODOWNED, STOPPED

    record = registry.cluster(name)
    if record is None:
        return
    if record.status == STOPPED:
        raise UserError(stopped_line(name))
    try:
        began = get_provider(record.cloud).removed_itself(cluster_dir(name), finished=False)
    except UserError:
        began = None
    if record.status != AUTODOWNED and autostop.saved(name) is None and began is None:
        return
    what, when = autostop.reconcile(name, record.status, registry)
    if what == STOPPED:
        raise UserError(stopped_line(name))
    if what is None and began is not None:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(began))
        raise UserError(f"cluster '{name}' is going: it began taking itself down (autodown) at {since}; "
                        f"`gpuctl apply` brings it up again once it is gone")
    if what == AUTODOWNED:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if when else "earlier"
        raise UserError(f"cluster '{name}' is gone: it took itself down (autodown) at {since}; `gpuctl apply` "
                        f"brings it up again, `gpuctl down {name}` forgets it")


def node_of(inv: Inventory, cluster: str, node: str) -> Node:
    """The node named by its name (head, worker2) or its rank; one line naming the nodes if none is."""
    found = next((n for n in inv.nodes if node in (n.name, str(n.rank))), None)
    if found is None:
        names = [n.name for n in inv.nodes]
        raise UserError(f"node {node!r}: cluster '{cluster}' has {', '.join(names[:6])}"
                        f"{', ...' if len(names) > 6 else ''} (a name or a rank 0..{len(names) - 1})")
    return found


def gpus_asked(asked: str | None, task_accelerator: tuple[str | None, float] | None, *, cluster: str,
               cluster_accelerator: str | None, capacity: int, flag: str = "--gpus") -> int:
    """The GPUs a job asks of each of its nodes: `--gpus N` or SkyPilot's `--gpus TYPE:N`, else the
    task file's resources.accelerators, else none (a CPU job, which the head's queue never holds
    back). Refused when the cluster's nodes could never give them (the job would wait for ever)."""
    where = flag
    if asked is not None:
        kind, colon, count_text = asked.strip().rpartition(":")
        try:
            count = float(count_text)
        except ValueError:
            count = -1.0
        if not 0 <= count < float("inf") or (colon and not kind.strip()):
            raise UserError(f"{flag} {asked}: give a GPU count per node (as --gpus 4) or TYPE:COUNT "
                            f"(as --gpus H100:4)")
        where = f"{flag} {asked}"
    elif task_accelerator is not None and task_accelerator[0]:
        kind, count = task_accelerator
        where = f"{flag} {kind}:{count:g}"
    else:
        return 0
    per_node = math.ceil(count)
    if per_node == 0:
        return 0
    if kind and cluster_accelerator and kind.lower() != cluster_accelerator.lower():
        raise UserError(f"{where}: cluster '{cluster}' has {cluster_accelerator} GPUs, not {kind}; ask for "
                        f"{cluster_accelerator}:N or a count alone")
    if per_node > capacity:
        has = f"{capacity} GPU(s) per node" if capacity else "no GPUs"
        raise UserError(f"{where}: cluster '{cluster}' has {has}; a job there asks for at most {capacity} "
                        f"(it would wait in the cluster's queue for ever)")
    return per_node
