"""How the command line reads what it is given and words what it answers, beside cli.py (which
defines the commands): `exec`'s argument, job names and failures as lines, the ssh config offer."""

from __future__ import annotations

import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer

from gpuctl import usage
from gpuctl.common import output
from gpuctl.common.console import Reporter
from gpuctl.common.errors import ClusterNotFound, UserError
from gpuctl.common.paths import cluster_dir, state_root
from gpuctl.jobplane import autostop
from gpuctl.provision import ssh, sshconfig
from gpuctl.provision.inventory import Inventory, Node, load_inventory
from gpuctl.provision.lifecycle import Teardown
from gpuctl.spec.request import check_cluster_name
from gpuctl.state.registry import Registry


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


def failure_lines(inv: Inventory, job: Any) -> list[str]:
    """What ended a failed job: the first rank that failed, with its node and exit code (or the
    recorded reason when no rank ran). The others were stopped because of it (fail-fast)."""
    if job.status not in ("FAILED", "FAILED_SETUP"):
        return []
    by_rank = {n.rank: n for n in inv.nodes}
    failed = [r for r, c in sorted(job.returncodes.items()) if c != 0]
    first = job.failed_rank if job.failed_rank in job.returncodes else (failed[0] if failed else None)
    if first is None:
        return [job.detail] if job.detail else []
    code = job.returncodes.get(first)
    node = by_rank.get(first)
    where = f"rank {first}" + (f" ({node.name})" if node else "")
    return [f"{where} " + ("lost (no exit code)" if code is None else f"exit code {code}")]


def offer_ssh_include(reporter: Reporter) -> None:
    """Once, and only on a terminal: offer to include gpuctl's ssh config from ~/.ssh/config, so
    `ssh NAME` reaches a cluster's head (SkyPilot adds its own without asking)."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        return
    ssh_dir = state_root() / "ssh"
    marker, gpuctl_config = ssh_dir / sshconfig.INCLUDE_ASKED, ssh_dir / "config"
    user_config = Path.home() / ".ssh" / "config"
    if marker.exists() or sshconfig.includes(user_config, gpuctl_config):
        return
    marker.touch()  # asked once, whatever the answer
    try:
        add = typer.confirm(f"Add `{sshconfig.include_line(gpuctl_config)}` to {user_config}, so `ssh NAME` "
                            "reaches a cluster's head?", default=True, err=True)
    except (typer.Abort, usage.Abort, EOFError):  # type: ignore[misc]
        return
    if add:
        try:
            sshconfig.add_include(user_config, gpuctl_config)
        except OSError as exc:  # a read-only config (a dotfiles link into a store): say so, go on
            reporter.info(f"Could not add it to {user_config} ({exc.strerror or exc}); add "
                          f"`{sshconfig.include_line(gpuctl_config)}` there yourself, or use `gpuctl ssh NAME`.")
            return
        reporter.info(f"Added it at the top of {user_config}; `ssh NAME` and `ssh NAME-worker1` work now.")
    else:
        reporter.info(f"Not added; `gpuctl ssh NAME` works, or add `{sshconfig.include_line(gpuctl_config)}` "
                      f"to {user_config} yourself.")


def down_targets(names: list[str], all_clusters: bool, registry: Registry) -> list[str]:
    """The clusters `gpuctl down` acts on (`-a`: every one, the state bucket's too), each name
    checked before any is torn down."""
    if all_clusters and names:
        raise UserError("give cluster names or -a/--all, not both")
    if not all_clusters:
        if not names:
            raise UserError("give the cluster to tear down (gpuctl down NAME [NAME...]), or -a/--all for every one")
        return list(dict.fromkeys(check_cluster_name(name) for name in names))
    registry.adopt_all()
    return [record.name for record in registry.clusters()]


def down_document(results: list[Teardown], one: bool) -> dict[str, Any]:
    """`down -o json`: one cluster as before (its `cluster` and `destroyed`, and `found`), or a list."""
    ok = not any(r.error for r in results)
    if one:
        return {"ok": ok, "cluster": results[0].cluster, "found": results[0].found, "destroyed": results[0].destroyed}
    return {"ok": ok, "clusters": [{k: v for k, v in asdict(r).items() if k != "error" or v} for r in results]}


def emit_apply(registry: Registry, name: str, inv: Inventory, *, job_id: int | None,
                latest_job: bool = False, phases: list | None = None) -> None:
    """apply's JSON document: the cluster as `status` shows it, the job this apply ran (or null), and
    how long each phase took (provision, prepare, job)."""
    record = registry.cluster(name)
    job = registry.job(name, job_id) if job_id is not None else None
    if latest_job:
        job = (registry.jobs(name) or [None])[-1]
    doc = output.cluster_doc(record, inv, None) if record is not None else {"name": name}
    doc.pop("last_job", None)
    output.emit("apply", {"ok": job is None or job.status in ("SUCCEEDED", "RUNNING"), "cluster": name,
                          **{k: v for k, v in doc.items() if k != "name"},
                          "inventory": str(cluster_dir(name) / "inventory.yml"),
                          "job": output.job_doc(job) if job is not None else None, "phases": phases or [],
                          "autostop": setting.as_dict() if (setting := autostop.saved(name)) else None})


def node_health(inv: Inventory) -> dict[int, str]:
    """reachable / UNREACHABLE (ssh's reason), asked of every node at once."""
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


def cluster_inventory(name: str) -> Inventory:
    check_cluster_name(name)
    Registry().adopt(name)  # shared state: the bucket's copy of the cluster, if any
    path = cluster_dir(name) / "inventory.yml"
    inv = load_inventory(path, cluster=name) if path.is_file() else None
    if inv is None:
        raise ClusterNotFound(name)
    return inv


def node_of(inv: Inventory, cluster: str, node: str) -> Node:
    """The node named by its name (head, worker2) or its rank; one line naming the nodes if none is."""
    found = next((n for n in inv.nodes if node in (n.name, str(n.rank))), None)
    if found is None:
        names = [n.name for n in inv.nodes]
        raise UserError(f"node {node!r}: cluster '{cluster}' has {', '.join(names[:6])}"
                        f"{', ...' if len(names) > 6 else ''} (a name or a rank 0..{len(names) - 1})")
    return found
